"""Every private torch and Lightning name ``lightning_elixir`` touches, in one module.

Written against torch 2.13 and Lightning 2.6 (:data:`WRITTEN_AGAINST`). Each function below names the internal it
reads or changes and why no public API does the job; :func:`missing_internals` checks that every one of them still
exists with the shape used here, and ``tests/lightning_elixir/test_adapter.py`` fails with its list when a torch or
Lightning release changes one. Nothing outside this module may name a private torch or Lightning attribute.

FSDP2 (``torch.distributed.fsdp``). FSDP2's public API drives whole modules (``FSDPModule.unshard/reshard``,
prefetch lists, ``CPUOffloadPolicy``); the disk tiers need what happens inside one parameter group's
gather/release cycle (read a unit's shards from disk just before FSDP2 gathers them, drop them once the gathered
copy exists, write a unit's gradients right after its reduce-scatter), which only the group's own methods see:
:func:`fsdp_param_group` finds the group, :func:`wrap_group_method` wraps one of its methods for one instance
(undone by the returned callable), :func:`group_pass` / :func:`gather_started` read where the group is.

Lightning. Fabric's strategies keep the data-parallel mesh and the gradient-sync control in private attributes
(:func:`setup_data_parallel_mesh`, :func:`set_backward_sync`). ``Trainer(precision="16-mixed")`` is refused for a ``ModelParallelStrategy`` instance and turned into
``"bf16-mixed"`` on a CPU, in ``_AcceleratorConnector._check_and_init_precision``, which has no extension point.
:func:`admit_fp16_flag` answers first for exactly the Elixir strategies that are alive (each registers itself when
constructed) and leaves every other case to Lightning; Lightning's own method is put back when the last of them is
garbage collected, so the class is Lightning's whenever no Elixir strategy exists.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["WRITTEN_AGAINST", "missing_internals", "describe", "fsdp_param_group", "fsdp_param_groups",
           "local_tensor", "storage_key", "group_pass", "gather_started", "wrap_group_method",
           "release_all_reduce_buffer", "wait_gradient_offload", "release_reduce_inputs", "gathers_in_backward",
           "set_gathers_in_backward", "composable_checkpoint", "composable_replicate", "composable_registry",
           "reregister_root_parameters", "foreach_unscale_", "ShardedGradScaler", "setup_data_parallel_mesh",
           "set_backward_sync",
           "redirect_step", "admit_fp16_flag", "fp16_flag_admitted"]

WRITTEN_AGAINST = {"torch": "2.13", "lightning": "2.6"}


# ---- torch: FSDP2 parameter groups ---------------------------------------------------------------------
def fsdp_param_group(module: nn.Module) -> Any:
    """FSDP2's ``FSDPParamGroup`` of a module ``fully_shard`` was applied to (``None``: not sharded, or no parameters
    of its own). FSDP2 keeps it in the module's private state (``_get_fsdp_state()._fsdp_param_group``)."""
    get = getattr(module, "_get_fsdp_state", None)
    return get()._fsdp_param_group if callable(get) else None


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """Every parameter group of a sharded module (one, or several where ``fully_shard`` took a list of modules)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    return [g for g in groups if g is not None]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of ``t``, detached: the very tensor FSDP2 holds (a DTensor's ``_local_tensor``; ``to_local()``
    goes through autograd and may hand back a storage that cannot be resized), or ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t).detach()


def storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage that survives resizing it to zero bytes (the storage object's address:
    ``data_ptr`` is 0 once resized away, so it cannot tell two released storages apart)."""
    return int(local_tensor(t).untyped_storage()._cdata)


def group_pass(group: Any) -> str:
    """Which pass the group is in (``"FORWARD"``, ``"PRE_BACKWARD"``, ``"POST_BACKWARD"``, ``"IDLE"`` ...)."""
    return str(getattr(group._training_state, "name", ""))


def gather_started(group: Any) -> bool:
    """Whether the group's all-gather was issued and not yet waited for (a prefetch in flight)."""
    return group._all_gather_result is not None


def release_all_reduce_buffer(group: Any) -> None:
    """Release a replicated unit's all-reduce buffer now (FSDP2 keeps it until the whole backward ends), ordering
    the current stream after the all-reduce as FSDP2's own release does."""
    release = getattr(group, "_wait_for_post_backward", None)
    if callable(release):
        release()


