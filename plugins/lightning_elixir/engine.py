"""What both Lightning front doors run once a plan is decided: apply it, step it, checkpoint it.

``Trainer(strategy="elixir")`` (:class:`~lightning_elixir.strategy.ElixirStrategy`) and
``Fabric(strategy="elixir")`` (:class:`~lightning_elixir.fabric_strategy.ElixirFabricStrategy`) are thin adapters:
each gathers what its host framework gives (the module, the first batch or an example input, the optimizers, the
precision flag) and calls these functions, which take plain values and never a strategy:

* :func:`apply_decided` - the plan onto the module: DDP's reducer for an all-replicate plan, FSDP2 otherwise;
* :func:`attach_optimizers` - the disk tier (when the plan has one) and the :class:`ElixirOptimizer` each optimizer
  steps through;
* :func:`streams_init` / :func:`materialize_streamed` - a model built on meta whose plan keeps parameters on disk
  (tier 3) allocated and initialised once the disk tier is attached, one unit at a time, never whole in memory;
* :func:`save_atomic` / :func:`check_before_load` / :func:`load_into` - sharded, atomic, verified checkpoints
  with the disk tier's state streamed;
* :func:`keep_or_refuse` / :func:`close_disk_state` - the disk tier's end of run (tier-3 weights read back into the
  module only where they fit);
* :func:`make_replanner` / :func:`check_step` - the predicted-vs-measured step check and, with ``replan=True``, the
  re-plan decided on its record (:mod:`lightning_elixir.replan`; each front door applies it at its checkpoint
  boundary with :meth:`~lightning_elixir.replan.Replanner.apply`).

Planning itself is :func:`lightning_elixir.planning.decide_plan`; the options both take are
:class:`~lightning_elixir.options.ElixirOptions`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_elixir.apply import AppliedUnit, apply_plan, describe_units, is_replicated, materialize
from lightning_elixir.checkpoint import CheckpointCorruptError, atomic_save, recover, verify_checkpoint
from lightning_elixir.disk_attach import attach_disk_state
from lightning_elixir.disk_checkpoint import DiskSavePlanner, load_sharded
from lightning_elixir.disk_state import DiskOptimizerState
from lightning_elixir.optim import splits_by_mesh
from lightning_elixir.options import ElixirOptions
from lightning_elixir.planning import PlanDecision
from lightning_elixir.replan import PlanState, Replanner
from lightning_elixir.replicate import apply_replicated, load_replicated, replicates_everything
from lightning_elixir.step import ElixirOptimizer
from tightfit.console import fit_text
from tightfit.planner.check import PredictionRecord, StepMonitor, make_monitor, on_step_start
from tightfit.planner.elixir import ElixirPlan
from tightfit.profiler.host_memory import host_available_bytes

# At the end of a run, tier-3 weights are read back into the module only with this much more host memory free than
# they take (:func:`left_on_disk`).
READ_BACK_MARGIN = 1.25

# Predicted vs measured: the first steps after warm-up are timed against the plan (tightfit.planner.check); a
# measured step off the prediction by more than this fraction warns (and, with replan=True, re-plans).
CHECK_TOLERANCE = 0.25

__all__ = ["READ_BACK_MARGIN", "CHECK_TOLERANCE", "register_presets", "apply_decided", "applied_text", "attach_optimizers", "fused_on_host", "save_atomic",
           "check_before_load", "load_into", "close_disk_state", "streams_init", "materialize_streamed", "left_on_disk", "keep_or_refuse",
           "refuse_forward", "make_replanner", "check_step"]


def streams_init(plan: ElixirPlan, options: ElixirOptions) -> bool:
    """Whether the module's allocation waits for the disk tier: a plan that keeps parameters on disk (tier 3), run
    on FSDP2 with a ``disk_dir``. Apply it with ``defer_materialize=True``, attach the optimizer, then
    :func:`materialize_streamed` (a module not on meta is left as it is)."""
    return bool(plan.param_disk_units) and options.disk_dir is not None and not replicates_everything(plan)


def materialize_streamed(module: nn.Module, units: list[AppliedUnit], device: torch.device,
                         disk: DiskOptimizerState | None) -> None:
    """Allocate and initialise the meta parameters that :func:`apply_decided` left (``defer_materialize``): the
    tier-3 units one at a time into the store (:func:`lightning_elixir.apply.materialize` with ``streamed``), the
    others where they live."""
    materialize(module, units, device, streamed=disk.master if disk is not None else None)


def apply_decided(module: nn.Module, plan: ElixirPlan, mesh: Any, *, device: torch.device, options: ElixirOptions,
                  defer_materialize: bool = False) -> tuple[str, list[AppliedUnit]]:
    """Apply ``plan``; returns how it runs (``"DDP"`` or ``"FSDP2"``) and its units.

    The plan decided; this picks the machinery that runs its decision: an all-replicate plan is data parallelism,
    run with DDP's reducer (re-planning needs FSDP2 units that can change mode). ``defer_materialize``: FSDP2 only,
    leave the meta parameters for the caller to allocate (the disk tier's streamed initialisation)."""
    if replicates_everything(plan) and not options.replan:
        return "DDP", apply_replicated(module, plan, mesh, device=device)
    return "FSDP2", apply_plan(module, plan, mesh, device=device, switchable=options.replan,
                               defer_materialize=defer_materialize)


def applied_text(plan: ElixirPlan, module: nn.Module, runtime: str) -> str:
    """The plan's table (wrapped to the terminal) and what was applied, as rank 0 prints them."""
    how = "DDP (every unit replicated: composable replicate)" if runtime == "DDP" else "FSDP2 groups as they run"
    return fit_text(plan.explain()) + f"\n\napplied ({how}):\n" + describe_units(module)


def fused_on_host(device: torch.device, units: Sequence[AppliedUnit]) -> bool:
    """Whether, on a GPU, offloaded units' host buckets of Adam/AdamW step with torch's fused CPU kernel when the
    user did not choose (:func:`lightning_elixir.optim.mesh_step`)."""
    return device.type == "cuda" and any(u.plan.offload for u in units)


def attach_optimizers(module: nn.Module, plan: ElixirPlan | None, units: Sequence[AppliedUnit],
                      optimizers: Sequence[torch.optim.Optimizer], options: ElixirOptions, *, rank: int,
                      device: torch.device, norm_type: float | None, precision: str,
                      chunk_elements: int | None = None) -> tuple[DiskOptimizerState | None, list[ElixirOptimizer]]:
    """The disk tier of ``plan`` over the run's optimizer (``None``: no unit on disk) and the :class:`ElixirOptimizer`
    of every optimizer that needs one (parameters on several meshes or devices, or a disk tier); the others step
    as they are."""
    fused = fused_on_host(device, units)
    chunk = {"chunk_elements": chunk_elements} if chunk_elements else {}
    disk = attach_disk_state(module, plan, units, optimizers, options.disk_dir, rank=rank, norm_type=norm_type,
                             precision=precision, fused_on_host=fused, **chunk)
    stepping = [ElixirOptimizer(opt, fused_on_host=fused, disk=disk if disk is not None and disk.optimizer is opt
                                else None)
                for opt in optimizers if splits_by_mesh(opt) or disk is not None]
    if disk is not None and rank == 0 and options.verbose:
        print(f"[elixir] optimizer state of units {list(disk.lengths)} streamed from {disk.store.path} (rank 0), "
              f"{len(disk.chunks)} chunks a step", flush=True)
    return disk, stepping


def save_atomic(state: dict[str, Any], metadata: dict[str, Any], path: Path, *, disk: DiskOptimizerState | None,
                rank: int, barrier: Callable[[], None], broadcast: Callable[[Any], Any]) -> None:
    """Save the model / optimizer state dicts (sharded) and ``metadata`` atomically, the disk tier's state streamed
    from its store (collective)."""
    planner = DiskSavePlanner(disk) if disk is not None else None
    atomic_save(state, metadata, path, rank=rank, barrier=barrier, broadcast=broadcast, planner=planner)


def check_before_load(path: Path, *, rank: int, broadcast: Callable[[Any], Any]) -> None:
    """Put back a checkpoint a crashed save left aside and verify its checksums on rank 0; every rank raises
    :class:`CheckpointCorruptError` together when it does not match (collective)."""
    problem = None
    if rank == 0:
        recover(path)
        try:
            verify_checkpoint(path)  # rank 0 re-hashes every shard; all ranks then agree to fail or load
        except ValueError as err:
            problem = str(err)
    problem = broadcast(problem)
    if problem is not None:
        raise CheckpointCorruptError(problem)


def load_into(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *,
              disk: DiskOptimizerState | None, stepping: Sequence[ElixirOptimizer], strict: bool,
              weights_only: bool | None, otherwise: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Load a checkpoint saved under the keys ``state_dict`` and ``optimizer_<i>`` into an applied module; returns
    its metadata. The disk units' optimizer state goes from the checkpoint to the store item by item; a module run
    as DDP reads the whole state on every rank; an FSDP2 module without a disk tier loads through ``otherwise``
    (the host framework's own loader)."""

    def init_state() -> None:
        # Optimizers without state get it through their Elixir step before torch's state-dict helpers would
        # initialise it with a plain step (ElixirOptimizer.init_state).
        for s in stepping:
            s.init_state()

    if disk is not None and path.is_dir():
        return load_sharded(path, module, optimizers[0], disk, strict=strict, weights_only=weights_only,
                            init_state=init_state)
    init_state()
    if is_replicated(module):
        return load_replicated(path, module, optimizers, strict=strict, weights_only=weights_only)
    return otherwise()


def left_on_disk(state: DiskOptimizerState, margin: float) -> str | None:
    """At the end of the run: ``None`` when the tier-3 units' weights fit the host memory left (``margin`` times
    their bytes free) and can come back into the module; otherwise why they stay in the store, in one sentence."""
    master = state.master
    if master is None:
        return None
    need, free = master.held_bytes(), host_available_bytes()
    if free is None or need * margin <= free:
        return None
    return (f"the fp32 weights of units {list(master.order)} ({need / 2**30:.2f} GiB on this rank) stay in "
            f"{state.store.path}, not read back into the module after training: this host has {free / 2**30:.2f} GiB "
            "free")


def refuse_forward(module: nn.Module, state: DiskOptimizerState, message: str) -> None:
    """Make every submodule holding a tier-3 parameter raise ``RuntimeError(message)`` at its forward (its weights
    stayed in the store: :func:`left_on_disk`)."""
    assert state.master is not None
    owned = {id(p) for u in state.master.units for p, _, _ in u.pieces}

    def refuse(*_: Any) -> None:
        raise RuntimeError(message)

    for m in module.modules():
        if any(id(p) in owned for p in m.parameters(recurse=False)):
            m.register_forward_pre_hook(refuse)


def keep_or_refuse(module: nn.Module, state: DiskOptimizerState, margin: float, *, warning: str,
                   refusal: str) -> str | None:
    """At the end of the run, for both front doors: ``None`` when the tier-3 weights can come back into the module
    (:func:`left_on_disk`); otherwise why not, said once as a warning (``warning`` tells how to keep the weights),
    and the module made to refuse its forward (``refusal`` tells how to run it again)."""
    reason = left_on_disk(state, margin)
    if reason is not None:
        warnings.warn(f"[elixir] {reason}. {warning}", stacklevel=3)
        refuse_forward(module, state, f"{reason}: their parameters do not hold them. {refusal}")
    return reason


def close_disk_state(state: DiskOptimizerState, *, read_back: Callable[[DiskOptimizerState], bool]) -> None:
    """End the disk tier: its hooks removed, the tier-3 weights read back when ``read_back(state)`` says they fit, a
    write that failed (disk full) raised once the hooks are gone, the store closed."""
    try:
        state.close(read_back=read_back(state))
    finally:
        state.store.close()


#: The names ``Trainer(strategy=...)`` and ``Fabric(strategy=...)`` both take: (name, description, options).
PRESETS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("elixir", "Elixir: searched FSDP2 sharding x offload x recompute", {}),
    ("elixir_offload", "Elixir with every unit offloaded to the host", {"offload": "all"}),
    ("elixir_no_offload", "Elixir without host offloading", {"offload": "none"}),
    ("elixir_checkpoint", "Elixir with every block recomputed", {"activation_checkpointing": True}),
)


def register_presets(registry: Any, cls: type) -> None:
    """Register :data:`PRESETS` for ``cls`` in a Lightning strategy registry (the Trainer's or Fabric's)."""
    for name, description, options in PRESETS:
        registry.register(name, cls, description=description, **options)


def make_replanner(options: ElixirOptions, decision: PlanDecision) -> Replanner | None:
    """The run's :class:`~lightning_elixir.replan.Replanner` when ``options.replan`` (``None`` otherwise), searching
    from the profile and cluster the running plan was decided from."""
    if not options.replan:
        return None
    return Replanner(decision.profile, decision.cluster, options.memory_budget, options.planner_constraints())


def check_step(monitor: StepMonitor | None, state: PlanState | None, replanner: Replanner | None, view: Any, *,
               device: torch.device, verbose: bool, rank_zero: bool, broadcast: Callable[[Any], Any],
               epoch: int = 0) -> tuple[StepMonitor | None, PredictionRecord | None]:
    """A step starts: tell the predicted-vs-measured monitor (made for ``state.plan`` when ``monitor`` is ``None``);
    when its record is ready, ``replanner`` decides on it. ``view`` is what :func:`tightfit.planner.check.on_step_start`
    reads of a trainer (``global_rank``, ``global_step``, ``logger``). Returns the monitor and the record (``None``
    until it is ready). Collective with a ``replanner``: every rank's record arrives at the same step."""
    if state is not None and monitor is None:
        monitor = make_monitor(state.plan, device, tolerance=CHECK_TOLERANCE)
    record = on_step_start(monitor, view, verbose=verbose)
    if record is not None and replanner is not None and state is not None:
        replanner.decide(state, record, step=int(getattr(view, "global_step", 0)), epoch=epoch, rank_zero=rank_zero,
                         broadcast=broadcast)
    return monitor, record
