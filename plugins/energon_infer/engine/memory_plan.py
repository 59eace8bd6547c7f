"""The engine's serving plan: the whole serving process fitted into the memory it may use, before anything loads.

:func:`fit_memory` runs in the caller's process before any worker starts (on a CPU, where the device and the host
are one memory and a memory limit binds the whole process tree). It measures what it can (the memory the limit
leaves, :func:`tightfit.memory_limit.read_memory`; one worker's interpreter and libraries, from this process after
the same imports), derives the rest from the model (each stage's weights as held, their packed copies, the read
buffers, the KV cache per token, a step's working memory per token), asks core's pure planner
(:func:`tightfit.planner.serving.plan_serving`) and applies its choices to the engine's configuration: the token
budget and the KV cache where the caller left them open, and, where layers must be read from disk, a memory pool
carrying each stage's plan (the workers apply it as it is).

Where the plan fits only without the CPU's packed weight copies (``packed_weights``, on by default, a second copy
of each projection and of the vocabulary head), they are turned off, unless the caller set ``packed_weights``.
An infeasible limit raises :class:`~tightfit.planner.errors.PlanInfeasibleError` here, in one line naming what the
least-memory plan needs and the cheapest change (``tightfit serve`` exits with code 3).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, cast

from energon_infer.worker.memory_pool import MemoryPoolConfig
from tightfit.planner.serving import ServingPlan, StageShape, plan_serving

__all__ = ["fit_memory", "cpu_dtype", "worker_baseline_bytes", "stage_shapes", "WORKER_RUNTIME_BYTES"]

#: What a loaded worker holds beyond the controller's imports: its intra-op thread pool and their allocator arenas,
#: its process group, the kernels it loads and the warm-up step's tensors the allocator keeps.
WORKER_RUNTIME_BYTES = 64 * 2**20


def worker_baseline_bytes() -> int:
    """This process's anonymous resident bytes (``/proc/self/statm``: resident less file-backed pages), measured after
    the engine's imports: what a worker spawned with the same imports holds before it loads. The libraries' file
    pages are shared by every process and charged to a memory limit once, so they are not counted again."""
    try:
        fields = Path("/proc/self/statm").read_text().split()
        return max(0, int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _packed_bytes(module: Any) -> int:
    """Bytes the CPU's packed copies of ``module``'s projection weights take (:func:`energon_infer.parallel.pack_weights`
    packs those big enough to earn a copy)."""
    from energon_infer.parallel import ColumnLinear, RowLinear, VocabHead
    from tightfit.kernels.packed_linear import rows_worth_packing

    total = 0
    for m in module.modules():
        if isinstance(m, (ColumnLinear, RowLinear, VocabHead)) and getattr(m, "weight", None) is not None:
            w = m.weight
            if w.is_floating_point() and rows_worth_packing(w.numel()) is not None:
                total += w.numel() * w.element_size()
    return total


def disk_tables(path: str | Path, cfg: Any, quant: Any) -> tuple[str, ...]:
    """The vocabulary tables (``"embed"``, ``"lm_head"``) that can be read from the checkpoint per step
    (:mod:`energon_infer.worker.disk_vocab`): each stored whole in one tensor, the model not quantized."""
    from energon_infer.loading.safetensors_files import TensorFiles
    from energon_infer.worker.disk_vocab import DISK_VOCAB, vocab_source

    if quant is not None:
        return ()
    files = TensorFiles(path)
    try:
        keys = set(files.keys())
        return tuple(t for t in DISK_VOCAB if vocab_source(cfg, f"{t}.weight", keys) is not None)
    finally:
        files.close()


def _table_bytes(stage: Any, tables: tuple[str, ...], cfg: Any, file_itemsize: int, itemsize: int, tp: int) -> int:
    """What reading ``tables`` from disk saves in ``stage``: their bytes, less what the head holds instead."""
    from energon_infer.worker.disk_vocab import disk_vocab_bytes

    saved = 0
    for t in tables:
        module = getattr(stage, t, None)
        if module is not None:
            saved += module.weight.numel() * itemsize - disk_vocab_bytes(t, cfg, file_itemsize, itemsize, tp)
    return saved


def stage_shapes(path: str | Path, cfg: Any, *, tp: int, pp: int, dtype: str, io_threads: int, quant: Any,
                 packed: bool, tables: tuple[str, ...] = ()) -> list[StageShape]:
    """Each stage's :class:`~tightfit.planner.serving.StageShape` from the model (meta copies and file headers);
    ``tables``: the vocabulary tables read from disk instead of held (:func:`disk_tables`)."""
    from energon_infer.worker.disk_pool import stage_weights
    from energon_infer.worker.runtime_config import DTYPES

    itemsize = DTYPES[dtype].itemsize
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * d // tp
    mlp = cfg.intermediate_size // tp
    # A step's live tensors per token at the widest point of a block: the residual stream, its norm and the block's
    # output (3 h), q/k/v and the attention output (2 qkv), the MLP's gate, up and activated product (3 mlp).
    per_token = (3 * h + 2 * qkv + 3 * mlp) * itemsize
    logits_row = 3 * 4 * -(-cfg.vocab_size // tp)  # fp32 logits, the sampler's probabilities and one working copy
    if "embed" in tables:  # a step's embedding rows, read per token
        per_token += cfg.embed_dim * itemsize
    file_itemsize = _file_itemsize(path, itemsize)
    what = "embedding, head and norms" if not tables else \
        f"{' and '.join({'embed': 'embedding', 'lm_head': 'head'}[t] for t in tables)} read from disk; the rest"
    shapes = []
    for s, (stage, layers, resident, buffers) in enumerate(stage_weights(path, cfg, tp=tp, pp=pp, dtype=dtype,
                                                                         io_threads=io_threads, quant=quant)):
        blocks = list(stage.layers.values())
        extra = [_packed_bytes(b) if packed else 0 for b in blocks]
        rest = sum(_packed_bytes(m) for name, m in stage.named_children()
                   if name != "layers" and name not in tables) if packed else 0
        resident -= _table_bytes(stage, tables, cfg, file_itemsize, itemsize, tp)
        # Each read also makes a working copy as large as its buffer (a transform, the first read's finite
        # check), which the I/O thread's allocator keeps while layers stream.
        shapes.append(StageShape(layer_bytes=tuple(layers), resident_bytes=resident + rest, resident_what=what,
                                 kept_extra_bytes=tuple(extra), read_buffer_bytes=buffers, read_work_bytes=buffers,
                                 kv_bytes_per_token=len(blocks) * 2 * max(1, cfg.n_kv_heads // tp) * d * itemsize,
                                 activation_bytes_per_token=per_token, logits_bytes_per_row=logits_row if s == pp - 1 else 0,
                                 ranks=tp))
    return shapes


def _file_itemsize(path: str | Path, default: int) -> int:
    """Bytes per element of the checkpoint's vocabulary tables as stored (the largest of its float dtypes)."""
    from energon_infer.loading.safetensors_files import TensorFiles

    files = TensorFiles(path)
    try:
        sizes = [e.dtype.itemsize for e in files.extents.values() if e.dtype.is_floating_point]
        return max(sizes, default=default)
    finally:
        files.close()


