"""The Elixir solver: :func:`search` / :func:`solve` (the fastest plan that fits) and :func:`estimate`
(price a given plan), turning the search's candidates into :class:`ElixirPlan` objects."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from tightfit.planner.elixir import space as S
from tightfit.planner.elixir.diagnose import infeasible
from tightfit.planner.elixir.disk import (
    DISK_STAGING_BYTES,
    Tier,
    disk_state_budget,
)
from tightfit.planner.elixir.exact import exhaustive
from tightfit.planner.elixir.plan import (
    ElixirPlan,
    MemoryBreakdown,
    RunnerUp,
    StepBreakdown,
    UnitPlan,
    model_identity,
)
from tightfit.planner.elixir.problem import ElixirConstraints, ElixirProblem
from tightfit.planner.elixir.sim import Context, Detail, peak, step_time
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.profiler.types import ClusterSpec, ModelProfile

__all__ = ["search", "solve", "estimate", "detail", "to_plan", "Progress"]

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)``: called while a search runs."""


def search(model: ModelProfile, cluster: ClusterSpec, *, optimizer: str = "adamw", precision: str = "bf16-mixed",
           memory_budget: int | float | str | None = None, constraints: ElixirConstraints | None = None,
           progress: Progress | None = None, host_budget: int | str | None = None,
           disk_budget: int | str | None = None) -> ElixirPlan:
    """The fastest plan (by the cost model) whose predicted peak per device fits ``memory_budget``.

    Args:
        model: the training-step profile of one rank's micro-batch.
        cluster: the devices, one per rank.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"adagrad"``.
        precision: Lightning precision string (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``, ``"bf16-true"``).
        memory_budget: bytes per device (int, ``"40GiB"``), a fraction of the smallest device's
            memory, or ``None`` for all of it.
        constraints: :class:`ElixirConstraints`.
        progress: ``progress(done, total, what)`` called while searching.
        host_budget: host bytes per rank (:class:`ElixirProblem`; ``None``: the default).
        disk_budget: disk bytes per rank (:class:`ElixirProblem`; ``None``: the default).

    Raises:
        PlanInfeasibleError: nothing fits; names the tier that is short (``tier``), the smallest budget that
            fits and the cheapest change.
    """
    return solve(ElixirProblem(model=model, cluster=cluster, optimizer=optimizer, precision=precision,
                               memory_budget=memory_budget, constraints=constraints, host_budget=host_budget,
                               disk_budget=disk_budget), progress=progress)


def solve(problem: ElixirProblem, *, progress: Progress | None = None) -> ElixirPlan:
    """:func:`search` on a built :class:`ElixirProblem` (forced choices in its constraints are honoured)."""
    model, cluster = problem.model, problem.cluster
    t0 = time.perf_counter()
    cons, ctx, tiers = problem.prepare_tiers()
    budget = int(tiers.device_bytes or 0)
    host_budget = math.inf if tiers.host_bytes is None else float(tiers.host_bytes)
    disk_budget = disk_state_budget(tiers.disk_bytes)  # the state's bytes; the old copy stays until the sync
    ev = S.Evaluator(ctx)
    space = cons.space(disk=tiers.has_disk)
    exact = cons.exhaustive if cons.exhaustive is not None else S.count_space(ctx, space) <= cons.exhaustive_limit
    if exact:
        # keep=4: the best plan and the three runner-up families below are exact; the rest may be cut off.
        per_family = exhaustive(ev, space, budget, host_budget, progress, keep=4, disk_budget=disk_budget)
        feasible = [c for c in per_family.values() if c is not None]
    else:
        pool = S.greedy_pool(ev, space, host_budget, progress, disk_budget=disk_budget)
        feasible = [c for c in pool if c.peak <= budget]
    best_of: dict[str, S.Candidate] = {}
    for c in feasible:
        if c.family not in best_of or c.key < best_of[c.family].key:
            best_of[c.family] = c
    feasible = list(best_of.values())
    if not feasible:
        raise infeasible(problem, cons, tiers, ctx, exact)
    ranked = sorted(feasible, key=lambda c: c.key)
    replicated = _replicate_everything(ev, space, ranked[0], budget, host_budget, disk_budget,
                                       cons.replication_margin)
    if replicated is not None:
        ranked = [replicated] + [c for c in ranked if c.family != replicated.family or c.modes != replicated.modes]
    best = ranked[0]
    plan = to_plan(ev, best, model, budget, cluster, disk_path=tiers.disk.path if tiers.disk else "",
                   host_budget=host_budget)
    best_detail = detail(ev, best)
    runner_ups = tuple(_runner_up(ev, c, best, best_detail) for c in ranked[1:4])
    method = "exhaustive" if exact else "greedy frontier"
    if replicated is not None:
        method += (f", replication kept: no plan predicted more than {cons.replication_margin:.0%} faster than "
                   "replicating every unit, which fits")
    plan = replace(plan, runner_ups=runner_ups, search_method=method,
                   search_seconds=time.perf_counter() - t0, candidates_evaluated=ev.evaluations)
    if cons.force_checkpointing:
        plan = _checkpoint_everything(problem, plan)
    return plan


