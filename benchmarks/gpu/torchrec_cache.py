"""Embedding cache on one GPU: 1.5% of Criteo-sized tables cached vs the full tables on the device.

    python -m benchmarks.gpu.torchrec_cache [--quick | --smoke] [--torchrec-cache-algorithm lru|lfu]

Contenders, all on the same 26 tables, batch, Zipf id batches and Adam (lr 1e-3, eps 1e-8), interleaved:
what a user without a cache would run (one ``nn.EmbeddingBag(sparse=True)`` per table holding the
*whole* table in GPU memory, trained with ``torch.optim.SparseAdam``); tightfit (tables in pinned
host memory, 1.5% of the collection's rows on the GPU in one ``FusedCache`` for all 26 tables,
fused lazy Adam, the same arithmetic as SparseAdam); and, where ``torchrec`` and a CUDA build of
``fbgemm_gpu`` import and CUDA is available, TorchRec's ``FUSED_UVM_CACHING``: the collection sharded
table-wise by ``DistributedModelParallel`` on a 1-rank NCCL group, tables in UVM, a cache of
``load_factor=0.015`` on the GPU, FBGEMM's fused Adam. Where it cannot run, the result says exactly
why (which import failed, no CUDA, a CPU-only FBGEMM build); the GPU loan image has neither library.
Reported: samples/s of each, ratios, device memory, hit rate (TorchRec's from FBGEMM's UVM cache
stats), device-to-host reads per step (the cache's own count and ``torch.cuda.set_sync_debug_mode``
warnings), and the copy/compute overlap: a step with the next batch's rows loaded on a side stream by
a worker thread, against the same two pieces run one after the other.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

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


TORCHREC = "torchrec_fused_uvm_caching"  # the contender's name in the timing dicts


def fused_uvm_skip_reason() -> str | None:
    """Why TorchRec's ``FUSED_UVM_CACHING`` cannot run here (every missing piece, named), or None if it can."""
    import importlib
    from importlib import metadata

    import torch

    problems = []
    for mod in ("torchrec", "fbgemm_gpu"):
        try:
            importlib.import_module(mod)
        except Exception as e:  # ImportError, or OSError from an fbgemm_gpu .so built for another torch
            problems.append(f"import {mod} failed ({type(e).__name__}: {e})")
    if not torch.cuda.is_available():
        problems.append(f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)")
    # fbgemm-gpu-cpu installs the same `fbgemm_gpu` package without the CUDA kernels the UVM cache needs
    dists = metadata.packages_distributions().get("fbgemm_gpu", [])
    if dists and all(d.lower().replace("_", "-").endswith("-cpu") for d in dists):
        problems.append(f"fbgemm_gpu is the CPU-only build ({', '.join(f'{d} {metadata.version(d)}' for d in dists)})")
    return "; ".join(problems) or None


