"""Embedding cache on one GPU: 1.5% of Criteo-sized tables cached vs the full tables on the device.

    python -m benchmarks.gpu.torchrec_cache [--quick | --smoke]

The GPU image has no TorchRec, so the peer is what a user without a cache would run: one
``nn.EmbeddingBag(sparse=True)`` per table holding the *whole* table in GPU memory, trained with
``torch.optim.SparseAdam``. tightfit keeps the tables in pinned host memory and 1.5% of the rows on
the GPU (``TableCache`` + the fused lazy Adam, the same arithmetic as SparseAdam). Both run the
same embedding forward+backward+update on the same Zipf id batches, interleaved; the headline is
samples/s of each and the device memory each needs, and how many times per batch each makes the host
wait for the GPU (``torch.cuda.set_sync_debug_mode("warn")`` counts every synchronising call of one
step; a cache must decide hits and misses, the question is how often it waits). Also timed: the
``cache_lookup`` kernel (Triton vs its PyTorch reference). ``--quick`` uses a tenth of Criteo's rows.
"""

from __future__ import annotations

import os
import sys
import warnings

from benchmarks.gpu.common import (
    ROOT,
    ensure_tightfit,
    interleave_cuda,
    parser,
    skip,
    summarize,
    write_result,
)

NAME, TITLE = "torchrec_cache", "Embedding cache: 1.5% cached vs full tables on the GPU"
CARDS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
         10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)  # Criteo Kaggle


def _zipf(n: int, rows: int, gen, device):
    import torch

    u = torch.rand(n, generator=gen, dtype=torch.float64)
    a = 1.05
    rank = (((rows ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))).long().clamp_(1, rows) - 1
    return ((rank * 2654435761) % rows).to(device)


def syncs_per_step(step) -> int | None:
    """How many times one call of ``step`` makes the host wait for the GPU (``None`` without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__ or TITLE).parse_args(argv)
    import torch

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        return skip(NAME, TITLE, "no CUDA device")
    ensure_tightfit()
    sys.path.insert(0, str(ROOT / "plugins"))  # the checkout is copied, not installed, on the GPU machine
    from tightfit.cuda import get_kernel
    from torchrec_cache.cache import TableCache
    from torchrec_cache.config import RowOptimizer
    from torchrec_cache.lookup import cached_lookup

    dev = torch.device("cpu" if args.smoke else "cuda")
    scale = 0.0005 if args.smoke else 0.1 if args.quick else 1.0
    batch = 256 if args.smoke else 16384
    dim, ratio, nbatches = 16, 0.015, 4 if args.smoke else 16
    repeats = args.repeats or (2 if args.smoke else 5 if args.quick else 7)
    rows = [max(4, int(c * scale)) for c in CARDS]
    gen = torch.Generator().manual_seed(0)
    print(f"[{NAME}] {len(rows)} tables, {sum(rows):,} rows x {dim}, batch {batch}, cache {ratio:.1%}", flush=True)
    batches = [[_zipf(batch, r, gen, dev) for r in rows] for _ in range(nbatches)]
    lengths = torch.ones(batch, dtype=torch.int64, device=dev)
    opt = RowOptimizer(kind="adam", lr=1e-3, eps=1e-8)

    # tightfit: full tables in (pinned) host memory, 1.5% on the device
    class Host(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n, dim) * 0.01, requires_grad=False)

    caches = []
    for r in rows:
        host = Host(r)
        c = TableCache(name=f"t{len(caches)}", host_table=host, capacity=max(1, int(r * ratio)), policy="lfu",
                       optimizer=opt, device=dev)
        c.pin_host_memory()
        c._host = host  # keep it alive
        caches.append(c)
    anchor = torch.zeros((), device=dev, requires_grad=True)
    peer = [torch.nn.EmbeddingBag(r, dim, mode="sum", sparse=True, device=dev) for r in rows]
    peer_opt = torch.optim.SparseAdam([p for e in peer for p in e.parameters()], lr=1e-3, eps=1e-8)
    state = {"i": 0}

    def cached_step() -> None:
        ids = batches[state["i"] % nbatches]
        state["i"] += 1
        out = torch.cat([cached_lookup(c, x, lengths, anchor=anchor) for c, x in zip(caches, ids)], dim=1)
        out.square().mean().backward()

    def peer_step() -> None:
        ids = batches[state["i"] % nbatches]
        state["i"] += 1
        offsets = torch.arange(batch, device=dev)
        peer_opt.zero_grad()
        out = torch.cat([e(x, offsets) for e, x in zip(peer, ids)], dim=1)
        out.square().mean().backward()
        peer_opt.step()

    iters = 1 if args.smoke else 5
    times = interleave_cuda({"full_tables_sparseadam": peer_step, "cached_1.5pct_fused_adam": cached_step},
                            repeats=repeats, warmup=1, iters=iters)
    syncs = {"full_tables_sparseadam": syncs_per_step(peer_step), "cached_1.5pct_fused_adam": syncs_per_step(cached_step)}
    stats = {k: sum(c.stats[k] for c in caches) for k in ("lookups", "hits", "rows_loaded", "rows_spilled")}
    hit = stats["hits"] / max(1, stats["lookups"])
    cache_bytes = sum(c.weight.numel() * 4 + c.state.numel() * 4 + c.row_slot.numel() * 4 + c.capacity * 24
                      for c in caches)
    peer_bytes = sum(r * dim * 4 * 3 for r in rows)  # weights + SparseAdam's two moments
    # the id -> slot kernel on its own: Triton vs the PyTorch reference, on the largest table
    big = max(caches, key=lambda c: c.num_rows)
    uniq = torch.unique(batches[0][rows.index(big.num_rows)])
    counts = torch.ones_like(uniq)
    kernel = get_kernel("cache_lookup")
    ktimes = interleave_cuda({
        b: (lambda b=b: kernel(big.row_slot, uniq, counts, big.slot_score.clone(), big.pinned_until.clone(),
                               big.step + 1, 1, backend=b)) for b in ("reference", "triton")},
        repeats=repeats, warmup=1, iters=iters)
    s = {k: summarize(v) for k, v in times.items()}
    ks = {k: summarize(v) for k, v in ktimes.items()}
    thr = {k: batch / v["median"] for k, v in s.items()}
    summary = (f"1.5% cached {thr['cached_1.5pct_fused_adam']:,.0f} samples/s vs full tables "
               f"{thr['full_tables_sparseadam']:,.0f} ({thr['cached_1.5pct_fused_adam'] / thr['full_tables_sparseadam']:.2f}x), "
               f"hit rate {hit:.1%}, device memory {cache_bytes / 2**30:.2f} vs {peer_bytes / 2**30:.2f} GiB; "
               f"cache_lookup triton {ks['reference']['median'] / ks['triton']['median']:.2f}x the reference; "
               f"host syncs per batch: cached {syncs['cached_1.5pct_fused_adam']}, full {syncs['full_tables_sparseadam']}")
    print(summary, flush=True)
    write_result(NAME, title=TITLE, summary=summary,
                 params={"rows": sum(rows), "dim": dim, "batch": batch, "ratio": ratio, "repeats": repeats,
                         "smoke": args.smoke, "quick": args.quick},
                 results={"syncs_per_batch": syncs, "step_seconds": times, "step_summary": s, "samples_per_s": thr, "hit_rate": hit,
                          "cache_stats": stats, "device_bytes": {"cached": cache_bytes, "full": peer_bytes},
                          "cache_lookup_seconds": ktimes, "cache_lookup_summary": ks})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