# ElixirConstraints.replication_margin (default 10%): with memory to spare, the plan DDP would run (every unit
# replicated, nothing offloaded or recomputed) is kept unless another plan is predicted faster by more than
# the margin, which is about the calibrated model's step error (benchmarks/results/REPORT.md#cost_model); a plan
# that shards every unit can run slower than DDP with the whole device free: a predicted gain within the model's
# error is no reason to leave the plan users compare against (benchmarks/results/REPORT.md#elixir_vs_ddp).
def _replicate_everything(ev: S.Evaluator, space: S.Space, best: S.Candidate, budget: int, host_budget: float,
                          disk_budget: float, margin: float) -> S.Candidate | None:
    """The all-replicated candidate when it fits and ``best`` is not predicted faster by ``margin``."""
    if margin <= 0 or "replicate" not in space.modes or 0 not in space.offload or best.modes == ("replicate",) * len(best.modes):
        return None
    n = len(ev.ctx.names)
    depth = best.df if best.df in space.depths else min(space.depths)
    rep = ev.make([(0, n)], ["replicate"], [0], [False] * n, depth, depth)
    if rep.peak > budget or not rep.fits(host_budget, disk_budget):
        return None
    return rep if best.time >= rep.time * (1 - margin) else None


def _checkpoint_everything(problem: ElixirProblem, plan: ElixirPlan) -> ElixirPlan:
    """``force_checkpointing``: the searched plan with every checkpointable block recomputed, priced again."""
    ok = {b.name for b in problem.model.blocks if b.checkpointable}
    units = [replace(u, checkpoint=tuple(b for b in u.blocks if b in ok)) for u in plan.units]
    forced = estimate(problem.model, problem.cluster, units, forward_prefetch=plan.forward_prefetch,
                      backward_prefetch=plan.backward_prefetch, optimizer=problem.optimizer,
                      precision=problem.precision, memory_budget=problem.memory_budget,
                      constraints=problem.constraints, host_budget=problem.host_budget,
                      disk_budget=problem.disk_budget)
    if not forced.fits:
        raise PlanInfeasibleError(
            f"ElixirConstraints(force_checkpointing=True) forces a plan whose predicted peak "
            f"({forced.peak_bytes:,} bytes) exceeds the budget ({forced.budget_bytes:,}); let the search choose "
            "(force_checkpointing=False) or raise the budget",
            needed_bytes=forced.peak_bytes, budget_bytes=forced.budget_bytes)
    return replace(forced, runner_ups=plan.runner_ups, search_seconds=plan.search_seconds,
                   candidates_evaluated=plan.candidates_evaluated,
                   search_method=f"{plan.search_method}, every checkpointable block recomputed (forced)")