def torchrec_setup(rows: list[int], dim: int, ratio: float, *, lr: float, eps: float, batch: int,
                   betas: tuple[float, float] = (0.9, 0.999),
                   hbm_cap_bytes: int, algorithm: str = "lru", kernel: str = "fused_uvm_caching",
                   compute_device: str = "cuda", optimizer: str = "adam") -> dict:
    """TorchRec's side, built as a user would: tables on the meta device, constraints, sharder, planner.

    Constructs on a CPU (the plan too: planning is arithmetic); only ``DistributedModelParallel`` with
    ``FUSED_UVM_CACHING`` needs CUDA. ``kernel="fused"``, ``compute_device="cpu"`` and ``optimizer="exact_sgd"``
    (FBGEMM's CPU kernels have no Adam) is the same model on TorchRec's CPU kernel, which lets a CPU test
    drive :func:`torchrec_contender` end to end.
    """
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import (
        KernelConfig,
        ParameterConstraints,
        TopologyFactory,
        TrainerConfig,
    )
    from torchrec.distributed.types import CacheParams, ShardingType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Sparse(torch.nn.Module):  # DMP shards submodules; the collection is this model's only part
        def __init__(self, ebc: EmbeddingBagCollection) -> None:
            super().__init__()
            self.ebc = ebc

        def forward(self, kjt):  # type: ignore[no-untyped-def]
            return self.ebc(kjt)

    algo = {"lru": CacheAlgorithm.LRU, "lfu": CacheAlgorithm.LFU}[algorithm]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=r, feature_names=[f"f{i}"],
                                 pooling=PoolingType.SUM) for i, r in enumerate(rows)]
    model = Sparse(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
    constraints = {t.name: ParameterConstraints(
        sharding_types=[ShardingType.TABLE_WISE.value],
        compute_kernels=[EmbeddingComputeKernel(kernel).value],
        cache_params=CacheParams(algorithm=algo, load_factor=ratio)) for t in tables}
    # FBGEMM's fused optimizer (applied inside the backward, as TorchRec users train); the UVM cache
    # statistics are gathered so the hit rate can be read (a few counter adds per batch).
    opt = EmbOptimType[optimizer.upper()]
    fused_params = {"optimizer": opt, "learning_rate": lr, "eps": eps, "beta1": betas[0], "beta2": betas[1],
                    "gather_uvm_cache_stats": True}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    topology = TopologyFactory.create_topology(TrainerConfig(world_size=1, hbm_cap_bytes=hbm_cap_bytes),
                                               kernel_config=KernelConfig(compute_device=compute_device))
    # 15% of HBM held back (TorchRec's default share); the model has no dense part to estimate
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch, constraints=constraints,
                                       storage_reservation=FixedPercentageStorageReservation(0.15))
    config = {"compute_kernel": EmbeddingComputeKernel(kernel).value,
              "sharding_type": ShardingType.TABLE_WISE.value, "load_factor": ratio, "algorithm": algo.name,
              "optimizer": opt.name, "lr": lr, "eps": eps, "betas": list(betas), "world_size": 1}
    return {"model": model, "tables": tables, "constraints": constraints, "sharder": sharder,
            "topology": topology, "planner": planner, "config": config}


def torchrec_contender(setup: dict, values: list, lengths, dev, state: dict) -> dict:  # type: ignore[no-untyped-def]
    """Shard ``setup``'s model with DMP on a 1-rank NCCL group (gloo on a CPU).

    Returns ``step`` (one forward+backward with FBGEMM's fused update, batch ``state["i"]``), ``hit_rate``
    (a float, or a string saying why it is not exposed), ``device_bytes``, ``plan`` (text), ``tbes``
    (FBGEMM's table-batched modules), ``dmp`` and ``close`` (destroys the group if this call made it).
    """
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
        UVMCacheStatsIndex,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    owns_group = not dist.is_initialized()
    if owns_group:  # one rank: an in-memory store, no port to pick
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    def close() -> None:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()

    cuda = dev.type == "cuda"
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    try:
        plan = setup["planner"].plan(setup["model"], [setup["sharder"]])
        dmp = DistributedModelParallel(setup["model"], env=ShardingEnv.from_process_group(dist.group.WORLD),
                                       device=dev, plan=plan, sharders=[setup["sharder"]], init_data_parallel=False)
        if cuda:
            torch.cuda.synchronize(dev)
    except BaseException:
        close()
        raise
    # the cache and its state (caching allocator); FBGEMM's UVM tables are managed memory, not counted
    device_bytes = torch.cuda.memory_allocated(dev) - before if cuda else 0
    keys = [f for t in setup["tables"] for f in t.feature_names]
    kjts = [KeyedJaggedTensor(keys=keys, values=v, lengths=lengths) for v in values]
    tbes: list = []

    def find_tbes(m: torch.nn.Module) -> None:
        # A sharded collection reports no submodules (its named_modules yields itself only); its kernels
        # hang off its lookups, which is where DMP itself looks for FBGEMM's modules.
        if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
            tbes.append(m)
        for child in [*getattr(m, "_lookups", []), *m.children()]:
            find_tbes(child)

    find_tbes(dmp)

    def step() -> None:
        kjt = kjts[state["i"] % len(kjts)]
        state["i"] += 1
        dmp(kjt).values().square().mean().backward()  # FBGEMM's fused Adam updates inside the backward

    def hit_rate() -> float | str:
        if not tbes or not all(getattr(t, "gather_uvm_cache_stats", False) for t in tbes):
            return "not exposed: no FBGEMM table-batched module with gather_uvm_cache_stats in the sharded model"
        s = sum(t.get_uvm_cache_stats().cpu() for t in tbes)
        unique, misses = int(s[UVMCacheStatsIndex.num_unique_indices]), int(s[UVMCacheStatsIndex.num_unique_misses])
        if not unique:
            return "not exposed: FBGEMM's UVM cache stats counted no lookups (no UVM cache in this kernel)"
        return 1.0 - misses / unique  # over each batch's distinct ids, as tightfit counts

    return {"step": step, "hit_rate": hit_rate, "device_bytes": device_bytes, "plan": str(plan), "tbes": tbes,
            "dmp": dmp, "close": close}


