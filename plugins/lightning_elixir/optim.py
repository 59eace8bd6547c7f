"""One optimizer over units on several meshes and devices: each step runs one param group per (mesh, device).

An Elixir plan puts ``replicate`` units on a ``(world, 1)`` mesh and the others on the 1-D mesh, and
offloaded units' shards on the host. torch's foreach and fused optimizer kernels take one list of
tensors per param group; a list of DTensors on two meshes is refused by the DTensor versions torch
ships with CUDA 13 images ("DTensor does not support cross-mesh operation", the error gradient
clipping met first), and the user's ``configure_optimizers`` knows nothing of meshes.

:func:`mesh_step` runs one step of the user's optimizer with, for the duration of that step only, the
user's groups split by (mesh, device) - same hyperparameters, read fresh every step, so LR schedulers,
``state_dict`` and checkpoints see the groups as the user made them (they are back when the step returns,
or raises). Host buckets of Adam/AdamW can also step with torch's fused CPU kernel (one pass over the
shards instead of foreach's several), chosen per bucket and passed as the group's own ``fused`` option,
never forced on a user who chose ``foreach`` or ``fused`` himself. :class:`lightning_elixir.step.ElixirOptimizer`
calls it from ``ElixirStrategy.optimizer_step``; nothing is installed on the optimizer.

Example:
    >>> opt = torch.optim.AdamW(model.parameters())              # doctest: +SKIP
    >>> loss.backward(); mesh_step(opt, fused_on_host=True)      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["mesh_step", "splits_by_mesh", "placement_key", "host_group", "presented"]

# Optimizers whose step takes each group's own ``fused`` flag (torch's fused CPU and CUDA kernels).
_FUSABLE = ("Adam", "AdamW")


def placement_key(p: torch.Tensor) -> tuple[Hashable, torch.device]:
    """(mesh, device of the local data): parameters sharing it can share one foreach/fused launch."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return (p.device_mesh, p.to_local().device)
    return (None, p.device)


def splits_by_mesh(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`mesh_step` splits ``optimizer``'s groups: it has a ``foreach`` or ``fused`` option (others,
    e.g. LBFGS, which needs its single group, step as they are)."""
    return bool({"foreach", "fused"} & set(optimizer.defaults))


def host_group(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor],
               device: torch.device = torch.device("cpu"), *, fused_on_host: bool = False) -> dict[str, Any]:
    """``group``'s hyperparameters over ``params`` (all on ``device``), with the fused choice for host buckets (so a
    step over a subset of a group, as the disk tier's chunks are, runs the kernel the whole group would)."""
    part = {**group, "params": params}
    if (fused_on_host and type(optimizer).__name__ in _FUSABLE and device.type == "cpu"
            and group.get("fused") is None and not group.get("foreach") and not group.get("differentiable")):
        part["fused"], part["foreach"] = True, False
    return part


def _split(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], fused_on_host: bool,
           skip: Collection[int]) -> list[dict[str, Any]]:
    out = []
    for group in groups:
        buckets: dict[tuple[Hashable, torch.device], list[torch.Tensor]] = {}
        for p in group["params"]:
            if id(p) not in skip:
                buckets.setdefault(placement_key(p), []).append(p)
        out += [host_group(optimizer, group, params, device, fused_on_host=fused_on_host)
                for (_mesh, device), params in buckets.items()]
    return out


@contextmanager
def presented(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> Iterator[None]:
    """Within: ``optimizer.param_groups`` is ``groups``; the user's groups are back on exit (a raise included)."""
    own = optimizer.param_groups
    optimizer.param_groups = groups
    try:
        yield
    finally:
        optimizer.param_groups = own


def mesh_step(optimizer: torch.optim.Optimizer, *, fused_on_host: bool = False, skip: Collection[int] = (),
              **kwargs: Any) -> Any:
    """One ``optimizer.step(**kwargs)`` (its hooks run as usual) over one param group per (mesh, device).

    Args:
        optimizer: any ``torch.optim`` optimizer; one without a ``foreach`` or ``fused`` option (e.g. LBFGS) steps
            its groups as they are (:func:`splits_by_mesh`).
        fused_on_host: Adam/AdamW groups whose parameters live on the host step with the fused CPU
            kernel unless the user set ``foreach``/``fused`` (worth it on a GPU machine, where the host
            step of offloaded units is on the critical path).
        skip: ids of parameters this step leaves out (the disk tier's, which it steps chunk by chunk).
    """
    if not splits_by_mesh(optimizer):
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in skip]} for g in optimizer.param_groups]
    else:
        groups = _split(optimizer, optimizer.param_groups, fused_on_host, skip)
    if not skip and not splits_by_mesh(optimizer):
        return optimizer.step(**kwargs)
    with presented(optimizer, groups):
        return optimizer.step(**kwargs)
