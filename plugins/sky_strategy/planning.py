"""From the first batch to a :class:`PartitionPlan`, and from measured stage times to a new one.

The planning path, one way (the strategy calls these; none of them reads the strategy):

1. :func:`check_forward` - once, that ``forward`` is the declared layers applied in order;
2. :func:`profile_pipeline` - every rank times its layers, its memory, its links, the replicas'
   all-reduce and the schedule's own cost, and every rank receives every profile; the result is a
   frozen :class:`PlanInputs` (what every plan of this fit is made from) and the profiles;
3. :func:`pipeline_problem` / :func:`make_plan` - the :class:`PipelineProblem` for given per-rank
   speeds and core's plan for it (pure: numbers in, a plan out, run on rank 0);
4. :func:`decide_plan` - rank 0 plans, every rank receives the same plan as JSON
   (:func:`tightfit.distributed.decide_on_rank0`);
5. :class:`Replanner` - every ``replan_every`` optimizer steps, the measured stage times against the
   first window after the plan; a drift beyond the threshold scales the speeds and decides again. It
   works on a small :class:`PlanState` (plan, speeds, baseline) and returns the plan to apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from sky_strategy.config import SkyConfig
from sky_strategy.layers import Layer, call_layer
from sky_strategy.mesh import Layout, PipelineGroups
from sky_strategy.profiling import (
    LINK_SIZES,
    InjectedSpeeds,
    RankProfile,
    check_memory_caps,
    fit_allreduce,
    measure_link_fits,
    pipeline_overhead,
    planner_inputs,
    profile_rank,
    step_overhead,
)
from tightfit.distributed import decide_on_rank0
from tightfit.planner.optimizers import optimizer_states
from tightfit.planner.pipeline import (
    DeviceSpec,
    LayerMemory,
    PartitionPlan,
    PipelineProblem,
    merge_latency,
    merge_replicas,
    plan_pipeline,
)

__all__ = ["PlanInputs", "Profiled", "check_forward", "profile_pipeline", "pipeline_problem", "make_plan",
           "decide_plan", "gather_stage_seconds", "PlanState", "Replan", "Replanner"]

Say = Callable[..., None]  # (text, level=logging.INFO): the strategy's rank-0 logger


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything a plan of this fit is made from, measured once on the first batch (equal on every rank).

    Args:
        layer_costs / layer_memory / devices: :func:`~sky_strategy.profiling.planner_inputs` of every
            rank's profile (``devices``: one per global rank, with its measured speed).
        links: bandwidth between global ranks (a matrix), the configured ``link_bandwidth``, or ``None``.
        link_latency: per-message seconds between global ranks (``None``: not measured).
        allreduce: the replicas' all-reduce ``(alpha s, bus bytes/s)`` (``None``: one replica).
        step_overhead_s: collectives every step pays whatever the partition.
        pipeline_overhead_s: one step of the schedule with stages that compute nothing.
        optimizer_state_factor: optimizer-state bytes per parameter byte.
        replicas: data-parallel copies of the pipeline (core folds them into one pipeline).
        config: the strategy's knobs (schedule, microbatches, partition, order, ...).
    """

    layer_costs: tuple[float, ...]
    layer_memory: tuple[LayerMemory, ...]
    devices: tuple[DeviceSpec, ...]
    links: Any
    link_latency: Any
    allreduce: tuple[float, float] | None
    step_overhead_s: float
    pipeline_overhead_s: float
    optimizer_state_factor: float
    replicas: int
    config: SkyConfig

    @property
    def speeds(self) -> tuple[float, ...]:
        """The measured speed of each global rank (rank 0 = 1.0): what the first plan is made for."""
        return tuple(d.speed for d in self.devices)


@dataclass(frozen=True, kw_only=True)
class Profiled:
    """What :func:`profile_pipeline` returns: the planner's inputs and every rank's profile."""

    inputs: PlanInputs
    profiles: tuple[RankProfile, ...]


def check_forward(module: nn.Module, layers: Sequence[Layer], sample: Any) -> None:
    """Raise unless ``module(sample)`` equals the declared layers applied in order (eval mode, no grad)."""
    module.eval()
    with torch.no_grad():
        ref = module(*sample) if isinstance(sample, tuple) else module(sample)
        x = sample
        for layer in layers:
            x = call_layer(layer.module, x)
    module.train()
    if isinstance(ref, torch.Tensor) and isinstance(x, torch.Tensor):
        if ref.shape != x.shape or not torch.allclose(ref, x, rtol=1e-4, atol=1e-5):
            diff = (ref - x).abs().max().item() if ref.shape == x.shape else f"shapes {ref.shape} vs {x.shape}"
            raise MisconfigurationException(
                f"SkyStrategy: {type(module).__name__}.forward differs from applying pipeline_layers in order "
                f"(max difference {diff}); declare the layers so that forward(x) == layers applied one after "
                "another, or pass check_forward=False if forward is deliberately different")


