"""``SkyStrategy``: load-balanced pipeline parallelism for Lightning, ``Trainer(strategy="sky")``.

The strategy is Lightning's side only; each override hands its work to the module that owns it:

* ``setup``: refuses what pipelining cannot follow (GradScaler, norm clipping, manual optimization),
  lays out the ranks (:mod:`sky_strategy.mesh`) and resolves the declared layers;
* the first batch: :mod:`sky_strategy.planning` profiles every rank and decides the plan on rank 0,
  :class:`~sky_strategy.runtime.PipelineRuntime` places the layers and runs the schedules;
* ``training_step`` / ``validation_step`` / ``test_step``: the pipelined forward (+ backward of
  ``loss_fn`` per microbatch) over the batch, then the module's own step on every rank of the
  pipeline (:class:`~sky_strategy.step.PipelineStep`): ``self(x)`` returns the model output on the
  last stage (it stays there) and zeros of its shape elsewhere; only scalars cross ranks;
* ``backward``: :meth:`PipelineStep.backward` - the schedule's gradients, the loss's own backward, and
  a second pipeline pass when the loss puts more on the output than ``loss_fn`` (``second_passes``
  counts them); a term mixing the output with an earlier stage's parameters is refused;
* ``optimizer_step``: with replicas, gradients are averaged over them inside the closure (so value
  clipping sees the averaged gradients); every ``replan_every`` steps the
  :class:`~sky_strategy.planning.Replanner` compares stage times and may move layers;
* checkpoints hold the full model and optimizer state under the original names, as one process
  would save them.

Data-parallel replicas (``data_parallel=N`` or ``"auto"``): the world is a 2-D ``DeviceMesh``
``("dp", "pp")`` of ``N`` replicas x ``world / N`` pipeline ranks, each pipeline a block of
consecutive ranks. Every replica runs the same plan; Lightning's distributed sampler gets the replica
index and count (the ranks of one pipeline load the same batches). The plan is made for one pipeline
whose device at each position is the slowest (and smallest-memory) of that position's ranks across
the replicas (core's :func:`~tightfit.planner.pipeline.merge_replicas`): every replica steps together,
so the slowest copy of a stage paces it. Losses are each replica's own (as under DDP); ``self.log(...,
sync_dist=True)`` averages them over the replicas. Every replica holds identical weights; global rank
0 writes the checkpoint.

Example:
    >>> import lightning as L, sky_strategy                              # doctest: +SKIP
    >>> trainer = L.Trainer(accelerator="cpu", devices=2,                 # doctest: +SKIP
    ...                     strategy=sky_strategy.SkyStrategy(schedule="1f1b", microbatches=4,
    ...                                                       speed_factors=[1.0, 0.33]))
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from sky_strategy.config import SkyConfig
from sky_strategy.layers import Layer, resolve_layers, split_batch
from sky_strategy.mesh import Layout, PipelineGroups, build_groups
from sky_strategy.planning import Replanner, decide_plan, gather_stage_seconds, profile_pipeline
from sky_strategy.profiling import InjectedSpeeds, RankProfile
from sky_strategy.runtime import PipelineRuntime
from sky_strategy.step import PipelineStep, check_same_batch
from tightfit.planner.check import PredictionRecord, StepMonitor, make_monitor, on_step_start
from tightfit.planner.pipeline import PartitionPlan

__all__ = ["SkyStrategy"]

log = logging.getLogger("sky_strategy")
BATCH_CHECKS = 3  # first training/evaluation batches whose pipeline ranks compare input and target sums


def _visible() -> None:
    """Give the ``sky_strategy`` logger a stderr handler at INFO when the application configured no logging
    (Lightning does the same for its own logger), so ``verbose=True`` shows progress and the plan; an
    application's own handlers or levels take precedence."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class SkyStrategy(DDPStrategy):
    """Pipeline stages sized to each rank's measured speed and memory (see :class:`SkyConfig` for the knobs).

    The LightningModule declares ``pipeline_layers`` and ``loss_fn`` (see :mod:`sky_strategy.layers`).
    Every rank of a pipeline loads the same batches; with ``data_parallel=N`` the world holds ``N``
    pipelines that split the data and average gradients (see the module docstring).

    Attributes after the first batch: ``plan`` (the :class:`PartitionPlan` in use), ``profiles`` (what
    each rank measured), ``replans`` (``(step, layer counts before, after)`` for each re-plan),
    ``runtime`` (the :class:`PipelineRuntime`), ``second_passes``, ``prediction`` (predicted vs measured).
    """

    strategy_name = "sky"

    def __init__(self, *, schedule: str = "1f1b", microbatches: int = 4, virtual_stages: int = 2,
                 partition: str | Sequence[int] = "balanced", order: str = "search",
                 speed_factors: Sequence[float] | None = None, memory_caps: Sequence[int | str] | None = None,
                 link_bandwidth: float | None = None, throttle: bool = True, replan_every: int | None = None,
                 replan_threshold: float = 0.25, profile_repeats: int = 3, profile_clock: str = "wall",
                 optimizer_state_factor: float | None = None, check_forward: bool = True, verbose: bool = True,
                 data_parallel: int | str = 1, pipeline_ranks: int | None = None,
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: str | None = None,
                 timeout: timedelta | None = None,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen") -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, timeout=default_pg_timeout if timeout is None else timeout)
        self.config = SkyConfig(
            schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
            partition=partition if isinstance(partition, str) else tuple(int(b) for b in partition), order=order,
            speed_factors=None if speed_factors is None else tuple(float(f) for f in speed_factors),
            memory_caps=None if memory_caps is None else tuple(memory_caps),  # type: ignore[arg-type]
            link_bandwidth=link_bandwidth, throttle=throttle, replan_every=replan_every,
            replan_threshold=replan_threshold, profile_repeats=profile_repeats, profile_clock=profile_clock,
            optimizer_state_factor=optimizer_state_factor, check_forward=check_forward, verbose=verbose,
            data_parallel=data_parallel, pipeline_ranks=pipeline_ranks)
        self.speeds = InjectedSpeeds(self.config.speed_factors, throttle=self.config.throttle)
        self.groups: PipelineGroups | None = None     # built at setup
        self._layers: list[Layer] = []                # resolved at setup
        # made on the first batch (planning.py, runtime.py, step.py)
        self.runtime: PipelineRuntime | None = None
        self.profiles: list[RankProfile] = []
        self._replanner: Replanner | None = None
        self._step: PipelineStep | None = None
        self.monitor: StepMonitor | None = None          # predicted vs measured after warm-up
        self.prediction: PredictionRecord | None = None
        self._steps = 0          # optimizer steps taken (re-planning windows)
        self._batches_checked = 0

    @property
    def _module(self) -> LightningModule:
        """The LightningModule (Lightning types ``lightning_module`` as optional; these hooks run once it is set)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("SkyStrategy: no LightningModule is attached yet (call trainer.fit first)")
        return module

    # -- what the parts own, read back -----------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """This rank's place among replicas x pipeline ranks (:class:`~sky_strategy.mesh.Layout`)."""
        return Layout.of(self.config, world=self.world_size, rank=self.global_rank)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return self.layout.replicas

    @property
    def pipeline_ranks(self) -> int:
        """Ranks (stage devices) per pipeline."""
        return self.layout.pipeline_ranks

    @property
    def replica_rank(self) -> int:
        return self.layout.replica_rank

    @property
    def pipeline_rank(self) -> int:
        return self.layout.pipeline_rank

    @property
    def device_mesh(self) -> Any:
        """The ``("dp", "pp")`` ``DeviceMesh`` when there are replicas (``None`` otherwise or before setup)."""
        return None if self.groups is None else self.groups.device_mesh

    @property
    def plan(self) -> PartitionPlan | None:
        return None if self._replanner is None else self._replanner.plan

    @property
    def replans(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        return [] if self._replanner is None else [(r.step, r.before, r.after) for r in self._replanner.records]

    @property
    def second_passes(self) -> int:
        """Training steps whose loss needed a second pipeline pass (terms beyond ``loss_fn`` on the output)."""
        return 0 if self._step is None else self._step.second_passes

    def speed_factor(self, rank: int | None = None) -> float:
        return self.speeds.factor(self.global_rank if rank is None else rank)

    def set_speed_factors(self, factors: Sequence[float]) -> None:
        """Change the speeds ranks play from now on (e.g. one device slows down mid-run)."""
        self.speeds.set(factors, world=self.world_size)

    def _say(self, text: str, level: int = logging.INFO) -> None:
        # rank 0 speaks for the group; warnings are logged whatever `verbose` says
        if self.global_rank == 0 and (self.config.verbose or level >= logging.WARNING):
            _visible()
            log.log(level, "[sky] %s", text)

    def _raw_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    # -- Lightning plumbing --------------------------------------------------------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a pipeline sees the same batches; replicas split the data
        return {"num_replicas": self.replicas, "rank": self.replica_rank}

    @override
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.config.check_world(self.world_size)
        if self.groups is None:  # a later trainer.validate/test keeps the groups of the first setup
            self.groups = build_groups(self.layout, self.root_device.type)
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise MisconfigurationException("SkyStrategy: '16-mixed' (GradScaler) is not supported; use "
                                            "precision='32-true', 'bf16-mixed' or 'bf16-true'")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):  # None: norm
            raise MisconfigurationException(
                "SkyStrategy: gradient_clip_algorithm='norm' would clip each stage by its own partial norm; use "
                "gradient_clip_algorithm='value' (element-wise, exact under pipelining)")
        if not self._module.automatic_optimization:
            raise MisconfigurationException(
                f"SkyStrategy: {type(self._module).__name__} sets automatic_optimization=False; the strategy "
                "backpropagates the step's loss through the pipeline itself (per microbatch, then the rest of the "
                "output's gradient) and cannot follow manual_backward calls. Return the loss from training_step with "
                "automatic optimization, or train this module with another strategy (ddp, elixir)")
        self._layers = resolve_layers(self._module)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.root_device.type == "cpu" or self.runtime is not None:
            self.model.to(self.root_device)
            return
        # accelerators: layers go to the device when placed; only what is outside them moves now
        in_layers = {id(t) for layer in self._layers for _, t in [*layer.parameters(), *layer.buffers()]}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if id(t) not in in_layers:
                t.data = t.data.to(self.root_device)

    # -- the first batch: profile, plan, place -------------------------------------------------------
    def _start_pipeline(self, inputs: Any) -> tuple[PipelineRuntime, PipelineStep]:
        """Profile every rank, decide the plan on rank 0, place the layers. Collective (first batch)."""
        module, cfg, groups = self._module, self.config, self.groups
        assert groups is not None
        profiled = profile_pipeline(module, self._layers, inputs, config=cfg, layout=self.layout, groups=groups,
                                    device=self.root_device, local_world_size=self.num_processes,
                                    optimizers=self._raw_optimizers(), speeds=self.speeds, say=self._say)
        self.profiles = list(profiled.profiles)
        plan = decide_plan(profiled.inputs, profiled.inputs.speeds, say=self._say)
        self._replanner = Replanner(profiled.inputs, plan, every=cfg.replan_every, threshold=cfg.replan_threshold,
                                    say=self._say)
        runtime = PipelineRuntime(module, self._layers, device=self.root_device,
                                  slowdown=self.speeds.slowdown_of(self.global_rank),
                                  context=self.precision_plugin.forward_context, group=groups.pipeline,
                                  replicas=groups.replicas)
        runtime.sync_replicas()
        runtime.apply(plan, self._raw_optimizers())
        self._say(plan.explain())
        return runtime, PipelineStep(module, runtime, device=self.root_device, group=groups.pipeline)

    def _maybe_replan(self, runtime: PipelineRuntime) -> None:
        replanner = self._replanner
        if replanner is None or not replanner.due(self._steps):
            return
        busy, chunks = runtime.busy_seconds(reset=True)
        replan = replanner.observe(self._steps, gather_stage_seconds(busy, chunks, world=self.world_size))
        if replan is not None:
            runtime.apply(replan.plan, self._raw_optimizers())
            self._say(replan.describe())

    def _pipeline_forward(self, batch: Any, *, train: bool) -> tuple[PipelineStep, Any, Any]:
        """The batch through the pipeline (planned on the first one): the step object, the output (last
        stage; ``None`` elsewhere) and the inputs."""
        assert self.groups is not None  # setup built them
        inputs, target = split_batch(self._module, batch)
        if self._batches_checked < BATCH_CHECKS:
            check_same_batch(inputs, target, ranks=self.pipeline_ranks, group=self.groups.pipeline)
            self._batches_checked += 1
        if self.runtime is None or self._step is None:
            self.runtime, self._step = self._start_pipeline(inputs)
        if train:
            self._maybe_replan(self.runtime)
        return self._step, self.runtime.run(inputs, target, train=train), inputs

    # -- steps ---------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any):
        # Predicted vs measured after warm-up (tightfit.planner.check): printed, logged, warned beyond 25%.
        if self.plan is not None and self.monitor is None:
            self.monitor = make_monitor(self.plan, self.root_device, planner="sky")
        self.prediction = on_step_start(self.monitor, self._module.trainer) or self.prediction
        step, output, inputs = self._pipeline_forward(args[0] if args else kwargs["batch"], train=True)
        return step.run(super().training_step, args, kwargs, output, inputs, train=True)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self._step is not None
        module = self._module
        scale = 1.0 / module.trainer.accumulate_grad_batches  # Lightning divides the closure loss alike
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._step.backward(lambda: self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs),
                            scale)
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        def averaged():
            # after backward (the last of an accumulation window), before clipping and the step
            result = closure()
            if self.runtime is not None:
                self.runtime.average_gradients()
            return result

        out = super().optimizer_step(optimizer, averaged if self.replicas > 1 else closure, model, **kwargs)
        self._steps += 1
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        step, output, inputs = self._pipeline_forward(args[0] if args else kwargs["batch"], train=False)
        return step.run(super().validation_step, args, kwargs, output, inputs, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any):
        step, output, inputs = self._pipeline_forward(args[0] if args else kwargs["batch"], train=False)
        return step.run(super().test_step, args, kwargs, output, inputs, train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any):
        raise MisconfigurationException("SkyStrategy does not run predict (no target to split batches by); "
                                        "use trainer.validate/test, or load the checkpoint into one process")

    # -- checkpoints ---------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.runtime is None:
            return super().lightning_module_state_dict()
        return self.runtime.full_state_dict()

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self.runtime is None:
            return super().optimizer_state(optimizer)
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self.runtime.full_optimizer_state(opt)

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if self.runtime is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self.runtime.load_full_state_dict(checkpoint["state_dict"])

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.runtime is not None:
            self.runtime.drop_foreign_optimizer_state(self._raw_optimizers())

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("sky", cls, description="Sky: load-balanced pipeline parallelism (tightfit)")
