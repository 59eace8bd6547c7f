"""Gradient clipping for a model whose Elixir units live on different meshes, devices and tiers.

``clip_grad_norm_`` / ``clip_grad_value_`` are torch's, extended to units on a 2-D replicate mesh beside a 1-D shard
mesh, to offloaded units, and to gradients that wait on disk (tier 4: scaled or clamped as the step reads them).
Both the Trainer's precision plugin and the Fabric strategy clip through them.
"""

from __future__ import annotations

import torch

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose units live on different meshes and devices.

    torch's version stacks per-parameter norms, which DTensor refuses across meshes (``replicate``
    units sit on a 2-D mesh, the others on the 1-D one) and which must meet on one device when some
    units are offloaded. Here each rank sums ``|g|^p`` of its local shards, divides what a mesh
    replicates by its replication factor (so every element is counted once), and one all-reduce
    gives the global norm. Returns the total norm (before clipping), like torch.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from lightning_elixir.disk_grads import disk_gradients_of, norm_term

    parameters = list(parameters)
    disk = disk_gradients_of(parameters)  # tier-4 units: gradients on disk, their norm terms kept in backward
    params = [p for p in parameters if p.grad is not None or (disk is not None and disk.holds(p))]
    grads = [p.grad for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    if disk is None and not any(isinstance(g, DTensor) for g in grads) and len({g.device for g in grads}) == 1:
        # Plain tensors on one device (a plan applied with DDP: every rank holds the same reduced gradients):
        # torch's own clipping, the very arithmetic DDP training clips with.
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    first = params[0].grad if params[0].grad is not None else params[0]  # a disk gradient: its parameter's device
    total = torch.zeros((), dtype=torch.float64, device=(first.to_local() if isinstance(first, DTensor)
                                                         else first).device)
    for p in params:
        g = p.grad
        ref = g if g is not None else p  # a gradient on disk has its parameter's placements
        if isinstance(ref, DTensor):
            copies = 1
            for dim, placement in enumerate(ref.placements):
                if isinstance(placement, Replicate):
                    copies *= ref.device_mesh.size(dim)
        else:
            copies = world  # a plain tensor is the same on every rank
        if g is None:
            assert disk is not None
            term = disk.term(p, norm_type)
        else:
            term = norm_term(g.to_local() if isinstance(g, DTensor) else g, norm_type)
        total += term.to(total.device) / copies
    if world > 1:
        comm = total.cuda() if dist.get_backend() == "nccl" else total.cpu()
        dist.all_reduce(comm)
        total = comm.to(total.device)
    norm = total.pow(1.0 / norm_type).float()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))
    if disk is not None:
        disk.scale(coef)  # the gradients on disk: multiplied as they are read by the step
    return norm


@torch.no_grad()
def clip_grad_value_(parameters, clip_val: float) -> None:
    """``torch.nn.utils.clip_grad_value_`` over gradients in memory and on disk (tier 4: clamped as the step reads
    them)."""
    from lightning_elixir.disk_grads import disk_gradients_of

    params = list(parameters)
    if any(p.grad is not None for p in params):  # torch's refuses a list with no gradient
        torch.nn.utils.clip_grad_value_(params, clip_val)
    disk = disk_gradients_of(params)
    if disk is not None:
        disk.clamp(float(clip_val))
