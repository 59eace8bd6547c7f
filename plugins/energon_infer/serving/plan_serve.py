"""``tightfit plan serve DIR``: the plan ``tightfit serve DIR`` would run, printed before anything loads.

    tightfit plan serve ./Qwen3-30B-A3B --json plan.json
    tightfit plan serve ./llama --memory-budget 2GiB --max-batch-tokens 1024

On a CPU the serving plan is the one :func:`~energon_infer.engine.memory_plan.fit_memory` makes at
``Engine.from_pretrained``: what the memory limit this process lives under leaves (read now), line by line, the
layers kept and read from disk, lookahead, the token budget and the KV cache. Nothing is loaded: the model's shapes
come from ``config.json`` and the safetensors headers. On a GPU the memory planner is the pool's (nothing is printed
beyond the model's shapes).

For a Mixture-of-Experts model it also prints the expert-level placement (core's
:func:`tightfit.planner.experts.plan_experts`): each layer's experts in memory or on disk, from the
expert-popularity profile beside the model (``tightfit-expert-popularity.json``) or uniform routing, priced at batch
1 and 32 with this machine's measured weight-read rate and the disk's: the placement the engine serves
(:mod:`energon_infer.engine.expert_plan`) where it places experts one by one, else, marked so, the one core's planner
gives within the weights budget while the engine serves whole layers.

``--json PATH`` writes ``{"serving": ServingPlan JSON, "experts": ExpertPlan JSON or null}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tightfit.cli import Parser
from tightfit.commands.args import byte_size, exit_codes_help, positive_int

__all__ = ["main", "build_parser", "moe_shapes"]


def build_parser() -> Parser:
    p = Parser(prog="tightfit plan serve", description="Print the plan `tightfit serve DIR` would run, before "
               "anything loads.", epilog=(__doc__ or "").replace("``", "") + "\n" + exit_codes_help())
    p.add_argument("path", help="a Hugging Face model directory (config.json and safetensors files)")
    p.add_argument("--memory-budget", type=byte_size, default=None,
                   help="bytes each worker's weights may hold in memory (as `tightfit serve --memory-budget`)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=None, help="a step's token budget (kept as given)")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=None, help="the KV cache in tokens (kept as given)")
    p.add_argument("--quantization", choices=("int8", "int4"), default=None, help="serve quantized weights")
    p.add_argument("--group-size", type=positive_int, default=None, help="int4's group size")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    p.add_argument("--dtype", default="auto", help="the weights' dtype (default: the checkpoint's, on a CPU fp32/bf16)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the plans as JSON to PATH")
    return p


def moe_shapes(path: Path, cfg: Any, *, dtype: str, quant: Any) -> tuple[list[Any], int]:
    """Each MoE layer's dense and expert bytes (core's :class:`~tightfit.planner.experts.MoELayerShape`), and the
    bytes of everything else (embedding, head, norms and the dense layers), from a meta copy of the model."""
    from energon_infer.worker.disk_pool import stage_weights
    from tightfit.planner.experts import MoELayerShape

    shapes, other = [], 0
    for stage, layers, resident, _ in stage_weights(path, cfg, tp=1, pp=1, dtype=dtype, io_threads=1, quant=quant):
        other += resident
        for block, total in zip(stage.layers.values(), layers):
            experts = getattr(getattr(block, "moe", None), "experts", None)
            if experts is None:  # a dense layer of an MoE model (qwen2_moe's mlp_only_layers)
                other += total
                continue
            each = [sum(p.numel() * p.element_size() for p in e.parameters()) for e in experts.values()]
            shapes.append(MoELayerShape(dense_bytes=total - sum(each), expert_bytes=tuple(each)))
    return shapes, other


def main(argv: list[str] | None = None) -> int:
    """``tightfit plan serve ARGV``: 0 and the plans; 2 and one line for bad input; 3 where nothing fits."""
    import dataclasses

    from energon_infer.engine.engine_config import engine_config
    from energon_infer.engine.memory_plan import fit_memory
    from energon_infer.loading.config import load_config
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    args = build_parser().parse_args(argv)
    path = Path(args.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model directory (no config.json); give a Hugging Face model directory")
    options = {k: v for k, v in (("max_batch_tokens", args.max_batch_tokens), ("kv_cache_tokens", args.kv_cache_tokens),
                                 ("quantization", args.quantization), ("group_size", args.group_size))
               if v is not None}
    cfg = engine_config(None, tp=args.tp, pp=args.pp, dtype=args.dtype, **options)
    model = load_config(path)
    pool = MemoryPoolConfig(memory_budget=args.memory_budget) if args.memory_budget is not None else None
    cfg, pool, plan = fit_memory(path, model, cfg, pool, given=frozenset(options))
    if plan is None:
        print(f"{path}: on a GPU the pool plans the weights when the engine starts (`tightfit serve`); "
              "nothing to print here")
        return 0
    print(plan.explain())
    experts = None
    if pool is not None and pool.experts is not None:  # the engine serves this placement
        from tightfit.planner.experts import ExpertPlan

        experts = ExpertPlan.from_json(pool.experts)
        print("\nexpert placement (the engine reads the disk experts when routed, the hot ones cached):")
        print(experts.explain())
    elif model.n_experts:
        experts = _expert_plan(path, model, cfg, plan)
        print("\nexpert placement core's planner gives (the engine serves whole layers here: the experts fit in "
              "memory, are fused into one unquantized tensor, or the expert plan does not fit beside its read arena):")
        print(experts.explain())
    if args.json:
        Path(args.json).write_text(json.dumps({"serving": json.loads(plan.to_json()),
                                               "experts": None if experts is None else json.loads(experts.to_json()),
                                               "runtime": dataclasses.asdict(cfg.runtime)}, indent=1, default=str))
    return 0


def _expert_plan(path: Path, model: Any, cfg: Any, plan: Any) -> Any:
    """Core's expert placement within the serving plan's weights budget (one memory on a CPU), the disk the
    checkpoint is read from, and the popularity profile beside the model where there is one."""
    from energon_infer.engine.expert_plan import weight_read_rate
    from energon_infer.engine.memory_plan import cpu_dtype
    from energon_infer.loading.quantization import QuantSpec
    from energon_infer.worker.disk_pool import resolve_disk
    from tightfit.planner.experts import plan_experts
    from tightfit.profiler.experts import POPULARITY_FILE, ExpertPopularity

    rt = cfg.runtime
    layers, other = moe_shapes(path, model, dtype=cpu_dtype(path, rt),
                               quant=QuantSpec.create(rt.quantization, rt.group_size))
    counts = len(layers[0].expert_bytes) if layers else 0
    popularity = None
    if (path / POPULARITY_FILE).is_file():
        popularity = ExpertPopularity.load(path, num_layers=len(layers), num_experts=counts)
    budget = max(plan.weight_budgets)
    return plan_experts(layers, experts_per_token=model.experts_per_token, budget_bytes=budget,
                        device_bytes_per_s=weight_read_rate(), popularity=popularity, resident_bytes=other,
                        unified=True, disk=resolve_disk(None, path))
