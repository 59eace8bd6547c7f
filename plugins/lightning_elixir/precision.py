"""``precision="16-mixed"`` for :class:`~lightning_elixir.strategy.ElixirStrategy`: fp16 compute, dynamic loss scaling.

Lightning's ``ModelParallelStrategy`` family (Elixir's base) refuses ``"16-mixed"``, and its
generic ``MixedPrecision`` plugin would be wrong here anyway: ``torch.amp.GradScaler`` looks for
inf/nan only in the gradients a rank holds, and under FSDP2 each rank holds a different shard of
every gradient (on the device, or on the host for offloaded units). One rank could then skip a step
that another takes, and the replicas would silently diverge.

Three pieces make fp16 work on Elixir's FSDP2 units:

* the plan is priced for ``"16-mixed"`` (:func:`tightfit.planner.cost.precision_spec`: fp16 gathered
  parameters and unsharded gradients, fp32 master weights, optimizer state and reduce-scatter, so the
  memory of bf16-mixed) and :func:`lightning_elixir.apply.mixed_precision_policy` turns it into
  ``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``: an fp16 overflow in backward
  reaches the fp32 sharded gradient as inf/nan;
* :class:`ElixirGradScaler` - ``torch.amp.GradScaler`` whose inf/nan check reads the *local shards* of
  FSDP2's DTensor gradients on every device they live on, then agrees across ranks with one
  all-reduce (max), so every rank skips the same steps and moves the scale the same way;
* :class:`ElixirPrecision` - the Lightning precision plugin: ``torch.autocast`` to fp16 around the
  steps (matmuls in fp16, losses and softmax in fp32), the loss scaled before backward, gradients
  unscaled right after the closure (so ``on_before_optimizer_step`` and gradient clipping see true
  gradients), the optimizer from ``configure_optimizers`` stepped through the scaler (skipped on
  inf/nan), and the scaler's state saved in and restored from checkpoints.

``Trainer(strategy="elixir" | ElixirStrategy(...), precision="16-mixed")`` selects the plugin:
:func:`admit_fp16_flag` (run when an ``ElixirStrategy`` is constructed, never on import) lets Lightning's accelerator
connector hand that strategy an :class:`ElixirPrecision` for ``"16-mixed"`` instead of refusing it
(a strategy instance) or silently training bf16 (the strategy's name on a CPU); Lightning's connector is its own
again once no Elixir strategy is alive (:mod:`lightning_elixir._torch_adapter`). Passing the plugin
yourself also works and sets the scaler's knobs: ``Trainer(strategy="elixir",
plugins=[ElixirPrecision(init_scale=2.0**12)])``.

Gradient clipping by norm is an override, :meth:`ClipAcrossMeshes.clip_grad_by_norm`, which every
Elixir plugin inherits: torch's ``clip_grad_norm_`` refuses gradients on several meshes and devices.
For the other precisions, :meth:`ElixirStrategy.setup` swaps Lightning's plugin for the Elixir
subclass with the same settings (:func:`with_mesh_clipping`: ``ElixirHalfPrecision``,
``ElixirMixedPrecision``, ``ClipAcrossMeshes`` for ``"32-true"``).

Example:
    >>> import lightning as L
    >>> import lightning_elixir
    >>> trainer = L.Trainer(strategy="elixir", precision="16-mixed", devices=2)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from typing_extensions import override

from lightning_elixir._torch_adapter import ShardedGradScaler, foreach_unscale_
from lightning_elixir._torch_adapter import admit_fp16_flag as _admit_while_alive
from lightning_elixir.clipping import clip_grad_norm_, clip_grad_value_

__all__ = ["ElixirGradScaler", "ElixirPrecision", "ElixirFabricPrecision", "ClipAcrossMeshes", "ElixirHalfPrecision", "ElixirMixedPrecision",
           "with_mesh_clipping", "admit_fp16_flag"]


class ElixirGradScaler(ShardedGradScaler):
    """Dynamic loss scaling for FSDP2 gradients sharded across ranks and devices.

    ``torch.amp.GradScaler`` with one change: the inf/nan check (:meth:`unscale_shards`, which
    ``unscale_`` and ``step`` call) unwraps DTensor gradients to their local shards, unscales them with
    one call of GradScaler's own kernel per (device, dtype) - offloaded units' shards on
    the host, the others on the device - and all-reduces one flag (max) over ``process_group``. Scale
    growth and backoff are GradScaler's own (``update``), and so is the state dict.

    Args:
        device: device type of the scale and the loss (``"cuda"`` or ``"cpu"``).
        init_scale / growth_factor / backoff_factor / growth_interval: as ``torch.amp.GradScaler``.
        process_group: the ranks that must agree (default: the whole world).
    """

    def __init__(self, device: str = "cuda", *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, process_group: Any = None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval)
        self.process_group = process_group

    @override
    def unscale_shards(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                       allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    # In-place on the local shard is in-place on the DTensor gradient (it wraps that tensor).
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    if local.is_sparse:
                        raise ValueError(f"ElixirGradScaler: parameter of shape {tuple(param.shape)} has a sparse "
                                         "gradient; FSDP2 units have dense gradients only, keep sparse embeddings "
                                         "out of Elixir's units or train them in bf16-mixed")
                    if local.dtype == torch.float16 and not allow_fp16:
                        raise ValueError(f"ElixirGradScaler: a gradient of shape {tuple(param.shape)} is float16; "
                                         "unscaling fp16 gradients loses them. With precision='16-mixed' Elixir "
                                         "keeps fp32 master weights: do not cast the model to fp16 yourself")
                    if local.numel():  # a rank may hold an empty shard of a small parameter
                        buckets.setdefault((local.device, local.dtype), []).append(local)
            flags: dict[torch.device, torch.Tensor] = {}
            for (device, _), grads in buckets.items():
                if device not in flags:
                    flags[device] = torch.zeros((), dtype=torch.float32, device=device)
                foreach_unscale_(grads, flags[device], inv_scale.to(device))
            for flag in flags.values():
                found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
            self._agree(found_inf)
        # One entry on the scale's device: GradScaler sums the entries to decide, and every rank holds the same.
        return {found_inf.device: found_inf}

    def _agree(self, found_inf: torch.Tensor) -> None:
        """Max of the flag over the ranks (a collective: every rank calls it at the same step)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.process_group) == 1:
            return
        # NCCL moves device tensors only; gloo moves host tensors (the flag is one float either way).
        comm_device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
        flag = found_inf.to(comm_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        found_inf.copy_(flag)


class ClipAcrossMeshes(Precision):
    """Lightning's ``Precision`` whose norm clipping counts every unit, whatever mesh or device it lives on.

    ``Precision.clip_grad_by_norm`` calls ``torch.nn.utils.clip_grad_norm_``, which refuses gradients
    on several meshes (``replicate`` units sit on a 2-D mesh, the others on the 1-D one) and needs
    them on one device (offloaded units keep theirs on the host); this override calls
    :func:`lightning_elixir.clipping.clip_grad_norm_` instead, on the same parameters. As a plugin of its
    own it is ``precision="32-true"``; the Elixir plugins below derive from it, and a custom
    precision plugin for :class:`~lightning_elixir.strategy.ElixirStrategy` should too.
    """

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float | int) -> None:
        clip_grad_norm_(self.main_params(optimizer), float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: float | int) -> None:
        clip_grad_value_(self.main_params(optimizer), float(clip_val))


