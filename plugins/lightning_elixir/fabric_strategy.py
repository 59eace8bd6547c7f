"""``ElixirFabricStrategy``: ``Fabric(strategy="elixir")``, the same plan search and runtime as the Trainer's.

Lightning has two front doors and two strategy base classes; this is Fabric's adapter, a thin one: the options are
:class:`~lightning_elixir.options.ElixirOptions` (the Trainer's :class:`~lightning_elixir.strategy.ElixirStrategy`
takes the very same), planning is :func:`lightning_elixir.planning.decide_plan`, and applying, stepping, the disk
tier and checkpoints are :mod:`lightning_elixir.engine`.

The profile. Fabric gives the strategy the model at ``fabric.setup_module`` (or ``fabric.setup``), before any batch;
the plan needs one step's profile, and the optimizer must be built over the parameters the plan places. So the
strategy is given an example of what the model's forward takes - ``ElixirFabricStrategy(example_input=...)`` (a
tensor, a tuple of arguments, a dict of keyword arguments, or a function returning one, called on rank 0 only) or
``model.example_input_array`` - and profiles ``model(example_input)`` on the meta device at setup, its output's loss
(``output.loss``, else the logits' sum) backpropagated. Nothing of the model is allocated for it: build the model
under ``fabric.init_module(empty_init=True)`` and the plan allocates each unit where it lives.

In the loop: ``fabric.backward(loss)``, ``optimizer.step()`` (offloaded and disk units step through
:class:`~lightning_elixir.step.ElixirOptimizer`), ``fabric.clip_gradients`` (norms across meshes, devices and the
disk tier), ``fabric.no_backward_sync(model)`` (an all-replicate plan skips the all-reduce until the last
micro-batch, as ``strategy="ddp"``; FSDP2 plans reduce-scatter every backward, as under the Trainer),
``fabric.save`` / ``fabric.load`` (sharded, atomic, verified, the disk tier's state streamed; the layout the
Trainer's checkpoints have, so ``python -m lightning_elixir.export`` reads them). ``precision=`` is Fabric's:
``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, priced into the plan; fp16 is ``plugins=[ElixirFabricPrecision()]``
(:class:`~lightning_elixir.precision.ElixirFabricPrecision`: Fabric's connector refuses the ``"16-mixed"`` flag).

A model on meta whose plan keeps parameters on disk (tier 3) is allocated one unit at a time into the optimizer's
disk tier, never whole in host memory (:func:`lightning_elixir.engine.streams_init`), so it is set up with
``fabric.setup(model, optimizer)``: Fabric's ``setup_optimizers`` refuses an optimizer over meta parameters.

Each ``fabric.backward`` starts a step of the predicted-vs-measured check (steps are counted in backwards). The first
``fabric.save`` writes the plan to ``plan.json`` beside the checkpoint (rank 0); with ``replan=True`` a re-plan from
steps off the prediction is applied right after the next ``fabric.save``, Fabric's checkpoint boundary, and written
to ``plan-replan.json`` beside ``plan.json`` (:mod:`lightning_elixir.replan`, shared with the Trainer).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_elixir._torch_adapter import set_backward_sync, setup_data_parallel_mesh
from lightning_elixir.apply import AppliedUnit, is_replicated, is_sharded
from lightning_elixir.clipping import clip_grad_norm_, clip_grad_value_
from lightning_elixir.disk_state import DiskOptimizerState
from lightning_elixir.engine import (
    READ_BACK_MARGIN,
    applied_text,
    apply_decided,
    attach_optimizers,
    check_before_load,
    check_step,
    close_disk_state,
    keep_or_refuse,
    load_into,
    make_replanner,
    materialize_streamed,
    register_presets,
    save_atomic,
    streams_init,
)
from lightning_elixir.options import ElixirOptions
from lightning_elixir.planning import FORWARD, decide_plan
from lightning_elixir.precision import ElixirGradScaler
from lightning_elixir.replan import PlanState, Replanner
from lightning_elixir.replicate import load_replicated, no_gradient_sync
from lightning_elixir.step import ElixirOptimizer
from tightfit.planner.check import PredictionRecord, StepMonitor
from tightfit.planner.elixir import ElixirConstraints, ElixirPlan
from tightfit.profiler.types import ClusterSpec, DeviceProfile
from tightfit.storage import return_large_frees

__all__ = ["ElixirFabricStrategy", "FABRIC_KEYS"]

# meta.pt's entry naming the user's keys of the model and optimizers (the shards are saved under the Trainer's names,
# ``state_dict`` and ``optimizer_<i>``).
FABRIC_KEYS = "elixir_fabric_keys"


def _not_called(module: nn.Module, mesh: Any) -> nn.Module:
    raise AssertionError("ElixirFabricStrategy applies its own plan (setup_module)")


class ElixirFabricStrategy(ModelParallelStrategy):
    """Search the fastest sharding x offloading x recomputation plan that fits, then run it under Fabric.

    Args:
        memory_budget / plan / offload / activation_checkpointing / optimizer / cluster / device_profile /
            constraints / host_budget / disk_dir / verbose / calibrate: as
            :class:`~lightning_elixir.strategy.ElixirStrategy` (one :class:`ElixirOptions`, validated once).
        example_input: what the model's forward takes, to profile one step before anything is allocated: a tensor,
            a tuple of arguments, a dict of keyword arguments or a function returning one (called on rank 0 only).
            ``None``: ``model.example_input_array``.
        process_group_backend / timeout: as Fabric's ``ModelParallelStrategy``.
        replan: as the Trainer's, with ``fabric.save`` the checkpoint boundary: when the steps after warm-up are off
            the prediction, rank 0 re-plans from the measurement and every rank switches to the new plan right after
            the next ``fabric.save`` (:mod:`lightning_elixir.replan`; :attr:`replanner` keeps the record).

    Precision: Fabric's ``precision=`` flag with ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"``; fp16 through
    ``plugins=[ElixirFabricPrecision()]`` (Fabric refuses the ``"16-mixed"`` flag for every ``ModelParallelStrategy``).
    A model on meta whose plan keeps parameters on disk is set up with ``fabric.setup(model, optimizer)`` (allocated
    one unit at a time into the disk tier). Each ``fabric.backward`` starts a step of the predicted-vs-measured check
    (:attr:`prediction`).

    Example:
        >>> import lightning as L, torch
        >>> import lightning_elixir  # registers "elixir" in both registries
        >>> fabric = L.Fabric(accelerator="cpu", devices=2, strategy=lightning_elixir.ElixirFabricStrategy(
        ...     memory_budget="6GiB", example_input=torch.zeros(4, 128, dtype=torch.long)))  # doctest: +SKIP
        >>> fabric.launch()  # doctest: +SKIP
        >>> model = fabric.setup_module(model)  # doctest: +SKIP
        >>> optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))  # doctest: +SKIP
    """

    strategy_name = "elixir"

    def __init__(self, memory_budget: int | float | str | None = None, plan: str | Path | ElixirPlan | None = None,
                 offload: str = "auto", activation_checkpointing: bool | str = "auto", optimizer: str = "adamw",
                 cluster: ClusterSpec | str | Path | None = None,
                 device_profile: DeviceProfile | str | Path | None = None,
                 constraints: ElixirConstraints | None = None, verbose: bool = True, calibrate: bool = True,
                 host_budget: int | str | None = None, disk_dir: str | Path | None = None,
                 example_input: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, replan: bool = False) -> None:
        self.options = ElixirOptions(memory_budget=memory_budget, plan=plan, offload=offload,
                                     activation_checkpointing=activation_checkpointing, optimizer=optimizer,
                                     cluster=cluster, device_profile=device_profile, constraints=constraints,
                                     verbose=verbose, replan=replan, calibrate=calibrate, host_budget=host_budget,
                                     disk_dir=disk_dir, owner="ElixirFabricStrategy")
        if self.options.host_budget is not None or self.options.disk_dir is not None:
            return_large_frees()  # as ElixirStrategy: a host bound is only kept if freed tensors leave the process
        super().__init__(parallelize_fn=_not_called, data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timeout)
        set_backward_sync(self, self._no_sync)
        self._accumulating = False  # inside fabric.no_backward_sync: this backward is not the step's last
        # Predicted vs measured (as the Trainer's): each fabric.backward starts a step (a batch, as the Trainer's
        # training_step); after warm-up the steps are timed against the plan and a record kept, a warning beyond
        # CHECK_TOLERANCE.
        self.monitor: StepMonitor | None = None
        self.prediction: PredictionRecord | None = None
        self._backwards = 0
        self.replanner: Replanner | None = None  # replan=True: the re-plan decided, applied at the next fabric.save
        self.plan_path: Path | None = None  # rank 0: plan.json, written beside the first checkpoint
        self.example_input = example_input
        self.plan: ElixirPlan | None = None
        self.units: list[AppliedUnit] = []
        self.runtime = ""  # "FSDP2" or "DDP" (an all-replicate plan), set at setup_module
        self.disk_state: DiskOptimizerState | None = None
        self._module: nn.Module | None = None
        self._optimizers: list[Optimizer] = []
        self._stepping: list[ElixirOptimizer] = []
        # fabric.setup(model, optimizer) of a model on meta with tier-3 units: its allocation waits for the
        # optimizer's disk tier (setup_module -> setup_optimizer, in one call).
        self._streamed_init = False
        self._left_on_disk: str | None = None  # after teardown: why tier-3 weights stayed in the store

    # ---- processes and mesh ------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # the accelerator on this rank's device
        setup_data_parallel_mesh(self)  # one data-parallel dimension: Elixir shards, offloads and recomputes

    # ---- plan and apply ----------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._setup_module(module, optimizer_follows=False)

    def _setup_module(self, module: nn.Module, *, optimizer_follows: bool) -> nn.Module:
        if self._module is not None:
            raise ValueError(f"ElixirFabricStrategy.setup_module({type(module).__name__}): a model was already set "
                             "up; the plan is made for one model - set up one per Fabric")
        if is_replicated(module) or any(is_sharded(m) for m in module.modules()):
            raise ValueError(f"ElixirFabricStrategy.setup_module({type(module).__name__}): the model is already "
                             "sharded or replicated; pass the plain model and let the plan apply FSDP2")
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None and not isinstance(scaler, ElixirGradScaler):
            raise ValueError(f"ElixirFabricStrategy with {type(self.precision).__name__}(precision='16-mixed') and a "
                             f"{type(scaler).__name__}: it checks only this rank's gradient shards, so ranks could skip "
                             "different steps; pass plugins=[lightning_elixir.ElixirFabricPrecision()] instead")
        example = self.example_input
        if example is None and getattr(module, "example_input_array", None) is None:
            raise ValueError(f"ElixirFabricStrategy cannot profile {type(module).__name__}: no example input; give "
                             "ElixirFabricStrategy(example_input=torch.zeros(batch, seq, dtype=torch.long)) (one "
                             "batch of what its forward takes) or set model.example_input_array")
        precision = str(getattr(self.precision, "precision", "32-true"))
        decision = decide_plan(self.options, module, first_batch=lambda: example() if callable(example) else example,
                               method=FORWARD, precision=precision, device=self.root_device,
                               world_size=self.world_size, num_nodes=self.num_nodes, rank=self.global_rank)
        self.plan = decision.plan
        self.replanner = make_replanner(self.options, decision)
        # A model built on meta whose plan keeps parameters on disk (tier 3) is allocated and initialised once the
        # optimizer's disk tier is attached (setup_optimizer), one unit at a time, never whole in host memory.
        self._streamed_init = streams_init(self.plan, self.options) and any(p.is_meta for p in module.parameters())
        if self._streamed_init and not optimizer_follows:
            raise ValueError(f"ElixirFabricStrategy.setup_module({type(module).__name__}): the plan keeps the "
                             f"parameters of units {list(self.plan.param_disk_units)} on disk, allocated from the meta "
                             "device into the optimizer's disk tier, and Fabric refuses an optimizer over meta "
                             "parameters in setup_optimizers: set both up together, model, optimizer = "
                             "fabric.setup(model, optimizer)")
        self.runtime, self.units = apply_decided(module, self.plan, self.device_mesh, device=self.root_device,
                                                 options=self.options, defer_materialize=self._streamed_init)
        if self.is_global_zero and self.options.verbose:
            print(applied_text(self.plan, module, self.runtime), flush=True)
        self.barrier()
        self._module = module
        return module

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: the optimizers, built over the plain model's parameters, are pointed
        at the parameters the plan placed (same names) before they have state."""
        names = {id(p): n for n, p in module.named_parameters()}
        for opt in optimizers:
            if opt.state:
                raise ValueError(f"fabric.setup(model, {type(opt).__name__}): the optimizer has state already; set it "
                                 "up before its first step, or load its state after setup (fabric.load)")
            if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
                raise ValueError(f"fabric.setup(model, {type(opt).__name__}): the optimizer holds parameters that are "
                                 "not the model's; build it from model.parameters()")
        module = self._setup_module(module, optimizer_follows=bool(optimizers))
        placed = dict(module.named_parameters())
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [placed[names[id(p)]] for p in group["params"]]
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None:
            raise ValueError("ElixirFabricStrategy.setup_optimizer: set the model up first (fabric.setup_module("
                             "model)), then build the optimizer from its parameters")
        if self.disk_state is not None or (self._optimizers and self.plan is not None and self.plan.disk_units):
            raise ValueError("ElixirFabricStrategy: the plan keeps optimizer state on disk, which one optimizer "
                             "streams; set up a single optimizer (param groups for different settings)")
        disk, stepping = attach_optimizers(self._module, self.plan, self.units, [optimizer], self.options,
                                           rank=self.global_rank, device=self.root_device, norm_type=2.0,
                                           precision=str(getattr(self.precision, "precision", "32-true")))
        self.disk_state = self.disk_state or disk
        self._stepping += stepping
        self._optimizers.append(optimizer)
        if self._streamed_init:
            materialize_streamed(self._module, self.units, self.root_device, self.disk_state)
            self._streamed_init = False
        return optimizer

    # ---- backward and the step ---------------------------------------------------------------------
    @contextmanager
    def _no_sync(self, module: nn.Module) -> Generator[None, None, None]:
        before, self._accumulating = self._accumulating, True
        try:
            with no_gradient_sync(module):
                yield
        finally:
            self._accumulating = before

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Fabric's backward; one outside ``fabric.no_backward_sync`` is the step's last, so where the plan keeps
        gradients on disk (tier 4) each unit's are written behind its backward and dropped, as the Trainer's closure
        marks them (:attr:`lightning_elixir.disk_grads.DiskGradients.final`)."""
        self._check_prediction()
        grads = self.disk_state.grads if self.disk_state is not None else None
        if grads is None or self._accumulating:
            return super().backward(tensor, module, *args, **kwargs)
        grads.final = True
        try:
            return super().backward(tensor, module, *args, **kwargs)
        finally:
            grads.final = False

    def _plan_state(self) -> PlanState | None:
        return None if self.plan is None else PlanState(plan=self.plan, units=tuple(self.units))

    def _check_prediction(self) -> None:
        # What tightfit.planner.check reads of a Trainer: the rank that reports, the step (fabric.backward calls so
        # far), no logger (Fabric's loggers are the loop's; the record is self.prediction, its metrics
        # record.metrics()).
        view = SimpleNamespace(global_rank=self.global_rank, global_step=self._backwards, logger=None)
        self._backwards += 1
        self.monitor, record = check_step(self.monitor, self._plan_state(), self.replanner, view,
                                          device=self.root_device, verbose=self.options.verbose,
                                          rank_zero=self.is_global_zero, broadcast=self.broadcast)
        if record is not None:
            self.prediction = record

    # ---- the step -----------------------------------------------------------------------------------
    def _stepping_of(self, optimizer: Any) -> Any:
        return next((s for s in self._stepping if s.optimizer is optimizer), optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's step, handed to the precision plugin with the optimizer as Elixir steps it (one param group per
        (mesh, device), then the disk units chunk by chunk: :class:`~lightning_elixir.step.ElixirOptimizer`)."""
        return self.precision.optimizer_step(self._stepping_of(optimizer), **kwargs)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """The norm over every unit, whatever mesh, device or disk it lives on (:func:`clipping.clip_grad_norm_`)."""
        self.precision.unscale_gradients(self._stepping_of(optimizer))  # the optimizer the scaler then steps
        norm = clip_grad_norm_(self.precision.main_params(optimizer), float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({norm.item()}); "
                               "pass error_if_nonfinite=False to clip anyway")
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(self._stepping_of(optimizer))
        clip_grad_value_(self.precision.main_params(optimizer), float(clip_val))

    # ---- checkpoints ------------------------------------------------------------------------------
    def _split(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        """The key of the model this strategy set up and the keys of its optimizers, in order."""
        models = [k for k, v in state.items() if isinstance(v, nn.Module)]
        if self._module is None or [k for k in models if state[k] is self._module] != models or len(models) != 1:
            raise ValueError(f"ElixirFabricStrategy: the checkpoint state {sorted(state)} must hold the model set up "
                             "with this strategy, once, and no other module: state={'model': model, ...}")
        return models[0], [k for k, v in state.items() if isinstance(v, Optimizer)]

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """A sharded ``torch.distributed.checkpoint`` directory, written atomically, the disk tier streamed."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if self._left_on_disk is not None:
            raise RuntimeError(f"cannot checkpoint: {self._left_on_disk}; fabric.save before the teardown")
        if storage_options is not None or filter is not None:
            raise ValueError("ElixirFabricStrategy.save_checkpoint(storage_options=/filter=): not supported; "
                             "checkpoints are whole sharded directories - leave both out")
        model_key, optimizer_keys = self._split(state)
        for s in self._stepping:
            s.init_state()  # an optimizer without state gets it through its Elixir step, not a plain one
        module = self._module
        assert module is not None
        options = StateDictOptions(cpu_offload=True)
        shards: dict[str, Any] = {"state_dict": get_model_state_dict(module, options=options)}
        shards.update({f"optimizer_{i}": get_optimizer_state_dict(module, state[k], options=options)
                       for i, k in enumerate(optimizer_keys)})
        metadata = {k: v.state_dict() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict") else v
                    for k, v in state.items() if k != model_key and k not in optimizer_keys}
        metadata[FABRIC_KEYS] = {"model": model_key, "optimizers": optimizer_keys}
        target = Path(self.broadcast(str(path)))
        save_atomic(shards, metadata, target, disk=self.disk_state, rank=self.global_rank, barrier=self.barrier,
                    broadcast=self.broadcast)
        if self.is_global_zero and self.plan_path is None and self.plan is not None:
            self.plan_path = target.parent / "plan.json"  # the plan the run started with, as the Trainer's log dir has
            self.plan.to_json(self.plan_path)
        current = self._plan_state()
        if self.replanner is not None and self.replanner.pending is not None and current is not None:
            # The checkpoint boundary: the state just written is valid under both plans (lightning_elixir.replan).
            switched = self.replanner.apply(module, current, step=self._backwards, boundary="checkpoint",
                                            rank_zero=self.is_global_zero, plan_path=self.plan_path)
            if switched is not None:
                self.plan, self.units = switched.plan, list(switched.units)
                self.monitor = None  # the new plan's prediction is checked against its own steps

    @override
    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint :meth:`save_checkpoint` wrote into ``state`` (the model, its optimizers, the rest in
        place); returns what ``state`` did not ask for."""
        if not isinstance(state, dict):
            raise ValueError(f"ElixirFabricStrategy.load_checkpoint(state={type(state).__name__}): give the dict "
                             "fabric.save was given, e.g. {'model': model, 'optimizer': optimizer, 'step': 0}")
        model_key, optimizer_keys = self._split(state)
        module = self._module
        assert module is not None
        target = Path(self.broadcast(str(path)))
        check_before_load(target, rank=self.global_rank, broadcast=self.broadcast)
        optimizers = [state[k] for k in optimizer_keys]
        # The directory holds the model under "state_dict" and each optimizer under "optimizer_<i>": read with
        # torch.distributed.checkpoint, resharded to this plan whichever plan (or Trainer) saved it.
        metadata = load_into(target, module, optimizers, disk=self.disk_state, stepping=self._stepping,
                             strict=strict, weights_only=weights_only,
                             otherwise=lambda: load_replicated(target, module, optimizers, strict=strict,
                                                               weights_only=weights_only))
        saved = metadata.pop(FABRIC_KEYS, {"optimizers": optimizer_keys})
        if strict and list(saved["optimizers"]) != optimizer_keys:
            raise KeyError(f"the checkpoint holds optimizers {saved['optimizers']}, state asks for {optimizer_keys}; "
                           "give the same keys, or strict=False")
        for key in state.keys() - {model_key, *optimizer_keys}:
            if key not in metadata:
                if strict:
                    raise KeyError(f"{key!r} is not in the checkpoint (it holds {sorted(metadata)}); drop it from "
                                   "state, or strict=False")
                continue
            value = metadata.pop(key)
            if hasattr(state[key], "load_state_dict") and hasattr(state[key], "state_dict"):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return metadata

    @override
    def teardown(self) -> None:
        """Close the disk tier (its weights read back into the module, a failed write raised). Fabric never calls
        a strategy's teardown: a loop with ``disk_dir`` ends with ``fabric.strategy.teardown()``."""
        state, self.disk_state = self.disk_state, None
        self._stepping = []
        try:
            if state is not None:
                close_disk_state(state, read_back=self._read_back)
        finally:
            # Strategy.teardown without its CheckpointIO, which Fabric's ModelParallelStrategy does not have.
            if self.cluster_environment is not None:
                self.cluster_environment.teardown()
            self.precision.teardown()
            if self.accelerator is not None:
                self.accelerator.teardown()

    def _read_back(self, state: DiskOptimizerState) -> bool:
        """At teardown: whether the tier-3 weights come back into the module (they fit the host memory left, with
        READ_BACK_MARGIN to spare, as under the Trainer); otherwise they stay in the store and this says so once."""
        assert self._module is not None
        self._left_on_disk = keep_or_refuse(
            self._module, state, READ_BACK_MARGIN,
            warning="The module cannot run or be saved now; to keep the trained weights, fabric.save before "
                    "fabric.strategy.teardown() (it streams them from the store)",
            refusal="fabric.load a checkpoint saved before the teardown, or train with more host memory free at the "
                    "end")
        return self._left_on_disk is None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_presets(strategy_registry, cls)
