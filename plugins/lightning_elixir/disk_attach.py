"""The disk tier of a plan applied to a run: which parameters are a plan unit's (:func:`unit_parameters`), and
:func:`attach_disk_state` opening the rank's store with the optimizer-state stream
(:class:`~lightning_elixir.disk_state.DiskOptimizerState`) and, for tier-3 units, their parameters
(:class:`~lightning_elixir.disk_params.DiskParameters`), for tier-4 units their gradients too
(:class:`~lightning_elixir.disk_grads.DiskGradients`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_elixir._torch_adapter import fsdp_param_group
from lightning_elixir.disk_grads import DiskGradients
from lightning_elixir.disk_params import DiskParameters, fsdp_group
from lightning_elixir.disk_state import ALIGN_ELEMENTS, CHUNK_ELEMENTS, DiskOptimizerState, flat_layout
from tightfit.planner.elixir import ElixirPlan
from tightfit.storage import TensorStore

__all__ = ["attach_disk_state", "clips_by_norm", "unit_parameters"]


def unit_parameters(module: nn.Module, units: Sequence[Any], index: int) -> list[nn.Parameter]:
    """The sharded parameters FSDP2 manages for applied unit ``index`` (:class:`~lightning_elixir.apply.AppliedUnit`):
    its group's, or the root group's for a unit whose blocks the root holds (the root follows the first such unit)."""
    unit = units[index]
    if unit.modules:
        owner = unit.modules[0]
    elif unit.on_root and next(u for u in units if u.on_root) is unit:
        owner = module
    else:
        return []
    group = fsdp_param_group(owner)
    return [fp.sharded_param for fp in group.fsdp_params] if group is not None else []


def clips_by_norm(trainer: Any) -> bool:
    """Whether Lightning may clip by norm in this run (``gradient_clip_val`` set, not by value, or the module
    overrides ``configure_gradient_clipping``): then the last backward keeps each disk gradient's norm term."""
    from lightning.pytorch import LightningModule

    module = getattr(trainer, "lightning_module", None)
    custom = module is not None and type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping
    by_value = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm") == "value"
    return custom or (getattr(trainer, "gradient_clip_val", None) is not None and not by_value)


def attach_disk_state(module: nn.Module, plan: ElixirPlan | None, units: Sequence[Any],
                      optimizers: Sequence[torch.optim.Optimizer], disk_dir: Any, *, rank: int,
                      chunk_elements: int = CHUNK_ELEMENTS, norm_type: float | None = 2.0,
                      precision: str = "32-true", fused_on_host: bool = False) -> DiskOptimizerState | None:
    """The disk tier of ``plan`` applied to the run's optimizer: ``None`` when no unit keeps its state on disk.

    Opens this rank's store (``<disk_dir>/rank<rank>``). Raises ``ValueError`` for several optimizers (each would
    need its own layout; the plan prices one), and for tier-4 units under ``precision="16-mixed"`` (its loss
    scaler unscales gradients in RAM). ``norm_type``: the norm the last backward keeps of each gradient that goes
    to disk, for norm clipping (``None``: no norm clipping configured, none kept). ``fused_on_host``: as
    :class:`~lightning_elixir.disk_state.DiskOptimizerState`'s."""
    if plan is None or not plan.disk_units:
        return None
    if disk_dir is None:
        raise ValueError(f"the plan keeps the optimizer state of units {list(plan.disk_units)} on disk, but no "
                         "disk_dir was given: pass ElixirStrategy(disk_dir='/path/on/nvme')")
    if len(optimizers) != 1:
        raise ValueError(f"the plan keeps optimizer state on disk and configure_optimizers returned "
                         f"{len(optimizers)} optimizers; the disk tier streams one: return a single optimizer "
                         "(param groups for different settings), or plan without disk_dir")
    if plan.grad_disk_units and precision.startswith("16"):
        raise ValueError(f"the plan keeps the gradients of units {list(plan.grad_disk_units)} on disk, which "
                         f"precision={precision!r} cannot run (its loss scaler unscales and checks every gradient in "
                         "RAM): use '32-true' or 'bf16-mixed', or plan with ElixirConstraints(allow_disk_grads=False)")
    chosen = [(i, ps) for i, ps in ((i, unit_parameters(module, units, i)) for i in plan.disk_units) if ps]
    store = TensorStore.for_rank(disk_dir, rank)
    tier3, tier4 = set(plan.param_disk_units), set(plan.grad_disk_units)
    master = grads = None
    if tier3:
        master = DiskParameters([(i, fsdp_group(module, units, i), flat_layout(ps)[0]) for i, ps in chosen
                                 if i in tier3], store)
    if tier4:
        grads = DiskGradients([(i, fsdp_group(module, units, i), flat_layout(ps)[0]) for i, ps in chosen
                               if i in tier4], store, accumulate_on_host=plan.grads_accumulate_on_host,
                              norm_type=norm_type)
    if chunk_elements == CHUNK_ELEMENTS and (tier3 or tier4):
        # Each staging set holds the chunk's master weights (and gradients) beside AdamW's two state tensors:
        # the chunk shrinks so that the area stays 128 MiB in all.
        tensors = 2 + bool(tier3) + bool(tier4)
        chunk_elements = max(ALIGN_ELEMENTS, CHUNK_ELEMENTS * 2 // tensors // ALIGN_ELEMENTS * ALIGN_ELEMENTS)
    return DiskOptimizerState(optimizers[0], chosen, store, chunk_elements=chunk_elements, master=master,
                              grads=grads, fused_on_host=fused_on_host)
