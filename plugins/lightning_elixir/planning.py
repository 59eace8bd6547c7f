"""From a LightningModule and a batch to an :class:`ElixirPlan`: profile, plan on rank 0, broadcast.

The strategy calls these at fit start; they are plain functions so a plan can also be made (and
inspected) outside a Trainer:

* :func:`example_batch` - the first batch of the stage's dataloader (the global RNG is restored
  afterwards, so a shuffled loader still yields the same batches as without Elixir);
* :func:`profile_module` - one ``training_step`` traced on the meta device (nothing allocated, the
  module is not changed), or ``forward(example_input_array)`` when there is no batch;
* :func:`local_device` - this rank's :class:`DeviceProfile` (``tightfit.profiler.profile_device``
  when the core provides it, otherwise a short local measurement);
* :func:`make_plan` - core's search with the strategy's knobs (``offload``, ``activation_checkpointing``
  become :class:`ElixirConstraints`; core decides forced choices, nothing is re-priced here);
* :func:`decide_plan` - what both strategies call, with what it needs (the options, the module, a
  way to the first batch, the precision, this rank's device and the world's shape; never the
  strategy): rank 0 profiles and searches (or checks a given plan), every rank gets the same plan as
  JSON through :func:`tightfit.distributed.decide_on_rank0`; it returns a :class:`PlanDecision` (the
  plan, and on rank 0 the profile and cluster re-planning starts from) and the strategy stores it.
  An error on rank 0 is raised on every rank with its type and numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_elixir.memory_budget import MemoryLimitError, check_given_budgets, module_bytes, process_budget
from lightning_elixir.options import OFFLOAD_CHOICES, ElixirOptions
from tightfit.distributed import decide_on_rank0
from tightfit.memory_limit import read_memory
from tightfit.planner.elixir import ElixirConstraints, ElixirPlan, search
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.profiler import calibrate_device, profile_model
from tightfit.profiler.types import ClusterSpec, DeviceProfile, ModelProfile
from tightfit.units import format_bytes, parse_bytes

__all__ = ["example_batch", "profile_module", "local_device", "make_plan", "load_plan", "decide_plan", "PlanDecision",
           "stage_method", "forked_rng", "time_module_blocks", "OFFLOAD_CHOICES", "STAGE_METHODS", "FORWARD"]

log = logging.getLogger(__name__)


# ---- the batch -----------------------------------------------------------------------------------
def example_batch(trainer: Any) -> Any | None:
    """The first batch the current stage will see, or ``None`` when its dataloader gives none."""
    from lightning.pytorch.trainer.states import TrainerFn

    loop = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}.get(trainer.state.fn)
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    # Iterating a shuffled loader draws from the global RNG; restore it so the run is unchanged.
    with torch.random.fork_rng(devices=[]):
        loaders = source.dataloader()
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        if isinstance(loaders, dict):
            loaders = next(iter(loaders.values()), None)
        if loaders is None:
            return None
        try:
            return next(iter(loaders))
        except StopIteration:
            return None


# ---- profiling -----------------------------------------------------------------------------------
class _StepModule(nn.Module):
    """The LightningModule's structure (the very same child/parameter dicts, so the same FQNs) whose
    forward runs one ``<stage>_step``: profiling what a step really does, loss included."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self._modules = module._modules
        self._parameters = module._parameters
        self._buffers = module._buffers
        object.__setattr__(self, "_lm", module)
        self._method = method

    def forward(self, batch: Any) -> Any:
        return getattr(self._lm, self._method)(batch, 0)


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, dict):
        output = output.get("loss")
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.requires_grad:
        return output
    from tightfit.profiler.model import default_loss

    return default_loss(output)