def _microbatch(inputs: Any, microbatches: int) -> tuple[int, Any]:
    """The microbatch size and the first microbatch of the batch's inputs, copied (profiling runs it many times)."""
    mb = max(1, (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape[0] // microbatches)
    return mb, tuple(t[:mb].clone() for t in inputs) if isinstance(inputs, (tuple, list)) else inputs[:mb].clone()


def profile_pipeline(module: nn.Module, layers: list[Layer], inputs: Any, *, config: SkyConfig, layout: Layout,
                     groups: PipelineGroups, device: torch.device, local_world_size: int,
                     optimizers: Sequence[torch.optim.Optimizer], speeds: InjectedSpeeds, say: Say) -> Profiled:
    """What this fit's plans are made from. Collective: every rank calls it on the first batch.

    Measured in train mode with gradients on (whatever Lightning's loop set), the module's own mode
    restored after. Every rank receives every profile (a few numbers per layer).
    """
    rank = layout.rank
    check_memory_caps(config.memory_caps, device=device, local_world_size=local_world_size)  # before any collective
    was_training = module.training
    with torch.inference_mode(False), torch.enable_grad():
        mb, sample = _microbatch(inputs, config.microbatches)
        module.train()
        if config.check_forward:
            check_forward(module, layers, sample)
        say(f"profiling {len(layers)} layers on a microbatch of {mb}")
        mine = profile_rank(layers, sample, rank=rank, device=device, speed_factor=speeds.factor(rank),
                            memory_cap=None if config.memory_caps is None else config.memory_caps[rank],
                            local_world_size=local_world_size, repeats=config.profile_repeats, progress=say,
                            optimizers=optimizers, clock=config.profile_clock)
        links: Any = config.link_bandwidth
        latency = None
        if links is None and layout.world > 1:
            act = max(max(m.output_bytes for m in mine.layers), 1)
            links, latency = measure_link_fits((*LINK_SIZES, act), device=device)
        allreduce = fit_allreduce(groups.replicas, device=device) if layout.replicas > 1 else None
        # the schedule's own cost per step (stand-in stages that compute nothing, real schedule class,
        # planned microbatches, this rank's slowdown): a few percent of a small model's step, which the
        # layer timings miss
        schedule_s = pipeline_overhead(config.microbatches, config.schedule, device=device, group=groups.pipeline,
                                       slowdown=speeds.slowdown_of(rank)) if layout.pipeline_ranks > 1 else 0.0
    module.train(was_training)
    gathered: list = [None] * layout.world
    dist.all_gather_object(gathered, mine)
    costs, mems, devices = planner_inputs(gathered)
    opt = config.optimizer_state_factor
    if opt is None:
        opt = max((float(optimizer_states(type(o).__name__, o.defaults, strict=False)) for o in optimizers),
                  default=0.0)
    batch_out = mine.layers[-1].output_bytes * config.microbatches
    inputs_ = PlanInputs(layer_costs=tuple(costs), layer_memory=tuple(mems), devices=tuple(devices), links=links,
                         link_latency=latency, allreduce=allreduce,
                         step_overhead_s=step_overhead(latency, links, batch_out), pipeline_overhead_s=schedule_s,
                         optimizer_state_factor=opt, replicas=layout.replicas, config=config)
    return Profiled(inputs=inputs_, profiles=tuple(gathered))


def pipeline_problem(inputs: PlanInputs, speeds: Sequence[float]) -> PipelineProblem:
    """The problem for one pipeline; ``speeds`` are per global rank (core merges the replicas)."""
    # a re-plan's speeds scale each rank's measured layer timings by the drift it saw
    scaled = [replace(d, speed=s, layer_seconds=None if d.layer_seconds is None else
                      tuple(t * d.speed / s for t in d.layer_seconds)) for d, s in zip(inputs.devices, speeds)]
    devices, links = merge_replicas(scaled, inputs.links, replicas=inputs.replicas)
    cfg = inputs.config
    return PipelineProblem(layer_costs=list(inputs.layer_costs), layer_memory=list(inputs.layer_memory),
                           devices=devices, microbatches=cfg.microbatches, schedule=cfg.schedule, links=links,
                           virtual_stages=cfg.virtual_stages, optimizer_state_factor=inputs.optimizer_state_factor,
                           link_latency=merge_latency(inputs.link_latency, replicas=inputs.replicas),
                           step_overhead_s=inputs.step_overhead_s, replicas=inputs.replicas,
                           pipeline_overhead_s=inputs.pipeline_overhead_s, allreduce=inputs.allreduce,
                           # the last step's gradients live until Lightning's zero_grad; each
                           # microbatch's gradient is computed whole, then accumulated
                           gradient_copies=2, accumulation_buffer=True)


def make_plan(inputs: PlanInputs, speeds: Sequence[float], *, say: Say) -> PartitionPlan:
    """Core's plan for ``speeds`` with the configured partitioner (a plan over a memory cap is warned about)."""
    plan = plan_pipeline(pipeline_problem(inputs, speeds), inputs.config.partition, order=inputs.config.order)
    if not plan.feasible:
        say(f"the {plan.method} partition exceeds a memory cap:\n{plan.explain()}", logging.WARNING)
    return plan


def decide_plan(inputs: PlanInputs, speeds: Sequence[float], *, say: Say) -> PartitionPlan:
    """Rank 0 plans; every rank gets the same plan as JSON (an error there is raised on every rank)."""
    return decide_on_rank0(lambda: make_plan(inputs, speeds, say=say), encode=lambda plan: plan.to_json(),
                           decode=PartitionPlan.from_json)


def gather_stage_seconds(busy_s: float, chunks: int, *, world: int) -> list[float]:
    """Every global rank's compute seconds per forward chunk since the last call. Collective."""
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, busy_s / max(1, chunks))
    return per_rank


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanState:
    """What re-planning needs between windows.

    Args:
        plan: the plan the ranks run.
        speeds: the per-global-rank speeds it was made for.
        baseline: stage seconds per chunk of each rank in the first window after the plan (``None``:
            that window has not been measured yet).
    """

    plan: PartitionPlan
    speeds: tuple[float, ...]
    baseline: tuple[float, ...] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Replan:
    """One re-plan that moved layers: at optimizer ``step``, from ``before`` to ``after`` layers per rank."""

    step: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    drift: tuple[float, ...]
    plan: PartitionPlan

    def describe(self) -> str:
        return (f"step {self.step}: stage times drifted by {[f'{d:.2f}x' for d in self.drift]}; re-planned "
                f"{self.before} -> {self.after} layers per rank")


class Replanner:
    """Re-plans when measured stage times drift from the first window after the plan.

    Args:
        inputs: what the first plan was made from (the re-plan scales its speeds only).
        plan: the first plan.
        every: compare every ``every`` optimizer steps (``None``: never).
        threshold: relative drift of any rank's stage time that triggers a re-plan.
        say: the strategy's rank-0 logger (for the planner's warnings).

    Attributes: ``state`` (:class:`PlanState`), ``records`` (every :class:`Replan` that moved layers).
    """

    def __init__(self, inputs: PlanInputs, plan: PartitionPlan, *, every: int | None, threshold: float,
                 say: Say) -> None:
        if every is not None and every < 1:
            raise ValueError(f"Replanner(every={every}): give a whole number of optimizer steps >= 1, or None to "
                             "never re-plan")
        self.inputs = inputs
        self.state = PlanState(plan=plan, speeds=inputs.speeds)
        self.every = every
        self.threshold = threshold
        self.say = say
        self.records: list[Replan] = []

    @property
    def plan(self) -> PartitionPlan:
        return self.state.plan

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` ends a measurement window."""
        return self.every is not None and step > 0 and step % self.every == 0

    def observe(self, step: int, stage_seconds: Sequence[float]) -> Replan | None:
        """Take one window's stage seconds per rank; a :class:`Replan` whose plan the ranks must apply now,
        or ``None``. Collective when the times drifted (every rank decides together, on equal inputs)."""
        state = self.state
        if state.baseline is None:  # the first window after a plan is the reference
            self.state = replace(state, baseline=tuple(stage_seconds))
            return None
        drift = tuple(now / max(then, 1e-12) for now, then in zip(stage_seconds, state.baseline))
        if max(abs(d - 1.0) for d in drift) <= self.threshold:
            return None
        speeds = tuple(s / d for s, d in zip(state.speeds, drift))
        new = decide_plan(self.inputs, speeds, say=self.say)
        if (new.boundaries, new.order) == (state.plan.boundaries, state.plan.order):
            self.state = PlanState(plan=state.plan, speeds=speeds)
            return None
        self.state = PlanState(plan=new, speeds=speeds)
        record = Replan(step=step, before=state.plan.layer_counts(), after=new.layer_counts(), drift=drift, plan=new)
        self.records.append(record)
        return record