def estimate(model: ModelProfile, cluster: ClusterSpec, units: Sequence[UnitPlan], *, forward_prefetch: int = 1,
             backward_prefetch: int = 1, optimizer: str = "adamw", precision: str = "bf16-mixed",
             memory_budget: int | float | str | None = None,
             constraints: ElixirConstraints | None = None, host_budget: int | str | None = None,
             disk_budget: int | str | None = None) -> ElixirPlan:
    """Price a given plan (units with their blocks, mode, offload, disk and checkpoint) on ``cluster``
    (units with ``disk`` need a disk profile on every device)."""
    problem = ElixirProblem(model=model, cluster=cluster, optimizer=optimizer, precision=precision,
                            memory_budget=memory_budget, constraints=constraints, host_budget=host_budget,
                            disk_budget=disk_budget)
    _, ctx, tiers = problem.prepare_tiers()
    budget = int(tiers.device_bytes or 0)
    index = {name: i for i, name in enumerate(ctx.names)}
    spans, modes, offs = [], [], []
    ckpt = [False] * len(ctx.names)
    expect = 0
    for u in units:
        try:
            ids = [index[b] for b in u.blocks]
        except KeyError as e:
            raise ValueError(f"unit names block {e.args[0]!r}, which the profile of {model.model!r} does not have") from None
        if ids != list(range(expect, expect + len(ids))):
            raise ValueError(f"unit {u.blocks} is not the next contiguous run of blocks (expected to start at "
                             f"{ctx.names[expect] if expect < len(ctx.names) else 'the end'!r}); units must cover "
                             "the blocks in first-use order")
        spans.append((ids[0], ids[-1] + 1))
        modes.append(u.mode)
        if u.tier >= Tier.DISK and ctx.disk is None:
            raise ValueError(f"unit {u.blocks} keeps its optimizer state on disk (tier={u.tier.name}), but there is "
                             "no disk tier: give every device a disk profile (DeviceProfile.disk)")
        offs.append(u.tier)
        for b in u.checkpoint:
            ckpt[index[b]] = True
        expect = ids[-1] + 1
    if expect != len(ctx.names):
        raise ValueError(f"units cover {expect} of {len(ctx.names)} blocks; add units for {list(ctx.names[expect:])}")
    ev = S.Evaluator(ctx)
    cand = ev.make(spans, modes, offs, ckpt, forward_prefetch, backward_prefetch)
    return to_plan(ev, cand, model, budget, cluster, disk_path=ctx.disk.path if ctx.disk else "",
                   host_budget=math.inf if tiers.host_bytes is None else float(tiers.host_bytes))


# ---- internals --------------------------------------------------------------------------------
def detail(ev: S.Evaluator, c: S.Candidate) -> Detail:
    d = Detail()
    terms = terms_of(ev, c)
    step_time(ev.ctx, list(c.units), terms, list(c.ckpt), c.df, c.db, d)
    peak(ev.ctx, list(c.units), terms, list(c.ckpt), c.df, c.db, d)
    return d


