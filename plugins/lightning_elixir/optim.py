"""One optimizer over units on several meshes and devices: each step sees one param group per (mesh, device).

An Elixir plan puts ``replicate`` units on a ``(world, 1)`` mesh and the others on the 1-D mesh, and
offloaded units' shards on the host. torch's foreach and fused optimizer kernels take one list of
tensors per param group; a list of DTensors on two meshes is refused by the DTensor versions torch
ships with CUDA 13 images ("DTensor does not support cross-mesh operation", the error gradient
clipping met first), and the user's ``configure_optimizers`` knows nothing of meshes.

:func:`step_per_mesh` fixes it without touching the user's optimizer: a step pre-hook presents, for
the duration of ``step`` only, the user's groups split by (mesh, device) - same hyperparameters,
read fresh every step, so LR schedulers, ``state_dict`` and checkpoints see the groups as the user
made them (the post-hook puts them back). Host buckets of Adam/AdamW can also step with torch's fused
CPU kernel (one pass over the shards instead of foreach's several), chosen per bucket and passed as
the group's own ``fused`` option, never forced on a user who chose ``foreach`` or ``fused`` himself.

Example:
    >>> opt = torch.optim.AdamW(model.parameters())              # doctest: +SKIP
    >>> step_per_mesh(opt, fused_on_host=True)                   # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["step_per_mesh", "placement_key", "host_group"]

# Optimizers whose step takes each group's own ``fused`` flag (torch's fused CPU and CUDA kernels).
_FUSABLE = ("Adam", "AdamW")
_installed: weakref.WeakKeyDictionary[torch.optim.Optimizer, _MeshSplit] = weakref.WeakKeyDictionary()


def placement_key(p: torch.Tensor) -> tuple[Hashable, torch.device]:
    """(mesh, device of the local data): parameters sharing it can share one foreach/fused launch."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return (p.device_mesh, p.to_local().device)
    return (None, p.device)


class _MeshSplit:
    def __init__(self, optimizer: torch.optim.Optimizer, fused_on_host: bool) -> None:
        self.fused_on_host = fused_on_host and type(optimizer).__name__ in _FUSABLE
        self.original: list[dict[str, Any]] | None = None
        self.handles = (optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after))

    def part(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
        """``group``'s hyperparameters over ``params`` (all on ``device``), with the fused choice for host buckets."""
        part = {**group, "params": params}
        if (self.fused_on_host and device.type == "cpu" and group.get("fused") is None
                and not group.get("foreach") and not group.get("differentiable")):
            part["fused"], part["foreach"] = True, False
        return part

    def _split(self, group: dict[str, Any]) -> list[dict[str, Any]]:
        buckets: dict[tuple[Hashable, torch.device], list[torch.Tensor]] = {}
        for p in group["params"]:
            buckets.setdefault(placement_key(p), []).append(p)
        return [self.part(group, params, device) for (_mesh, device), params in buckets.items()]

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._after(optimizer, args, kwargs)  # a step that raised left the split in place
        self.original = optimizer.param_groups
        optimizer.param_groups = [part for group in self.original for part in self._split(group)]

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.original is not None:
            optimizer.param_groups = self.original
            self.original = None


def step_per_mesh(optimizer: torch.optim.Optimizer, *, fused_on_host: bool = False) -> torch.optim.Optimizer:
    """Make every ``optimizer.step()`` run one param group per (mesh, device); returns the optimizer.

    Args:
        optimizer: any ``torch.optim`` optimizer with a ``foreach`` or ``fused`` option (others, e.g.
            LBFGS, which needs its single group, are left alone).
        fused_on_host: Adam/AdamW groups whose parameters live on the host step with the fused CPU
            kernel unless the user set ``foreach``/``fused`` (worth it on a GPU machine, where the host
            step of offloaded units is on the critical path).

    Installing twice is a no-op (the first installation's ``fused_on_host`` stays).
    """
    if optimizer in _installed or not {"foreach", "fused"} & set(optimizer.defaults):
        return optimizer
    _installed[optimizer] = _MeshSplit(optimizer, fused_on_host)
    return optimizer


def host_group(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """The param group one step of ``params`` (host tensors of ``group``) runs with: the group's hyperparameters
    and the fused choice :func:`step_per_mesh` makes for host buckets (so a step over a subset of a group, as the
    disk tier's chunks are, runs the kernel the whole group would)."""
    split = _installed.get(optimizer)
    return split.part(group, params, torch.device("cpu")) if split is not None else {**group, "params": params}
