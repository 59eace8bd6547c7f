"""``ElixirDeepSpeedStrategy`` (``strategy="elixir_deepspeed"``): the plan translated to a DeepSpeed ZeRO config, run by
Lightning's ``DeepSpeedStrategy``.

The translation is the planner's (:meth:`ElixirPlan.to_deepspeed_config`, with
:meth:`~ElixirPlan.deepspeed_gaps` saying what DeepSpeed cannot express, e.g. per-unit modes); this
adapter adds what the runtime needs:

* the plan's recomputed blocks get the same composable activation checkpointing as the FSDP2 path
  (DeepSpeed's config only configures ``deepspeed.checkpointing``, it does not choose blocks);
* a client optimizer (from ``configure_optimizers``) is allowed with ZeRO-Offload
  (``zero_force_ds_cpu_optimizer: false``), so the optimizer works unchanged;
* a ``config`` given by the user is merged over the translation (the user wins);
* a partial ``offload_optimizer.ratio`` is dropped (every optimizer state offloaded) unless the
  config builds DeepSpeed's own optimizer: DeepSpeed runs that ratio only with DeepSpeedCPUAdam;
* the disk tier (``host_budget`` / ``disk_dir``, :func:`nvme_translation`): a plan whose units keep
  their optimizer state on disk becomes ZeRO-Infinity's ``offload_optimizer: {device: nvme}`` with
  ``nvme_path = disk_dir``, and DeepSpeed's ``aio`` block size and queue depth come from the measured
  disk profile (``profile_disk(disk_dir)``, cached) instead of being tuned by hand;
* on a CPU-only machine, Lightning's "only supported on CUDA GPUs" check is lifted knowingly:
  DeepSpeed runs on its CPU accelerator over gloo there (its shared-memory all-reduce op is disabled:
  it crashes on some machines, and gloo is what the CPU tests use). This is for tests and
  development; real DeepSpeed training is on GPUs.

A model built in ``configure_model`` is first built on the meta device to profile it and decide the
plan; when the plan is ZeRO-3 the real build then runs under ``deepspeed.zero.Init``, so every rank
allocates only its partition of each parameter (a model larger than one device can start). A model
built in ``__init__`` is already materialised on every rank; DeepSpeed partitions it at ``initialize``.
Initialisation code that writes parameters after their module is constructed (``init_weights`` loops)
must run under ``deepspeed.zero.GatheredParameters`` there, as with any ``zero.Init`` model.

What ZeRO-Infinity cannot express of a disk plan (each is also a line of :func:`nvme_translation`'s gaps,
printed at setup; the first two are warnings, the third an error):

* **no host budget**: DeepSpeed has no host-memory limit; its host use is what it keeps there (the
  parameters under ``offload_param: cpu``, gradients, swap buffers of ``buffer_count`` x the largest
  sub-group), not bounded by ``host_budget``. The plan is checked against the budget; DeepSpeed is not.
* **per-unit tiers**: ZeRO-Infinity swaps the optimizer state of every offloaded parameter to NVMe or
  none; a plan with some units' state on the host and some on disk runs with all of it on disk. And it
  swaps the fp32 master weights with the moments (12 bytes per element against the plan's 8), so disk
  use and traffic are higher than the plan's prediction. Sub-groups smaller than ``max(1 MiB, aio block_size)``
  stay in host RAM.
* **stage**: DeepSpeed swaps optimizer state to NVMe only at ZeRO stage 3 (at stages 1-2 ``nvme`` keeps
  it in host RAM, silently): a disk plan that translates to stage 0-2 is refused with a ValueError.
* parameters stay where the plan keeps them (``offload_param: cpu`` when every unit is offloaded): the
  plan has no disk tier for parameters, so ``offload_param: nvme`` is never chosen by the translation
  (a ``config`` entry can still ask for it).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_elixir.options import ElixirOptions
from lightning_elixir.planning import decide_plan, example_batch, stage_method
from tightfit.planner.elixir import ElixirConstraints, ElixirPlan
from tightfit.profiler.types import ClusterSpec, DeviceProfile, DiskProfile
from tightfit.units import format_bytes, parse_bytes

__all__ = ["ElixirDeepSpeedStrategy", "deepspeed_config", "merge_config", "nvme_translation"]


def merge_config(base: dict[str, Any], override_with: dict[str, Any] | None) -> dict[str, Any]:
    """``base`` with ``override_with`` merged in recursively (the override wins)."""
    out = copy.deepcopy(base)
    for key, value in (override_with or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


_DS_MIN_AIO_BYTES = 1 << 20  # DeepSpeed swaps an optimizer sub-group only from max(this, aio block_size) bytes


def _aio_block(disk: DiskProfile | None, swapped: int) -> int:
    """The aio ``block_size``: the profiled request size, unless that would keep each rank's ``swapped`` bytes of
    fp32 state in RAM.

    DeepSpeed leaves a sub-group whose fp32 partition is smaller than ``max(1 MiB, block_size)`` in host memory.
    Every offloaded unit's state is swapped once any unit is on disk, in sub-groups of up to 1e9 elements of each
    rank's partition; when that partition is smaller than the profiled request size, the block falls back to
    DeepSpeed's 1 MiB floor so the state still reaches the disk (smaller requests, not none).
    """
    if disk is None:
        return _DS_MIN_AIO_BYTES
    block = int(disk.request_bytes)
    return block if block <= _DS_MIN_AIO_BYTES or swapped >= block else _DS_MIN_AIO_BYTES


def nvme_translation(plan: ElixirPlan, *, disk_dir: str | Path | None, disk: DiskProfile | None = None,
                     host_budget: int | None = None, pin_memory: bool = False) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(ZeRO-Infinity config entries, what they cannot express) for the disk units of ``plan``.

    Pure mapping. Empty when no unit keeps its state on disk. Otherwise ``offload_optimizer`` goes to
    ``device: nvme`` at ``nvme_path = disk_dir`` (else the directory the plan was priced for), with
    ``pipeline_read`` / ``pipeline_write`` on (the plan prices reads and write-backs overlapped with the
    update), and ``aio`` takes the disk profile's request size as ``block_size`` and its queue depth
    as ``queue_depth`` (DeepSpeed's defaults, 1 MiB and 8, without a profile); the block falls back to 1 MiB
    where the profiled size would exceed each rank's swapped state, which DeepSpeed would then keep in RAM.

    Raises:
        ValueError: the plan has disk units but translates to a ZeRO stage below 3, or names no directory.
    """
    disk_units = plan.disk_units
    if not disk_units:
        return {}, ()
    cfg = plan.to_deepspeed_config()
    stage = cfg["zero_optimization"]["stage"]
    if stage != 3:
        raise ValueError(f"ElixirDeepSpeedStrategy: the plan keeps the optimizer state of {len(disk_units)} units on "
                         f"disk but translates to ZeRO stage {stage}; DeepSpeed swaps optimizer state to NVMe only at "
                         "stage 3 (at stage 1-2 'nvme' keeps it in host RAM). Use strategy='elixir' for this plan, or "
                         "raise memory_budget/host_budget so no state goes to disk")
    path = str(disk_dir) if disk_dir is not None else plan.disk_path
    if not path:
        raise ValueError("ElixirDeepSpeedStrategy: the plan keeps optimizer state on disk but no directory is known "
                         "(disk_dir=None and the plan names none); pass disk_dir='/nvme/dir'")
    opt = {"device": "nvme", "nvme_path": path, "pin_memory": pin_memory, "pipeline_read": True,
           "pipeline_write": True}
    # each rank's fp32 partition of every offloaded unit: what DeepSpeed swaps once any unit is on disk
    swapped = 4 * sum(plan.units[i].param_numel for i in plan.offloaded_units) // max(1, plan.world_size)
    block = _aio_block(disk, swapped)
    depth = max(1, disk.queue_depth) if disk is not None else 8
    aio = {"block_size": int(block), "queue_depth": int(depth), "intra_op_parallelism": 1, "single_submit": False,
           "overlap_events": True, "use_gds": False}
    zero: dict[str, Any] = {"offload_optimizer": opt}
    if "offload_param" in cfg["zero_optimization"]:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    gaps = [
        f"host_budget {format_bytes(host_budget) if host_budget is not None else '(none)'}: DeepSpeed has no host "
        "memory limit; what it keeps on the host (parameters, gradients, swap buffers) is not bounded by it",
        "DeepSpeed swaps the fp32 master weights with the optimizer moments (12 bytes per element on disk, the "
        "plan's disk units keep 8): disk use and traffic exceed the plan's prediction",
        "parameters: the plan has no disk tier for them, so offload_param stays off NVMe",
        f"DeepSpeed keeps an optimizer sub-group smaller than max(1 MiB, aio block_size {format_bytes(block)}) in "
        "host RAM, whatever the plan says",
    ]
    if swapped < _DS_MIN_AIO_BYTES:
        gaps.append(f"each rank's swapped optimizer state is {format_bytes(swapped)}, below DeepSpeed's 1 MiB swap "
                    "floor: DeepSpeed keeps all of it in host RAM, nothing reaches nvme_path")
    if disk is None:
        gaps.append("no disk profile: aio block_size and queue_depth are DeepSpeed's defaults (1 MiB, 8), not measured")
    return {"zero_optimization": zero, "aio": aio}, tuple(gaps)


