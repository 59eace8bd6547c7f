"""``ElixirStrategy``: ``Trainer(strategy="elixir")`` profiles the model, searches a plan and trains it on FSDP2.

At ``setup`` (after ``configure_model``, which runs on the meta device: nothing is allocated) the
strategy profiles one ``training_step`` of the first batch on meta, measures this device (cached),
searches on rank 0, broadcasts the plan, prints its table, writes ``plan.json`` into the log
directory and applies it with :func:`lightning_elixir.apply.apply_plan`. Everything after is
Lightning's ``ModelParallelStrategy`` machinery (FSDP2 state dicts, distributed checkpoints,
collectives), with atomic checkpoint saves (:mod:`lightning_elixir.checkpoint`). A plan that replicates every
unit on the device and recomputes nothing is data parallelism and runs with DDP semantics instead of FSDP2
(:mod:`lightning_elixir.replicate`; :attr:`ElixirStrategy.runtime` says which ran), at ``strategy="ddp"``'s cost.

Precision follows the Trainer's and the plan is priced for it: ``"32-true"``; ``"bf16-mixed"`` (FSDP2
computes in bf16 and reduce-scatters in fp32, fp32 master weights); ``"bf16-true"`` (bf16 weights);
``"16-mixed"`` (fp16 compute, fp32 reduce-scatter and master weights, dynamic loss scaling that every
rank agrees on, its state in the checkpoints: :mod:`lightning_elixir.precision`, which Lightning's
``ModelParallelStrategy`` itself does not offer).

Fabric's front door, ``Fabric(strategy="elixir")``, is :class:`~lightning_elixir.fabric_strategy.ElixirFabricStrategy`:
the same :class:`~lightning_elixir.options.ElixirOptions`, planning and runtime (:mod:`lightning_elixir.engine`).

Presets registered in ``StrategyRegistry``: ``elixir`` (search everything), ``elixir_offload``
(every unit offloaded), ``elixir_no_offload``, ``elixir_checkpoint`` (every block recomputed),
``elixir_deepspeed`` (the plan translated to DeepSpeed ZeRO; :mod:`lightning_elixir.deepspeed_backend`).
"""

from __future__ import annotations

