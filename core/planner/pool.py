"""The weight-pool planner: which layers of a pipeline stage live off the device, and in which tier.

Energon's peer memory pool (``energon_infer.worker.memory_pool``) keeps some layers' weights outside the
computing device and copies each one into one of ``lookahead + 1`` device slots just before it
runs. This planner decides which: from the stage's per-layer parameter bytes (its profile), the
bytes that always stay (embedding, head, norms) and a device budget, it pools the fewest layers
that make the stage fit, spread evenly so the resident layers' compute hides the copies.

With a host budget and a disk tier (:class:`~tightfit.planner.tiers.MemoryTiers`) the pooled layers are
placed again: as many as the host budget holds stay in host memory, a fixed set chosen here (a cyclic scan
over the layers defeats LRU, so nothing is evicted at run time), and the rest are read from disk each pass,
spread evenly among the pooled so each read overlaps the compute of the layers before it. Disk reads come
from the checkpoint's own files, so the disk tier adds no bytes on disk; reading into the device needs
``min(lookahead + 1, disk layers)`` host staging slots unless host and device are one memory (a CPU
"device": ``unified``), where host-resident layers save nothing and only the disk tier does.

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
    >>> from tightfit.profiler.types import DiskProfile
    >>> disk = DiskProfile(path="/nvme", free_bytes=10**9, read_fit=(0.0, 1000.0))
    >>> plan = plan_pool([100] * 4, resident_bytes=50, budget_bytes=300, lookahead=0, host_budget_bytes=200, disk=disk)
    >>> plan.tiers, plan.host_bytes, plan.disk_bytes, plan.io_seconds  # 1 layer + 1 staging slot on the host
    (('disk', 'disk', 'host'), 200, 200, 0.2)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tightfit.checks import check_number
from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.tiers import MemoryTiers, disk_seconds, tier_error
from tightfit.profiler.types import DiskProfile
from tightfit.units import format_bytes

__all__ = ["PoolPlan", "PoolInfeasibleError", "plan_pool", "spread_layers", "streaming_groups"]


class PoolInfeasibleError(PlanInfeasibleError):
    """Even with every layer pooled the stage does not fit the budget (``needed_bytes`` > ``budget_bytes``)."""

    def __init__(self, needed: int, budget: int, unified: bool = False):
        where = ("in memory with every layer streamed from disk (on a CPU the device and the host are one memory: "
                 "embedding, head, norms, the prefetch slots and read buffers)" if unified else
                 "on the device with every layer pooled (embedding, head, norms and the prefetch slots)")
        super().__init__(
            f"the stage needs at least {format_bytes(needed)} {where} but the budget is {format_bytes(budget)}; "
            "raise the budget, lower lookahead, or split the model over more ranks (tp/pp)",
            needed_bytes=needed, budget_bytes=budget,
            suggestions=("raise the memory budget" if unified else "raise the device budget", "lower lookahead",
                         "split the model over more ranks (tp/pp)"))
        self.unified = unified

    @property
    def needed(self) -> int:
        return self.needed_bytes

    @property
    def budget(self) -> int:
        return self.budget_bytes

    def __reduce__(self) -> tuple[Any, ...]:  # keeps its numbers across processes (the workers raise it)
        return (type(self), (self.needed_bytes, self.budget_bytes, self.unified))


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolPlan:
    """Layers (positions within the stage) kept in the pool, where each one lives, and what that costs.

    Args:
        pooled: positions of the layers that live off the device, increasing.
        n_layers: layers in the stage.
        lookahead: layers fetched ahead.
        device_bytes: weight bytes on the device: resident bytes, kept layers and the prefetch slots.
        pool_bytes: bytes of the pooled layers.
        slot_bytes: one prefetch slot (the largest pooled layer).
        tiers: the tier of each pooled layer (``"host"`` or ``"disk"``), in ``pooled`` order; empty: all host
            (plans made without tiers).
        host_bytes: host memory the plan uses: host-resident layers and the staging slots for disk reads.
        disk_bytes: bytes read from disk per pass over the stage.
        io_seconds: predicted disk read seconds per pass (from the disk profile's read fit).
        compute_seconds: the stage's compute per pass (the sum of the layer timings given; 0 when none).
        stall_seconds: predicted wait on the disk per pass: reads run back to back while compute runs, so
            ``max(0, io_seconds - compute_seconds)``.
    """

    pooled: tuple[int, ...]
    n_layers: int
    lookahead: int
    device_bytes: int
    pool_bytes: int
    slot_bytes: int
    tiers: tuple[str, ...] = ()
    host_bytes: int = 0
    disk_bytes: int = 0
    io_seconds: float = 0.0
    compute_seconds: float = 0.0
    stall_seconds: float = 0.0

    def __post_init__(self) -> None:
        if any(not 0 <= i < self.n_layers for i in self.pooled) or list(self.pooled) != sorted(set(self.pooled)):
            raise ValueError(f"pooled={self.pooled} must be increasing layer positions in [0, {self.n_layers})")
        if self.tiers and (len(self.tiers) != len(self.pooled) or set(self.tiers) - {"host", "disk"}):
            raise ValueError(f"tiers={self.tiers} must name 'host' or 'disk' for each of the {len(self.pooled)} "
                             "pooled layers")

    @property
    def fraction(self) -> float:
        return len(self.pooled) / self.n_layers if self.n_layers else 0.0

    def tier_of(self, layer: int) -> str:
        """``"device"``, ``"host"`` or ``"disk"``: where ``layer`` (a position in the stage) lives between uses."""
        if layer not in self.pooled:
            return "device"
        return self.tiers[self.pooled.index(layer)] if self.tiers else "host"

    @property
    def disk_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in zip(self.pooled, self.tiers) if t == "disk")

    def io_roofline(self, batch: int) -> float:
        """Tokens/s the disk allows for ``batch`` sequences decoding together: one read of the disk layers per
        step serves the whole batch, so ``batch / io_seconds`` (infinite without disk layers)."""
        return batch / self.io_seconds if self.io_seconds > 0 else float("inf")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "pooled": list(self.pooled), "tiers": list(self.tiers)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PoolPlan:
        raw = json.loads(text)
        return cls(**{**raw, "pooled": tuple(raw["pooled"]), "tiers": tuple(raw.get("tiers", ()))})


def streaming_groups(plans: Sequence[PoolPlan], groups: int) -> int:
    """The scheduler policy for stages that stream layers from disk: how many groups of requests to keep in flight.

    Without disk layers: ``groups`` unchanged (one group per pipeline stage keeps every stage busy). With disk
    layers in any stage a step's cost is mostly its pass of reads, and each group's step reads every disk layer
    again: ``G`` groups read the checkpoint ``G`` times per round of the running batch on a disk the ranks share.
    One group makes one pass of reads serve the whole running batch (the largest batch per pass), so: 1.

    >>> streaming_groups([plan_pool([100] * 4, lookahead=0)], 2)
    2
    """
    return 1 if any(p.disk_bytes > 0 for p in plans) else groups


def spread_layers(n_layers: int, k: int) -> tuple[int, ...]:
    """``k`` of ``n_layers`` positions, evenly spaced (k=2 of 4: 0 and 2)."""
    if k <= 0:
        return ()
    return tuple(sorted({(i * n_layers) // k for i in range(k)}))


def plan_pool(layer_bytes: Sequence[int], *, resident_bytes: int = 0, budget_bytes: int | None = None,
              fraction: float = 0.5, lookahead: int = 2, host_budget_bytes: int | None = None,
              disk: DiskProfile | None = None, unified: bool = False,
              layer_seconds: Sequence[float] | None = None, sharers: int = 1,
              kept_extra_bytes: Sequence[int] | None = None) -> PoolPlan:
    """Choose the pooled layers of a stage, and the tier of each.

    Args:
        layer_bytes: parameter bytes of each layer of the stage, in execution order (its profile).
        resident_bytes: bytes that always stay on the device (embedding, head, norms).
        budget_bytes: device bytes the stage's weights may use; ``None`` pools ``fraction`` of the layers.
        fraction: used without a budget.
        lookahead: layers fetched ahead (slots = lookahead + 1, capped at the pooled count).
        host_budget_bytes: host bytes the pooled layers may use (``None``: unbounded, every pooled layer on the host).
        disk: the disk the checkpoint is read from (``None``: no disk tier).
        unified: host and device are one memory (a CPU "device"): only the disk tier saves memory, and
            ``budget_bytes`` covers everything the stage holds.
        layer_seconds: each layer's compute per pass (prices how much of the disk reads compute hides).
        sharers: ranks of a node reading the same disk at once (they split its bandwidth).
        kept_extra_bytes: bytes each layer adds on the device while it is kept there (not pooled), e.g. the
            packed copy of its projections on a CPU (``None``: none).

    Raises:
        PoolInfeasibleError: not even pooling every layer fits ``budget_bytes`` (the device tier).
        PlanInfeasibleError: the host tier is short (``tier="host"``) even with every pooled layer on disk, or
            with no disk tier.
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
    if host_budget_bytes is not None:
        check_number(host_budget_bytes, "host_budget_bytes", where=where, integer=True, low=0, error=PlanError,
                     fix="give the host bytes pooled layers may use, or None for no limit")
    check_number(fraction, "fraction", where=where, low=0, high=1, error=PlanError,
                 fix="the share of layers to pool without a budget, e.g. 0.5")
    check_number(lookahead, "lookahead", where=where, integer=True, low=0, error=PlanError,
                 fix="layers fetched ahead, e.g. 2")
    if layer_seconds is not None and len(layer_seconds) != len(layer_bytes):
        raise PlanError(f"plan_pool: layer_seconds has {len(layer_seconds)} entries for {len(layer_bytes)} layers; "
                        "give one compute time per layer, or None")
    n = len(layer_bytes)
    extra = [0] * n if kept_extra_bytes is None else [int(b) for b in kept_extra_bytes]
    if len(extra) != n or any(b < 0 for b in extra):
        raise PlanError(f"plan_pool: kept_extra_bytes has {len(extra)} entries for {n} layers; give one byte count "
                        ">= 0 per layer, or None")
    tiers = MemoryTiers(device_bytes=budget_bytes, host_bytes=host_budget_bytes, disk=disk, unified=unified)
    compute = float(sum(layer_seconds)) if layer_seconds is not None else 0.0

    def plan_for(k: int, on_disk: int = 0) -> PoolPlan:
        pooled = spread_layers(n, k)
        slots = min(lookahead + 1, len(pooled))
        slot = max((layer_bytes[i] for i in pooled), default=0)
        kept = sum(b + extra[i] for i, b in enumerate(layer_bytes) if i not in pooled)
        disk_at = {pooled[j] for j in spread_layers(len(pooled), on_disk)}
        placed = tuple("disk" if i in disk_at else "host" for i in pooled) if disk is not None else ()
        read = [layer_bytes[i] for i in sorted(disk_at)]
        staging = 0 if unified or not read else min(lookahead + 1, len(read)) * max(read)
        host = sum(layer_bytes[i] for i in pooled if i not in disk_at) + staging
        io = sum(disk_seconds(disk, b, sharers=sharers) for b in read) if disk is not None else 0.0
        return PoolPlan(pooled=pooled, n_layers=n, lookahead=lookahead, device_bytes=resident_bytes + kept + slots * slot,
                        pool_bytes=sum(layer_bytes[i] for i in pooled), slot_bytes=slot, tiers=placed,
                        host_bytes=host if (disk is not None or host_budget_bytes is not None) else 0,
                        disk_bytes=sum(read), io_seconds=io, compute_seconds=compute,
                        stall_seconds=max(0.0, io - compute))

    if unified and disk is not None and budget_bytes is not None:
        return _unified_plan(plan_for, n, budget_bytes)
    if budget_bytes is None:
        k = round(fraction * n)
    else:
        k = next((k for k in range(n + 1) if plan_for(k).device_bytes <= budget_bytes), -1)
        if k < 0:
            raise PoolInfeasibleError(min(plan_for(k).device_bytes for k in range(n + 1)), budget_bytes)
    return _place_off_device(plan_for, k, tiers)


def _place_off_device(plan_for: Callable[..., PoolPlan], k: int, tiers: MemoryTiers) -> PoolPlan:
    """The plan pooling ``k`` layers with the fewest of them on disk that fits the host budget."""
    plan = plan_for(k)
    if tiers.host_bytes is None or plan.host_bytes <= tiers.host_bytes:
        return plan
    if tiers.disk is None:
        raise tier_error(tiers, "host", needed=plan.host_bytes, what=f"pooling {k} layers")
    for j in range(1, k + 1):
        plan = plan_for(k, j)
        if plan.host_bytes <= tiers.host_bytes:
            return plan
    raise tier_error(tiers, "host", needed=plan.host_bytes, what="the disk reads' staging slots",
                     suggestions=("raise host_budget", "lower lookahead"))


def _unified_plan(plan_for: Callable[..., PoolPlan], n: int, budget: int) -> PoolPlan:
    """One memory (a CPU "device"): the fewest layers on disk such that everything held fits ``budget``.

    Pooled layers are exactly the disk layers here: a host-resident pooled layer would be a second copy in the
    same memory.
    """
    best = None
    for k in range(n + 1):
        plan = plan_for(k, k)
        total = plan.device_bytes + plan.host_bytes
        if total <= budget:
            return plan
        best = total if best is None else min(best, total)
    raise PoolInfeasibleError(int(best or 0), budget, unified=True)