def _pct(x: float | str) -> str:
    return f"{x:.1%}" if isinstance(x, float) else str(x)


def _table(s: dict, thr: dict, ours: float, hits: dict) -> str:
    """Markdown: one row per contender, its step time beside tightfit's (ratio > 1: slower than tightfit)."""
    rows = ["| contender | step ms (median) | samples/s | step time / tightfit's | hit rate |",
            "|---|---:|---:|---:|---:|"]
    for name, v in s.items():
        hit = _pct(hits[name]) if name in hits else "all rows on the device"
        rows.append(f"| {name} | {v['median'] * 1e3:.2f} | {thr[name]:,.0f} | {v['median'] / ours:.2f}x | {hit} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or TITLE)
    p.add_argument("--torchrec-cache-algorithm", choices=("lru", "lfu"), default="lru",
                   help="FBGEMM's cache policy for FUSED_UVM_CACHING (default LRU, TorchRec's default)")
    args = p.parse_args(argv)
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
    state: dict[str, Any] = {"i": 0, "syncs": []}
    # TorchRec's FUSED_UVM_CACHING where torchrec, a CUDA build of fbgemm_gpu and a GPU are all present
    uvm: dict = {"status": "skipped", "reason": fused_uvm_skip_reason() or ""}
    tr_step = tr_hit = tr_close = None
    try:
        import torchrec  # noqa: F401

        hbm = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 80 << 30
        tr_setup = torchrec_setup(rows, dim, ratio, lr=opt.lr, eps=opt.eps, betas=(opt.beta1, opt.beta2),
                                  batch=batch, hbm_cap_bytes=hbm,
                                  algorithm=args.torchrec_cache_algorithm)
        uvm["config"] = tr_setup["config"]
    except Exception as e:  # no torchrec here: the skip reason already says so
        tr_setup = None
        if not uvm["reason"]:
            uvm["reason"] = f"TorchRec setup failed ({type(e).__name__}: {e})"
    if uvm["reason"]:
        print(f"[{NAME}] TorchRec FUSED_UVM_CACHING skipped: {uvm['reason']}", flush=True)
    elif tr_setup is not None:
        try:
            # TorchRec places shards on an indexed device ("rank:0/cuda:0")
            tr_dev = torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev
            tr = torchrec_contender(tr_setup, values, lengths, tr_dev, state)
            tr_step, tr_hit, tr_close = tr["step"], tr["hit_rate"], tr["close"]
            tr_step()  # one step first, so a failure is reported here rather than inside the timing
            uvm.update(status="ok", device_bytes_allocated=tr["device_bytes"], plan=tr["plan"],
                       tbe_modules=len(tr["tbes"]),
                       how_run=("DMP forward/backward per step: the cache prefetch runs inside the forward (no "
                                "TrainPipelineSparseDist prefetch pipeline), the 1-rank input/output all-to-alls "
                                "included as DMP runs them; UVM cache stats gathered while timed"))
        except Exception as e:
            uvm.update(status="failed", reason=f"{type(e).__name__}: {e}")
            print(f"[{NAME}] TorchRec FUSED_UVM_CACHING failed: {uvm['reason']}", flush=True)
            if tr_close is not None:
                tr_close()
            tr_step = None

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
    contenders: dict[str, Callable[[], object]] = {"full_tables_sparseadam": peer_step, "cached_1.5pct_fused_adam": cached_step}
    if tr_step is not None:
        contenders[TORCHREC] = tr_step
    times = interleave_cuda(contenders, repeats=repeats, warmup=1, iters=iters)
    stats = cache.stats_total()
    hit = stats["hits"] / max(1, stats["lookups"])
    cache_bytes = sum(b.numel() * b.element_size() for b in cache.buffers())
    peer_bytes = sum(r * dim * 4 * 3 for r in rows)  # weights + SparseAdam's two moments
    # Synchronisations the CUDA runtime reports for one step (the cache's own lookup reads included).
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
            cache.prefetch(v, lengths, feature_table, until=cache.step + 1)
            return
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.default_stream(dev))
            cache.prefetch(v, lengths, feature_table, until=cache.step + 1)

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
    ours = s["cached_1.5pct_fused_adam"]["median"]
    if tr_step is not None:
        assert tr_hit is not None and tr_close is not None
        uvm.update(step_summary=s[TORCHREC], samples_per_s=thr[TORCHREC],
                   step_ratio_vs_tightfit=s[TORCHREC]["median"] / ours, hit_rate=tr_hit(),
                   hit_rate_counts="1 - unique misses / unique ids per batch (FBGEMM's UVM cache stats)")
        tr_close()
        tr_text = (f"TorchRec FUSED_UVM_CACHING ({args.torchrec_cache_algorithm}) "
                   f"{s[TORCHREC]['median'] * 1e3:.1f} ms/step, {uvm['step_ratio_vs_tightfit']:.2f}x tightfit's step, "
                   f"hit rate {_pct(uvm['hit_rate'])}")
    else:
        tr_text = f"TorchRec FUSED_UVM_CACHING: {uvm['status']}: {uvm['reason']}"
    table = _table(s, thr, ours, {"cached_1.5pct_fused_adam": hit,
                                  **({TORCHREC: uvm["hit_rate"]} if tr_step is not None else {})})
    summary = (f"1.5% cached {thr['cached_1.5pct_fused_adam']:,.0f} samples/s vs full tables "
               f"{thr['full_tables_sparseadam']:,.0f} ({thr['cached_1.5pct_fused_adam'] / thr['full_tables_sparseadam']:.2f}x), "
               f"hit rate {hit:.1%}, device memory {cache_bytes / 2**30:.2f} vs {peer_bytes / 2**30:.2f} GiB; "
               f"{syncs:.1f} host reads per step (CUDA sync debug: {debug_syncs}); prefetch beside the step "
               f"{os_['prefetch_beside_step']['median'] * 1e3:.1f} ms vs one after the other "
               f"{os_['prefetch_then_step']['median'] * 1e3:.1f} ms; {tr_text}")
    print(table + "\n" + summary, flush=True)
    write_result(NAME, title=TITLE, summary=summary,
                 params={"rows": sum(rows), "dim": dim, "batch": batch, "ratio": ratio, "repeats": repeats,
                         "smoke": args.smoke, "quick": args.quick,
                         "torchrec_cache_algorithm": args.torchrec_cache_algorithm},
                 results={"step_seconds": times, "step_summary": s, "samples_per_s": thr, "hit_rate": hit,
                          "cache_stats": stats, "device_bytes": {"cached": cache_bytes, "full": peer_bytes},
                          "host_reads_per_step": syncs, "cuda_sync_debug_warnings": debug_syncs,
                          "overlap_seconds": otimes, "overlap_summary": os_,
                          "fused_uvm_caching": uvm, "table_md": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
