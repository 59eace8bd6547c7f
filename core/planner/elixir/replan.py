"""Re-planning from a measurement: the profile scaled by measured / predicted, searched over what a running
FSDP2 model can change in place.

A run whose steps are far from the plan's prediction (:mod:`tightfit.planner.check`) was planned from
numbers that do not describe this machine under this load. :func:`scale_profile` corrects the profile by
the measured ratios (block compute times by measured / predicted step time, activation bytes by measured
/ predicted peak), and :func:`replan_in_place` searches that corrected profile for the fastest plan that
fits, keeping what cannot change without rebuilding the model: the units (FSDP2 groups), which units are
offloaded and which are replicated. It may change every unit's reshard-after-forward (``reshard`` /
``keep``), every block's activation checkpointing and the prefetch depths: FSDP2 and composable
checkpointing switch all three between steps without touching a parameter, so the training math is the
same before and after.

The search: for each assignment of the sharded units' modes (as planned, all ``reshard``, all ``keep``)
and each prefetch depth, start from every checkpointable block recomputed (the least memory) and drop
recomputation greedily, the block whose removal gives the fastest plan that still fits first, until none
fits; the fastest result wins. A plan of ``n`` blocks costs O(n^2) evaluations per assignment.

Example:
    >>> from tightfit.planner.elixir.replan import scale_profile
    >>> scale_profile.__name__
    'scale_profile'
"""

from __future__ import annotations

from dataclasses import replace

from tightfit.planner.elixir import space as S
from tightfit.planner.elixir.plan import ElixirPlan
from tightfit.planner.elixir.problem import ElixirConstraints, prepare
from tightfit.planner.elixir.solver import to_plan
from tightfit.profiler.types import ClusterSpec, ModelProfile

__all__ = ["scale_profile", "replan_in_place"]


def scale_profile(profile: ModelProfile, *, time_ratio: float = 1.0, memory_ratio: float = 1.0) -> ModelProfile:
    """``profile`` with every block's compute (measured seconds and FLOPs) times ``time_ratio`` and its
    activation bytes times ``memory_ratio`` (both measured / predicted; 1.0 leaves that part alone)."""
    for name, value in (("time_ratio", time_ratio), ("memory_ratio", memory_ratio)):
        if not value > 0:
            raise ValueError(f"scale_profile({name}={value}): a ratio of measured to predicted must be > 0")
    blocks = []
    for b in profile.blocks:
        kw: dict[str, float | int] = {}
        if time_ratio != 1.0:
            kw.update(fwd_s=b.fwd_s * time_ratio, bwd_s=b.bwd_s * time_ratio, recompute_s=b.recompute_s * time_ratio,
                      fwd_flops=b.fwd_flops * time_ratio, bwd_flops=b.bwd_flops * time_ratio)
        if memory_ratio != 1.0:
            kw.update(saved_bytes=round(b.saved_bytes * memory_ratio),
                      checkpoint_bytes=round(b.checkpoint_bytes * memory_ratio),
                      transient_bytes=round(b.transient_bytes * memory_ratio),
                      fwd_transient_bytes=round(b.fwd_transient_bytes * memory_ratio),
                      loss_transient_bytes=round(b.loss_transient_bytes * memory_ratio))
        blocks.append(replace(b, **kw))  # type: ignore[arg-type]
    return replace(profile, blocks=tuple(blocks))


def replan_in_place(profile: ModelProfile, cluster: ClusterSpec, plan: ElixirPlan, *,
                    memory_budget: int | float | str | None = None,
                    constraints: ElixirConstraints | None = None) -> ElixirPlan | None:
    """The fastest plan for ``profile`` on ``cluster`` that keeps ``plan``'s units, offload and replicate
    choices (see the module docstring), or ``None`` when no such plan fits ``memory_budget``."""
    cons, budget, ctx, host_budget = prepare(profile, cluster, plan.optimizer, plan.precision, memory_budget,
                                            constraints)
    index = {name: i for i, name in enumerate(ctx.names)}
    try:
        spans = [(index[u.blocks[0]], index[u.blocks[-1]] + 1) for u in plan.units]
    except KeyError as e:
        raise ValueError(f"plan names block {e.args[0]!r}, which the profile of {profile.model!r} does not have; "
                         "re-plan with the profile the plan was made from") from None
    ev = S.Evaluator(replace(ctx, alias_replicated=False))  # re-planned units stay FSDP2 groups, replicate ones too
    offload = [u.tier for u in plan.units]  # disk units stay on disk
    planned = tuple(u.mode for u in plan.units)
    mode_sets = {planned} | {tuple(m if m == "replicate" else x for m in planned)
                             for x in ("reshard", "keep") if x in cons.modes}
    depths = {(plan.forward_prefetch, plan.backward_prefetch)} | {(d, d) for d in cons.prefetch_depths}
    n = len(ctx.names)
    may = [ctx.checkpointable[i] and cons.allow_checkpointing for i in range(n)]
    best: S.Candidate | None = None
    for modes in sorted(mode_sets):
        for df, db in sorted(depths):
            ck = list(may)
            cand = ev.make(spans, modes, offload, ck, df, db)
            if cand.peak > budget or cand.host > host_budget:
                continue
            while not cons.force_checkpointing:
                step: tuple[S.Candidate, int] | None = None
                for i in range(n):
                    if not ck[i]:
                        continue
                    ck[i] = False
                    trial = ev.make(spans, modes, offload, ck, df, db)
                    ck[i] = True
                    if trial.peak <= budget and (step is None or trial.key < step[0].key):
                        step = (trial, i)
                if step is None or step[0].time > cand.time:
                    break
                cand = step[0]
                ck[step[1]] = False
            if best is None or cand.key < best.key:
                best = cand
    if best is None:
        return None
    return replace(to_plan(ev, best, profile, budget, cluster), search_method="replan in place",
                   candidates_evaluated=ev.evaluations)
