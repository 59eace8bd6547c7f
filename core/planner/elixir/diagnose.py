"""Why no Elixir plan fits, and the cheapest change that makes one fit: :func:`infeasible` builds the
:class:`PlanInfeasibleError` naming the tier that is short (``tier``): the device (smallest budget that
fits, then: allow offload/recompute, a smaller batch, more devices), the host (what binds once the device
fits; a disk directory for the optimizer state, more devices) or the disk (its free space)."""

from __future__ import annotations

import math
from dataclasses import replace

from tightfit.planner.elixir import space as S
from tightfit.planner.elixir.disk import Tier, disk_bytes_needed
from tightfit.planner.elixir.exact import exhaustive
from tightfit.planner.elixir.problem import ElixirConstraints, ElixirProblem, prepare
from tightfit.planner.elixir.sim import Context
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.planner.tiers import MemoryTiers, tier_error
from tightfit.profiler.types import ClusterSpec, ModelProfile
from tightfit.units import format_bytes

__all__ = ["infeasible", "least_memory"]


def least_memory(ctx: Context, space: S.Space, exact: bool) -> float:
    """Peak of the least-memory plan in the space (every unit at its least-memory choice, every block
    checkpointed, the shallowest prefetch), over the groupings the search considers."""
    best = _least_memory_plan(ctx, space, exact)
    return best.peak if best is not None else float("inf")


def _least_memory_plan(ctx: Context, space: S.Space, exact: bool) -> S.Candidate | None:
    ev = S.Evaluator(ctx)
    n = len(ctx.numel)
    groups = list(S.compositions(n)) if exact else S.groupings(ctx, space.unit_blocks)
    ck = [ctx.checkpointable[i] and space.checkpointing for i in range(n)]
    d = min(space.depths)
    best: S.Candidate | None = None
    for units in groups:
        choice = [S.least_memory_choice(ev, space, a, b) for a, b in units]
        c = ev.make(units, [m for m, _ in choice], [o for _, o in choice], ck, d, d)
        if best is None or c.peak < best.peak:
            best = c
    return best