def deepspeed_config(plan: ElixirPlan, user: dict[str, Any] | None = None, *, disk_dir: str | Path | None = None,
                     disk: DiskProfile | None = None, host_budget: int | None = None,
                     pin_memory: bool = False) -> dict[str, Any]:
    """The DeepSpeed config this adapter runs: the plan's translation (its disk units as ZeRO-Infinity NVMe
    settings, :func:`nvme_translation`), a client optimizer allowed, ``user`` on top."""
    cfg = merge_config(plan.to_deepspeed_config(),
                       nvme_translation(plan, disk_dir=disk_dir, disk=disk, host_budget=host_budget,
                                        pin_memory=pin_memory)[0])
    cfg.pop("activation_checkpointing", None)  # blocks are checkpointed by apply_activation_checkpointing
    cfg["zero_force_ds_cpu_optimizer"] = False
    # The optimizer is the user's (configure_optimizers), any torch one: SGD etc. too, as Lightning's own default.
    cfg["zero_allow_untested_optimizer"] = True
    offload = cfg.get("zero_optimization", {}).get("offload_optimizer", {})
    if "ratio" in offload and "optimizer" not in (user or {}):
        # A partial offload ratio (ZeRO-Offload++) runs only DeepSpeedCPUAdam; the optimizer from
        # configure_optimizers is a torch one, so offload all optimizer state instead.
        offload.pop("ratio")
    return merge_config(cfg, user)


