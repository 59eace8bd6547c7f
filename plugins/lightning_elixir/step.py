"""The optimizer step of an Elixir run, in one call chain.

``ElixirStrategy.optimizer_step`` (Lightning's override point) hands the precision plugin an
:class:`ElixirOptimizer` in place of the user's optimizer. Whatever the plugin does (Lightning's ``Precision``
calls ``step(closure)``; :class:`~lightning_elixir.precision.ElixirPrecision` runs the closure, unscales, and
steps through its scaler), its ``step`` runs, in order:

1. Lightning's closure (forward, backward, ``on_before_optimizer_step``, gradient clipping), over every
   parameter of the user's groups; where the plan keeps gradients on disk, this backward is marked the step's
   last (:attr:`lightning_elixir.disk_grads.DiskGradients.final`);
2. the user's optimizer over the parameters in RAM, one param group per (mesh, device)
   (:func:`lightning_elixir.optim.mesh_step`; its hooks run, once);
3. the disk units' parameters, chunk by chunk (:meth:`lightning_elixir.disk_state.DiskOptimizerState.step`).

Nothing is installed on the user's optimizer: its groups, hooks and ``state_dict`` are its own, and the
wrapper reads through to them (``param_groups``, ``state``, ``defaults`` and any other attribute). The hooks
Lightning calls with the optimizer during the step (``on_before_optimizer_step``, ``configure_gradient_clipping``)
receive the wrapper; its ``optimizer`` is the user's.

Example:
    >>> stepper = ElixirOptimizer(torch.optim.AdamW(params), fused_on_host=True, disk=disk_state)  # doctest: +SKIP
    >>> stepper.step(closure)                                                                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_elixir.disk_state import DiskOptimizerState
from lightning_elixir.optim import mesh_step

__all__ = ["ElixirOptimizer"]


class ElixirOptimizer:
    """The user's ``optimizer`` as Elixir steps it (see the module docstring).

    Args:
        optimizer: the optimizer ``configure_optimizers`` returned, used unchanged.
        fused_on_host: Adam/AdamW host buckets step with torch's fused CPU kernel unless the user chose
            (:func:`lightning_elixir.optim.mesh_step`; the disk tier's chunks make the choice its
            ``fused_on_host`` says).
        disk: the disk tier's streamed state of this optimizer's disk units (``None``: no unit on disk).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, fused_on_host: bool = False,
                 disk: DiskOptimizerState | None = None) -> None:
        if disk is not None and disk.optimizer is not optimizer:
            raise ValueError("ElixirOptimizer(disk=...): the disk state streams another optimizer's state; pass "
                             "the optimizer it was built for")
        self.optimizer, self.fused_on_host, self.disk = optimizer, fused_on_host, disk

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        # Only for names not defined here: the user's optimizer answers (``state_dict``, its own attributes). Not
        # its private ones: GradScaler reads a fused optimizer's private flag to hand it the inf check and skip
        # inside the kernel, which would skip the user's call only, not the disk chunks; answering none, GradScaler
        # skips the whole step itself when a gradient is inf/nan.
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("_"):  # not constructed yet (copy, unpickling), or private
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __repr__(self) -> str:
        return f"ElixirOptimizer({self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def init_state(self) -> None:
        """Give an optimizer without state the state its first step makes, parameters unchanged (zero gradients, zero
        learning rate; gradients cleared after). torch's distributed state-dict helpers initialise an empty state
        this way, with a plain ``optimizer.step()``, which would skip the per-mesh groups and the disk tier: the
        strategy calls this first, before a checkpoint is saved or loaded. No-op where the state exists or any
        gradient does, as theirs."""
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if opt.state or any(p.grad is not None for p in params):
            return
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in opt.param_groups if "lr" in g]
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        try:
            self.step()
        finally:
            for g in opt.param_groups:
                if "lr" in g:
                    g["lr"] = lrs.pop(0)
            opt.zero_grad(set_to_none=True)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Closure, the step of the parameters in RAM, the disk units' streamed step; returns the closure's result."""
        loss = None
        if closure is not None:
            grads = self.disk.grads if self.disk is not None else None
            if grads is not None:
                grads.final = True  # this backward is the step's last: its gradients go to disk final
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                if grads is not None:
                    grads.final = False
        skip = self.disk.params if self.disk is not None else ()
        mesh_step(self.optimizer, fused_on_host=self.fused_on_host, skip=skip, **kwargs)
        if self.disk is not None:
            self.disk.step()
        return loss
