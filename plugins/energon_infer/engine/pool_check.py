"""The weight pool's plan made once in the caller's process, before any worker starts.

A budget no plan fits (``memory_pool="300KiB"``, ``--memory-pool 300KiB``, a ``memory_budget`` below the
least-memory plan) raises the planner's one-line :class:`~tightfit.planner.errors.PlanInfeasibleError` here,
from the model's shapes on the meta device, instead of a worker failing to load with its traceback in a
``WorkerStartError``. The workers plan the same pool again from the same shapes (``worker/memory_pool.py``,
``worker/quantized_pool.py``, ``worker/disk_pool.py``); this only decides earlier whether one exists.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_pool_plan"]


def check_pool_plan(path: str, runtime: Any, pool: Any) -> None:
    """Plan every stage's pool of ``pool`` (a ``MemoryPoolConfig``) for the model at ``path`` served with
    ``runtime`` (a ``RuntimeConfig``); raises ``PlanInfeasibleError`` where no plan fits its budget."""
    from energon_infer.engine.memory_report import check_tiered_plan

    if pool.tiered:  # device, host and disk tiers (memory_budget=...)
        check_tiered_plan(path, runtime, pool)
        return
    budget = pool.device_budget
    if not isinstance(budget, int):  # a fraction of the layers: always a plan
        return
    from energon_infer.loading.config import load_config
    from energon_infer.loading.hf_files import auto_dtype
    from energon_infer.loading.quantization import QuantSpec
    from energon_infer.worker.disk_pool import stage_weights
    from tightfit.planner.pool import plan_pool

    dtype = runtime.dtype
    if dtype == "auto":
        dtype = auto_dtype(path, runtime.device or "cpu")[0]
    quant = QuantSpec.create(runtime.quantization, runtime.group_size)
    for _, layers, resident, _ in stage_weights(path, load_config(path), tp=runtime.tp, pp=runtime.pp, dtype=dtype,
                                                io_threads=1, quant=quant):
        plan_pool(layers, resident_bytes=resident, budget_bytes=budget, fraction=pool.fraction,
                  lookahead=pool.lookahead)