class ElixirDeepSpeedStrategy(DeepSpeedStrategy):
    """Elixir's plan executed by DeepSpeed ZeRO (``Trainer(strategy="elixir_deepspeed")``).

    Args:
        memory_budget: as :class:`~lightning_elixir.strategy.ElixirStrategy`; it and the nine arguments below
            are validated into :attr:`options`, an :class:`~lightning_elixir.options.ElixirOptions`.
        plan: as ``ElixirStrategy``.
        offload: as ``ElixirStrategy``.
        activation_checkpointing: as ``ElixirStrategy``.
        optimizer: as ``ElixirStrategy``.
        cluster: as ``ElixirStrategy``.
        device_profile: as ``ElixirStrategy``.
        constraints: as ``ElixirStrategy``.
        verbose: as ``ElixirStrategy``.
        calibrate: as ``ElixirStrategy``.
        host_budget: host bytes per rank the plan may use (``"4GiB"``; ``None``: what the host has free),
            as ``ElixirStrategy``. DeepSpeed does not enforce it (module docstring: the gaps).
        disk_dir: a directory on an NVMe/SSD drive for the disk tier (``None``: no disk tier). Units the
            plan puts on disk run as ZeRO-Infinity ``offload_optimizer: {device: nvme, nvme_path: disk_dir}``
            with ``aio`` sized from the drive's measured profile (:func:`nvme_translation`).
        config: DeepSpeed config entries merged over the translated plan.
        process_group_backend: as Lightning's ``DeepSpeedStrategy``.

    Only these arguments are taken (no ``**kwargs``): every knob is a typed argument that
    ``LightningCLI`` can set, and the ZeRO settings come from the plan (``config`` overrides them).
    """

    strategy_name = "elixir_deepspeed"

    def __init__(self, memory_budget: int | float | str | None = None, plan: str | Path | ElixirPlan | None = None,
                 offload: str = "auto", activation_checkpointing: bool | str = "auto", optimizer: str = "adamw",
                 cluster: ClusterSpec | str | Path | None = None, device_profile: DeviceProfile | str | Path | None = None,
                 constraints: ElixirConstraints | None = None, verbose: bool = True, calibrate: bool = True,
                 host_budget: int | str | None = None, disk_dir: str | Path | None = None,
                 config: dict[str, Any] | None = None, process_group_backend: str | None = None) -> None:
        self.options = ElixirOptions(memory_budget=memory_budget, plan=plan, offload=offload,
                                     activation_checkpointing=activation_checkpointing, optimizer=optimizer,
                                     cluster=cluster, device_profile=device_profile, constraints=constraints,
                                     verbose=verbose, calibrate=calibrate, host_budget=host_budget,
                                     disk_dir=disk_dir, owner="ElixirDeepSpeedStrategy")
        # Validated by ElixirOptions; kept in bytes / as a Path for the NVMe translation.
        self.host_budget = None if host_budget is None else parse_bytes(host_budget)
        self.disk_dir = None if self.options.disk_dir is None else Path(self.options.disk_dir)
        # A placeholder config: the real one is translated from the plan in ``setup``.
        super().__init__(config={"zero_optimization": {"stage": 3}}, process_group_backend=process_group_backend)
        self.user_config = config
        self.plan: ElixirPlan | None = None
        self._nvme_gaps: tuple[str, ...] = ()
        # ZeRO-3 (``zero.Init``, also run inside ``deepspeed.initialize``) replaces ``torch.nn.functional.linear``
        # for the whole process, and DeepSpeed leaves it replaced; ``teardown`` puts this one back.
        self._torch_linear = torch.nn.functional.linear

    @override
    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_environment()
            return
        import importlib

        # import_module, not `import deepspeed.comm.torch as`: that binds deepspeed.comm's attribute `torch`, PyTorch
        ds_torch: Any = importlib.import_module("deepspeed.comm.torch")

        ds_torch.build_shm_op = lambda: None  # its CPU shared-memory all-reduce crashes here; gloo instead
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's CUDA-only check, knowingly (module doc)

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        # Lightning's check that device indices match local ranks has no meaning for CPU devices.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import argparse

        import deepspeed

        # DeepSpeed reads the device index from ``args.device_rank``; a CPU device has none: use the local rank.
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
            lr_scheduler=lr_scheduler, dist_init_required=False)
        return engine, ds_optimizer

    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        # Real tensors: under ZeRO-3, zero.Init (model_sharded_context) partitions each one as it is made.
        return super(DeepSpeedStrategy, self).tensor_init_context(empty_init=False)

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: decide the plan first (from a meta-device build), then build for
        real under ``deepspeed.zero.Init`` when the plan shards parameters (ZeRO-3), so each rank only
        ever holds its partition: a model larger than one device can start."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if self.plan is None and trainer is not None:
            self.plan = self._plan_from_meta_build(trainer)
        config = self._config_of(self.plan) if self.plan is not None else {}
        if config.get("zero_optimization", {}).get("stage", 0) != 3:
            yield
            return
        import deepspeed

        config.setdefault("train_micro_batch_size_per_gpu", 1)  # zero.Init parses the whole config
        with deepspeed.zero.Init(config_dict_or_path=config):
            yield

    def _plan_from_meta_build(self, trainer: Any) -> ElixirPlan:
        """Run ``configure_model`` once on the meta device (nothing allocated), decide the plan from that
        structure, then put the module's own attributes back so ``configure_model`` builds it for real.

        Only the LightningModule's own attributes and child/parameter/buffer tables are restored: a
        ``configure_model`` that changes submodules which existed before it runs is built on meta here
        and its real build then sees meta submodules (such models should plan in ``setup``: build them
        in ``__init__``)."""
        module = self.lightning_module
        assert module is not None
        saved = dict(vars(module))
        tables = {k: dict(saved[k]) for k in ("_modules", "_parameters", "_buffers")}
        try:
            # The dry run must not move the RNG the real build draws its initial weights from.
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                module.configure_model()
            plan = self._decide_plan(trainer)
        finally:
            vars(module).clear()
            vars(module).update(saved)
            for key, table in tables.items():
                object.__setattr__(module, key, table)
        return plan

    def _decide_plan(self, trainer: Any) -> ElixirPlan:
        """The plan for this run (collective), from what planning needs of this strategy and the trainer."""
        module = self.lightning_module
        assert module is not None
        return decide_plan(self.options, module, first_batch=lambda: example_batch(trainer),
                           method=stage_method(trainer),
                           precision=str(getattr(self.precision_plugin, "precision", "32-true")),
                           device=self.root_device, world_size=self.world_size, num_nodes=self.num_nodes,
                           rank=self.global_rank).plan

    @override
    def setup(self, trainer: Any) -> None:
        from lightning_elixir.apply import apply_activation_checkpointing

        module = self.lightning_module
        assert module is not None
        if self.plan is None:  # no configure_model hook: plan here, on the model built in __init__
            self.plan = self._decide_plan(trainer)
        apply_activation_checkpointing(module, self.plan)
        self.config = self._config_of(self.plan)
        if trainer.state.fn == TrainerFn.FITTING and "train_micro_batch_size_per_gpu" not in (self.user_config or {}):
            self.config["train_micro_batch_size_per_gpu"] = self.config.get("train_micro_batch_size_per_gpu", 1)
        self._config_initialized = False
        if self.is_global_zero and self.options.verbose:
            print(self.plan.explain(), flush=True)
            print("\nDeepSpeed config from the plan:", self.config, flush=True)
            for gap in self.plan.deepspeed_gaps():
                print(f"[elixir/deepspeed] not expressible: {gap}", flush=True)
        if self.is_global_zero:
            for gap in self._nvme_gaps:
                warnings.warn(f"ElixirDeepSpeedStrategy: not expressible in ZeRO-Infinity: {gap}", stacklevel=2)
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        super().teardown()
        # The rest of the user's process (an evaluation, another model) computes with torch's linear again.
        torch.nn.functional.linear = self._torch_linear

    def _config_of(self, plan: ElixirPlan) -> dict[str, Any]:
        """The DeepSpeed config of ``plan`` on this machine: its disk units on ``disk_dir`` with ``aio`` from
        the disk's measured profile (cached per filesystem), pinned buffers only on CUDA."""
        disk = None
        if plan.disk_units and (self.disk_dir is not None or plan.disk_path):
            from tightfit.profiler import profile_disk

            disk = profile_disk(self.disk_dir or plan.disk_path, quick=True, progress=False)
        cuda = isinstance(self.accelerator, CUDAAccelerator)
        self._nvme_gaps = nvme_translation(plan, disk_dir=self.disk_dir, disk=disk, host_budget=self.host_budget,
                                           pin_memory=cuda)[1]
        return deepspeed_config(plan, self.user_config, disk_dir=self.disk_dir, disk=disk,
                                host_budget=self.host_budget, pin_memory=cuda)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("elixir_deepspeed", cls,
                                   description="Elixir's plan translated to DeepSpeed ZeRO (Lightning DeepSpeedStrategy)")