class ElixirHalfPrecision(ClipAcrossMeshes, HalfPrecision):
    """Lightning's ``HalfPrecision`` (``"bf16-true"`` / ``"16-true"``) with :class:`ClipAcrossMeshes`' norm clipping."""


class ElixirMixedPrecision(ClipAcrossMeshes, MixedPrecision):
    """Lightning's ``MixedPrecision`` (``"bf16-mixed"``) with :class:`ClipAcrossMeshes`' norm clipping."""


def with_mesh_clipping(plugin: Precision) -> Precision:
    """``plugin`` as the Elixir plugin with the same settings whose norm clipping works across meshes.

    Lightning picks its own plugin for the Trainer's precision flag (``Precision`` for ``"32-true"``,
    ``HalfPrecision``, ``MixedPrecision``); :meth:`ElixirStrategy.setup` hands it here and keeps what
    comes back. Plugins that already clip across meshes (:class:`ElixirPrecision`, any
    :class:`ClipAcrossMeshes`) and classes this does not know (a user's own) are returned unchanged.
    """
    if isinstance(plugin, ClipAcrossMeshes):
        return plugin
    kind = type(plugin)  # exactly Lightning's classes: a subclass may carry state a copy would lose
    if kind is Precision:
        return ClipAcrossMeshes()
    if kind is HalfPrecision and isinstance(plugin, HalfPrecision):
        return ElixirHalfPrecision(plugin.precision)
    if kind is MixedPrecision and isinstance(plugin, MixedPrecision):
        return ElixirMixedPrecision(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]
    return plugin


