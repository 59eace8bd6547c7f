"""Atomic sharded checkpoints: an interrupted save never damages the last good checkpoint.

A checkpoint is a ``torch.distributed.checkpoint`` directory (each rank writes its shards of the
model and optimizer state; rank 0 adds Lightning's ``meta.pt``: loops, callbacks, hyperparameters).
:func:`atomic_save` writes it under a temporary sibling name (``.<name>.tmp-<id>``); only when every
rank has finished does rank 0 swap it in with two renames:

    <name> -> .<name>.old ;  .<name>.tmp-<id> -> <name> ;  remove .<name>.old

A crash before the swap leaves ``<name>`` untouched (the temporary is removed by the next save); a
crash between the two renames leaves the previous checkpoint complete at ``.<name>.old``, which
:func:`recover` (run before every load) puts back.

Durability and integrity: every file of the checkpoint and the temporary directory itself are
``fsync``-ed before the swap, and the parent directory after it, so a power loss cannot leave a
renamed directory whose files are still in the page cache. Rank 0 writes ``checksums.json``
(SHA-256 of every file, including each rank's ``.distcp`` shards) last; :func:`verify_checkpoint`
(run at load and at export) re-hashes the files and names any shard that is truncated, flipped or
missing: two flipped bits in a shard would otherwise load as a weight of 1e37 without a word.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "recover", "METADATA_FILENAME", "CHECKSUMS_FILENAME", "CheckpointCorruptError",
           "is_checkpoint_dir", "verify_checkpoint"]

METADATA_FILENAME = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.utilities.load)
CHECKSUMS_FILENAME = "checksums.json"
_CHUNK = 8 * 2**20


class CheckpointCorruptError(ValueError):
    """A checkpoint file does not match the checksum written when it was saved (or is missing)."""


def _stage(name: str) -> None:
    """Named points of a save, in order; a crash test replaces this to kill the process at one of them."""


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (its renames and new files), to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_checksums(tmp: Path) -> None:
    sums = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file() and f.name != CHECKSUMS_FILENAME}
    out = tmp / CHECKSUMS_FILENAME
    with open(out, "w") as f:
        json.dump({"algorithm": "sha256", "files": sums}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: str | Path) -> bool:
    """Re-hash every file of checkpoint ``path`` against its ``checksums.json``.

    Returns ``False`` for a checkpoint saved before checksums existed (nothing to check), ``True``
    when every file matches. Raises :class:`CheckpointCorruptError` naming the first file that is
    missing, truncated or changed.
    """
    path = Path(path)
    file = path / CHECKSUMS_FILENAME
    if not file.is_file():
        return False
    try:
        sums = json.loads(file.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(f"{file} is not a checksum list ({err}); the checkpoint directory is damaged: "
                                     "restore it from a copy or save it again") from None
    listed = set(sums)
    for extra in sorted(f.name for f in path.glob("*.distcp") if f.name not in listed):
        raise CheckpointCorruptError(f"shard {path / extra} is not in {CHECKSUMS_FILENAME}; it was added after the "
                                     "save: remove it or restore the checkpoint from a copy")
    for name, want in sorted(sums.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointCorruptError(f"checkpoint file {shard} is missing; {CHECKSUMS_FILENAME} lists it. Copy "
                                         "the whole checkpoint directory")
        got = _sha256(shard)
        if got != want:
            raise CheckpointCorruptError(
                f"checkpoint file {shard} ({shard.stat().st_size} bytes) does not match the SHA-256 written at save "
                f"({got[:12]}... != {want[:12]}...): it is truncated or corrupt. Restore it from a copy or resume "
                "from an earlier checkpoint")
    return True


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
                barrier: Callable[[], None], broadcast: Callable[[Any], Any], planner: Any = None) -> None:
    """Save ``state`` (model / optimizer state dicts, sharded) and ``metadata`` (rank 0) to ``path`` atomically.

    Collective: every rank calls it with its own shards. ``planner``: a DCP ``SavePlanner`` (the disk tier's
    streams disk-resident optimizer state: :class:`lightning_elixir.disk_checkpoint.DiskSavePlanner`).
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
        _stage("shards")
        # DCP's writer keeps every tensor of a file until the file is closed (torch's _write_files_from_queue), so a
        # streamed planner (the disk tier reads each item from its store) writes one file per item: one tensor
        # held at a time, not the rank's whole state.
        writer = FileSystemWriter(tmp, sync_files=True, single_file_per_rank=planner is None)  # fsyncs each shard
        save(state, storage_writer=writer, planner=planner)
        if rank == 0:
            _stage("metadata")
            torch.save(metadata, tmp / METADATA_FILENAME)
            _fsync(tmp / METADATA_FILENAME)
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
        # Every rank's shards are on disk (the all-reduce above follows each rank's save): hash them
        # all, then make the directory's entries durable before it is renamed into place.
        _stage("checksums")
        _write_checksums(tmp)
        _fsync(tmp)
        _stage("swap")
        old = _old(path)
        if old.exists():
            shutil.rmtree(old)
        if path.is_file():
            path.unlink()
        elif path.exists():
            os.replace(path, old)
        _stage("between-renames")
        os.replace(tmp, path)
        _fsync(path.parent)
        _stage("cleanup")
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
