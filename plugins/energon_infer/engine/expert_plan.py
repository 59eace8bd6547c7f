"""The serving plan of a Mixture-of-Experts model that does not fit: experts placed one by one, not whole layers.

Where :func:`~energon_infer.engine.memory_plan.fit_memory`'s plan reads layers from disk and the model has experts,
:func:`place_experts` asks core's expert planner (:func:`tightfit.planner.experts.plan_experts`, pure) to place the
weights within the same weights budget expert by expert instead: every layer's dense parts (attention, norms, router,
shared expert, with their packed copies where the plan keeps them) and the bytes that always stay (embedding, head,
norms) in memory, then the experts most used per byte (the popularity profile beside the model, else uniform
routing), the rest read when the router picks them (:mod:`energon_infer.worker.expert_pool`): from the checkpoint,
or with quantized weights (int8 / int4) from the quantized store, every expert priced at its packed quantized bytes
(weights, scales, zero points and biases: what a read moves and a slot holds). What that runtime holds besides is
taken off the budget first: the arena the step's uncached disk experts are read into (one layer's experts), the two
lookahead buffers the next layer's predicted experts are read ahead into (one token's picks each) and the I/O
threads' read buffers.

The plan's budget lines are rewritten to say so (dense parts, experts kept, cache slots, arena, lookahead buffers,
read buffers) and the layer pool keeps every layer. Where the expert plan does not fit, where unquantized experts are
sliced from one tensor shared by all of them (gpt-oss's fused experts: an expert read would read them all; quantized,
each expert is stored on its own), or with tensor or pipeline parallelism, the layer plan stands.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tightfit.planner.serving import ServingPlan, StageShape

__all__ = ["place_experts", "moe_shapes", "weight_read_rate"]


def weight_read_rate(total_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes per second this machine's compute reads a weight matrix at in a decode step (a matrix-vector product
    over ``total_bytes`` of fp32, the fastest of ``repeats``): the rate a batch-1 step streams the weights it holds."""
    import torch

    n = int((total_bytes // 4) ** 0.5)
    w, x = torch.randn(n, n), torch.randn(n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(w, x)
        best = min(best, time.perf_counter() - start)
    return n * n * 4 / max(best, 1e-9)


def moe_shapes(stage: Any, extra: list[int] | None = None, *, quantized: bool = False
               ) -> tuple[list[Any], int, list[int]]:
    """Each MoE layer's dense and expert bytes (core's :class:`~tightfit.planner.experts.MoELayerShape`; ``extra``:
    each layer's packed copies, counted with its dense parts), the bytes of the dense layers (an MoE model's
    ``mlp_only_layers``) and the MoE layers' positions in the stage, from a meta copy of the stage. ``quantized``
    (the stage's projections quantized on meta): an expert's bytes are its packed quantized bytes, what the expert
    pool reads from the quantized store and a slot holds
    (:func:`~energon_infer.worker.quantized_pool.packed_block_bytes`)."""
    from energon_infer.worker.quantized_pool import packed_block_bytes
    from tightfit.planner.experts import MoELayerShape

    shapes, dense_layers, where = [], 0, []
    for i, block in enumerate(stage.layers.values()):
        total = sum(p.numel() * p.element_size() for p in block.parameters()) + (extra[i] if extra else 0)
        experts = getattr(getattr(block, "moe", None), "experts", None)
        if experts is None:
            dense_layers += total
            continue
        each = [sum(p.numel() * p.element_size() for p in e.parameters()) for e in experts.values()]
        held = [packed_block_bytes(e) for e in experts.values()] if quantized else each
        shapes.append(MoELayerShape(dense_bytes=total - sum(each), expert_bytes=tuple(held)))
        where.append(i)
    return shapes, dense_layers, where


def place_experts(path: str | Path, model: Any, rt: Any, dtype: str, plan: ServingPlan, shape: StageShape, *,
                  io_threads: int, disk: Any, lookahead: int | None = None) -> tuple[Any, ServingPlan, int] | None:
    """``(the expert plan, the serving plan it replaces the layer plan with, the experts read ahead per layer)``, or
    ``None`` where the layer plan stands (see the module docstring). ``shape``: the stage's shape the layer plan was
    made from; ``lookahead``: the experts each lookahead buffer holds (``None``: one token's picks where the plan fits
    beside them, else none)."""
    from energon_infer.loading.quantization import QuantSpec, meta_quantize
    from energon_infer.loading.safetensors_files import TensorFiles
    from energon_infer.worker.disk_pool import _meta_stage
    from energon_infer.worker.expert_pool import expert_read_buffer_bytes, lookahead_experts
    from energon_infer.worker.quantized_pool import store_buffer_bytes
    from energon_infer.worker.runtime_config import DTYPES
    from tightfit.planner.errors import PlanInfeasibleError
    from tightfit.planner.experts import plan_experts
    from tightfit.profiler.experts import POPULARITY_FILE, ExpertPopularity
    from tightfit.storage import ALIGN

    if not model.n_experts or rt.tp != 1 or rt.pp != 1 or len(plan.pools) != 1:
        return None
    stage = _meta_stage(model, 1, 1, 0, DTYPES[dtype])
    quant = QuantSpec.create(rt.quantization, rt.group_size)
    if quant is not None:  # the experts' packed quantized bytes, read from the quantized store
        meta_quantize(stage.layers.values(), quant)
        layers, dense_layers, _ = moe_shapes(stage, list(shape.kept_extra_bytes) or None, quantized=True)
        # Each slot, arena place and lookahead place of the runtime starts 4 KiB-aligned (an O_DIRECT read's).
        widest = -(-max(max(s.expert_bytes) for s in layers) // ALIGN) * ALIGN
        buffers = store_buffer_bytes([widest], io_threads)
    else:
        files = TensorFiles(path)
        try:
            buffer = expert_read_buffer_bytes(stage, model, files)
        finally:
            files.close()
        if buffer < 0:
            return None
        layers, dense_layers, _ = moe_shapes(stage, list(shape.kept_extra_bytes) or None)
        widest = max(max(s.expert_bytes) for s in layers)
        buffers = io_threads * buffer
    ahead_buffers = 2 if len(layers) > 1 else 0
    popularity = None
    if (Path(path) / POPULARITY_FILE).is_file():
        popularity = ExpertPopularity.load(path, num_layers=len(layers), num_experts=model.n_experts)
    wanted = lookahead_experts(model.experts_per_token, model.n_experts) if lookahead is None else lookahead
    # One token's picks read ahead where the plan fits beside them, else (lookahead not given) none.
    for ahead_n in dict.fromkeys([wanted] if lookahead is not None else [wanted, 0]):
        # The arena and the lookahead buffers at their largest until the plan says how many of a layer's are on disk.
        budget = plan.weight_budgets[0] - max(len(s.expert_bytes) for s in layers) * widest - buffers \
            - ahead_buffers * ahead_n * widest
        if budget < 0:  # the arena and buffers alone exceed the weights budget: no expert plan fits
            continue
        try:
            # One cache slot per layer: the arena serves a step's other reads, so more slots only keep more experts.
            experts = plan_experts(layers, experts_per_token=model.experts_per_token, budget_bytes=budget,
                                   device_bytes_per_s=weight_read_rate(), popularity=popularity,
                                   resident_bytes=shape.resident_bytes + dense_layers, unified=True, disk=disk,
                                   cache_slots=1)
        except PlanInfeasibleError:
            continue
        if not experts.count("disk"):
            return None
        # The arena holds the most disk experts of any one layer (the runtime's size), not a whole layer; each
        # lookahead buffer at most that many.
        on_disk = max(tiers.count("disk") for tiers in experts.placement)
        ahead_n = min(ahead_n, on_disk)
        return experts, _rewritten(plan, shape, experts, layers, dense_layers, on_disk * widest,
                                   (ahead_buffers, ahead_n, ahead_buffers * ahead_n * widest), buffers,
                                   rt.block_size), ahead_n
    return None


def _rewritten(plan: ServingPlan, shape: StageShape, experts: Any, layers: list[Any], dense_layers: int, arena: int,
               ahead: tuple[int, int, int], buffers: int, block_size: int) -> ServingPlan:
    """The serving plan with its weights lines for the expert placement, every layer kept by the layer pool."""
    import dataclasses

    from tightfit.planner.pool import PoolPlan

    old = dict(plan.lines[0])
    kept = [(lay, e) for lay, tiers in enumerate(experts.placement) for e, t in enumerate(tiers) if t == "device"]
    kept_bytes = sum(layers[lay].expert_bytes[e] for lay, e in kept)
    slots = sum(n * b for n, b in zip(experts.slots, experts.slot_bytes))
    total_experts = sum(len(s.expert_bytes) for s in layers)
    head = [("interpreter, libraries and runtime", old["interpreter, libraries and runtime"]),
            (shape.resident_what, shape.resident_bytes),
            (f"dense parts of {len(layers)} MoE layer(s) and {len(shape.layer_bytes) - len(layers)} dense layer(s)",
             sum(s.dense_bytes for s in layers) + dense_layers),
            (f"{len(kept)} of {total_experts} experts kept in memory", kept_bytes),
            (f"{sum(experts.slots)} expert cache slot(s)", slots),
            ("expert read arena (one layer's experts)", arena),
            (f"lookahead buffers ({ahead[0]} x {ahead[1]} expert(s) of the next layer, read ahead)", ahead[2]),
            (f"read buffers ({experts.count('disk')} expert(s) read from disk when routed)", buffers)]
    tail = [(w, b) for w, b in plan.lines[0] if w.startswith(("activations", "KV swap", "allocator"))]
    # The KV cache gets what is left, up to the layer plan's (the expert plan was made with it at its floor).
    share = old["this rank's share of the limit"]
    left = share - sum(b for _, b in head + tail)
    per_token = shape.kv_bytes_per_token
    kv = plan.kv_cache_tokens if not per_token else \
        max(0, min(plan.kv_cache_tokens, left // per_token // block_size * block_size))
    lines = head + [(f"KV cache, {kv} tokens", kv * per_token)] + tail
    total = sum(b for _, b in lines)
    lines += [("total", total), ("this rank's share of the limit", share)]
    n = len(shape.layer_bytes)
    held = shape.resident_bytes + sum(s.dense_bytes for s in layers) + dense_layers + kept_bytes + slots + arena \
        + ahead[2]
    pool = PoolPlan(pooled=(), n_layers=n, lookahead=0, device_bytes=held, pool_bytes=0, slot_bytes=0)
    return dataclasses.replace(plan, pools=(pool,), lookahead=0, kv_cache_tokens=kv, lines=(tuple(lines),))