class ElixirPrecision(ClipAcrossMeshes):
    """Lightning precision plugin for ``precision="16-mixed"`` under :class:`ElixirStrategy` (see the module docstring).

    Args:
        precision: ``"16-mixed"`` (the only one it implements; the others use Lightning's own plugins).
        device: device type compute runs on (``"cuda"`` / ``"cpu"``); ``None``: the strategy's device,
            set when the strategy sets up.
        init_scale: the loss scaler's initial scale, as ``torch.amp.GradScaler``'s.
        growth_factor: the scale's factor after ``growth_interval`` steps without an overflow, as ``GradScaler``'s.
        backoff_factor: the scale's factor after an overflow, as ``GradScaler``'s.
        growth_interval: steps without an overflow before the scale grows, as ``GradScaler``'s.
        scaler: an :class:`ElixirGradScaler` to use instead of building one.

    Example:
        >>> trainer = L.Trainer(strategy="elixir", plugins=[ElixirPrecision(growth_interval=500)])  # doctest: +SKIP
    """

    def __init__(self, precision: str = "16-mixed", device: str | None = None, *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 scaler: ElixirGradScaler | None = None) -> None:
        if precision not in ("16-mixed", "16"):
            raise ValueError(f"ElixirPrecision(precision={precision!r}): it implements '16-mixed' only; for "
                             "'32-true', 'bf16-mixed' or 'bf16-true' pass Trainer(precision=...) and Lightning's own "
                             "plugin is used")
        if scaler is not None and not isinstance(scaler, ElixirGradScaler):
            raise TypeError(f"ElixirPrecision(scaler={type(scaler).__name__}): use an ElixirGradScaler; a plain "
                            "GradScaler checks only this rank's gradient shards and lets ranks skip different steps")
        self.precision = "16-mixed"  # type: ignore[assignment]
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._explicit_device = device is not None or scaler is not None
        self.scaler = scaler or ElixirGradScaler(self.device, init_scale=init_scale, growth_factor=growth_factor,
                                                 backoff_factor=backoff_factor, growth_interval=growth_interval)

    def bind(self, device: torch.device) -> None:
        """Follow the strategy's device when none was given (called by :meth:`ElixirStrategy.setup`)."""
        if self._explicit_device or device.type == self.device:
            return
        old = self.scaler
        self.device = device.type
        self.scaler = ElixirGradScaler(self.device, init_scale=old.get_scale(), growth_factor=old.get_growth_factor(),
                                       backoff_factor=old.get_backoff_factor(),
                                       growth_interval=old.get_growth_interval())

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # FSDP2 already gathers fp16 parameters; autocast keeps the precision-sensitive ops (softmax,
        # log-softmax, losses) in fp32, where fp16's 65504 ceiling and 6e-8 floor cannot bite.
        with torch.autocast(self.device, dtype=torch.float16, cache_enabled=False):
            yield

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(self.scaler.scale(tensor), module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],  # type: ignore[override]
                       **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("precision='16-mixed' cannot step LBFGS: it re-evaluates the loss inside step(), which "
                            "loss scaling cannot wrap; use precision='32-true' or 'bf16-mixed' with LBFGS")
        result = closure()
        if result is None and model.automatic_optimization:
            return result  # training_step returned None: no backward ran, nothing to step
        # Unscale here, always (fused optimizers too): the hooks and gradient clipping that follow must see
        # true gradients, and the inf/nan flag must be agreed by every rank before anyone steps.
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        out = self.scaler.step(optimizer, **kwargs)  # skipped when any rank found inf/nan
        self.scaler.update()  # backoff after a skipped step, growth after growth_interval clean ones
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)


