"""Checkpoints of optimizer state on disk, streamed: ``torch.distributed.checkpoint`` planners that read each
disk-resident state tensor from the store as DCP writes it, and write each one to the store as DCP reads it.

The optimizer's state dict holds, for a disk parameter's streamed keys (AdamW's ``exp_avg`` / ``exp_avg_sq``),
placeholders of the right shape backed by one element (:class:`~lightning_elixir.disk_state.DiskOptimizerState`).
So the checkpoint has the very layout of a run all in RAM - the same keys, shapes and DTensor shards - and
loads into one (``ElixirStrategy`` without ``disk_dir``, another plan, another world size) unchanged; the
atomic rename and the SHA-256 checksums of :mod:`lightning_elixir.checkpoint` cover it like any other.

Memory: DCP's serial loader resolves one write item at a time (one parameter's shard of one key, at most a
unit), and the file-system reader commits each read item before the next; no step holds the whole state.

Example:
    >>> atomic_save(state, meta, path, ..., planner=DiskSavePlanner(disk_state))        # doctest: +SKIP
    >>> dcp.load(optimizer_state, checkpoint_id=path, planner=DiskLoadPlanner(disk_state))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem

from lightning_elixir.disk_state import DiskOptimizerState

__all__ = ["DiskSavePlanner", "DiskLoadPlanner", "load_sharded"]


class DiskSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a placeholder's data is read from the store when its item is written."""

    def __init__(self, state: DiskOptimizerState) -> None:
        super().__init__()
        self.disk = state

    def lookup_object(self, index: Any) -> Any:
        obj = super().lookup_object(index)
        if isinstance(obj, torch.Tensor) and self.disk.is_placeholder(obj):
            return self.disk.read_state(obj)  # this item's tensor only; dropped once written
        master = self.disk.master
        if isinstance(obj, torch.Tensor) and master is not None and master.is_released(obj):
            return master.read_parameter(obj)  # a tier-3 parameter waiting on disk: its shard, read for this item
        return obj


class DiskLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; a placeholder's items are read into a buffer of their own and written to the
    store (FSDP2 shards along dim 0, so an item of another world size's shard is a contiguous range)."""

    def __init__(self, state: DiskOptimizerState) -> None:
        super().__init__()
        self.disk = state

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.lookup_tensor(read_item.dest_index)
        if not self.disk.is_placeholder(dest):
            return super().resolve_tensor(read_item)
        return torch.empty(tuple(read_item.lengths), dtype=dest.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        dest = self.lookup_tensor(read_item.dest_index)
        if not self.disk.is_placeholder(dest):
            return super().commit_tensor(read_item, tensor)
        shape, offsets, lengths = tuple(dest.shape), list(read_item.dest_offsets), list(read_item.lengths)
        if any(o != 0 or n != full for o, n, full in zip(offsets[1:], lengths[1:], shape[1:])):
            raise ValueError(f"checkpoint item {read_item.dest_index.fqn} covers elements {offsets}+{lengths} of a "
                             f"{shape} shard: only whole rows load into disk-resident state; resume with the "
                             "plan the checkpoint was written with, or without disk_dir")
        row = 1
        for n in shape[1:]:
            row *= n
        self.disk.write_state(dest, tensor.reshape(-1), offsets[0] * row if offsets else 0)
        return None


def load_sharded(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: DiskOptimizerState,
                 *, strict: bool, weights_only: bool | None,
                 init_state: Callable[[], None] | None = None) -> dict[str, Any]:
    """Lightning's sharded-checkpoint load (model, ``optimizer_0``, then the metadata it returns) with the
    optimizer's disk-resident state streamed into the store. ``init_state``: gives an optimizer without state its
    state (through the disk tier) once the model is loaded, before torch's helpers would with a plain step."""
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = {"state_dict": get_model_state_dict(module)}
    load(model, checkpoint_id=path)
    module.load_state_dict(model["state_dict"], strict=strict)
    if init_state is not None:
        init_state()
    optim = {"optimizer_0": get_optimizer_state_dict(module, optimizer)}  # placeholders for the disk state
    load(optim, checkpoint_id=path, planner=DiskLoadPlanner(state))
    set_optimizer_state_dict(module, optimizer, optim_state_dict=optim["optimizer_0"],
                             options=StateDictOptions(cpu_offload=True))
    state.adopt_placeholders()
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