def infeasible(problem: ElixirProblem, cons: ElixirConstraints, tiers: MemoryTiers, ctx: Context,
               exact: bool) -> PlanInfeasibleError:
    """The error for ``problem`` having no plan within ``tiers``: the device tier when even the least-memory
    plan does not fit it, else the host or the disk tier, whichever the least-memory plan overfills."""
    model, cluster, optimizer, precision = problem.model, problem.cluster, problem.optimizer, problem.precision
    memory_budget = problem.memory_budget
    budget = int(tiers.device_bytes or 0)
    space = cons.space(disk=tiers.has_disk)
    needed = least_memory(ctx, space, exact)
    if needed <= budget:
        # The device budget is not what binds: every plan that fits it needs more host memory (host memory x
        # host_memory_fraction / ranks per node, or host_budget) or more disk than there is.
        short = _short_tier(ctx, space, tiers, exact)
        if short is not None:
            return short
        return _host_infeasible(model, cluster, precision, optimizer, cons, tiers, ctx, exact)
    suggestions: list[str] = []
    if not (cons.allow_checkpointing and cons.allow_offload):
        full = replace(cons, allow_checkpointing=True, allow_offload=True)
        need_full = least_memory(ctx, full.space(disk=tiers.has_disk), exact)
        if need_full <= budget:
            suggestions.append(f"allow activation checkpointing and offloading (ElixirConstraints(allow_checkpointing"
                               f"=True, allow_offload=True)): the least-memory plan then needs {format_bytes(need_full)}")
    shapes = list(model.inputs.values())
    batch = shapes[0][0] if shapes and shapes[0] else 0
    for smaller in range(batch - 1, 0, -1):
        c2 = prepare(model, cluster, optimizer, precision, memory_budget, cons, act_scale=smaller / batch)[2]
        need = least_memory(c2, space, exact)
        if need <= budget:
            suggestions.append(f"reduce the per-device batch from {batch} to {smaller} (use gradient accumulation "
                               f"to keep the global batch): needs {format_bytes(need)}")
            break
    one_memory = ctx.unified or all(d.kind == "cpu" for d in cluster.devices)
    if one_memory and not tiers.has_disk and cons.allow_offload and cons.allow_disk:
        # One memory (a CPU device): offloading to "host" frees nothing; the disk tier is the move that does.
        suggestions.append("give a disk directory (disk_dir) on an NVMe/SSD drive: device and host are one memory "
                           "here, so only the disk tier takes optimizer state and master weights out of it")
    rpn = cluster.world_size // cluster.nodes

    def need_at(count: int) -> float:
        nodes = max(1, count // rpn) if cluster.nodes > 1 else 1
        big = ClusterSpec(devices=(cluster.devices[0],) * count, nodes=nodes,
                          inter_node_bytes_per_s=cluster.inter_node_bytes_per_s)
        return least_memory(prepare(model, big, optimizer, precision, memory_budget, cons)[2], space, exact)

    lo = cluster.world_size
    for more in [cluster.world_size * 2 ** k for k in range(1, 11)]:
        if need_at(more) <= budget:
            # Fewest devices that fit: bisect between the last doubling that failed and this one
            # (single node only: several nodes grow by whole nodes).
            while cluster.nodes == 1 and more - lo > 1:
                mid = (lo + more) // 2
                lo, more = (lo, mid) if need_at(mid) <= budget else (mid, more)
            suggestions.append(f"use {more} devices instead of {cluster.world_size} (sharded state shrinks as "
                               f"1/devices): needs {format_bytes(need_at(more))}")
            break
        lo = more
    if not suggestions:
        suggestions.append("use devices with more memory: the gathered parameters and activations of one unit "
                           "alone exceed the budget at any device count")
    msg = (f"no Elixir plan fits {format_bytes(budget)} per device for {model.model} (inputs {dict(model.inputs)}) on "
           f"{cluster.world_size} x {ctx.device_name} at {precision}/{optimizer}: the least-memory plan (every unit "
           f"at its least-memory choice, prefetch {min(space.depths)}) needs {format_bytes(needed)}. Smallest budget "
           f"that fits: {format_bytes(needed)}. Cheapest change: {suggestions[0]}"
           + (f". Other options: {'; '.join(suggestions[1:])}" if suggestions[1:] else ""))
    return PlanInfeasibleError(msg, needed_bytes=int(needed) + 1, budget_bytes=budget, suggestions=tuple(suggestions))


def _short_tier(ctx: Context, space: S.Space, tiers: MemoryTiers, exact: bool) -> PlanInfeasibleError | None:
    """With the disk tier: the disk error when the same search with an unbounded disk finds a plan (the disk
    is what binds: that plan's disk bytes are what it needs), else the host error when even the least-memory
    plan with every offloaded unit's optimizer state on disk overfills the host; ``None`` without a disk tier."""
    if not tiers.has_disk or not S.has_disk(space):
        return None
    budget = int(tiers.device_bytes or 0)
    host_budget = float("inf") if tiers.host_bytes is None else float(tiers.host_bytes)
    ev = S.Evaluator(ctx)
    if exact:
        found = [c for c in exhaustive(ev, space, budget, host_budget, keep=1).values() if c is not None]
    else:
        found = [c for c in S.greedy_pool(ev, space, host_budget) if c.peak <= budget]
    if found:
        best = min(found, key=lambda c: c.key)
        if disk_bytes_needed(best.disk) > tiers.disk_bytes:
            return tier_error(tiers, "disk", needed=disk_bytes_needed(best.disk),
                              what=f"the fastest plan within the device and host budgets ({format_bytes(best.disk)} "
                                   "of state, held twice at a step's end: the old copy stays until the store syncs)")
        return None
    lm = _least_memory_plan(ctx, space, exact)
    if lm is None:
        return None
    # The least-host version of the least-memory plan: every offloaded unit's state on disk, as deep as allowed.
    deepest = max(o for o in (Tier.DISK, Tier.DISK_PARAMS, Tier.DISK_GRADS) if o in space.offload or o == Tier.DISK)
    least_host = ev.make(lm.units, lm.modes, [deepest if o else o for o in lm.offload], lm.ckpt, lm.df, lm.db)
    return tier_error(tiers, "host", needed=math.ceil(max(least_host.host, host_budget + 1)),
                      what="the least-memory plan (" + ("every offloaded unit's optimizer state and master weights on disk"
                                                         + (", gradients too" if deepest == Tier.DISK_GRADS else "")
                                                         if deepest >= Tier.DISK_PARAMS else
                                                         "the optimizer state of every offloaded unit on disk") + ")",
                      suggestions=("raise host_budget", "use more devices (sharded state per rank shrinks as "
                                   "1/devices)"))


def _host_infeasible(model: ModelProfile, cluster: ClusterSpec, precision: str, optimizer: str,
                     cons: ElixirConstraints, tiers: MemoryTiers, ctx: Context, exact: bool) -> PlanInfeasibleError:
    budget = int(tiers.device_bytes or 0)
    hosts = [d.host_memory_bytes for d in cluster.devices if d.host_memory_bytes > 0]
    host_budget = float(tiers.host_bytes) if tiers.host_bytes is not None else float("inf")
    # Sharded training state per rank (parameters, gradients, optimizer state): whatever the
    # device does not hold must sit in host memory, so device budget + host budget must exceed it.
    state = sum(ctx.numel) * ctx.state_per_elem / ctx.world
    devices_needed = ctx.world * 2  # at least one doubling: the devices there are do not fit
    while devices_needed < ctx.world * 1024 and \
            sum(ctx.numel) * ctx.state_per_elem / devices_needed > host_budget + budget * 0.5:
        devices_needed *= 2
    suggestions = (
        f"use about {devices_needed} devices instead of {ctx.world} (sharded state per rank shrinks as 1/devices)",
        *(() if tiers.has_disk else ("give a disk directory (disk_dir) on an NVMe/SSD drive for the optimizer "
                                     "state, the largest part of it (DeviceProfile.disk from profile_disk)",)),
        f"run fewer ranks per host or on hosts with more memory ({format_bytes(min(hosts))} now, "
        f"{cons.host_memory_fraction:.0%} usable, shared by {ctx.ranks_per_node} rank(s))" if hosts else
        "raise host_budget",
        "raise ElixirConstraints(host_memory_fraction=...) if the host really has that memory free",
    )
    lm = _least_memory_plan(ctx, cons.space(disk=tiers.has_disk), exact)
    lm_host = lm.host if lm is not None else state
    head = tier_error(tiers, "host", needed=int(max(lm_host, min(host_budget, state))) + 1,
                      what="the least-memory plan")
    msg = (f"{head}. No Elixir plan for {model.model} fits on {cluster.world_size} x {ctx.device_name} at {precision}/"
           f"{optimizer}: a least-memory plan fits the device budget of {format_bytes(budget)}, but the state it "
           f"offloads does not fit host memory: each rank holds {format_bytes(state)} of sharded training state "
           f"and may keep only {format_bytes(host_budget)} on the host. Cheapest change: {suggestions[0]}. "
           f"Other options: {'; '.join(suggestions[1:])}")
    return PlanInfeasibleError(msg, needed_bytes=head.needed_bytes, budget_bytes=head.budget_bytes,
                               suggestions=suggestions, tier="host")
