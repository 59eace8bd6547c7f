"""The weight-pool planner: which layers of a pipeline stage live in a pool off the device.

Energon's peer memory pool (``energon_infer.memory_pool``) keeps some layers' weights outside the
computing device and copies each one into one of ``lookahead + 1`` device slots just before it
runs. This planner decides which: from the stage's per-layer parameter bytes (its profile), the
bytes that always stay (embedding, head, norms) and a device budget, it pools the fewest layers
that make the stage fit, spread evenly so the resident layers' compute hides the copies.

Pure: numbers in, a frozen JSON-serialisable :class:`PoolPlan` out; no torch.

Example:
    >>> plan = plan_pool([100] * 4, resident_bytes=50, budget_bytes=400, lookahead=1)  # 2 slots of 100 B
    >>> plan.pooled, plan.device_bytes, plan.pool_bytes
    ((0, 1, 2), 350, 300)
    >>> PoolPlan.from_json(plan.to_json()) == plan
    True
    >>> try:
    ...     plan_pool([100] * 4, resident_bytes=50, budget_bytes=100, lookahead=0)
    ... except PlanInfeasibleError as err:
    ...     print(err.needed_bytes, err.budget_bytes)
    150 100
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tightfit.checks import check_number
from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.units import format_bytes

__all__ = ["PoolPlan", "PoolInfeasibleError", "plan_pool", "spread_layers"]


class PoolInfeasibleError(PlanInfeasibleError):
    """Even with every layer pooled the stage does not fit the budget (``needed_bytes`` > ``budget_bytes``)."""

    def __init__(self, needed: int, budget: int):
        super().__init__(
            f"the stage needs at least {format_bytes(needed)} on the device with every layer pooled (embedding, "
            f"head, norms and the prefetch slots) but the budget is {format_bytes(budget)}; raise the budget, lower "
            "lookahead, or split the model over more ranks (tp/pp)",
            needed_bytes=needed, budget_bytes=budget,
            suggestions=("raise the device budget", "lower lookahead", "split the model over more ranks (tp/pp)"))

    @property
    def needed(self) -> int:
        return self.needed_bytes

    @property
    def budget(self) -> int:
        return self.budget_bytes

    def __reduce__(self) -> tuple[Any, ...]:  # keeps its numbers across processes (the workers raise it)
        return (type(self), (self.needed_bytes, self.budget_bytes))


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolPlan:
    """Layers (positions within the stage) kept in the pool, and the device bytes that leaves."""

    pooled: tuple[int, ...]
    n_layers: int
    lookahead: int
    device_bytes: int
    pool_bytes: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if any(not 0 <= i < self.n_layers for i in self.pooled) or list(self.pooled) != sorted(set(self.pooled)):
            raise ValueError(f"pooled={self.pooled} must be increasing layer positions in [0, {self.n_layers})")

    @property
    def fraction(self) -> float:
        return len(self.pooled) / self.n_layers if self.n_layers else 0.0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "pooled": list(self.pooled)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PoolPlan:
        raw = json.loads(text)
        return cls(**{**raw, "pooled": tuple(raw["pooled"])})


def spread_layers(n_layers: int, k: int) -> tuple[int, ...]:
    """``k`` of ``n_layers`` positions, evenly spaced (k=2 of 4: 0 and 2)."""
    if k <= 0:
        return ()
    return tuple(sorted({(i * n_layers) // k for i in range(k)}))


def plan_pool(layer_bytes: Sequence[int], *, resident_bytes: int = 0, budget_bytes: int | None = None,
              fraction: float = 0.5, lookahead: int = 2) -> PoolPlan:
    """Choose the pooled layers of a stage.

    Args:
        layer_bytes: parameter bytes of each layer of the stage, in execution order (its profile).
        resident_bytes: bytes that always stay on the device (embedding, head, norms).
        budget_bytes: device bytes the stage's weights may use; ``None`` pools ``fraction`` of the layers.
        fraction: used without a budget.
        lookahead: layers fetched ahead (slots = lookahead + 1, capped at the pooled count).

    Raises:
        PoolInfeasibleError: not even pooling every layer fits ``budget_bytes``.
    """
    where = "plan_pool"
    for i, b in enumerate(layer_bytes):
        check_number(b, f"layer_bytes[{i}]", where=where, integer=True, low=0, error=PlanError,
                     fix="give each layer's parameter bytes from its profile")
    check_number(resident_bytes, "resident_bytes", where=where, integer=True, low=0, error=PlanError,
                 fix="give the bytes that always stay on the device (embedding, head, norms), or 0")
    if budget_bytes is not None:
        check_number(budget_bytes, "budget_bytes", where=where, integer=True, low=0, error=PlanError,
                     fix="give the device bytes the stage's weights may use, or None to pool `fraction` of the layers")
    check_number(fraction, "fraction", where=where, low=0, high=1, error=PlanError,
                 fix="the share of layers to pool without a budget, e.g. 0.5")
    check_number(lookahead, "lookahead", where=where, integer=True, low=0, error=PlanError,
                 fix="layers fetched ahead, e.g. 2")
    n = len(layer_bytes)

    def plan_for(k: int) -> PoolPlan:
        pooled = spread_layers(n, k)
        slots = min(lookahead + 1, len(pooled))
        slot = max((layer_bytes[i] for i in pooled), default=0)
        kept = sum(b for i, b in enumerate(layer_bytes) if i not in pooled)
        return PoolPlan(pooled=pooled, n_layers=n, lookahead=lookahead, device_bytes=resident_bytes + kept + slots * slot,
                        pool_bytes=sum(layer_bytes[i] for i in pooled), slot_bytes=slot)

    if budget_bytes is None:
        return plan_for(round(fraction * n))
    for k in range(n + 1):
        plan = plan_for(k)
        if plan.device_bytes <= budget_bytes:
            return plan
    raise PoolInfeasibleError(min(plan_for(k).device_bytes for k in range(n + 1)), budget_bytes)
