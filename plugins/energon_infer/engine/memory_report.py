"""The engine's memory report: where each layer lives, what the disk tier read, and tokens/s against the I/O roofline.

:meth:`Engine.memory_report <energon_infer.engine.engine.Engine.memory_report>` asks every worker for its
counters (in order with the steps, as :meth:`~energon_infer.engine.engine.Engine.pipeline_stats` does) and
:func:`memory_report` puts them together with each rank's :class:`~tightfit.planner.pool.PoolPlan`:

* per rank: the tier of every layer of its stage (model layer numbers), the disk layers, how many times
  each was read and the bytes read;
* for the interval since the previous report: steps, generated tokens, the mean batch (tokens per step),
  measured tokens/s (over the busiest stage's span of steps), the bytes streamed per step, and the I/O roofline ``batch × disk bandwidth ÷ bytes
  streamed per step`` (``batch / io_seconds`` of the slowest rank's plan, from the measured disk), with
  the fraction of it reached, and the bytes read per generated token;
* where an MoE model's experts are placed one by one (:mod:`energon_infer.worker.expert_pool`), since the start:
  routed expert uses, the share served without a read (``expert_hit_rate``: in memory or a cache hit), the expert
  cache's own hit rate over the disk experts it was asked for, the bytes the expert reads took, and the lookahead's
  accuracy (``expert_lookahead_accuracy``: the share of routed experts the next-layer prediction named) with the
  share of its reads ahead that a layer then used (``expert_prefetch_precision``).

:func:`check_tiered_plan` makes the plan once in the caller's process before any worker starts, so an
impossible budget raises :class:`~tightfit.planner.errors.PlanInfeasibleError` (naming the tier) there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from energon_infer.protocol import WorkerInfo
from tightfit.planner.pool import PoolPlan

__all__ = ["memory_report", "ReportMark", "check_tiered_plan", "METRIC_KEYS"]

#: The report's figures ``/metrics`` carries (as ``energon_pool_<key>``).
METRIC_KEYS = ("tokens_per_s", "io_roofline_tokens_per_s", "roofline_fraction", "disk_bytes_per_step", "mean_batch",
               "disk_bytes_per_token", "expert_hit_rate", "expert_cache_hit_rate", "expert_lookahead_accuracy",
               "expert_prefetch_precision")


@dataclass(frozen=True, slots=True)
class ReportMark:
    """The counters at one report: the next report's interval starts here."""

    at: float = 0.0
    steps: int = 0
    generated: int = 0
    bytes_read: int = 0


def check_tiered_plan(path: str, runtime: Any, pool: Any) -> list[PoolPlan]:
    """Every stage's tiered pool plan, made here (raises ``PlanInfeasibleError`` before workers start)."""
    import torch

    from energon_infer.loading.config import load_config
    from energon_infer.loading.quantization import QuantSpec
    from energon_infer.worker.disk_pool import plan_tiers

    device = runtime.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return plan_tiers(path, load_config(path), tp=runtime.tp, pp=runtime.pp, dtype=runtime.dtype,
                      device_type=str(device).split(":")[0], config=pool,
                      quant=QuantSpec.create(runtime.quantization, runtime.group_size))


def _rank_entry(info: WorkerInfo, stats: dict[str, Any]) -> tuple[dict[str, Any], PoolPlan | None]:
    pool = info.pool
    plan = PoolPlan.from_json(pool.plan) if pool is not None and pool.plan else None
    entry: dict[str, Any] = {"rank": info.rank, "weight_bytes": info.weight_bytes, "weights": info.weights_format}
    if info.layer_bytes:  # what each layer holds, by model layer number (quantized bytes where quantized)
        entry["layer_bytes"] = {info.first_layer + i: b for i, b in enumerate(info.layer_bytes)}
    if plan is not None and pool is not None:
        first = pool.first_layer
        entry.update(tiers={first + i: plan.tier_of(i) for i in range(plan.n_layers)},
                     device_bytes=plan.device_bytes, host_bytes=plan.host_bytes, io_seconds=plan.io_seconds)
    entry.update({k: v for k, v in stats.items() if k.startswith(("disk_", "pool_", "io_", "expert"))})
    return entry, plan


def memory_report(infos: list[WorkerInfo], stats: list[dict[str, Any]], *, steps: int, generated: int,
                  since: ReportMark) -> tuple[dict[str, Any], ReportMark]:
    """The report (see the module docstring) and the mark the next one measures from."""
    ranks, plans = [], []
    for info, st in zip(infos, stats):
        entry, plan = _rank_entry(info, st)
        ranks.append(entry)
        if plan is not None:
            plans.append(plan)
    now = time.monotonic()
    read = sum(int(r.get("disk_bytes_read", 0)) for r in ranks)
    d_steps, d_gen = steps - since.steps, generated - since.generated
    # The stages' span (first step's start to last step's end since the previous report): idle time before
    # the first request or after the last does not dilute tokens/s.
    seconds = max((float(st.get("span_s", 0.0)) for st in stats), default=0.0)
    batch = d_gen / d_steps if d_steps else 0.0
    io = max((p.io_seconds for p in plans), default=0.0)
    roofline = batch / io if io > 0 else float("inf")
    tps = d_gen / seconds if seconds > 0 else 0.0
    report = {"ranks": ranks, "steps": d_steps, "generated_tokens": d_gen, "seconds": seconds, "mean_batch": batch,
              "tokens_per_s": tps, "io_seconds_per_step": io,
              "disk_bytes_per_step": (read - since.bytes_read) / d_steps if d_steps else 0.0,
              "disk_bytes_per_token": (read - since.bytes_read) / d_gen if d_gen else 0.0,
              "io_roofline_tokens_per_s": roofline,
              "roofline_fraction": tps / roofline if roofline not in (0.0, float("inf")) else 0.0}
    uses = sum(int(r.get("expert_uses", 0)) for r in ranks)
    if uses:  # experts placed one by one (energon_infer.worker.expert_pool): uses served without a read, since start
        cached = sum(int(r.get("expert_cache_hits", 0)) for r in ranks)
        looked_up = uses - sum(int(r.get("expert_uses_in_memory", 0)) for r in ranks)
        report.update(expert_uses=uses, expert_hit_rate=(uses - looked_up + cached) / uses,
                      expert_cache_hit_rate=cached / looked_up if looked_up else 0.0,
                      expert_bytes_read=sum(int(r.get("expert_bytes_read", 0)) for r in ranks))
        routed, issued = (sum(int(r.get(k, 0)) for r in ranks) for k in ("expert_lookahead_routed", "expert_prefetches"))
        if routed:  # the lookahead predicted the next layer's experts
            right, used = (sum(int(r.get(k, 0)) for r in ranks)
                           for k in ("expert_lookahead_correct", "expert_prefetches_used"))
            report.update(expert_lookahead_accuracy=right / routed,
                          expert_prefetch_precision=used / issued if issued else 0.0)
    return report, ReportMark(now, steps, generated, read)