class ElixirFabricPrecision(FabricMixedPrecision):
    """Fabric's ``"16-mixed"`` for :class:`~lightning_elixir.fabric_strategy.ElixirFabricStrategy`: pass it as
    ``Fabric(strategy=..., plugins=[ElixirFabricPrecision()])``.

    Fabric's own ``MixedPrecision`` plugin (autocast to fp16, the loss scaled in ``fabric.backward``, the step through
    the scaler and skipped on inf/nan, the scaler's state in ``fabric.save``) with an :class:`ElixirGradScaler`: the
    inf/nan check reads every rank's gradient shards, on every device, and all ranks agree, as
    :class:`ElixirPrecision` does under the Trainer. Fabric's connector refuses the ``precision="16-mixed"`` flag for
    any ``ModelParallelStrategy`` and has no hook to choose another plugin, so the plugin is passed, not the flag.

    Args:
        device: device type compute runs on (``None``: ``"cuda"`` where there is one, else ``"cpu"``).
        init_scale / growth_factor / backoff_factor / growth_interval: as ``torch.amp.GradScaler``'s.
        scaler: an :class:`ElixirGradScaler` to use instead of building one.

    Example:
        >>> fabric = L.Fabric(strategy=ElixirFabricStrategy(...), plugins=[ElixirFabricPrecision()])  # doctest: +SKIP
    """

    def __init__(self, device: str | None = None, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 scaler: ElixirGradScaler | None = None) -> None:
        if scaler is not None and not isinstance(scaler, ElixirGradScaler):
            raise TypeError(f"ElixirFabricPrecision(scaler={type(scaler).__name__}): use an ElixirGradScaler; a plain "
                            "GradScaler checks only this rank's gradient shards and lets ranks skip different steps")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__("16-mixed", device, scaler or ElixirGradScaler(
            device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval))


def admit_fp16_flag(strategy: Any) -> None:
    """Make ``Trainer(precision="16-mixed")`` give ``strategy`` (an ``ElixirStrategy``, which passes itself when
    constructed: this module never imports the strategy) an :class:`ElixirPrecision` (idempotent).

    Lightning decides the precision plugin in its accelerator connector, which has no extension point: it refuses
    ``"16-mixed"`` for a ``ModelParallelStrategy`` instance and replaces it with ``"bf16-mixed"`` on a CPU.
    :func:`lightning_elixir._torch_adapter.admit_fp16_flag` answers first for exactly one case - this strategy (not
    the DeepSpeed backend, which has its own fp16 engine), the ``"16-mixed"`` flag, no precision plugin given - and
    only while an Elixir strategy exists; every other case is Lightning's.
    """
    _admit_while_alive(strategy, lambda on_cuda: ElixirPrecision("16-mixed", "cuda" if on_cuda else "cpu"))
