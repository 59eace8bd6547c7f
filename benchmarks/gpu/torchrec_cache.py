"""Embedding cache on one GPU: 1.5% of Criteo-sized tables cached vs the full tables on the device.

    python -m benchmarks.gpu.torchrec_cache [--quick | --smoke]

The GPU image has no TorchRec or FBGEMM, so TorchRec's ``FUSED_UVM_CACHING`` cannot run here (it is
recorded as skipped); the peer is what a user without a cache would run: one
``nn.EmbeddingBag(sparse=True)`` per table holding the *whole* table in GPU memory, trained with
``torch.optim.SparseAdam``. tightfit keeps the tables in pinned host memory and 1.5% of the
collection's rows on the GPU in one ``FusedCache`` for all 26 tables (fused lazy Adam, the same
arithmetic as SparseAdam). Both run the same embedding forward+backward+update on the same Zipf id
batches, interleaved. Reported: samples/s of each, device memory, hit rate, device-to-host reads per
step (the cache's own count and ``torch.cuda.set_sync_debug_mode`` warnings), and the copy/compute
overlap: a step with the next batch's rows loaded on a side stream by a worker thread, against the
same two pieces run one after the other.
"""

from __future__ import annotations

import os
import sys

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


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__ or TITLE).parse_args(argv)
    import torch

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        return skip(NAME, TITLE, "no CUDA device")
    ensure_tightfit()
    sys.path.insert(0, str(ROOT / "plugins"))  # the checkout is copied, not installed, on the GPU machine
    import threading
    import warnings

    from tightfit.planner.cache import CacheTableSpec, split_slots
    from torchrec_cache.cache import FusedCache, TableSpec
    from torchrec_cache.config import RowOptimizer
    from torchrec_cache.lookup import cached_pooled_lookup, prepare_batch
    from torchrec_cache.sync import SYNCS

    dev = torch.device("cpu" if args.smoke else "cuda")
    scale = 0.0005 if args.smoke else 0.25 if args.quick else 1.0
    batch = 256 if args.smoke else 16384
    dim, ratio, nbatches = 16, 0.015, 4 if args.smoke else 16
    repeats = args.repeats or (2 if args.smoke else 5 if args.quick else 7)
    rows = [max(4, int(c * scale)) for c in CARDS]
    gen = torch.Generator().manual_seed(0)
    print(f"[{NAME}] {len(rows)} tables, {sum(rows):,} rows x {dim}, batch {batch}, cache {ratio:.1%}", flush=True)
    batches = [[_zipf(batch, r, gen, dev) for r in rows] for _ in range(nbatches)]
    values = [torch.cat(b) for b in batches]
    lengths = torch.ones(len(rows) * batch, dtype=torch.int64, device=dev)
    feature_table = torch.arange(len(rows), device=dev)
    opt = RowOptimizer(kind="adam", lr=1e-3, eps=1e-8)

    # tightfit: full tables in pinned host memory, 1.5% of the collection's rows in one fused cache
    specs = [CacheTableSpec(name=f"t{i}", rows=r, dim=dim) for i, r in enumerate(rows)]
    slots = split_slots(specs, int(sum(rows) * ratio))
    cache = FusedCache([TableSpec(name=t.name, rows=t.rows, dim=dim, capacity=slots[t.name]) for t in specs],
                       policy="lfu", optimizer=opt, device=dev)
    for g in cache.groups:
        g.host.normal_(0, 0.01)
    cache.pin_host_memory()
    cache.finish_setup()
    anchor = torch.zeros((), device=dev, requires_grad=True)
    peer = [torch.nn.EmbeddingBag(r, dim, mode="sum", sparse=True, device=dev) for r in rows]
    peer_opt = torch.optim.SparseAdam([p for e in peer for p in e.parameters()], lr=1e-3, eps=1e-8)
    state = {"i": 0, "syncs": []}

    def lookup(v: torch.Tensor) -> None:
        b = prepare_batch(cache, v, lengths, feature_table, train=True)
        out = cached_pooled_lookup(cache, b, lengths, batch_size=batch, group_features=[(0, len(rows))],
                                   anchor=anchor)[0]
        out.square().mean().backward()

    def cached_step() -> None:
        SYNCS.reset()
        lookup(values[state["i"] % nbatches])
        state["syncs"].append(SYNCS.count)
        state["i"] += 1

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
    stats = cache.stats_total()
    hit = stats["hits"] / max(1, stats["lookups"])
    cache_bytes = sum(b.numel() * b.element_size() for b in cache.buffers())
    peer_bytes = sum(r * dim * 4 * 3 for r in rows)  # weights + SparseAdam's two moments
    # Synchronisations the CUDA runtime reports for one step (cache_lookup's own reads included).
    debug_syncs = -1
    if dev.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                lookup(values[0])
            finally:
                torch.cuda.set_sync_debug_mode(0)
        debug_syncs = sum("synchroniz" in str(w.message) for w in record)
    # Overlap: the next batch's lookups and loads on a worker thread and side stream while this one computes.
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def prefetch(v: torch.Tensor) -> None:
        if side is None:
            cache.prepare(v, lengths, feature_table, count=False, pin_until=cache.step + 1)
            return
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.default_stream(dev))
            cache.prepare(v, lengths, feature_table, count=False, pin_until=cache.step + 1)

    def sequential() -> None:
        nxt = values[(state["i"] + 1) % nbatches]
        prefetch(nxt)
        if side is not None:
            torch.cuda.current_stream(dev).wait_stream(side)
        cached_step()

    def overlapped() -> None:
        nxt = values[(state["i"] + 1) % nbatches]
        worker = threading.Thread(target=prefetch, args=(nxt,))
        worker.start()
        cached_step()
        worker.join()
        if side is not None:
            torch.cuda.current_stream(dev).wait_stream(side)

    otimes = interleave_cuda({"prefetch_then_step": sequential, "prefetch_beside_step": overlapped},
                             repeats=repeats, warmup=1, iters=iters)
    s = {k: summarize(v) for k, v in times.items()}
    os_ = {k: summarize(v) for k, v in otimes.items()}
    thr = {k: batch / v["median"] for k, v in s.items()}
    syncs = sum(state["syncs"]) / max(1, len(state["syncs"]))
    summary = (f"1.5% cached {thr['cached_1.5pct_fused_adam']:,.0f} samples/s vs full tables "
               f"{thr['full_tables_sparseadam']:,.0f} ({thr['cached_1.5pct_fused_adam'] / thr['full_tables_sparseadam']:.2f}x), "
               f"hit rate {hit:.1%}, device memory {cache_bytes / 2**30:.2f} vs {peer_bytes / 2**30:.2f} GiB; "
               f"{syncs:.1f} host reads per step (CUDA sync debug: {debug_syncs}); prefetch beside the step "
               f"{os_['prefetch_beside_step']['median'] * 1e3:.1f} ms vs one after the other "
               f"{os_['prefetch_then_step']['median'] * 1e3:.1f} ms; TorchRec FUSED_UVM_CACHING: skipped (no "
               "TorchRec/FBGEMM on this image)")
    print(summary, flush=True)
    write_result(NAME, title=TITLE, summary=summary,
                 params={"rows": sum(rows), "dim": dim, "batch": batch, "ratio": ratio, "repeats": repeats,
                         "smoke": args.smoke, "quick": args.quick},
                 results={"step_seconds": times, "step_summary": s, "samples_per_s": thr, "hit_rate": hit,
                          "cache_stats": stats, "device_bytes": {"cached": cache_bytes, "full": peer_bytes},
                          "host_reads_per_step": syncs, "cuda_sync_debug_warnings": debug_syncs,
                          "overlap_seconds": otimes, "overlap_summary": os_,
                          "fused_uvm_caching": "skipped: TorchRec and FBGEMM are not on the GPU image"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