def profile_module(module: nn.Module, batch: Any = None, *, stage_method: str = "training_step",
                   name: str | None = None) -> ModelProfile:
    """Profile one step of a LightningModule on the meta device.

    With a ``batch``: ``stage_method(batch, 0)`` (its loss is backpropagated). Without: ``forward`` on
    ``module.example_input_array``. ``stage_method="forward"``: ``batch`` is what ``forward`` takes (a tensor, a
    tuple of arguments or a dict of keyword arguments), profiled with the output's default loss. The module is
    neither changed nor moved.

    Raises:
        ValueError: no batch and no ``example_input_array``; the message says what to add.
    """
    from tightfit.profiler import MetaProfilingError

    name = name or _model_name(module)
    example = getattr(module, "example_input_array", None)
    if batch is not None and stage_method == FORWARD:
        example, batch = batch, None  # a forward input (Fabric's example_input), profiled as example_input_array is
    if batch is not None:
        target = _StepModule(module, stage_method)
        try:
            with warnings.catch_warnings(), _plain_attributes_on_meta(module):
                # self.log() in the traced step has no Trainer: Lightning warns and skips it, which is right here.
                warnings.simplefilter("ignore")
                # A model that cannot run on meta (a value-dependent op) is profiled on a CPU copy instead,
                # which is possible only when its parameters are real.
                real = not any(p.is_meta for p in module.parameters())
                return profile_model(target, (batch,), loss_fn=_loss_of, name=name, fallback="cpu" if real else None)
        except MetaProfilingError as exc:
            if example is None:
                raise MetaProfilingError(
                    f"{type(module).__name__}.{stage_method} cannot run on the meta device ({exc.__cause__!r}); "
                    "a value-dependent call such as `loss.item()` in the step is the usual cause: move it to "
                    "`on_train_batch_end`, or set `self.example_input_array` so the forward is profiled instead"
                ) from exc
    if example is None:
        raise ValueError(
            f"ElixirStrategy cannot profile {type(module).__name__}: the dataloader gave no batch and "
            "`example_input_array` is not set. Give the LightningModule a train dataloader, set "
            "`self.example_input_array = torch.zeros(batch, seq, dtype=torch.long)`, or pass plan=... ")
    with _plain_attributes_on_meta(module):
        return profile_model(module, example, name=name)


@contextlib.contextmanager
def _plain_attributes_on_meta(module: nn.Module) -> Iterator[None]:
    """The profiler copies the module under the fake mode, where tensors kept as plain attributes
    (not parameters or buffers: ``example_input_array``, caches) and the strategy's ``DeviceMesh``
    cannot be copied; hide them (``None``) while it does. A step that needs such a tensor should
    register it as a buffer."""
    from torch.distributed.device_mesh import DeviceMesh

    saved: list[tuple[nn.Module, str, Any]] = []
    for sub in module.modules():
        for key, value in list(vars(sub).items()):
            if isinstance(value, DeviceMesh) or (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)):
                saved.append((sub, key, value))
                object.__setattr__(sub, key, None)
    try:
        yield
    finally:
        for sub, key, value in saved:
            object.__setattr__(sub, key, value)


def _model_name(module: nn.Module) -> str:
    for sub in module.modules():
        config = getattr(sub, "config", None)
        value = getattr(config, "name", None)
        if isinstance(value, str) and value and value != "custom":
            return value
    return type(module).__name__


def time_module_blocks(module: nn.Module, batch: Any, profile: ModelProfile, *, device: torch.device,
                       precision: str = "32-true", stage_method: str = "training_step") -> ModelProfile:
    """``profile`` with each block's forward and backward measured on ``device``, one block at a time
    (:func:`tightfit.profiler.time_blocks`: random inputs of the shapes the batch gives each block, cached
    per block shapes, device, thread count and dtype). Only the planning rank times (``agree=False``): the
    others wait for the plan it shares. Under ``*-true`` precisions the blocks run in that dtype; mixed
    precisions are timed in the parameters' dtype (autocast is not replayed), which the plan's notes say.
    """
    from tightfit.profiler import time_blocks

    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}.get(precision)
    # What profile_module traced: the step on the batch, else forward on the given input or example_input_array.
    steps = batch is not None and stage_method != FORWARD
    target: nn.Module = _StepModule(module, stage_method) if steps else module
    inputs = (batch,) if steps else batch if batch is not None else getattr(module, "example_input_array", None)
    # The shapes are recorded on a copy of the module: detach the Trainer first, so the copy does not drag it
    # along and the step's self.log() warns and skips (no Trainer) instead of raising (a Trainer mid-setup).
    trainer = module.__dict__.get("_trainer")
    try:
        if trainer is not None:
            module.__dict__["_trainer"] = None
        with warnings.catch_warnings(), _plain_attributes_on_meta(module):
            warnings.simplefilter("ignore")  # self.log() without a Trainer, as in profile_module
            timed = time_blocks(target, inputs, profile, device=device, dtype=dtype, loss_fn=_loss_of, agree=False)
    finally:
        if trainer is not None:
            module.__dict__["_trainer"] = trainer
    if "mixed" in precision:
        timed = dataclasses.replace(timed, notes=(*timed.notes, f"blocks timed in the parameters' dtype, not "
                                                                f"under {precision} autocast"))
    return timed