def cpu_dtype(path: str | Path, rt: Any) -> str:
    """The dtype a CPU serves ``path`` in under runtime config ``rt``: its own, or the checkpoint's for ``"auto"``."""
    if rt.dtype != "auto":
        return str(rt.dtype)
    from energon_infer.loading.hf_files import auto_dtype

    return str(auto_dtype(path, "cpu")[0])


def fit_memory(path: str | Path, model: Any, cfg: Any, pool: MemoryPoolConfig | None, *,
               given: frozenset[str] = frozenset()) -> tuple[Any, MemoryPoolConfig | None, ServingPlan | None]:
    """Plan the serving process on a CPU and apply the plan: ``(engine config, memory pool, plan)``.

    ``given``: the flat options the caller set (``max_batch_tokens``, ``kv_cache_tokens``, ``chunked_prefill``);
    the planner chooses the others. On a GPU, or with a pool sized by ``device_budget`` / ``fraction``, nothing is
    planned here (``plan`` is ``None``).
    """
    import torch

    from energon_infer.loading.quantization import QuantSpec
    from energon_infer.worker.disk_pool import encode_plans
    from tightfit.memory_limit import read_memory

    rt, sched = cfg.runtime, cfg.scheduler
    device = rt.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") or (pool is not None and not pool.tiered):
        return cfg, pool, None
    dtype = cpu_dtype(path, rt)
    quant = QuantSpec.create(rt.quantization, rt.group_size)
    io_threads = pool.io_threads if pool is not None else MemoryPoolConfig().io_threads
    packed = rt.packed_weights and quant is None

    def shapes_of(packed: bool, tables: tuple[str, ...] = ()) -> list[StageShape]:
        return stage_shapes(path, model, tp=rt.tp, pp=rt.pp, dtype=dtype, io_threads=io_threads, quant=quant,
                            packed=packed, tables=tables)

    shapes = shapes_of(packed)
    reading = read_memory(settle=True)
    where = f"the memory limit ({reading.limit_file})" if reading.limited else "this machine's free memory"
    fixes = []
    if quant is None:
        fixes.append("quantized weights (--quantization int8)")
    fixes.append("a larger memory limit, or more ranks (tp/pp) on more machines")
    common = dict(free_bytes=reading.free, worker_bytes=worker_baseline_bytes() + WORKER_RUNTIME_BYTES,
                  weight_budget_bytes=None if pool is None else cast(int, pool.memory_budget),  # parsed to bytes
                  lookahead=(pool or MemoryPoolConfig()).lookahead,
                  max_batch_tokens=sched.max_batch_tokens, fix_batch_tokens="max_batch_tokens" in given,
                  kv_cache_tokens=rt.kv_cache_tokens, fix_kv_tokens="kv_cache_tokens" in given,
                  block_size=rt.block_size, max_running=sched.max_running, swap_tokens=rt.swap_space_tokens,
                  where=where, fixes=tuple(fixes))
    from tightfit.planner.errors import PlanInfeasibleError

    plan, tables, experts = None, pool.disk_vocab if pool is not None else (), None
    expert_lookahead = pool.expert_lookahead if pool is not None else None
    if pool is None:  # everything in memory with the knobs as given: the plan the disk would give too, unmeasured
        try:
            plan = plan_serving(shapes, disk=None, **common)
        except PlanInfeasibleError:
            plan = None
        if plan is not None and (plan.max_batch_tokens, plan.lookahead) != (sched.max_batch_tokens,
                                                                            MemoryPoolConfig().lookahead):
            plan = None  # a knob was lowered to keep every layer: ask again with the disk tier
    if plan is None:
        plan, kept, tables = _plan_with_disk(path, pool, quant, dtype, rt, shapes_of, packed=packed,
                                             may_unpack="packed_weights" not in given,
                                             tables=(tables, disk_tables(path, model, quant)), common=common)
        if packed and not kept:  # given up by the plan
            rt = dataclasses.replace(rt, packed_weights=False)
        if plan.streams and model.n_experts:  # experts placed one by one where they allow it
            from energon_infer.engine.expert_plan import place_experts
            from energon_infer.worker.disk_pool import resolve_disk

            placed = place_experts(path, model, rt, dtype, plan, shapes_of(packed and kept, tables)[0],
                                   io_threads=io_threads, disk=resolve_disk(pool.disk if pool else None,
                                                                            _disk_dir(path, pool, quant, dtype, rt)),
                                   lookahead=pool.expert_lookahead if pool else None)
            if placed is not None:
                experts, plan, expert_lookahead = placed
    scheduler = dataclasses.replace(sched, max_batch_tokens=plan.max_batch_tokens)
    if plan.max_batch_tokens < sched.max_batch_tokens and "chunked_prefill" not in given:
        scheduler = dataclasses.replace(scheduler, chunked_prefill=True)  # prompts longer than a step still run
    runtime = dataclasses.replace(rt, kv_cache_tokens=plan.kv_cache_tokens, max_batch_tokens=plan.max_batch_tokens)
    if plan.streams or pool is not None or tables or experts is not None:
        pool = dataclasses.replace(pool or MemoryPoolConfig(memory_budget=max(0, *plan.weight_budgets)),
                                   lookahead=plan.lookahead, plans=encode_plans(list(plan.pools)), disk_vocab=tables,
                                   experts=None if experts is None else experts.to_json(),
                                   expert_lookahead=expert_lookahead)
    return dataclasses.replace(cfg, scheduler=scheduler, runtime=runtime), pool, plan


