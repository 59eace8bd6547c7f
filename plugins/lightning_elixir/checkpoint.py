"""Atomic sharded checkpoints: an interrupted save never damages the last good checkpoint.

A checkpoint is a ``torch.distributed.checkpoint`` directory (each rank writes its shards of the
model and optimizer state; rank 0 adds Lightning's ``meta.pt``: loops, callbacks, hyperparameters).
:func:`atomic_save` writes it under a temporary sibling name (``.<name>.tmp-<id>``); only when every
rank has finished does rank 0 swap it in with two renames:

    <name> -> .<name>.old ;  .<name>.tmp-<id> -> <name> ;  remove .<name>.old

A crash before the swap leaves ``<name>`` untouched (the temporary is removed by the next save); a
crash between the two renames leaves the previous checkpoint complete at ``.<name>.old``, which
:func:`recover` (run before every load) puts back.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "recover", "METADATA_FILENAME", "is_checkpoint_dir"]

METADATA_FILENAME = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.utilities.load)


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def is_checkpoint_dir(path: str | Path) -> bool:
    """A complete checkpoint: the DCP metadata (written last by DCP) and Lightning's ``meta.pt``."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / METADATA_FILENAME).is_file()


def recover(path: str | Path) -> bool:
    """Put back the previous checkpoint when a save died between its two renames; ``True`` if it did."""
    path = Path(path)
    old = _old(path)
    if not path.exists() and is_checkpoint_dir(old):
        os.replace(old, path)
        return True
    return False


def atomic_save(state: dict[str, Any], metadata: dict[str, Any], path: str | Path, *, rank: int,
                barrier: Callable[[], None], broadcast: Callable[[Any], Any]) -> None:
    """Save ``state`` (model / optimizer state dicts, sharded) and ``metadata`` (rank 0) to ``path`` atomically.

    Collective: every rank calls it with its own shards.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{broadcast(uuid.uuid4().hex[:8])}")
    if rank == 0:
        recover(path)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a save that died
        tmp.mkdir(parents=True)
    barrier()
    failed: BaseException | None = None
    try:
        save(state, storage_writer=FileSystemWriter(tmp))
        if rank == 0:
            torch.save(metadata, tmp / METADATA_FILENAME)
    except BaseException as exc:  # noqa: BLE001 - re-raised below after the ranks agree
        failed = exc
    # Every rank must know whether any rank failed before rank 0 swaps the directories.
    ok = _all_ok(failed is None)
    if not ok:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        if failed is not None:
            raise failed
        raise RuntimeError(f"saving checkpoint {path} failed on another rank; the previous checkpoint is unchanged")
    if rank == 0:
        old = _old(path)
        if old.exists():
            shutil.rmtree(old)
        if path.is_file():
            path.unlink()
        elif path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def _all_ok(ok: bool) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag)
    return int(flag.item()) == 0