def wrap_group_method(group: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
                      ) -> Callable[[], None]:
    """Replace ``group.<name>`` (FSDP2 calls ``self.<name>(...)``) for this instance only by ``make(current)``;
    returns the undo, which puts back what was there (another wrapper, or the class's method)."""
    had = name in vars(group)
    current = getattr(group, name)
    setattr(group, name, make(current))

    def undo() -> None:
        if had:
            setattr(group, name, current)
        elif name in vars(group):
            delattr(group, name)
    return undo


def wait_gradient_offload(fsdp_param: Any) -> None:
    """Wait for the non-blocking copy of a parameter's gradient to the host (FSDP2's ``grad_offload_event``, set
    under ``CPUOffloadPolicy`` on a GPU), so the host copy can be read now."""
    event = getattr(fsdp_param, "grad_offload_event", None)
    if event is not None:
        event.synchronize()
        fsdp_param.grad_offload_event = None


def release_reduce_inputs(group: Any) -> None:
    """Drop the reduce-scatter input buffers FSDP2 keeps after a unit's reduction (it recycles them at the next
    unit's, for its streams), after their events, as FSDP2 drops them."""
    states = getattr(getattr(group, "comm_ctx", None), "reduce_scatter_states", None)
    if states:
        for state in states:
            if getattr(state, "event", None) is not None:
                group.device_handle.current_stream().wait_event(state.event)
        states.clear()


def gathers_in_backward(group: Any) -> bool:
    """Whether the group gathers its parameters for backward (FSDP2's ``unshard_in_backward``)."""
    return bool(getattr(group, "unshard_in_backward", True))


def set_gathers_in_backward(group: Any, on: bool) -> None:
    """Turn the group's gathering for backward on or off (backward prefetches of it become no-ops when off)."""
    group.unshard_in_backward = on


# ---- torch: composable APIs and module internals -----------------------------------------------------
def composable_checkpoint() -> Any:
    """torch's composable activation checkpointing (hooks, no wrapper module: parameter names do not change);
    torch ships it under ``torch.distributed._composable`` only."""
    from torch.distributed._composable import checkpoint
    return checkpoint


def composable_replicate() -> Any:
    """torch's composable ``replicate`` (DDP's reducer as hooks on the module, no wrapper)."""
    from torch.distributed._composable import replicate
    return replicate


def composable_registry(module: nn.Module) -> dict[str, Any]:
    """The composable APIs applied to ``module`` (``"checkpoint"``, ``"replicate"``, ``"fully_shard"`` ...)."""
    from torch.distributed._composable.contract import _get_registry

    return dict(_get_registry(module) or {})


def reregister_root_parameters(module: nn.Module) -> None:
    """After materialising a sharded root's own parameters in place (``to_empty``), register FSDP2's sharded
    parameters on it again, as FSDP2's ``_apply`` override does (an identity ``_apply`` over the root only)."""
    module._apply(lambda t: t, recurse=False)


