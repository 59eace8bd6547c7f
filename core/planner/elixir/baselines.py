"""Hand-picked configurations priced by the same cost model (:func:`baseline`), the budget-independent
Pareto :func:`frontier`, and :func:`mixed_budget` (a budget that yields a mixed plan, for tests and demos)."""

from __future__ import annotations

from dataclasses import replace

from tightfit.planner.elixir import space as S
from tightfit.planner.elixir.disk import Tier, disk_state_budget
from tightfit.planner.elixir.plan import BASELINES, DISK_BASELINES, ElixirPlan, UnitPlan
from tightfit.planner.elixir.problem import ElixirConstraints, ElixirProblem, prepare
from tightfit.planner.elixir.solver import estimate, search, to_plan
from tightfit.profiler.types import ClusterSpec, ModelProfile

__all__ = ["baseline", "frontier", "mixed_budget"]


def baseline(model: ModelProfile, cluster: ClusterSpec, name: str, *, checkpoint: bool | str = "auto",
             **kwargs: object) -> ElixirPlan:
    """A configuration users pick by hand, priced by the same cost model (one unit per block, merged
    like the search merges tiny blocks): ``ddp`` (replicate), ``zero2`` (keep), ``zero3``
    (reshard), ``-offload`` variants (every unit offloaded), ``zero3-offload-nvme`` (ZeRO-Infinity's
    optimizer state on NVMe: every unit offloaded with its optimizer state on disk; needs the disk tier,
    a disk profile on every device). ``checkpoint="auto"`` checkpoints every block only when the plan
    does not fit otherwise (what a user does after an out-of-memory error)."""
    if name not in BASELINES + DISK_BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES + DISK_BASELINES)}")
    mode = {"ddp": "replicate", "zero2": "keep", "zero3": "reshard"}[name.split("-")[0]]
    tier = Tier.DISK if name.endswith("-nvme") else Tier.HOST if name.endswith("-offload") else Tier.DEVICE
    _, _, ctx, _ = prepare(model, cluster, str(kwargs.get("optimizer", "adamw")),
                          str(kwargs.get("precision", "bf16-mixed")), None, None)
    spans = S.groupings(ctx, (1,))[0]

    def units(ck: bool) -> list[UnitPlan]:
        return [UnitPlan(blocks=ctx.names[a:b], mode=mode, tier=tier,
                         checkpoint=tuple(n for i, n in enumerate(ctx.names[a:b], a) if ck and ctx.checkpointable[i]))
                for a, b in spans]

    plan = estimate(model, cluster, units(checkpoint is True), **kwargs)  # type: ignore[arg-type]
    if checkpoint == "auto" and not plan.fits:
        plan = estimate(model, cluster, units(True), **kwargs)  # type: ignore[arg-type]
    return replace(plan, search_method=f"baseline {name}")


def frontier(model: ModelProfile, cluster: ClusterSpec, *, optimizer: str = "adamw", precision: str = "bf16-mixed",
             constraints: ElixirConstraints | None = None) -> list[ElixirPlan]:
    """The greedy search's Pareto frontier (peak ascending, time descending), budget-independent (within the
    default host and disk budgets)."""
    cons, ctx, tiers = ElixirProblem(model=model, cluster=cluster, optimizer=optimizer, precision=precision,
                                     constraints=constraints).prepare_tiers()
    ev = S.Evaluator(ctx)
    host = float("inf") if tiers.host_bytes is None else float(tiers.host_bytes)
    pool = S.greedy_pool(ev, cons.space(disk=tiers.has_disk), host, disk_budget=disk_state_budget(tiers.disk_bytes))
    path = tiers.disk.path if tiers.disk is not None else ""
    return [to_plan(ev, c, model, int(tiers.device_bytes or 0), cluster, disk_path=path) for c in S.pareto(pool)]


def mixed_budget(model: ModelProfile, cluster: ClusterSpec, **kwargs: object) -> int:
    """A per-device budget under which :func:`search` returns a *mixed* plan (:attr:`ElixirPlan.is_mixed`:
    some units offloaded and some resident, some resharded, some blocks recomputed), preferring plans
    where checkpointing and unit modes are mixed too (:attr:`ElixirPlan.variety`). It is the peak of
    such a frontier plan, verified by searching with it; runtime tests use it to exercise every kind
    of unit on a small model.

    Raises:
        ValueError: no budget gives a mixed plan for this model (e.g. a single unit); the message says why.
    """
    plans = frontier(model, cluster, **kwargs)  # type: ignore[arg-type]
    mixed = [p for p in plans if p.is_mixed]
    # Most varied first; among equals, the middle of the mixed range (furthest from both extremes).
    middle = (len(mixed) - 1) / 2
    order = sorted(range(len(mixed)), key=lambda i: (-mixed[i].variety, abs(i - middle)))
    for p in (mixed[i] for i in order):
        if search(model, cluster, memory_budget=p.peak_bytes, **kwargs).is_mixed:  # type: ignore[arg-type]
            return p.peak_bytes
    raise ValueError(f"no budget gives a mixed plan for {model.model!r} on {cluster.world_size} device(s): the "
                     f"frontier has {len(plans)} plans, {len(mixed)} of them mixed; a model needs at least two "
                     "units (two blocks with parameters) for a mixed plan")
