"""A plan that replicates everything, applied with DDP semantics instead of FSDP2.

When the plan's every unit is ``replicate``, nothing is offloaded, nothing is recomputed and the parameters
are computed in the dtype their gradients are reduced in, the plan *is* data parallelism: every rank holds
the whole model, gradients are all-reduced. FSDP2 on a ``(world, 1)`` mesh runs that plan, but with its
per-unit hooks, DTensor parameters and a DTensor optimizer step that DDP does not pay (the benchmark
``elixir_vs_ddp`` measured the difference on 2 CPU processes). :func:`apply_replicated` runs it with torch's
composable ``replicate`` (DistributedDataParallel's reducer, bucketed all-reduce overlapped with backward)
on the LightningModule itself: the module is not wrapped, parameter names and checkpoints stay the model's
own, and DCP saves the (plain, replicated) tensors once.

The plan decides; this module only applies it. :func:`replicates_everything` reads the plan, it does not
weigh alternatives. Re-planning (``ElixirStrategy(replan=True)``) keeps FSDP2, whose units can change mode
between steps.

Example:
    >>> if replicates_everything(plan):                               # doctest: +SKIP
    ...     units = apply_replicated(module, plan, mesh, device=torch.device("cpu"))
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_elixir._torch_adapter import composable_replicate
from lightning_elixir.apply import AppliedUnit, is_replicated, materialize, resolve_units
from tightfit.planner.elixir import ElixirPlan, Tier

__all__ = ["replicates_everything", "apply_replicated", "no_gradient_sync", "load_replicated"]


def replicates_everything(plan: ElixirPlan) -> bool:
    """Every unit replicated, on the device, nothing recomputed, compute dtype = reduction dtype."""
    return (bool(plan.units) and all(u.mode == "replicate" and u.tier == Tier.DEVICE and not u.checkpoint
                                     for u in plan.units)
            and plan.param_dtype == plan.reduce_dtype)


def apply_replicated(module: nn.Module, plan: ElixirPlan, mesh, *, device: torch.device) -> list[AppliedUnit]:
    """Apply an all-replicate ``plan`` to ``module`` with DDP's gradient all-reduce; returns the plan's units.

    Meta parameters are allocated on ``device`` and initialised as :func:`lightning_elixir.apply.materialize`
    does; DDP broadcasts rank 0's parameters at the first forward, as ``DistributedDataParallel`` does.
    """
    replicate = composable_replicate()
    if not replicates_everything(plan):
        raise ValueError("apply_replicated: the plan does not replicate every unit on the device without "
                         "recomputation; apply it with lightning_elixir.apply.apply_plan")
    if plan.world_size != mesh.size():
        raise ValueError(f"plan was made for world size {plan.world_size}, the mesh has {mesh.size()} ranks; "
                         "re-plan for this run")
    units = resolve_units(module, plan)
    materialize(module, units, device)
    module.to(device)  # parameters built outside the meta device (no-op where they already are)
    replicate(module, device_id=device)
    return units


@contextmanager
def no_gradient_sync(module: nn.Module) -> Generator[None, None, None]:
    """Backward passes inside accumulate local gradients without the all-reduce (DDP's ``no_sync``)."""
    if not is_replicated(module):
        yield
        return
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]


def load_replicated(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, strict: bool,
                    weights_only: bool | None) -> dict[str, Any]:
    """Load a checkpoint into a module applied with :func:`apply_replicated`; returns Lightning's metadata.

    ``path``: a ``torch.distributed.checkpoint`` directory as :class:`~lightning_elixir.ElixirStrategy` saves (any
    plan's: DCP reshards on load), or a single-file Lightning checkpoint (``strategy="ddp"``'s ``.ckpt``). Every rank
    reads the whole state: each holds the whole model. (Lightning's own loader looks for DTensor modules.)
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from lightning_elixir.checkpoint import METADATA_FILENAME

    if path.is_dir():
        state = {"state_dict": get_model_state_dict(module)}
        dcp_load(state, storage_reader=FileSystemReader(path))
        module.load_state_dict(state["state_dict"], strict=strict)
        for i, opt in enumerate(optimizers):
            key = f"optimizer_{i}"
            optim = {key: get_optimizer_state_dict(module, opt)}
            dcp_load(optim, storage_reader=FileSystemReader(path))
            set_optimizer_state_dict(module, opt, optim_state_dict=optim[key])
        return torch.load(path / METADATA_FILENAME, weights_only=weights_only)
    checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
    module.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
    for opt, saved in zip(optimizers, checkpoint.get("optimizer_states", [])):
        opt.load_state_dict(saved)
    return checkpoint
