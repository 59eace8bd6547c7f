"""``SkyStrategy``: load-balanced pipeline parallelism for Lightning, ``Trainer(strategy="sky")``.

Flow (one short path): on the first batch every rank measures the declared layers on a microbatch
(forward+backward), its memory and its links; rank 0 builds a
:class:`~tightfit.planner.pipeline.PipelineProblem` and asks core for the plan
(:func:`tightfit.planner.pipeline.plan_pipeline`), which every rank receives as JSON
(:func:`tightfit.distributed.decide_on_rank0`); each rank keeps its stages' layers (original
parameter names) and trains with a ``torch.distributed.pipelining`` schedule.

How it fits Lightning's loop (automatic optimization, unchanged user code):
    * ``training_step``: the strategy runs the pipelined forward+backward of ``loss_fn`` over the batch's
      microbatches, then the module's own ``training_step`` on every rank of the pipeline. There
      ``self(x)`` returns the model output on the last stage (it stays there: nothing of it is sent) and
      zeros of its shape on the other ranks, where the layers of other ranks hold empty parameters.
    * the loss ``training_step`` returns is the one trained, extra terms included: a term on parameters
      (a regulariser) reaches them on the rank that holds them; on the last stage, the gradient the loss
      puts on the output is compared with what the pipeline backpropagated for ``loss_fn``, and any
      difference (an auxiliary term on the output, a loss not split by microbatch) goes back through
      the pipeline in a second pass from the same RNG state (backpropagation is linear in that gradient,
      so the passes add up; ``second_passes`` counts them). A term mixing the output with an earlier
      stage's parameters cannot be split this way and is refused (checked on the first two steps), as is
      manual optimization (at setup).
    * what the step returns and logs: the last stage's numbers plus what each other rank's own parameters
      add (its step run again with them emptied); only these scalars cross ranks;
    * ``backward``: the gradients computed by the schedule are added to ``p.grad`` (Lightning zeroes
      gradients between the two, so the schedule's gradients wait aside until then), then the loss's own
      backward runs and the second pass if needed;
    * validation/test run the schedule forward-only and the step the same way; checkpoints hold the full
      model and optimizer state under the original names, as a single process would save them.

Data-parallel replicas (``data_parallel=N`` or ``"auto"``): the world is a 2-D ``DeviceMesh``
``("dp", "pp")`` of ``N`` replicas x ``world / N`` pipeline ranks, global rank = replica x ranks per
pipeline + position, so each pipeline is a block of consecutive ranks. Every replica runs the same
plan; Lightning's distributed sampler gets the replica index and count (each replica loads its own
share of the data, the ranks of one pipeline the same batches); before each optimizer step the
gradients of every stage are averaged over its replicas (inside the closure, so value clipping
sees the averaged gradients). The plan is made for one pipeline whose device at each position is
the slowest (and smallest-memory) of that position's ranks across the replicas, with the slowest
link between neighbouring positions in any replica (core's
:func:`~tightfit.planner.pipeline.merge_replicas`): every replica steps together, so the slowest
copy of a stage paces it. Losses are each replica's own (as under DDP); ``self.log(...,
sync_dist=True)`` averages them over the replicas, which for equal shares is the loss of the global
batch. Checkpoints: every replica holds identical weights; global rank 0 writes the file.

Example:
    >>> import lightning as L, sky_strategy                              # doctest: +SKIP
    >>> trainer = L.Trainer(accelerator="cpu", devices=2,                 # doctest: +SKIP
    ...                     strategy=sky_strategy.SkyStrategy(schedule="1f1b", microbatches=4,
    ...                                                       speed_factors=[1.0, 0.33]))
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from sky_strategy.config import SkyConfig
from sky_strategy.layers import call_layer, resolve_layers, split_batch
from sky_strategy.profiling import (
    LINK_SIZES,
    RankProfile,
    fit_allreduce,
    measure_link_fits,
    pipeline_overhead,
    planner_inputs,
    profile_rank,
    step_overhead,
)
from sky_strategy.runtime import PipelineRuntime
from tightfit.distributed import decide_on_rank0
from tightfit.planner.check import PredictionRecord, StepMonitor, make_monitor, on_step_start
from tightfit.planner.optimizers import optimizer_states
from tightfit.planner.pipeline import (
    PartitionPlan,
    PipelineProblem,
    merge_latency,
    merge_replicas,
    plan_pipeline,
)

__all__ = ["SkyStrategy"]

log = logging.getLogger("sky_strategy")


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
    each rank measured), ``replans`` (``(step, layer counts before, after)`` for each re-plan).
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
        self._speed_factors = list(self.config.speed_factors) if self.config.speed_factors else None
        self.runtime: PipelineRuntime | None = None
        self.plan: PartitionPlan | None = None
        self.monitor: StepMonitor | None = None          # predicted vs measured after warm-up
        self.prediction: PredictionRecord | None = None
        self.profiles: list[RankProfile] = []
        self.replans: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self._inputs: tuple | None = None
        self._step_terms: dict[str, Any] = {}  # link latency, all-reduce fit, per-step overhead (profiling.py)
        self._speeds: list[float] = []
        self._baseline: list[float] | None = None
        self._steps = 0
        self._checked = 0
        self._coupling_checks = 0
        self.second_passes = 0  # steps whose loss needed a second pipeline pass (terms beyond loss_fn on the output)
        self._step_leaf: torch.Tensor | None = None  # the output (stand-in elsewhere) the step's loss saw
        self._step_inputs: Any = None
        self.device_mesh: Any = None  # DeviceMesh ("dp", "pp") when there are replicas
        self._pp_group: dist.ProcessGroup | None = None
        self._dp_group: dist.ProcessGroup | None = None

    @property
    def _module(self) -> LightningModule:
        """The LightningModule (Lightning types ``lightning_module`` as optional; these hooks run once it is set)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("SkyStrategy: no LightningModule is attached yet (call trainer.fit first)")
        return module

    # -- layout: replicas x pipeline ranks -----------------------------------------------------------
    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return self.config.layout(self.world_size)[0]

    @property
    def pipeline_ranks(self) -> int:
        """Ranks (stage devices) per pipeline."""
        return self.config.layout(self.world_size)[1]

    @property
    def replica_rank(self) -> int:
        return self.global_rank // self.pipeline_ranks

    @property
    def pipeline_rank(self) -> int:
        return self.global_rank % self.pipeline_ranks

    def _build_mesh(self) -> None:
        if self.device_mesh is not None or self.replicas == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        # rank = replica * pipeline_ranks + position: each pipeline is a block of consecutive ranks
        mesh = init_device_mesh(self.root_device.type, (self.replicas, self.pipeline_ranks),
                                mesh_dim_names=("dp", "pp"))
        self.device_mesh = mesh
        self._pp_group = mesh.get_group("pp")
        self._dp_group = mesh.get_group("dp")

    # -- injected heterogeneity ----------------------------------------------------------------------
    def speed_factor(self, rank: int | None = None) -> float:
        rank = self.global_rank if rank is None else rank
        return 1.0 if self._speed_factors is None else self._speed_factors[rank]

    def set_speed_factors(self, factors: Sequence[float]) -> None:
        """Change the speeds ranks play from now on (e.g. one device slows down mid-run)."""
        if len(factors) != self.world_size or any(f <= 0 for f in factors):
            raise ValueError(f"set_speed_factors({list(factors)}): give {self.world_size} factors > 0")
        self._speed_factors = [float(f) for f in factors]

    def _slowdown(self) -> float:
        return 1.0 / self.speed_factor() if self.config.throttle else 1.0

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
        self._build_mesh()
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

    def _raw_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def _say(self, text: str, level: int = logging.INFO) -> None:
        # rank 0 speaks for the group; warnings are logged whatever `verbose` says
        if self.global_rank == 0 and (self.config.verbose or level >= logging.WARNING):
            _visible()
            log.log(level, "[sky] %s", text)

    # -- profiling and planning ----------------------------------------------------------------------
    def _ensure_plan(self, inputs, target) -> None:
        if self.runtime is not None:
            return
        module = self._module
        cfg = self.config
        mb = max(1, (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape[0] // cfg.microbatches)
        was_training = module.training
        with torch.inference_mode(False), torch.enable_grad():
            sample = (tuple(t[:mb].clone() for t in inputs) if isinstance(inputs, (tuple, list))
                      else inputs[:mb].clone())
            module.train()
            if cfg.check_forward:
                self._check_forward(sample)
            self._say(f"profiling {len(self._layers)} layers on a microbatch of {mb}")
            mine = profile_rank(self._layers, sample, rank=self.global_rank, device=self.root_device,
                                speed_factor=self.speed_factor(),
                                memory_cap=None if cfg.memory_caps is None else cfg.memory_caps[self.global_rank],
                                local_world_size=self.num_processes, repeats=cfg.profile_repeats, progress=self._say,
                                optimizers=self._raw_optimizers(), clock=cfg.profile_clock)
            links: Any = cfg.link_bandwidth
            latency = None
            if links is None and self.world_size > 1:
                act = max(max(m.output_bytes for m in mine.layers), 1)
                links, latency = measure_link_fits((*LINK_SIZES, act), device=self.root_device)
            allreduce = fit_allreduce(self._dp_group, device=self.root_device) if self.replicas > 1 else None
            # the schedule's own cost per step (stand-in stages that compute nothing, real schedule class,
            # planned microbatches, this rank's slowdown): 4.5 ms of a 94 ms step in sky_train, which the
            # layer timings miss
            schedule_s = pipeline_overhead(cfg.microbatches, cfg.schedule, device=self.root_device,
                                           group=self._pp_group, slowdown=self._slowdown) if self.pipeline_ranks > 1 else 0.0
        module.train(was_training)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        self.profiles = gathered
        costs, mems, devices = planner_inputs(gathered)
        self._inputs = (costs, mems, devices, links)
        batch_out = mine.layers[-1].output_bytes * cfg.microbatches
        self._step_terms = {"link_latency": latency, "allreduce": allreduce,
                            "step_overhead_s": step_overhead(latency, links, batch_out),
                            "pipeline_overhead_s": schedule_s}
        self._speeds = [d.speed for d in devices]
        self.plan = self._decide_plan(self._speeds)
        self.runtime = PipelineRuntime(module, self._layers, device=self.root_device, slowdown=self._slowdown,
                                       context=self.precision_plugin.forward_context, group=self._pp_group,
                                       replicas=self._dp_group)
        self.runtime.sync_replicas()
        self.runtime.apply(self.plan, self._raw_optimizers())
        self._say(self.plan.explain())

    def _check_forward(self, sample) -> None:
        module = self._module
        module.eval()
        with torch.no_grad():
            ref = module(*sample) if isinstance(sample, tuple) else module(sample)
            x = sample
            for layer in self._layers:
                x = call_layer(layer.module, x)
        module.train()
        if isinstance(ref, torch.Tensor) and isinstance(x, torch.Tensor):
            if ref.shape != x.shape or not torch.allclose(ref, x, rtol=1e-4, atol=1e-5):
                diff = (ref - x).abs().max().item() if ref.shape == x.shape else f"shapes {ref.shape} vs {x.shape}"
                raise MisconfigurationException(
                    f"SkyStrategy: {type(module).__name__}.forward differs from applying pipeline_layers in order "
                    f"(max difference {diff}); declare the layers so that forward(x) == layers applied one after "
                    "another, or pass check_forward=False if forward is deliberately different")

    def _decide_plan(self, speeds: Sequence[float]) -> PartitionPlan:
        """Rank 0 plans; every rank gets the same plan as JSON (an error there is raised on every rank)."""
        return decide_on_rank0(lambda: self._make_plan(speeds), encode=lambda plan: plan.to_json(),
                               decode=PartitionPlan.from_json)

    def _make_plan(self, speeds: Sequence[float]) -> PartitionPlan:
        """The plan for one pipeline; ``speeds`` are per global rank (core merges the replicas)."""
        assert self._inputs is not None
        costs, mems, devices, links = self._inputs
        # a re-plan's speeds scale each rank's measured layer timings by the drift it saw
        devices, links = merge_replicas(
            [replace(d, speed=s, layer_seconds=None if d.layer_seconds is None else
                     tuple(t * d.speed / s for t in d.layer_seconds)) for d, s in zip(devices, speeds)], links,
            replicas=self.replicas)
        terms = self._step_terms
        cfg = self.config
        opt = cfg.optimizer_state_factor
        if opt is None:
            opt = max((float(optimizer_states(type(o).__name__, o.defaults, strict=False))
                       for o in self._raw_optimizers()), default=0.0)
        problem = PipelineProblem(layer_costs=costs, layer_memory=mems, devices=devices,
                                  microbatches=cfg.microbatches, schedule=cfg.schedule, links=links,
                                  virtual_stages=cfg.virtual_stages, optimizer_state_factor=opt,
                                  link_latency=merge_latency(terms.get("link_latency"), replicas=self.replicas),
                                  step_overhead_s=terms.get("step_overhead_s", 0.0), replicas=self.replicas,
                                  pipeline_overhead_s=terms.get("pipeline_overhead_s", 0.0),
                                  allreduce=terms.get("allreduce"),
                                  # the last step's gradients live until Lightning's zero_grad; each
                                  # microbatch's gradient is computed whole, then accumulated
                                  gradient_copies=2, accumulation_buffer=True)
        plan = plan_pipeline(problem, cfg.partition, order=cfg.order)
        if not plan.feasible:
            self._say(f"the {plan.method} partition exceeds a memory cap:\n{plan.explain()}", logging.WARNING)
        return plan

    def _maybe_replan(self) -> None:
        cfg = self.config
        if not cfg.replan_every or self.runtime is None or self._steps == 0 or self._steps % cfg.replan_every:
            return
        busy, chunks = self.runtime.busy_seconds(reset=True)
        per_rank: list = [None] * self.world_size
        dist.all_gather_object(per_rank, busy / max(1, chunks))
        if self._baseline is None:
            self._baseline = per_rank  # the first window after a plan is the reference
            return
        drift = [now / max(then, 1e-12) for now, then in zip(per_rank, self._baseline)]
        if max(abs(d - 1.0) for d in drift) <= cfg.replan_threshold:
            return
        speeds = [s / d for s, d in zip(self._speeds, drift)]
        new = self._decide_plan(speeds)
        self._speeds, self._baseline = speeds, None
        assert self.plan is not None
        if (new.boundaries, new.order) == (self.plan.boundaries, self.plan.order):
            return
        before = self.plan.layer_counts()
        self.runtime.apply(new, self._raw_optimizers())
        self.plan = new
        self.replans.append((self._steps, before, new.layer_counts()))
        self._say(f"step {self._steps}: stage times drifted by {[f'{d:.2f}x' for d in drift]}; re-planned "
                  f"{before} -> {new.layer_counts()} layers per rank")

    # -- steps ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _forward_returns(self, output, inputs):
        module = self._module
        expected = (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape

        def forward(*args, **kwargs):
            got = args[0].shape if args and isinstance(args[0], torch.Tensor) else None
            if got is not None and got[:1] != expected[:1]:
                raise MisconfigurationException(
                    f"SkyStrategy: the step called the model on inputs of shape {tuple(got)} but the pipeline ran "
                    f"the batch's inputs of shape {tuple(expected)}; transform inputs in `pipeline_batch(batch)` "
                    "(or the dataloader), not inside the step")
            return output

        module.forward = forward
        try:
            yield
        finally:
            del module.forward

    def _check_same_batch(self, inputs, target) -> None:
        # the first stage consumes the inputs and the last the target: they must be the same batch
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        mine = torch.tensor([float(first.double().sum()), float(target.double().sum()), float(first.shape[0])],
                            dtype=torch.float64)
        sums: list = [None] * self.pipeline_ranks
        dist.all_gather_object(sums, mine.tolist(), group=self._pp_group)
        if any(s != sums[0] for s in sums):
            raise MisconfigurationException(
                f"SkyStrategy: ranks of one pipeline received different batches (input/target sums by pipeline "
                f"rank: {sums}); every stage must see the same batch. Keep Lightning's sampler (use_distributed_sampler=True) or give every "
                "rank the same data order (no unseeded shuffling)")

    def _run(self, batch, train: bool):
        inputs, target = split_batch(self._module, batch)
        if self._checked < 3:
            self._check_same_batch(inputs, target)
            self._checked += 1
        self._ensure_plan(inputs, target)
        if train:
            self._maybe_replan()
        assert self.runtime is not None
        return self.runtime.run(inputs, target, train=train), inputs

    def _user_step(self, step: Callable[..., Any], args: tuple, kwargs: dict, output: Any, inputs: Any, *,
                   train: bool) -> Any:
        """Run the module's own step on every rank of the pipeline (see the module docstring).

        Only the last stage holds the model output: there ``self(x)`` returns it (a leaf, so the step's
        loss can be differentiated with respect to it), elsewhere zeros of its shape. Every rank's step
        runs, so a term on the parameters a rank holds reaches them there. The numbers the step returns
        and logs are the last stage's plus, from every other rank, what its own parameters add (its step
        run again with them emptied, as the other ranks see them): a handful of floats cross ranks.
        """
        runtime = self.runtime
        assert runtime is not None
        batch_size = (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape[0]
        shape, dtype = runtime.output_meta(output, batch_size)
        leaf = (output.detach() if runtime.is_last
                else torch.zeros(shape, dtype=dtype, device=self.root_device))
        if train:
            leaf.requires_grad_(True)
        error: Exception | None = None
        numbers: dict[str, float] | None = None
        logged: list[float] = []
        calls: list[tuple[str, Any, tuple, dict]] = []
        try:  # an error on one rank is raised on every rank (after the exchange), not left to hang the others
            result, calls = self._call_step(step, args, kwargs, leaf, inputs)
            numbers, logged = _scalars(result), [_logged_value(name, value) for name, value, _, _ in calls]
            if not runtime.is_last:
                with torch.no_grad(), _emptied(runtime.owned_parameters()):
                    base, base_calls = self._call_step(step, args, kwargs, leaf.detach(), inputs)
                numbers = _minus(numbers, _scalars(base))
                logged = [_delta(a, _logged_value(name, value)) for a, (name, value, _, _) in zip(logged, base_calls)]
                if train and self._coupling_checks < 2:
                    self._coupling_checks += 1
                    self._check_separable(step, args, kwargs, leaf, inputs, numbers)
        except Exception as exc:
            error = exc
        parts: list[Any] = [None] * runtime.world
        dist.all_gather_object(parts, (numbers, logged, None if error is None else f"{type(error).__name__}: {error}"),
                               group=self._pp_group)
        if error is not None:
            raise error
        failed = next(((rank, p[2]) for rank, p in enumerate(parts) if p[2] is not None), None)
        if failed is not None:
            raise MisconfigurationException(f"SkyStrategy: pipeline rank {failed[0]} stopped the step: {failed[1]}")
        last_numbers, last_logged, _ = parts[runtime.last_rank]
        for rank, (their_numbers, their_logged, _) in enumerate(parts):
            if len(their_logged) != len(last_logged) or (last_numbers is not None and (
                    their_numbers is None or set(their_numbers) != set(last_numbers))):
                raise MisconfigurationException(
                    f"SkyStrategy: {type(self._module).__name__}.{step.__name__} returned or logged "
                    f"different things on the last stage ({sorted(last_numbers or {})}, {len(last_logged)} values "
                    f"logged) and on pipeline rank {rank} ({sorted(their_numbers or {})}, {len(their_logged)} "
                    "logged), where `self(x)` returns zeros: make what the step returns and logs independent of the "
                    "output's values (log a NaN rather than skip a value)")
        totals = None if last_numbers is None else {
            k: v + sum(p[0][k] for r, p in enumerate(parts) if r != runtime.last_rank) for k, v in last_numbers.items()}
        logged_totals = [v + sum(p[1][i] for r, p in enumerate(parts) if r != runtime.last_rank)
                         for i, v in enumerate(last_logged)]
        for (name, value, rest, kw), number in zip(calls, logged_totals):
            value = torch.tensor(number, device=self.root_device) if isinstance(value, torch.Tensor) else number
            self._module.log(name, value, *rest, **kw)
        if train:
            self._step_leaf, self._step_inputs = leaf, inputs
        return _with_values(result, totals)

    def _check_separable(self, step: Callable[..., Any], args: tuple, kwargs: dict, leaf: torch.Tensor, inputs: Any,
                         own: dict[str, float] | None) -> None:
        """Refuse a loss whose terms on this rank's parameters depend on the model output (a product of the
        output and an earlier stage's weights): they would be differentiated at the stand-in output here.
        What the parameters add must not change when the stand-in does (zeros vs ones; first two steps)."""
        runtime = self.runtime
        assert runtime is not None
        ones = torch.ones_like(leaf)
        with torch.no_grad():
            with_own, _ = self._call_step(step, args, kwargs, ones, inputs)
            with _emptied(runtime.owned_parameters()):
                without, _ = self._call_step(step, args, kwargs, ones, inputs)
        other = _minus(_scalars(with_own), _scalars(without))
        for key, value in (own or {}).items():
            again = (other or {}).get(key, value)
            if not math.isclose(value, again, rel_tol=1e-4, abs_tol=1e-6):
                raise MisconfigurationException(
                    f"SkyStrategy: the loss {type(self._module).__name__}.{step.__name__} returns mixes the "
                    f"model output with parameters of pipeline rank {runtime.rank}'s layers (their terms add {value:.6g} "
                    f"with one stand-in output and {again:.6g} with another). Only the last stage sees the output, so "
                    "a term on an earlier stage's parameters must not depend on it: keep such terms separate "
                    "(`loss_fn(self(x), y) + aux(self(x)) + reg(params)`), or train this module with another "
                    "strategy (ddp, elixir)")

    def _call_step(self, step: Callable[..., Any], args: tuple, kwargs: dict, leaf: torch.Tensor,
                   inputs: Any) -> tuple[Any, list[tuple[str, Any, tuple, dict]]]:
        calls: list[tuple[str, Any, tuple, dict]] = []
        with self._forward_returns(leaf, inputs), self._deferred_log(calls):
            try:
                return step(*args, **kwargs), calls
            except MisconfigurationException:
                raise
            except Exception as exc:
                raise RuntimeError(
                    f"SkyStrategy: {type(self._module).__name__}.{step.__name__} failed on pipeline rank "
                    f"{self.runtime.rank if self.runtime else '?'}: it runs on every rank, where the parameters of "
                    "the layers other ranks hold are empty tensors and, off the last stage, `self(x)` returns zeros "
                    "of the output's shape (the output stays on the last stage). Write the step as a function of "
                    "`self(x)` and the batch, plus terms on parameters that also work for an empty tensor (e.g. "
                    f"`sum(p.pow(2).sum() for p in self.parameters())`): {type(exc).__name__}: {exc}") from exc

    @contextlib.contextmanager
    def _deferred_log(self, calls: list[tuple[str, Any, tuple, dict]]) -> Iterator[None]:
        # `self.log` (and `log_dict`, which calls it) only records during the step: the values logged on
        # ranks without the output are replaced by the last stage's before they reach Lightning
        module = self._module

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            calls.append((name, value, args, kwargs))

        module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del module.log

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        # Predicted vs measured after warm-up (tightfit.planner.check): printed, logged, warned beyond 25%.
        if self.plan is not None and self.monitor is None:
            self.monitor = make_monitor(self.plan, self.root_device, planner="sky")
        self.prediction = on_step_start(self.monitor, self._module.trainer) or self.prediction
        output, inputs = self._run(args[0] if args else kwargs["batch"], train=True)
        return self._user_step(super().training_step, args, kwargs, output, inputs, train=True)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.runtime is not None
        module = self._module
        scale = 1.0 / module.trainer.accumulate_grad_batches  # Lightning divides the closure loss alike
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # 1. what the schedule already backpropagated, loss_fn per microbatch (it ran before Lightning's
        #    zero_grad, so its gradients waited aside until now)
        self.runtime.take_gradients(scale)
        # 2. the user's loss itself: its terms on this rank's parameters reach them directly, and the
        #    stand-in output (a leaf) receives d loss / d output
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self.runtime.drop_foreign_gradients()
        # 3. the part of d loss / d output that loss_fn did not account for goes back through the pipeline
        self._backprop_rest(scale)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _backprop_rest(self, scale: float) -> None:
        """Compare, on the last stage, the gradient the step's loss puts on the output with the one the
        schedule backpropagated (``loss_fn`` per microbatch); if they differ (an auxiliary term on the
        output, a loss not split by microbatch), backpropagate the difference through the pipeline in a
        second pass. Backpropagation is linear in the output gradient, so the two passes add up to the
        gradient of the user's loss. Only a flag crosses ranks."""
        runtime = self.runtime
        assert runtime is not None and self._step_leaf is not None
        leaf, rest, differs = self._step_leaf, None, False
        if runtime.is_last:
            wanted = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            done = runtime.loss_fn_output_grad()
            done = torch.zeros_like(wanted) if done is None else done.to(wanted.dtype) * scale
            rest = wanted - done
            # within a few rounding steps of the largest gradient: the same gradient (splitting the batch
            # into microbatches reorders sums; fp32 CE on 16 rows agrees to ~1e-7 relative). The bound is the
            # output dtype's: 8 ulps is ~1e-6 of the largest element in fp32 but ~6% in bf16, where a smaller
            # output term is taken for rounding and not backpropagated (put it in loss_fn to be sure)
            tol = 8 * torch.finfo(wanted.dtype).eps * float(wanted.abs().max()) if wanted.numel() else 0.0
            differs = not bool((rest.abs() <= tol).all())  # NaN differs: propagated as one process would
        flag = [differs]
        dist.broadcast_object_list(flag, group=self._pp_group, group_src=runtime.last_rank)
        self._step_leaf = None
        if flag[0]:
            runtime.backprop_output(self._step_inputs, rest)
            runtime.take_gradients(1.0)
            self.second_passes += 1

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
        output, inputs = self._run(args[0] if args else kwargs["batch"], train=False)
        return self._user_step(super().validation_step, args, kwargs, output, inputs, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any):
        output, inputs = self._run(args[0] if args else kwargs["batch"], train=False)
        return self._user_step(super().test_step, args, kwargs, output, inputs, train=False)

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


@contextlib.contextmanager
def _emptied(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """These parameters hold no data for a while, as on the ranks that do not own them."""
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        yield
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _delta(with_own: float, without: float) -> float:
    """What a rank's own parameters add to a number. Equal values (the same NaN or infinity from the
    stand-in output included) add nothing; a NaN that appears only with the parameters is kept."""
    if with_own == without or (math.isnan(with_own) and math.isnan(without)):
        return 0.0
    return with_own - without


def _minus(numbers: dict[str, float] | None, base: dict[str, float] | None) -> dict[str, float] | None:
    if numbers is None:
        return None
    return {k: _delta(v, (base or {}).get(k, 0.0)) for k, v in numbers.items()}


def _scalars(result: Any) -> dict[str, float] | None:
    """The numbers a step returned: a loss tensor, or a dict's one-element tensors (``None``: no result)."""
    if result is None:
        return None
    if isinstance(result, torch.Tensor):
        return {"": float(result.detach())} if result.numel() == 1 else {}
    if isinstance(result, Mapping):
        return {str(k): float(v.detach()) for k, v in result.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
    return {}


def _logged_value(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    raise MisconfigurationException(
        f"SkyStrategy: self.log({name!r}, ...) got a {type(value).__name__}; only the last stage sees the model "
        "output, so logged values are shared from it as numbers: log a number or a one-element tensor (for a "
        "torchmetrics Metric, log `metric.compute()`)")


class _ValueOf(torch.autograd.Function):
    """``value`` in the forward, gradient straight to ``loss`` in the backward: a rank's loss carries the
    last stage's number (what the user sees) and this rank's own graph (what reaches its parameters)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _with_value(tensor: torch.Tensor, number: float) -> torch.Tensor:
    value = torch.tensor(number, dtype=tensor.dtype, device=tensor.device).reshape(tensor.shape)
    if tensor.requires_grad:
        return _ValueOf.apply(tensor, value)  # type: ignore[no-any-return]
    return value


def _with_values(result: Any, numbers: dict[str, float] | None) -> Any:
    """A non-last rank's step result with the last stage's numbers (its graph kept for the backward)."""
    if numbers is None or result is None:
        return None
    if isinstance(result, torch.Tensor):
        return _with_value(result, numbers[""]) if "" in numbers else result
    if isinstance(result, Mapping):
        return {k: _with_value(v, numbers[str(k)]) if str(k) in numbers and isinstance(v, torch.Tensor) else v
                for k, v in result.items()}
    return result