import warnings
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_elixir._torch_adapter import redirect_step, setup_data_parallel_mesh
from lightning_elixir.apply import AppliedUnit, is_replicated, is_sharded
from lightning_elixir.disk_attach import clips_by_norm
from lightning_elixir.disk_state import DiskOptimizerState
from lightning_elixir.engine import (
    CHECK_TOLERANCE,
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
from lightning_elixir.planning import PlanDecision, decide_plan, example_batch, stage_method
from lightning_elixir.precision import ElixirPrecision, admit_fp16_flag, with_mesh_clipping
from lightning_elixir.replan import PlanState, Replanner
from lightning_elixir.replicate import no_gradient_sync
from lightning_elixir.step import ElixirOptimizer
from tightfit.planner.check import PredictionRecord, StepMonitor
from tightfit.planner.elixir import ElixirConstraints, ElixirPlan
from tightfit.profiler.types import ClusterSpec, DeviceProfile
from tightfit.storage import return_large_frees

__all__ = ["ElixirStrategy", "CHECK_TOLERANCE"]


class ElixirStrategy(ModelParallelStrategy):
    """Search the fastest sharding x offloading x recomputation plan that fits, then train it on FSDP2.

    Args:
        memory_budget: per-device memory the plan may use: bytes, ``"20GiB"``, a fraction of the
            device's memory (``0.8``) or ``None`` for all of it.
        plan: ``None`` (search at fit start), a plan file written by ``tightfit plan elixir --json``
            or an :class:`ElixirPlan`; a given plan is checked against this model and world size.
        backend: deprecated, leave it out: this strategy always runs FSDP2 (``"fsdp2"`` is accepted with a
            ``DeprecationWarning``); the DeepSpeed backend is its own class,
            :class:`~lightning_elixir.deepspeed_backend.ElixirDeepSpeedStrategy` (``strategy="elixir_deepspeed"``),
            and ``backend="deepspeed"`` raises an error saying so.
        offload: ``"auto"`` (the search decides per unit), ``"none"`` or ``"all"``.
        activation_checkpointing: ``"auto"`` (the search decides per block), ``True`` (every block) or ``False``.
        optimizer: the optimizer the plan prices (``"adamw"``, ``"adam"``, ``"sgd"``, ``"adagrad"`` ...);
            the one ``configure_optimizers`` returns is used unchanged.
        cluster: the devices to plan for instead of measuring this one (a ``ClusterSpec`` or its JSON path).
        device_profile: the device to plan for instead of measuring this one (a ``DeviceProfile``, its JSON
            path, or a datasheet preset name such as ``"a100-40g"``).
        constraints: limits on the search (:class:`ElixirConstraints`).
        verbose: print the plan table and what was applied (rank 0).
        replan: when the steps after warm-up are off the prediction by more than :data:`CHECK_TOLERANCE`, re-plan
            from the measurement and switch to the new plan at the next checkpoint boundary (after the next
            checkpoint is saved, or at the next epoch's first step): :mod:`lightning_elixir.replan`.
        calibrate: ``True`` (default): when planning for this machine, time the first batch's blocks and fit
            the collectives and FSDP2's overheads here, cached for the next run, so the plan is priced from
            measurements; ``False``: from FLOPs / rate. The plan's ``cost_model`` says which priced it.
        process_group_backend: as Lightning's ``ModelParallelStrategy``.
        timeout: as Lightning's ``ModelParallelStrategy``.
        host_budget: host memory per rank for offloaded state (``"4GiB"``; ``None``: what the host has).
        disk_dir: a directory on a local SSD/NVMe for the disk tier (``None``: none). Units the plan puts there
            keep their fp32 optimizer state in a :class:`tightfit.storage.TensorStore` under
            ``<disk_dir>/rank<r>``, streamed through a fixed staging area in each optimizer step
            (:mod:`lightning_elixir.disk_state`); checkpoints stream it too.

    The options are validated once into :attr:`options` (:class:`~lightning_elixir.options.ElixirOptions`).
    Every one is a typed keyword argument, so ``LightningCLI`` and YAML configs can set them
    (``--trainer.strategy=lightning_elixir.ElixirStrategy --trainer.strategy.memory_budget=6GiB``).

    Precision: ``Trainer(precision=...)`` with ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or
    ``"16-mixed"`` (:class:`~lightning_elixir.precision.ElixirPrecision`: FSDP2
    ``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``, loss scaling whose inf/nan
    check covers every rank's gradient shards; pass ``plugins=[ElixirPrecision(init_scale=...)]`` to tune it).

    Example:
        >>> import lightning as L
        >>> import lightning_elixir  # registers "elixir"
        >>> trainer = L.Trainer(strategy="elixir", devices=2, accelerator="cpu", max_steps=10)  # doctest: +SKIP
        >>> trainer = L.Trainer(strategy=lightning_elixir.ElixirStrategy(memory_budget="20GiB"))  # doctest: +SKIP
        >>> lightning_elixir.ElixirStrategy(memory_budget="20GiB", host_budget="4GiB",
        ...                                 disk_dir="/nvme/tightfit")  # doctest: +SKIP
    """

    strategy_name = "elixir"
    # The disk tier's chunk (elements per state tensor per staging set; ``None``: sized by ``attach_disk_state``).
    # Not an option: tests lower it on an instance before fit to get many chunks from a small model.
    _disk_chunk_elements: int | None = None

    def __init__(self, memory_budget: int | float | str | None = None, plan: str | Path | ElixirPlan | None = None,
                 backend: str | None = None, offload: str = "auto", activation_checkpointing: bool | str = "auto",
                 optimizer: str = "adamw", cluster: ClusterSpec | str | Path | None = None,
                 device_profile: DeviceProfile | str | Path | None = None,
                 constraints: ElixirConstraints | None = None, verbose: bool = True, replan: bool = False,
                 calibrate: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, host_budget: int | str | None = None,
                 disk_dir: str | Path | None = None) -> None:
        if backend == "deepspeed":
            raise ValueError("ElixirStrategy(backend='deepspeed'): the DeepSpeed backend is its own strategy; use "
                             "lightning_elixir.ElixirDeepSpeedStrategy(...) or Trainer(strategy='elixir_deepspeed')")
        if backend not in (None, "fsdp2"):
            raise ValueError(f"ElixirStrategy(backend={backend!r}): leave backend out (it runs 'fsdp2'); for "
                             "'deepspeed' use ElixirDeepSpeedStrategy or strategy='elixir_deepspeed'")
        if backend is not None:
            warnings.warn("ElixirStrategy(backend='fsdp2') is deprecated: the strategy always runs FSDP2; leave "
                          "backend out", DeprecationWarning, stacklevel=2)
        self.options = ElixirOptions(memory_budget=memory_budget, plan=plan, offload=offload,
                                     activation_checkpointing=activation_checkpointing, optimizer=optimizer,
                                     cluster=cluster, device_profile=device_profile, constraints=constraints,
                                     verbose=verbose, replan=replan, calibrate=calibrate, host_budget=host_budget,
                                     disk_dir=disk_dir, owner="ElixirStrategy")
        admit_fp16_flag(self)  # Trainer(precision="16-mixed") with this strategy -> ElixirPrecision
        if self.options.host_budget is not None or self.options.disk_dir is not None:
            # A host bound is only kept if freed tensors leave the process (tightfit.storage.host): from here, and
            # again at setup in spawned ranks; before the model is built where the user builds it after this.
            return_large_frees()
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.plan: ElixirPlan | None = None
        self.units: list[AppliedUnit] = []
        self.plan_path: Path | None = None
        self.monitor: StepMonitor | None = None
        self.prediction: PredictionRecord | None = None
        self.replanner: Replanner | None = None
        # The disk tier's runtime (units whose optimizer state is on disk), made at fit start.
        self.disk_state: DiskOptimizerState | None = None
        # What each optimizer step runs (optimizer_step), one per optimizer of configure_optimizers; set at fit start.
        self._stepping: list[ElixirOptimizer] = []
        # How the plan runs: "FSDP2" (fully_shard per unit), or "DDP" for a plan that replicates every unit on the
        # device without recomputation (composable replicate: lightning_elixir.replicate); set at setup.
        self.runtime = ""
        self._left_on_disk: str | None = None  # after fit: why tier-3 weights were not read back (None: they were)
        self._streamed_init = False  # setup: the model's allocation waits for the disk tier (tier-3 units on meta)

    # ---- processes and mesh ------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # One data-parallel dimension: Elixir shards, offloads and recomputes; it does not split layers.
        setup_data_parallel_mesh(self)

    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        # ``configure_model`` builds on the meta device unless told otherwise: the plan decides where
        # each unit's parameters live, so nothing is allocated before it exists.
        return super().tensor_init_context(empty_init=True if empty_init is None else empty_init)

    # ---- plan and apply ----------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self.options.host_budget is not None or self.options.disk_dir is not None:
            return_large_frees()
        # Lightning's plugin for the precision flag, as the Elixir subclass whose norm clipping counts units
        # on every mesh and device (precision.ClipAcrossMeshes); before anything below uses the plugin.
        self.precision_plugin = with_mesh_clipping(self.precision_plugin)
        # "-true" precisions cast the weights themselves; do it before sharding (meta casts are free).
        self.model = self.precision_plugin.convert_module(self.model)
        if not is_replicated(module) and not any(is_sharded(m) for m in module.modules()):
            decision = self._decide_plan(trainer)
            self.plan = decision.plan
            # A model built on meta whose plan keeps parameters on disk (tier 3) is allocated and initialised
            # once the disk tier is attached, one unit at a time (below), never whole in host memory.
            self._streamed_init = trainer.state.fn == TrainerFn.FITTING and streams_init(self.plan, self.options)
            self.runtime, self.units = apply_decided(module, self.plan, self.device_mesh, device=self.root_device,
                                                     options=self.options, defer_materialize=self._streamed_init)
            self._report(trainer)
            self.replanner = make_replanner(self.options, decision)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.disk_state, self._stepping = attach_optimizers(
                self._module, self.plan, self.units, self.optimizers, self.options, rank=self.global_rank,
                device=self.root_device, norm_type=2.0 if clips_by_norm(trainer) else None,
                precision=str(getattr(self.precision_plugin, "precision", "")),
                chunk_elements=self._disk_chunk_elements)
            if self._streamed_init:
                materialize_streamed(self._module, self.units, self.root_device, self.disk_state)
                self._streamed_init = False
        self.setup_precision_plugin()
        if isinstance(self.precision_plugin, ElixirPrecision):
            self.precision_plugin.bind(self.root_device)  # autocast and the loss scale on this rank's device

    def _decide_plan(self, trainer: Any) -> PlanDecision:
        """The plan for this run (collective): what planning needs, taken from this strategy and the trainer."""
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        return decide_plan(self.options, self._module, first_batch=lambda: example_batch(trainer),
                           method=stage_method(trainer), precision=precision, device=self.root_device,
                           world_size=self.world_size, num_nodes=self.num_nodes, rank=self.global_rank)

    def _report(self, trainer: Any) -> None:
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # collective: Trainer.log_dir broadcasts
        if not self.is_global_zero:
            return
        assert self.plan is not None
        log_dir.mkdir(parents=True, exist_ok=True)
        self.plan_path = log_dir / "plan.json"
        self.plan.to_json(self.plan_path)
        if self.options.verbose:
            print(applied_text(self.plan, self._module, self.runtime), flush=True)
            print(f"[elixir] plan written to {self.plan_path}", flush=True)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, handed to the precision plugin with the user's optimizer as Elixir steps it
        (:class:`~lightning_elixir.step.ElixirOptimizer`): the closure, then one param group per (mesh, device) -
        foreach/fused refuse DTensors of two meshes (``replicate`` units) - then the disk units chunk by chunk."""
        stepping = next((s for s in self._stepping if s.optimizer is optimizer), None)
        # Lightning's precision plugins step any ``Steppable`` (what ElixirOptimizer is); the base types it Optimizer.
        return super().optimizer_step(stepping if stepping is not None else optimizer, closure, model,  # type: ignore[arg-type]
                                      **kwargs)

    def _read_back(self, state: DiskOptimizerState) -> bool:
        """After fit: whether the tier-3 units' weights come back into the module (they fit the host memory left,
        with READ_BACK_MARGIN to spare); otherwise they stay in the store and this says so once."""
        self._left_on_disk = keep_or_refuse(
            self._module, state, READ_BACK_MARGIN,
            warning="The module cannot run or be checkpointed now; to keep the trained weights, checkpoint during fit "
                    "(ModelCheckpoint, or trainer.save_checkpoint in a callback: it streams them from the store)",
            refusal="Load a checkpoint written during fit (ModelCheckpoint) into the module, or train with more host "
                    "memory free at the end of fit")
        return self._left_on_disk is None

    @override
    def teardown(self) -> None:
        state, self.disk_state = self.disk_state, None
        self._stepping = []
        try:
            if state is not None:
                close_disk_state(state, read_back=self._read_back)
        finally:
            super().teardown()

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: a plan applied with DDP skips the all-reduce until the last micro-batch, as
        ``strategy="ddp"`` does (FSDP2 plans reduce-scatter every backward, as Lightning's ``ModelParallelStrategy``)."""
        with no_gradient_sync(self._module):
            yield None

    # ---- steps: through the root module's __call__, so FSDP2's root hooks run -----------------------
    @property
    def _module(self) -> LightningModule:
        """The LightningModule: Lightning types it optional; every hook here runs once it is attached."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("ElixirStrategy: no LightningModule attached yet (call trainer.fit(model) first)")
        return module

    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module = self._module
        with context:
            # The LightningModule is FSDP2's root; ``training_step`` calling ``self.model(x)`` directly would
            # skip the root's forward hook (lazy init, root all-gather), so redirect it through ``module(...)``.
            return redirect_step(self, module, name, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._module.trainer
        if self.replanner is not None and self.replanner.due(int(getattr(trainer, "current_epoch", 0))):
            self._switch_plan(trainer, "epoch")
        self.monitor, record = check_step(self.monitor, self._plan_state(), self.replanner, trainer,
                                          device=self.root_device, verbose=self.options.verbose,
                                          rank_zero=self.is_global_zero, broadcast=self.broadcast,
                                          epoch=int(getattr(trainer, "current_epoch", 0)))
        if record is not None:
            self.prediction = record
        return self._step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @override
    def model_to_device(self) -> None:
        # FSDP2 placed every unit (offloaded ones on the host); moving the module would undo that.
        pass

    # ---- checkpoints ------------------------------------------------------------------------------
    def _init_optimizer_state(self) -> None:
        """Optimizers without state get it through their Elixir step before torch's state-dict helpers would
        initialise it with a plain step (:meth:`ElixirOptimizer.init_state`)."""
        for stepping in self._stepping:
            stepping.init_state()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._init_optimizer_state()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self._left_on_disk is not None:
            raise RuntimeError(f"cannot checkpoint: {self._left_on_disk}; checkpoint during fit (ModelCheckpoint, or "
                               "trainer.save_checkpoint in a callback)")
        if storage_options is not None:
            raise TypeError("ElixirStrategy.save_checkpoint(storage_options=...) is not supported: checkpoints are "
                            "sharded torch.distributed.checkpoint directories")
        path = Path(self.broadcast(str(filepath)))
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        save_atomic(converted, checkpoint, path, disk=self.disk_state, rank=self.global_rank, barrier=self.barrier,
                    broadcast=self.broadcast)
        if self.replanner is not None and self.replanner.pending is not None:
            # A checkpoint boundary: the state just written is valid under both plans.
            self._switch_plan(self._module.trainer, "checkpoint")

    def _plan_state(self) -> PlanState | None:
        return None if self.plan is None else PlanState(plan=self.plan, units=tuple(self.units))

    def _switch_plan(self, trainer: Any, boundary: str) -> None:
        """Switch to the re-planned plan at a checkpoint boundary and keep the state the switch returns."""
        current = self._plan_state()
        assert self.replanner is not None and current is not None
        state = self.replanner.apply(self._module, current, step=int(getattr(trainer, "global_step", 0)),
                                     boundary=boundary, rank_zero=self.is_global_zero, plan_path=self.plan_path,
                                     logger=getattr(trainer, "logger", None))
        if state is not None:
            self.plan, self.units = state.plan, list(state.units)
            self.monitor = None  # the new plan's prediction is checked against its own steps

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        check_before_load(path, rank=self.global_rank, broadcast=self.broadcast)
        return load_into(path, self._module, self.optimizers, disk=self.disk_state, stepping=self._stepping,
                         strict=self._module.strict_loading, weights_only=weights_only,
                         otherwise=lambda: super(ElixirStrategy, self).load_checkpoint(path, weights_only=weights_only))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_presets(strategy_registry, cls)
