"""``replan=True``: re-plan from the measured step, apply the new plan at the next checkpoint.

When the first steps after warm-up (:mod:`tightfit.planner.check`) are off the plan's prediction by more
than the tolerance, rank 0 re-plans from the measurement: the profile the plan was made from, its block
compute scaled by measured / predicted step time and its activations by measured / predicted peak (when
the device reports a peak), searched by :func:`tightfit.planner.elixir.replan.replan_in_place` for the
fastest plan that fits and can be applied to the running model: same FSDP2 units, offload and replicate
choices; free are each unit's reshard-after-forward, each block's recomputation and the prefetch depths.
Every rank receives the decision (one broadcast at the step of the measurement).

The new plan takes effect at the next checkpoint boundary: under the Trainer (``ElixirStrategy``) right after the
next checkpoint is written (``save_checkpoint``, e.g. ``ModelCheckpoint`` at the end of an epoch) or, when nothing
saves checkpoints, at the first step of the next epoch, whichever comes first; under Fabric
(``ElixirFabricStrategy``, which has no epochs) right after the next ``fabric.save``. At that point no forward or
backward is in flight and the checkpoint just written is valid for both plans (the switches change no
parameter, gradient or optimizer state), so a run resumed from it continues either way. Between steps
FSDP2 (``set_reshard_after_forward``, ``set_modules_to_*_prefetch``) and composable checkpointing (its
hooks installed on every block at setup, switched on or off) change without touching a tensor: the
training math is the same before and after. One re-plan per ``fit`` (per strategy under Fabric); the new
plan's prediction is checked against its own measurement like the first one's. Both front doors decide through
:func:`lightning_elixir.engine.check_step` and apply with :meth:`Replanner.apply`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.fsdp import FSDPModule

from lightning_elixir.apply import AppliedUnit, apply_prefetch, set_checkpointing
from tightfit.planner.check import PredictionRecord
from tightfit.planner.elixir import ElixirConstraints, ElixirPlan
from tightfit.planner.elixir.replan import replan_in_place, scale_profile
from tightfit.profiler.types import ClusterSpec, ModelProfile

__all__ = ["PlanState", "ReplanRecord", "Replanner", "switch_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanRecord:
    """One re-plan.

    Args:
        measured_at_step: the global step whose measurement triggered it (under Fabric: the ``fabric.backward``
            calls before it).
        time_ratio / memory_ratio: measured / predicted step time and peak (1.0: not measured).
        old_step_s / new_step_s: the running plan's prediction and the new plan's (from the scaled profile).
        changes: what differs (``"blocks.0: recompute on"``, ``"unit 2: keep"``, ``"prefetch 2/2"``); empty: the
            running plan is still the best one and nothing is switched.
        applied_at_step: the global step (under Fabric: ``fabric.backward`` calls) from which the new plan runs
            (``None`` until applied).
        boundary: ``"checkpoint"`` or ``"epoch"`` (where it was applied); ``""`` until then.
        plan_path: where rank 0 wrote the new plan (``plan-replan.json`` beside ``plan.json``).
    """

    measured_at_step: int
    time_ratio: float
    memory_ratio: float
    old_step_s: float
    new_step_s: float
    changes: tuple[str, ...]
    applied_at_step: int | None = None
    boundary: str = ""
    plan_path: str = ""


def _changes(old: ElixirPlan, new: ElixirPlan) -> tuple[str, ...]:
    out = []
    for i, (a, b) in enumerate(zip(old.units, new.units)):
        if a.mode != b.mode:
            out.append(f"unit {i}: {b.mode}")
    was, now = set(old.checkpointed_blocks), set(new.checkpointed_blocks)
    out += [f"{n}: recompute on" for n in sorted(now - was)] + [f"{n}: recompute off" for n in sorted(was - now)]
    if (old.forward_prefetch, old.backward_prefetch) != (new.forward_prefetch, new.backward_prefetch):
        out.append(f"prefetch {new.forward_prefetch}/{new.backward_prefetch}")
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanState:
    """The running plan and the FSDP2 units it is applied to: what a switch reads and returns.

    Args:
        plan: the plan the model runs now.
        units: what :func:`lightning_elixir.apply.apply_plan` built for it, one per planned unit, in order.
    """

    plan: ElixirPlan
    units: tuple[AppliedUnit, ...]


def switch_plan(module: Any, state: PlanState, new: ElixirPlan) -> PlanState:
    """Switch the running model from ``state.plan`` to ``new`` in place, between steps (see the module
    docstring); returns the new state (``new`` and the units relabelled with its unit plans)."""
    old = state.plan
    units = list(state.units)
    for i, (a, b) in enumerate(zip(old.units, new.units)):
        if (a.blocks, a.offload, a.mode == "replicate") != (b.blocks, b.offload, b.mode == "replicate"):
            raise ValueError(f"unit {i} of the new plan changes its blocks, offload or replication ({a} -> {b}); "
                             "only reshard-after-forward, recomputation and prefetch switch in place")
        if a.mode != b.mode:
            applied = units[i]
            targets = applied.modules[:1] if applied.modules else ([module] if applied.on_root else [])
            for m in targets:  # one fully_shard group shares one state: its first module sets it
                if isinstance(m, FSDPModule):
                    m.set_reshard_after_forward(b.reshard_after_forward, recurse=False)
        units[i] = dataclasses.replace(units[i], plan=b)
    was, now = set(old.checkpointed_blocks), set(new.checkpointed_blocks)
    for name in sorted(was ^ now):
        set_checkpointing(module, name, name in now)
    if (old.forward_prefetch, old.backward_prefetch) != (new.forward_prefetch, new.backward_prefetch):
        apply_prefetch(units, new.forward_prefetch, new.backward_prefetch)
    return PlanState(plan=new, units=tuple(units))


class Replanner:
    """One fit's re-planning: the inputs kept from setup, the plan decided but not yet applied, the records.

    It never reads or writes the strategy: it is given the running :class:`PlanState` and what it
    needs of the trainer (step, epoch, rank 0 or not, the broadcast), and returns what changed; the
    strategy keeps the returned state.

    Args:
        profile / cluster: what the running plan was searched from (rank 0; ``None`` on the other ranks).
        memory_budget / constraints: the strategy's.

    Attributes:
        pending: the decided plan, applied at the next checkpoint boundary (``None``: nothing to switch).
        records: one :class:`ReplanRecord` per re-plan (at most one per fit, or per Fabric strategy).
    """

    def __init__(self, profile: ModelProfile | None, cluster: ClusterSpec | None,
                 memory_budget: int | float | str | None, constraints: ElixirConstraints) -> None:
        self.profile, self.cluster = profile, cluster
        self.memory_budget, self.constraints = memory_budget, constraints
        self.pending: ElixirPlan | None = None
        self.pending_epoch = -1
        self.records: list[ReplanRecord] = []

    def _propose(self, plan: ElixirPlan, record: PredictionRecord) -> dict[str, Any]:
        """Rank 0: the measured / predicted ratios and the plan searched from the scaled profile (or ``None``)."""
        assert self.profile is not None and self.cluster is not None
        time_ratio = record.measured_step_s / record.predicted_step_s if record.predicted_step_s > 0 else 1.0
        memory_ratio = (record.measured_peak_bytes / record.predicted_peak_bytes
                        if record.measured_peak_bytes > 0 and record.predicted_peak_bytes > 0 else 1.0)
        scaled = scale_profile(self.profile, time_ratio=time_ratio, memory_ratio=memory_ratio)
        new = replan_in_place(scaled, self.cluster, plan, memory_budget=self.memory_budget,
                              constraints=self.constraints)
        return {"time_ratio": time_ratio, "memory_ratio": memory_ratio, "plan": None if new is None else new.to_json()}

    def decide(self, state: PlanState, record: PredictionRecord, *, step: int, epoch: int, rank_zero: bool,
               broadcast: Callable[[Any], Any]) -> ReplanRecord | None:
        """Collective, at the step the prediction record arrives: rank 0 decides, every rank learns it
        through ``broadcast`` (the strategy's, from rank 0). Returns the new record (``None``: no re-plan);
        a plan that changes something becomes :attr:`pending`."""
        if self.records:
            return None  # one re-plan per fit
        plan = state.plan
        proposal = None
        if rank_zero and not record.within_tolerance and self.profile is not None and self.cluster is not None:
            proposal = self._propose(plan, record)
        proposal = broadcast(proposal)
        if proposal is None:
            return None
        new_plan = None if proposal["plan"] is None else ElixirPlan.from_json(proposal["plan"])
        changes = _changes(plan, new_plan) if new_plan is not None else ()
        rec = ReplanRecord(measured_at_step=step, time_ratio=float(proposal["time_ratio"]),
                           memory_ratio=float(proposal["memory_ratio"]), old_step_s=plan.step_time_s,
                           new_step_s=new_plan.step_time_s if new_plan is not None else plan.step_time_s,
                           changes=changes)
        self.records.append(rec)
        if new_plan is not None and changes:
            self.pending = new_plan
            self.pending_epoch = epoch
        if rank_zero:
            what = ", ".join(changes) if changes else "the running plan is still the fastest that fits; nothing changes"
            log.info("[elixir] re-planned from the measurement (step x%.2f): predicted %.1f ms -> %.1f ms; %s%s",
                     rec.time_ratio, rec.old_step_s * 1e3, rec.new_step_s * 1e3, what,
                     "; applied at the next checkpoint boundary" if self.pending is not None else "")
        return rec

    def due(self, epoch: int) -> bool:
        """Whether a pending plan should be applied at the start of a step of ``epoch`` (a new epoch began)."""
        return self.pending is not None and epoch > self.pending_epoch

    def apply(self, module: Any, state: PlanState, *, step: int, boundary: str, rank_zero: bool,
              plan_path: Path | None = None, logger: Any = None) -> PlanState | None:
        """Switch ``module`` to the pending plan (every rank, between steps); returns the new state for the
        strategy to keep, or ``None`` when none is pending. Rank 0 writes the plan beside ``plan_path``."""
        new = self.pending
        if new is None:
            return None
        switched = switch_plan(module, state, new)
        self.pending = None
        path = ""
        if rank_zero and plan_path is not None:
            target = Path(plan_path).with_name("plan-replan.json")
            new.to_json(target)
            path = str(target)
        self.records[-1] = dataclasses.replace(self.records[-1], applied_at_step=step, boundary=boundary,
                                               plan_path=path)
        if logger is not None:
            logger.log_metrics({"elixir/replanned": 1.0, "elixir/replan_predicted_step_s": new.step_time_s},
                               step=step)
        if rank_zero:
            log.info("[elixir] new plan applied at step %d (%s boundary)%s", step, boundary,
                     f"; written to {path}" if path else "")
        return switched