# ---- the device ----------------------------------------------------------------------------------
def local_device(device: torch.device) -> DeviceProfile:
    """This rank's device profile, measured by ``tightfit.profiler.profile_device`` (cached per machine).

    Collective under a process group (the collectives are measured together): call it on every rank.
    """
    from tightfit.profiler import profile_device

    profile = profile_device(device, quick=True, progress=False)
    # A profile measured in a 1-rank group may carry 0 B/s collective rates (nothing moved); the
    # planner treats missing rates as unmeasured (a documented fallback), so drop such tables.
    coll = {k: v for k, v in profile.collective_bytes_per_s.items() if v and all(r > 0 for r in v.values())}
    return dataclasses.replace(profile, collective_bytes_per_s=coll)


# ---- the plan ------------------------------------------------------------------------------------
def make_plan(profile: ModelProfile, cluster: ClusterSpec, *, memory_budget: int | float | str | None = None,
              precision: str = "32-true", optimizer: str = "adamw", offload: str = "auto",
              activation_checkpointing: str | bool = "auto", constraints: ElixirConstraints | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> ElixirPlan:
    """Core's search with the strategy's knobs: ``offload="all"`` / ``activation_checkpointing=True`` are
    forced choices of :class:`ElixirConstraints` (``"none"`` / ``False`` forbid them), decided by core."""
    options = ElixirOptions(memory_budget=memory_budget, offload=offload, optimizer=optimizer,
                            activation_checkpointing=activation_checkpointing, constraints=constraints,
                            owner="make_plan")
    return search(profile, cluster, optimizer=optimizer, precision=precision, memory_budget=memory_budget,
                  constraints=options.planner_constraints(), progress=progress)


def load_plan(plan: str | Path | ElixirPlan) -> ElixirPlan:
    if isinstance(plan, ElixirPlan):
        return plan
    path = Path(plan)
    if not path.is_file():
        raise FileNotFoundError(f"plan file {path} does not exist; write one with `tightfit plan elixir ... --json "
                                f"{path}` or use ElixirStrategy(plan=None) to plan at fit start")
    return ElixirPlan.from_json(path)


# The "stage method" of a Fabric loop: the module's forward on an example input (the loss is the user's loop's).
FORWARD = "forward"
STAGE_METHODS = {"fit": "training_step", "validate": "validation_step", "test": "test_step",
                 "predict": "predict_step"}


@contextlib.contextmanager
def forked_rng(device: torch.device) -> Iterator[None]:
    """Run the block and leave every random stream as it found it: torch's CPU generator, ``device``'s
    CUDA generator, Python's ``random`` and NumPy's global state.

    Planning measures the device (``torch.randn`` matrices, an AdamW step) and profiles a step; without
    this, a seeded Elixir run's first dropout masks differ from a seeded DDP run's, and so does its first loss
    under dropout.
    """
    state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:
        np, np_state = None, None  # type: ignore[assignment]
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(state)
        if np is not None:
            np.random.set_state(np_state)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanDecision:
    """What :func:`decide_plan` returns; the strategy stores it.

    Args:
        plan: the plan every rank runs (equal objects on every rank, decoded from the same JSON).
        profile / cluster: what the plan was searched from or checked against, on rank 0 (``None`` on
            the other ranks, and ``cluster`` also where no device was measured or given); re-planning
            (``replan=True``) starts from them.
    """

    plan: ElixirPlan
    profile: ModelProfile | None = None
    cluster: ClusterSpec | None = None


def stage_method(trainer: Any) -> str:
    """The LightningModule method the trainer's current stage runs (``"training_step"`` while fitting)."""
    return STAGE_METHODS.get(str(getattr(trainer.state.fn, "value", trainer.state.fn)), "training_step")


def decide_plan(options: ElixirOptions, module: nn.Module, *, first_batch: Callable[[], Any], precision: str,
                device: torch.device, world_size: int, num_nodes: int = 1, rank: int = 0,
                method: str = "training_step") -> PlanDecision:
    """The plan every rank runs: gathered inputs, decided by core on rank 0, shared as JSON.

    Args:
        options: the strategy's validated options (budget, given plan or cluster, forced choices).
        module: the LightningModule (on the meta device or real); profiled, never changed.
        first_batch: returns the batch to profile (:func:`example_batch`); called on rank 0 only, so
            only one rank reads the dataloader.
        precision: the Trainer's precision flag the plan is priced for (``"bf16-mixed"`` ...).
        device / world_size / num_nodes / rank: this rank's device and the run's shape.
        method: the step to profile (:func:`stage_method`).

    Collective: every rank calls it (the device measurement and the broadcast are collectives).
    Runs under :func:`forked_rng`: planning leaves the RNG streams as it found them, so seeded runs
    match DDP's. An error on rank 0 is raised on every rank with its type and numbers.
    """
    say = _say if options.verbose and rank == 0 else (lambda text: None)
    # A budget larger than the memory limit this process runs under is refused on every rank, before any work.
    ranks_per_node = max(1, world_size // max(1, num_nodes))
    check_given_budgets(options.owner, options.memory_budget, options.host_budget, device_type=device.type,
                        ranks_per_node=ranks_per_node, reading=read_memory())
    with forked_rng(device):
        measured: DeviceProfile | None = None
        calibration_s = 0.0
        # Re-planning (replan=True) prices plans on a cluster even when the plan itself was given.
        if options.measures_device or (options.replan and options.cluster is None and options.device_profile is None):
            say("[elixir] profiling the device (cached after the first run) ...")
            measured = local_device(device)  # collective: every rank measures the collectives
            if options.calibrates:
                say("[elixir] calibrating collectives and FSDP2's per-unit overheads (cached after the first run) ...")
                start = time.perf_counter()
                measured = calibrate_device(measured, device=device, quick=True, progress=False)  # collective
                calibration_s = time.perf_counter() - start
        planned_from: list[tuple[ModelProfile, ClusterSpec | None]] = []  # filled on rank 0 only

        def decide() -> ElixirPlan:
            say(f"[elixir] profiling one {method} on the meta device ...")
            batch = first_batch()
            profile = profile_module(module, batch, stage_method=method)
            blocks_s = 0.0
            cluster = _with_disk_tier(options, _cluster(options, measured, world_size, num_nodes), say)
            if options.calibrates and options.plan is None and read_memory().limited:
                # Under a memory limit, one that no plan fits is refused before any block runs for real (memory does
                # not depend on the timings; a large block timed under too small a limit would be killed instead).
                _plan_for(options, profile, cluster, world_size=world_size, precision=precision, say=lambda _: None,
                          device_type=device.type, held_by_model=module_bytes(module))
            if options.calibrates:
                say("[elixir] timing each distinct block on this device (cached after the first run) ...")
                start = time.perf_counter()
                profile = time_module_blocks(module, batch, profile, device=device, precision=precision,
                                             stage_method=method)
                blocks_s = time.perf_counter() - start
            planned_from.append((profile, cluster))
            plan = _plan_for(options, profile, cluster, world_size=world_size, precision=precision, say=say,
                             device_type=device.type, held_by_model=module_bytes(module))
            if options.calibrates:
                note = (f"calibrated on this hardware in {calibration_s + blocks_s:.1f} s (blocks {blocks_s:.1f} s, "
                        f"collectives and FSDP2 overheads {calibration_s:.1f} s; cached: a second run re-measures "
                        "nothing that did not change)")
                say(f"[elixir] {note}")
                plan = dataclasses.replace(plan, notes=(*plan.notes, note))
            return plan

        plan = decide_on_rank0(decide, encode=lambda plan: plan.to_json(), decode=ElixirPlan.from_json)
    profile, cluster = planned_from[0] if planned_from else (None, None)
    return PlanDecision(plan=plan, profile=profile, cluster=cluster)


def _cluster(options: ElixirOptions, measured: DeviceProfile | None, world_size: int,
             num_nodes: int) -> ClusterSpec | None:
    """The devices to plan for: the given cluster, else the given or measured device on every rank."""
    given = options.cluster
    assert given is None or isinstance(given, ClusterSpec)  # ElixirOptions resolved paths
    device = options.device_profile if isinstance(options.device_profile, DeviceProfile) else measured
    return given or (ClusterSpec.uniform(device, world_size, nodes=num_nodes) if device is not None else None)


def _with_disk_tier(options: ElixirOptions, cluster: ClusterSpec | None,
                    say: Callable[[str], None]) -> ClusterSpec | None:
    """The cluster with ``options.disk_dir`` measured as every device's disk tier (rank 0 only: the ranks of a node
    share the directory; ``profile_disk`` caches per filesystem). A device that already carries a disk profile
    (a given cluster) keeps it. Without ``disk_dir`` or a plan to search: unchanged."""
    if options.disk_dir is None or cluster is None or options.plan is not None:
        return cluster
    if all(getattr(d, "disk", None) is not None for d in cluster.devices):
        return cluster
    from tightfit.profiler import profile_disk

    say(f"[elixir] profiling the disk tier {options.disk_dir} (cached after the first run) ...")
    disk = profile_disk(options.disk_dir, quick=True, progress=False)
    return dataclasses.replace(cluster, devices=tuple(d if d.disk is not None else dataclasses.replace(d, disk=disk)
                                                      for d in cluster.devices))


def _plan_for(options: ElixirOptions, profile: ModelProfile, cluster: ClusterSpec | None, *, world_size: int,
              precision: str, say: Callable[[str], None], device_type: str = "cpu",
              held_by_model: int = 0) -> ElixirPlan:
    """Rank 0's decision: the given plan checked against this model and world, or core's search."""
    if options.plan is not None:
        plan = load_plan(options.plan)
        plan.check_compatible(profile, world_size, precision=precision)
        if plan.disk_units and options.disk_dir is None:
            raise ValueError(f"{options.owner}(plan=...) keeps the optimizer state of units {list(plan.disk_units)} "
                             "on disk, but no disk_dir was given: pass disk_dir='/path/on/nvme' (or re-plan without "
                             "a disk tier)")
        return plan
    assert cluster is not None
    if cluster.world_size != world_size:
        raise ValueError(f"{options.owner}(cluster=...) describes {cluster.world_size} devices, this run has "
                         f"{world_size} ranks; give one DeviceProfile per rank")
    say(f"[elixir] {profile.model}: {profile.param_numel / 1e6:,.2f} M parameters in {len(profile.blocks)} "
        f"blocks; searching a plan for {world_size} x {cluster.devices[0].name} ...")
    constraints = options.planner_constraints()
    if not options.measures_device:  # planning for a described cluster or device: its budgets as given
        return search(profile, cluster, optimizer=options.optimizer, precision=precision,
                      memory_budget=options.memory_budget, constraints=constraints, host_budget=options.host_budget)
    # Planning for this machine: the whole process within the memory it may use (the limit, on a CPU shared by the
    # device and the host), counting what it holds outside the plan as the reserve.
    reading = read_memory(settle=True)
    budget = process_budget(options.memory_budget, options.host_budget, device_type=device_type,
                            ranks_per_node=max(1, world_size // cluster.nodes), held_by_model=held_by_model,
                            reading=reading, reserved_given=constraints.reserved_bytes is not None)
    if budget.reserved_bytes is not None:
        constraints = dataclasses.replace(constraints, reserved_bytes=budget.reserved_bytes)
    if budget.source:
        say(f"[elixir] device budget {format_bytes(parse_bytes(budget.memory_budget))}: {budget.source}")
    try:
        plan = search(profile, cluster, optimizer=options.optimizer, precision=precision,
                      memory_budget=budget.memory_budget, constraints=constraints, host_budget=budget.host_budget)
    except PlanInfeasibleError as exc:
        if not reading.limited or isinstance(exc, MemoryLimitError):
            raise
        raise MemoryLimitError(f"{options.owner}: under the memory limit of {format_bytes(reading.capacity)} "
                               f"({reading.limit_file}): {exc}", needed_bytes=exc.needed_bytes,
                               budget_bytes=exc.budget_bytes, suggestions=exc.suggestions, tier=exc.tier) from None
    return dataclasses.replace(plan, budget_source=budget.source) if budget.source else plan


def _say(text: str) -> None:
    # Progress of planning (rank 0, verbose): the "lightning_elixir.planning" logger at INFO, so an
    # application routes or silences it like any other library's diagnostics.
    log.info(text)