def to_plan(ev: S.Evaluator, c: S.Candidate, model: ModelProfile, budget: int, cluster: ClusterSpec, *,
            disk_path: str = "", host_budget: float = math.inf) -> ElixirPlan:
    ctx = ev.ctx
    d = detail(ev, c)
    units = []
    disk_io = 0.0
    # Accumulating tier 4's gradients in RAM between micro-batches holds all of them at once: only if that fits.
    grads_on_host = c.host + sum(t.grad_buf for t in terms_of(ev, c)) <= host_budget
    for u, (t, (a, b), m, o) in enumerate(zip(terms_of(ev, c), c.units, c.modes, c.offload)):
        disk_io += t.disk_io
        rc = sum(ctx.rfwd[i] for i in range(a, b) if c.ckpt[i])
        units.append(UnitPlan(
            blocks=ctx.names[a:b], mode=m, tier=Tier(o), disk_bytes=int(t.disk),
            checkpoint=tuple(ctx.names[i] for i in range(a, b) if c.ckpt[i]),
            param_numel=sum(ctx.numel[a:b]), device_bytes=int(t.state), host_bytes=int(t.host),
            gathered_bytes=int(t.gathered),
            time_s=t.cf + t.cb + rc + d.stall_fwd[u] + d.stall_bwd[u] + t.opt,
        ))
    raw = d.peak_state + d.peak_params + d.peak_acts
    names, digest = model_identity(model)
    spec = ctx.precision
    return ElixirPlan(
        model=model.model, param_numel=model.param_numel, blocks=names, blocks_hash=digest,
        inputs={k: list(v) for k, v in model.inputs.items()}, world_size=ctx.world, precision=spec.name,
        param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype, optimizer=ctx.optimizer, units=tuple(units),
        forward_prefetch=c.df, backward_prefetch=c.db, step_time_s=c.time, peak_bytes=math.ceil(c.peak),
        budget_bytes=int(budget), host_bytes_per_rank=int(c.host), disk_bytes_per_rank=int(c.disk),
        disk_path=disk_path if c.disk > 0 else "", grads_accumulate_on_host=grads_on_host,
        breakdown=StepBreakdown(compute_s=d.compute, recompute_s=d.recompute,
                                exposed_comm_s=c.time - d.compute - d.recompute - d.optimizer, optimizer_s=d.optimizer,
                                disk_io_s=disk_io, param_io_s=sum(t.disk_f + t.disk_b for t in terms_of(ev, c))),
        memory=MemoryBreakdown(phase=d.peak_phase, block=d.peak_block, state_bytes=int(d.peak_state),
                               params_bytes=int(d.peak_params), activation_bytes=int(d.peak_acts),
                               margin_bytes=int(c.peak - raw), reserved_bytes=int(ctx.reserved),
                               staging_bytes=DISK_STAGING_BYTES if ctx.unified and c.disk > 0
                               and d.peak_phase == "optimizer" else 0),
        device=f"{cluster.world_size} x {ctx.device_name}", notes=ctx.notes,
        checkpointable_blocks=sum(ctx.checkpointable), cost_model=describe_model(ctx, cluster, disk=c.disk > 0),
    )


def terms_of(ev: S.Evaluator, c: S.Candidate) -> list:
    return ev.terms_for(c.units, c.modes, c.offload, c.ckpt)


def describe_model(ctx: Context, cluster: ClusterSpec, *, disk: bool = False) -> str:
    """Which cost model priced the plan: compute source, then each calibration term in use (``disk``: the plan
    has disk units, priced from the disk profile)."""
    parts = [ctx.compute_model]
    if any(d.collective_fit for d in cluster.devices):
        parts.append("collectives latency + bandwidth (measured)")
    if ctx.overhead:
        parts.append("FSDP2 per-unit overhead (measured)")
    if ctx.overlap >= 0:
        parts.append(f"comm/compute overlap {ctx.overlap:.2f} (measured)")
    if all(d.unified_memory for d in cluster.devices):
        parts.append("host = device memory (no copy cost)")
    if disk and ctx.disk is not None:
        overlap = "measured" if ctx.disk.compute_overlap >= 0 else "unmeasured: full"
        parts.append(f"disk tier {ctx.disk.path} latency + bandwidth ({ctx.disk.source}), I/O overlap with the "
                     f"optimizer step {ctx.disk_overlap:.2f} ({overlap})")
    return "; ".join(parts)


def _runner_up(ev: S.Evaluator, c: S.Candidate, best: S.Candidate, best_detail: Detail) -> RunnerUp:
    d = detail(ev, c)
    parts = {
        "compute": (d.compute, best_detail.compute),
        "recompute": (d.recompute, best_detail.recompute),
        "exposed communication": (c.time - d.compute - d.recompute - d.optimizer,
                                  best.time - best_detail.compute - best_detail.recompute - best_detail.optimizer),
        "optimizer": (d.optimizer, best_detail.optimizer),
    }
    name, (mine, theirs) = max(parts.items(), key=lambda kv: kv[1][0] - kv[1][1])
    slower = (c.time / best.time - 1) * 100 if best.time > 0 else 0.0
    if mine - theirs > 0:
        why = f"{slower:+.1f}%: {mine - theirs:.3g} s more {name} ({mine:.3g} s vs {theirs:.3g} s)"
    else:
        why = f"{slower:+.1f}%: same predicted time, but more offloading, recompute or memory"
    return RunnerUp(family=c.family, step_time_s=c.time, peak_bytes=int(c.peak), units=len(c.units),
                    offloaded=sum(1 for o in c.offload if o >= Tier.HOST), checkpointed=sum(c.ckpt), why=why)