def foreach_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (one device and dtype) by ``inv_scale`` in place and set ``found_inf`` where any is
    inf/nan: the kernel ``torch.amp.GradScaler`` itself uses."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check and unscaling is :meth:`unscale_shards` (GradScaler's
    ``unscale_`` and ``step`` call its private ``_unscale_grads_``, which has no public replacement)."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        return self.unscale_shards(optimizer, inv_scale, found_inf, allow_fp16)

    def unscale_shards(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                       allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """Unscale ``optimizer``'s gradients by ``inv_scale``, fill ``found_inf``; returns the flags per device."""
        raise NotImplementedError


# ---- Lightning: ModelParallelStrategy's own state ------------------------------------------------------
def setup_data_parallel_mesh(strategy: Any) -> None:
    """``ModelParallelStrategy.setup_environment`` with one data-parallel dimension over every rank instead of its
    (data, tensor) mesh: the process group, the sizes it keeps, and the mesh it gives the LightningModule
    (``configure_model`` reads ``self.device_mesh``) - all private attributes of the strategy and the module."""
    from torch.distributed.device_mesh import init_device_mesh

    strategy._setup_distributed()
    strategy._data_parallel_size = strategy.world_size
    strategy._tensor_parallel_size = 1
    strategy._device_mesh = init_device_mesh(strategy.root_device.type, (strategy.world_size,),
                                             mesh_dim_names=("data_parallel",))
    if hasattr(strategy, "lightning_module"):  # the Trainer's strategy; Fabric's has no LightningModule
        assert strategy.lightning_module is not None
        strategy.lightning_module._device_mesh = strategy._device_mesh


def set_backward_sync(strategy: Any, no_sync: Callable[[nn.Module], Any]) -> None:
    """``fabric.no_backward_sync(model)`` on a Fabric strategy runs ``no_sync(module)`` (a context manager). Fabric
    asks the strategy's private ``_backward_sync_control``, an instance of its private ``_BackwardSyncControl``."""
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    class _ElixirBackwardSync(_BackwardSyncControl):
        def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
            from contextlib import nullcontext

            return no_sync(module) if enabled else nullcontext()

    strategy._backward_sync_control = _ElixirBackwardSync()


def redirect_step(strategy: Any, module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``module.<name>(*args, **kwargs)`` through ``module.__call__`` (Lightning's forward redirection, which
    its FSDP strategies use so the root module's forward hooks run)."""
    return strategy._forward_redirection(module, module, name, *args, **kwargs)


# ---- Lightning: the precision flag ------------------------------------------------------------------
_lock = threading.Lock()
_alive = 0  # Elixir strategies constructed and not yet garbage collected
_original: Any = None  # Lightning's _check_and_init_precision while ours is installed
_elixir: weakref.WeakSet[Any] = weakref.WeakSet()


def admit_fp16_flag(strategy: Any, make_plugin: Callable[[bool], Any]) -> None:
    """While ``strategy`` lives, a Trainer given it (or constructing it from a registry name) with
    ``precision="16-mixed"`` and no precision plugin gets ``make_plugin(on_cuda)`` as its plugin."""
    global _alive, _original
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    with _lock:
        if strategy in _elixir:
            return
        _elixir.add(strategy)
        _alive += 1
        weakref.finalize(strategy, _forget)
        if _original is not None:
            return
        original = _AcceleratorConnector._check_and_init_precision

        def _check_and_init_precision(self: Any) -> Any:
            if (self.strategy in _elixir and self._precision_plugin_flag is None
                    and self._precision_flag == "16-mixed"):
                return make_plugin(isinstance(self.accelerator, CUDAAccelerator))
            return original(self)

        _original = original
        _AcceleratorConnector._check_and_init_precision = _check_and_init_precision  # type: ignore[method-assign]


def _forget() -> None:
    global _alive, _original
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    with _lock:
        _alive -= 1
        if _alive == 0 and _original is not None:
            _AcceleratorConnector._check_and_init_precision = _original  # type: ignore[method-assign]
            _original = None


def fp16_flag_admitted() -> bool:
    """Whether Lightning's accelerator connector currently answers ``"16-mixed"`` for Elixir strategies."""
    return _original is not None


# ---- the check ----------------------------------------------------------------------------------------
def _fsdp_group_class() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    return FSDPParamGroup


def _fsdp_state_class() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    return FSDPState


def _connector_class() -> Any:
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    return _AcceleratorConnector


def _model_parallel_class() -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy
    return ModelParallelStrategy


def _fabric_model_parallel_class() -> Any:
    from lightning.fabric.strategies import ModelParallelStrategy
    return ModelParallelStrategy


def _fabric_strategy_class() -> Any:
    from lightning.fabric.strategies import Strategy
    return Strategy


def _strategy_class() -> Any:
    from lightning.pytorch.strategies import Strategy
    return Strategy


def _module_class() -> Any:
    from lightning.pytorch import LightningModule
    return LightningModule


def _has_method(cls: Callable[[], Any], name: str) -> Callable[[], bool]:
    return lambda: callable(getattr(cls(), name, None))


def _sets(cls: Callable[[], Any], name: str) -> Callable[[], bool]:
    """``cls`` assigns ``self.<name>`` somewhere in its source, or defines it (a property)."""
    import inspect

    def check() -> bool:
        source = inspect.getsource(cls())
        return f"self.{name} =" in source or f"self.{name}: " in source or f"def {name}(" in source
    return check


def _expected() -> list[tuple[str, Callable[[], bool]]]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    group, state, connector = _fsdp_group_class, _fsdp_state_class, _connector_class
    checks: list[tuple[str, Callable[[], bool]]] = [
        ("torch: FSDPModule._get_fsdp_state()", lambda: callable(getattr(FSDPModule, "_get_fsdp_state", None))),
        ("torch: FSDPState._fsdp_param_group", _sets(state, "_fsdp_param_group")),
        ("torch: DTensor._local_tensor", lambda: "_local_tensor" in getattr(DTensor, "__slots__", ())
         or _sets(lambda: DTensor, "_local_tensor")()),
        ("torch: UntypedStorage._cdata", lambda: isinstance(torch.empty(1).untyped_storage()._cdata, int)),
        ("torch: torch._amp_foreach_non_finite_check_and_unscale_",
         lambda: callable(getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None))),
        ("torch: GradScaler._unscale_grads_() (ElixirGradScaler overrides it)",
         _has_method(lambda: torch.amp.GradScaler, "_unscale_grads_")),
        ("lightning: _AcceleratorConnector._check_and_init_precision()",
         _has_method(connector, "_check_and_init_precision")),
    ]
    checks += [(f"torch: FSDPParamGroup.{m}()", _has_method(group, m))
               for m in ("unshard", "wait_for_unshard", "post_forward", "post_backward", "reshard",
                         "_wait_for_post_backward")]
    checks += [(f"torch: FSDPParamGroup.{a}", _sets(group, a))
               for a in ("_training_state", "_all_gather_result", "unshard_in_backward", "comm_ctx", "fsdp_params",
                         "is_unsharded", "offload_policy", "device_handle")]
    checks += [("torch: torch.distributed._composable.checkpoint / replicate",
                lambda: callable(composable_checkpoint()) and callable(composable_replicate())),
               ("torch: torch.distributed._composable.contract._get_registry",
                lambda: composable_registry(nn.Linear(1, 1)) == {}),
               ("torch: nn.Module._apply(fn, recurse=)",
                lambda: "recurse" in __import__("inspect").signature(nn.Module._apply).parameters),
               ("torch: FSDPParam.grad_offload_event",
                lambda: "grad_offload_event" in __import__("inspect").getsource(
                    __import__("torch.distributed.fsdp._fully_shard._fsdp_param", fromlist=["FSDPParam"]).FSDPParam)),
               ("torch: FSDPCommContext.reduce_scatter_states",
                lambda: "reduce_scatter_states" in __import__("inspect").getsource(
                    __import__("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                               fromlist=["FSDPCommContext"]).FSDPCommContext))]
    checks += [("lightning: ModelParallelStrategy._setup_distributed()",
                _has_method(_model_parallel_class, "_setup_distributed"))]
    checks += [(f"lightning: ModelParallelStrategy.{a}", _sets(_model_parallel_class, a))
               for a in ("_data_parallel_size", "_tensor_parallel_size", "_device_mesh")]
    checks += [("lightning: fabric ModelParallelStrategy._setup_distributed()",
                _has_method(_fabric_model_parallel_class, "_setup_distributed")),
               ("lightning: fabric Strategy._backward_sync_control", _sets(_fabric_strategy_class, "_backward_sync_control")),
               ("lightning: fabric _BackwardSyncControl.no_backward_sync()",
                _has_method(lambda: __import__("lightning.fabric.strategies.strategy",
                                               fromlist=["_BackwardSyncControl"])._BackwardSyncControl,
                            "no_backward_sync"))]
    checks += [(f"lightning: fabric ModelParallelStrategy.{a}", _sets(_fabric_model_parallel_class, a))
               for a in ("_data_parallel_size", "_tensor_parallel_size", "_device_mesh")]
    checks += [("lightning: Strategy._forward_redirection", _sets(_strategy_class, "_forward_redirection")),
               ("lightning: LightningModule._device_mesh", _sets(_module_class, "_device_mesh"))]
    checks += [(f"lightning: _AcceleratorConnector.{a}", _sets(connector, a))
               for a in ("_precision_plugin_flag", "_precision_flag")]
    return checks


def missing_internals() -> list[str]:
    """The internals this module relies on that the installed torch / Lightning lack (empty: all present)."""
    problems = []
    for what, check in _expected():
        try:
            ok = check()
        except Exception as err:  # an import or attribute that moved
            ok, what = False, f"{what} ({type(err).__name__}: {err})"
        if not ok:
            problems.append(what)
    return problems


def describe(problems: Iterable[str]) -> str:
    """The failure message for :func:`missing_internals`' list."""
    return ("lightning_elixir was written against torch {torch} and Lightning {lightning}; these internals it uses "
            "changed: ".format(**WRITTEN_AGAINST) + "; ".join(problems)
            + ". Update lightning_elixir/_torch_adapter.py (the only module that names them) for this release.")
