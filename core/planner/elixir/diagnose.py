"""Why no Elixir plan fits, and the cheapest change that makes one fit: :func:`infeasible` builds the
:class:`PlanInfeasibleError` (smallest budget that fits, then: allow offload/recompute, a smaller
batch, more devices; or host memory as the binding limit)."""

from __future__ import annotations

from dataclasses import replace

from tightfit.planner.elixir import space as S
from tightfit.planner.elixir.problem import ElixirConstraints, prepare
from tightfit.planner.elixir.sim import Context
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.profiler.types import ClusterSpec, ModelProfile
from tightfit.units import format_bytes

__all__ = ["infeasible", "least_memory"]


def least_memory(ctx: Context, space: S.Space, exact: bool) -> float:
    """Peak of the least-memory plan in the space (every unit at its least-memory choice, every block
    checkpointed, the shallowest prefetch), over the groupings the search considers."""
    ev = S.Evaluator(ctx)
    n = len(ctx.numel)
    groups = list(S.compositions(n)) if exact else S.groupings(ctx, space.unit_blocks)
    ck = [ctx.checkpointable[i] and space.checkpointing for i in range(n)]
    d = min(space.depths)
    best = float("inf")
    for units in groups:
        choice = [S.least_memory_choice(ev, space, a, b) for a, b in units]
        best = min(best, ev.make(units, [m for m, _ in choice], [o for _, o in choice], ck, d, d).peak)
    return best


def infeasible(model: ModelProfile, cluster: ClusterSpec, optimizer: str, precision: str,
                memory_budget: int | float | str | None, cons: ElixirConstraints, budget: int,
                ctx: Context, exact: bool) -> PlanInfeasibleError:
    space = cons.space()
    needed = least_memory(ctx, space, exact)
    if needed <= budget:
        # The device budget is not what binds: every plan that fits it offloads more state than
        # the host memory can hold (host memory x host_memory_fraction / ranks per node).
        return _host_infeasible(model, cluster, precision, optimizer, cons, budget, ctx)
    suggestions: list[str] = []
    if not (cons.allow_checkpointing and cons.allow_offload):
        full = replace(cons, allow_checkpointing=True, allow_offload=True)
        need_full = least_memory(ctx, full.space(), exact)
        if need_full <= budget:
            suggestions.append(f"allow activation checkpointing and offloading (ElixirConstraints(allow_checkpointing"
                               f"=True, allow_offload=True)): the least-memory plan then needs {format_bytes(need_full)}")
    shapes = list(model.inputs.values())
    batch = shapes[0][0] if shapes and shapes[0] else 0
    for smaller in range(batch - 1, 0, -1):
        _, _, c2, _ = prepare(model, cluster, optimizer, precision, memory_budget, cons, act_scale=smaller / batch)
        need = least_memory(c2, space, exact)
        if need <= budget:
            suggestions.append(f"reduce the per-device batch from {batch} to {smaller} (use gradient accumulation "
                               f"to keep the global batch): needs {format_bytes(need)}")
            break
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


def _host_infeasible(model: ModelProfile, cluster: ClusterSpec, precision: str, optimizer: str,
                     cons: ElixirConstraints, budget: int, ctx: Context) -> PlanInfeasibleError:
    hosts = [d.host_memory_bytes for d in cluster.devices if d.host_memory_bytes > 0]
    host_budget = min(hosts) * cons.host_memory_fraction / ctx.ranks_per_node
    # Sharded training state per rank (parameters, gradients, optimizer state): whatever the
    # device does not hold must sit in host memory, so device budget + host budget must exceed it.
    state = sum(ctx.numel) * ctx.state_per_elem / ctx.world
    devices_needed = ctx.world
    while devices_needed < ctx.world * 1024 and \
            sum(ctx.numel) * ctx.state_per_elem / devices_needed > host_budget + budget * 0.5:
        devices_needed *= 2
    suggestions = (
        f"use about {devices_needed} devices instead of {ctx.world} (sharded state per rank shrinks as 1/devices)",
        f"run fewer ranks per host or on hosts with more memory ({format_bytes(min(hosts))} now, "
        f"{cons.host_memory_fraction:.0%} usable, shared by {ctx.ranks_per_node} rank(s))",
        "raise ElixirConstraints(host_memory_fraction=...) if the host really has that memory free",
    )
    msg = (f"no Elixir plan for {model.model} fits on {cluster.world_size} x {ctx.device_name} at {precision}/"
           f"{optimizer}: a least-memory plan fits the device budget of {format_bytes(budget)}, but the state it "
           f"offloads does not fit host memory: each rank holds {format_bytes(state)} of sharded training state "
           f"and may keep only {format_bytes(host_budget)} on the host. Cheapest change: {suggestions[0]}. "
           f"Other options: {'; '.join(suggestions[1:])}")
    return PlanInfeasibleError(msg, needed_bytes=int(state - host_budget) + 1, budget_bytes=budget,
                               suggestions=suggestions)
