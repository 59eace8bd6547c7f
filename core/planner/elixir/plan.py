"""Plan types of the Elixir planner: :class:`UnitPlan`, :class:`ElixirPlan` (JSON round trip, explain hooks)
and what a plan is bound to (:func:`model_identity`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tightfit.planner.elixir.disk import Tier
from tightfit.planner.elixir.sim import MODES
from tightfit.planner.errors import PlanMismatchError
from tightfit.profiler.types import ModelProfile
from tightfit.serde import dump_json, load_json

__all__ = ["MODES", "Tier", "BASELINES", "DISK_BASELINES", "UnitPlan", "StepBreakdown", "MemoryBreakdown", "RunnerUp", "ElixirPlan",
           "model_identity"]


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitPlan:
    """One FSDP2 unit of a plan.

    Args:
        blocks: block names, contiguous in first-use order.
        mode: ``"reshard"``, ``"keep"`` or ``"replicate"``.
        tier: where the unit's training state waits, a :class:`~tightfit.planner.elixir.disk.Tier` or its value:
            ``DEVICE``, ``HOST`` (``CPUOffloadPolicy``), then on disk its optimizer state (``DISK``), also its
            master weights and parameters between uses (``DISK_PARAMS``), also its gradients (``DISK_GRADS``).
        checkpoint: blocks of this unit run under activation checkpointing.
        param_numel: parameter elements of the unit.
        device_bytes: sharded state (parameters, gradients, optimizer) resident on each device.
        host_bytes: state each rank keeps in host memory.
        gathered_bytes: unsharded parameters while the unit is live.
        time_s: predicted share of the step (compute, recompute, waits on its fetches, its optimizer step).
        disk_bytes: state each rank keeps on disk for this unit (optimizer state; from ``DISK_PARAMS`` the fp32
            master weights too, in ``DISK_GRADS`` the gradients).
    """

    blocks: tuple[str, ...]
    mode: str = "reshard"
    tier: Tier = Tier.DEVICE
    checkpoint: tuple[str, ...] = ()
    param_numel: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    gathered_bytes: int = 0
    time_s: float = 0.0
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tier, Tier):
            if self.tier not in tuple(Tier):
                raise ValueError(f"UnitPlan(blocks={self.blocks}, tier={self.tier!r}): use a Tier, "
                                 f"{', '.join(f'{t.value} {t.name}' for t in Tier)}")
            object.__setattr__(self, "tier", Tier(self.tier))
        if not self.blocks:
            raise ValueError("UnitPlan.blocks is empty: a unit holds at least one block")
        if self.mode not in MODES:
            raise ValueError(f"UnitPlan.mode={self.mode!r}: use one of {MODES}")
        stray = [b for b in self.checkpoint if b not in self.blocks]
        if stray:
            raise ValueError(f"UnitPlan.checkpoint names {stray} that are not blocks of this unit {self.blocks}")

    @property
    def offload(self) -> bool:
        """Parameters, gradients and optimizer state off the device (``tier >= HOST``: FSDP2's ``CPUOffloadPolicy``)."""
        return self.tier >= Tier.HOST

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's flag: only ``keep`` units stay gathered between forward and backward."""
        return self.mode != "keep"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBreakdown:
    """Where one predicted step's time goes (seconds): the parts add up to the step time."""

    compute_s: float
    recompute_s: float
    exposed_comm_s: float
    optimizer_s: float
    disk_io_s: float = 0.0  # disk reads and writes of the optimizer step before overlap (part of optimizer_s)
    param_io_s: float = 0.0  # tier-3 parameter reads ahead of forward and backward before overlap (in the waits)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """The predicted peak, taken apart (bytes per device, before the margin).

    Args:
        phase: the phase of the step where the peak falls (``"forward"``, ``"backward"``, ``"optimizer"``).
        block: the block running at the peak.
        state_bytes: sharded training state at the peak.
        params_bytes: parameters and gradients in flight (the optimizer step's temporaries at its peak).
        activation_bytes: activations at the peak.
        margin_bytes: the allocator's slack (``fragmentation``) plus the reserve.
        reserved_bytes: the reserve, part of ``margin_bytes``: the CUDA context, or on a CPU the interpreter,
            libraries and data the process held before planning (``ElixirConstraints.reserved_bytes``).
        staging_bytes: the disk tier's staging buffers, part of ``params_bytes`` (the optimizer step's
            temporaries) where the peak is the optimizer step on unified memory (a CPU device), else 0 here.
    """

    phase: str
    block: str
    state_bytes: int
    params_bytes: int
    activation_bytes: int
    margin_bytes: int
    reserved_bytes: int = 0
    staging_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerUp:
    """The best plan of another family (grouping x prefetch depths) and why it lost."""

    family: str
    step_time_s: float
    peak_bytes: int
    units: int
    offloaded: int
    checkpointed: int
    why: str


@dataclass(frozen=True, kw_only=True)
class ElixirPlan:
    """A plan FSDP2 can execute, with its predictions and the identity of what it was made for.

    Args:
        model: the profiled model's name; with the five fields below, the identity
            :meth:`check_compatible` checks before a runtime applies the plan.
        param_numel: the model's parameter count.
        blocks: the model's block names in first-use order.
        blocks_hash: a short hash of each block's name and parameter count (``model_identity``).
        inputs: the profiled micro-batch's input shapes.
        world_size: the number of ranks it was planned for.
        precision: the Lightning precision it was priced for.
        param_dtype: the dtype parameters are gathered in.
        reduce_dtype: the dtype gradients are reduced in.
        optimizer: the optimizer whose state it places.
        units: the units in first-use order.
        forward_prefetch: how many units ahead the forward gathers.
        backward_prefetch: how many units ahead the backward gathers.
        step_time_s: the predicted seconds of one training step.
        peak_bytes: the predicted peak memory per device.
        budget_bytes: the device memory budget it was planned under.
        host_bytes_per_rank: host memory each rank uses for offloaded state.
        breakdown: where the step time goes.
        memory: where the peak memory goes.
        runner_ups: the best plans of other families (fastest first).
        search_method: how it was found (``"exhaustive"``, ``"greedy frontier"``, a baseline's name...).
        search_seconds: how long the search took.
        candidates_evaluated: how many plans the search priced.
        device: the device it was planned for.
        notes: assumptions the cost model made.
        checkpointable_blocks: how many of the model's blocks can be checkpointed.
        cost_model: how the step time was priced: ``"FLOPs / rate"`` or ``"measured block timings"``,
            then the calibration terms used (collective latency, per-unit overhead, measured overlap).
        disk_bytes_per_rank: optimizer state each rank keeps on disk (units with ``disk``).
        disk_path: the disk tier's directory the plan was priced for (``""``: no disk tier).
        grads_accumulate_on_host: under gradient accumulation, the units with ``grads_disk`` keep the sum of the
            micro-batches' gradients in RAM until the last one (the host budget has room for all of them beside
            the plan's host bytes); ``False``: each micro-batch reads, adds and writes the sums on disk.
        budget_source: where the device budget came from, for :meth:`explain` (``"the memory limit 1.00 GiB
            (/sys/fs/cgroup/.../memory.max)"``); ``""``: given or the device's memory.
    """

    model: str
    param_numel: int
    blocks: tuple[str, ...]
    blocks_hash: str
    inputs: dict[str, list[int]]
    world_size: int
    precision: str
    param_dtype: str
    reduce_dtype: str
    optimizer: str
    units: tuple[UnitPlan, ...]
    forward_prefetch: int
    backward_prefetch: int
    step_time_s: float
    peak_bytes: int
    budget_bytes: int
    host_bytes_per_rank: int
    breakdown: StepBreakdown
    memory: MemoryBreakdown
    runner_ups: tuple[RunnerUp, ...] = ()
    search_method: str = "estimate"
    search_seconds: float = 0.0
    candidates_evaluated: int = 0
    device: str = ""
    notes: tuple[str, ...] = ()
    checkpointable_blocks: int = 0
    cost_model: str = "FLOPs / rate"
    disk_bytes_per_rank: int = 0
    disk_path: str = ""
    grads_accumulate_on_host: bool = True
    budget_source: str = ""

    # ---- views -------------------------------------------------------------------------------
    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    @property
    def offloaded_units(self) -> tuple[int, ...]:
        return tuple(i for i, u in enumerate(self.units) if u.tier >= Tier.HOST)

    @property
    def disk_units(self) -> tuple[int, ...]:
        """Units whose optimizer state lives on disk (a subset of :attr:`offloaded_units`)."""
        return tuple(i for i, u in enumerate(self.units) if u.tier >= Tier.DISK)

    @property
    def param_disk_units(self) -> tuple[int, ...]:
        """Units whose master weights and parameters between uses live on disk (a subset of :attr:`disk_units`)."""
        return tuple(i for i, u in enumerate(self.units) if u.tier >= Tier.DISK_PARAMS)

    @property
    def grad_disk_units(self) -> tuple[int, ...]:
        """Units whose gradients wait on disk between backward and the step (a subset of :attr:`param_disk_units`)."""
        return tuple(i for i, u in enumerate(self.units) if u.tier >= Tier.DISK_GRADS)

    @property
    def checkpointed_blocks(self) -> tuple[str, ...]:
        return tuple(b for u in self.units for b in u.checkpoint)

    @property
    def is_mixed(self) -> bool:
        """Some units offloaded and some resident, some resharded, some blocks recomputed."""
        off = self.offloaded_units
        return (0 < len(off) < len(self.units) and any(u.mode == "reshard" for u in self.units)
                and bool(self.checkpointed_blocks))

    @property
    def variety(self) -> int:
        """How many of the plan's choices are mixed (0-3): offload, checkpointing, and modes."""
        return (int(0 < len(self.offloaded_units) < len(self.units))
                + int(0 < len(self.checkpointed_blocks) < self.checkpointable_blocks)
                + int(len({u.mode for u in self.units}) > 1))

    @property
    def samples_per_step(self) -> int:
        shapes = list(self.inputs.values())
        return self.world_size * (shapes[0][0] if shapes and shapes[0] else 1)

    @property
    def tokens_per_step(self) -> int:
        shapes = list(self.inputs.values())
        per = shapes[0][0] * shapes[0][1] if shapes and len(shapes[0]) >= 2 else (shapes[0][0] if shapes and shapes[0] else 1)
        return self.world_size * per

    # ---- I/O -----------------------------------------------------------------------------------
    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> ElixirPlan:
        """Read :meth:`to_json`'s output; plans written before ``UnitPlan.tier`` (four flags per unit) read too."""
        return load_json(cls, source, upgrade=_upgrade_units)

    # ---- identity ------------------------------------------------------------------------------
    def check_compatible(self, profile: ModelProfile, world_size: int, *, precision: str | None = None) -> None:
        """Raise :class:`PlanMismatchError` unless this plan was made for ``profile`` on ``world_size`` ranks."""
        fix = ("re-plan for this run (`tightfit plan elixir ...` with the same model, batch and --devices, "
               "or ElixirStrategy(plan=None) to plan at fit start)")
        if world_size != self.world_size:
            raise PlanMismatchError(
                f"plan was made for world size {self.world_size}, this run has {world_size} ranks; {fix}",
                field="world_size", expected=self.world_size, actual=world_size)
        if profile.param_numel != self.param_numel:
            raise PlanMismatchError(
                f"plan was made for a model with {self.param_numel:,} parameters ({self.model}), this model has "
                f"{profile.param_numel:,} ({profile.model}); {fix}",
                field="param_numel", expected=self.param_numel, actual=profile.param_numel)
        names, digest = model_identity(profile)
        if digest != self.blocks_hash:
            diff = next((f"block {i}: plan {a!r} vs model {b!r}" for i, (a, b) in enumerate(zip(self.blocks, names))
                         if a != b), f"plan has {len(self.blocks)} blocks, model has {len(names)}")
            raise PlanMismatchError(f"plan's blocks do not match the model's ({diff}); {fix}",
                                    field="blocks", expected=self.blocks_hash, actual=digest)
        if precision is not None and precision != self.precision:
            raise PlanMismatchError(f"plan was priced for precision {self.precision!r}, this run uses {precision!r}; "
                                    f"{fix}", field="precision", expected=self.precision, actual=precision)

    # ---- explanation --------------------------------------------------------------------------
    def explain(self, *, full: bool = False) -> str:
        """The plan as a table (runs of identical units folded unless ``full``), totals and runner-ups."""
        from tightfit.planner.elixir.explain import explain

        return explain(self, full=full)

    # ---- DeepSpeed ----------------------------------------------------------------------------
    def to_deepspeed_config(self) -> dict:
        """The closest DeepSpeed ZeRO configuration; :meth:`deepspeed_gaps` says what it cannot express."""
        from tightfit.planner.elixir.explain import deepspeed_config

        return deepspeed_config(self)[0]

    def deepspeed_gaps(self) -> tuple[str, ...]:
        """What of this plan the DeepSpeed configuration cannot express (one sentence each)."""
        from tightfit.planner.elixir.explain import deepspeed_config

        return deepspeed_config(self)[1]


BASELINES = ("ddp", "zero2", "zero2-offload", "zero3", "zero3-offload")
"""The fixed configurations a plan is compared with (``tightfit.planner.elixir.baseline``)."""
DISK_BASELINES = ("zero3-offload-nvme",)
"""ZeRO-Infinity's optimizer state on NVMe (DeepSpeed's ``offload_optimizer`` device ``"nvme"``): a baseline that
needs a disk tier, so it is listed apart from :data:`BASELINES`."""


def _upgrade_units(data: dict) -> dict:
    """A plan written before ``UnitPlan.tier``: each unit's chained flags ``offload`` > ``disk`` > ``params_disk`` >
    ``grads_disk`` (each needs the one before) become its tier, the number of flags set."""
    for i, unit in enumerate(data.get("units") or () if isinstance(data, dict) else ()):
        if not isinstance(unit, dict) or "tier" in unit:
            continue
        flags = [bool(unit.pop(k, False)) for k in ("offload", "disk", "params_disk", "grads_disk")]
        if flags != sorted(flags, reverse=True):
            raise ValueError(f"ElixirPlan JSON: unit {i} {unit.get('blocks')} has (offload, disk, params_disk, "
                             f"grads_disk) = {tuple(flags)}, but each flag needs the one before it; re-plan "
                             "(`tightfit plan elixir ... --json`) or give the unit its tier (0-4)")
        unit["tier"] = sum(flags)
    return data


def model_identity(profile: ModelProfile) -> tuple[tuple[str, ...], str]:
    """Block names and a short hash of (name, parameter count) per block: what a plan is bound to."""
    names = tuple(b.name for b in profile.blocks)
    h = hashlib.sha256(";".join(f"{b.name}:{b.param_numel}" for b in profile.blocks).encode()).hexdigest()[:16]
    return names, h