def _disk_dir(path: str | Path, pool: MemoryPoolConfig | None, quant: Any, dtype: str, rt: Any) -> Any:
    """Where the disk tier reads from: the model directory, or the quantized store's (quantized layers and experts
    are read from it)."""
    if quant is None:
        return path
    from energon_infer.worker.quantized_pool import quantized_store_dir

    return quantized_store_dir(path, pool.quantized_dir if pool is not None else None, quant, dtype, rt.tp, rt.pp)


def _plan_with_disk(path: str | Path, pool: MemoryPoolConfig | None, quant: Any, dtype: str, rt: Any,
                    shapes_of: Any, *, packed: bool, may_unpack: bool, tables: tuple[tuple[str, ...], tuple[str, ...]],
                    common: dict[str, Any]) -> tuple[ServingPlan, bool, tuple[str, ...]]:
    """The plan with the disk tier, whether it keeps the packed copies and the vocabulary tables it reads from disk.

    ``tables``: (those the caller put there, those that may go). Each step down gives up the next cheapest thing
    where the plan does not fit: the embedding read per step by row (a few KiB a token), the ``packed`` copies where
    ``may_unpack`` (the caller did not name ``packed_weights``), then the head read per step in chunks (its bytes
    once a step, as one more streamed layer). The last step's refusal names the least-memory plan."""
    from energon_infer.worker.disk_pool import resolve_disk
    from tightfit.planner.errors import PlanInfeasibleError

    disk = resolve_disk(pool.disk if pool is not None else None, _disk_dir(path, pool, quant, dtype, rt))
    given, may = tables
    steps = [(packed, given)]
    for step in ("embed", "unpack", "lm_head"):
        keep, held = steps[-1]
        if step == "unpack" and keep and may_unpack:
            steps.append((False, held))
        elif step in may and step not in held:
            steps.append((keep, tuple(t for t in may if t in held or t == step)))
    for keep, held in steps[:-1]:
        try:
            return plan_serving(shapes_of(keep, held), disk=disk, **common), keep, held
        except PlanInfeasibleError:
            continue
    keep, held = steps[-1]
    return plan_serving(shapes_of(keep, held), disk=disk, **common), keep, held
