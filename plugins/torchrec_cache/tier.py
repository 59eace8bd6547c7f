"""The disk tier of one cache: a :class:`~tightfit.storage.TensorStore` in a fresh directory, one
:class:`~torchrec_cache.disk.DiskRows` and one :class:`~torchrec_cache.hostlevel.HostLevel` per slot-tensor group."""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from tightfit.profiler.types import DiskProfile
from tightfit.storage import TensorStore, check_disk_dir
from torchrec_cache.disk import DiskRows
from torchrec_cache.hostlevel import HostLevel
from torchrec_cache.layout import KeySpace
from torchrec_cache.sketch import FrequencySketch

__all__ = ["DiskTier", "DiskSpec", "CHECKSUM_BLOCK", "READ_WORKERS", "extent_bytes_for"]

# The store's extent is the unit a missed row costs on disk: small, so a scattered miss reads little, but not
# so small that writing the tables and the store's index (~180 bytes of Python per extent) cost too much:
# at most 2**18 extents (16 KiB for 4 GiB of tables). On the DLRM benchmark 4 KiB extents made writing the
# tables take minutes; the requests' count, not their size, bounds the reads.
_MIN_EXTENT, _MAX_EXTENTS = 4096, 2**18


# A missed row is read as the 4 KiB checksum block holding it (TensorStore.read_ranges), not its extent. Those
# reads are short and scattered: the disk answers them by queue depth, not bandwidth (random 4 KiB O_DIRECT
# reads, one thread each, scale with the threads well past 16 on a virtio disk).
CHECKSUM_BLOCK, READ_WORKERS = 4096, 16


def extent_bytes_for(total_bytes: int) -> int:
    """The smallest power-of-two extent >= 4 KiB that keeps ``total_bytes`` within 2**18 extents."""
    e = _MIN_EXTENT
    while total_bytes > e * _MAX_EXTENTS:
        e *= 2
    return e


@dataclass(frozen=True)
class DiskSpec:
    """What a cache needs to open its disk tier: the directory, each table's host-level rows, the disk's profile."""

    disk_dir: str
    host_rows: dict[str, int]
    profile: DiskProfile | None = None

    def open(self, space: KeySpace, row_bytes: list[int], sketch: FrequencySketch | None, lock: threading.RLock,
             device: torch.device) -> DiskTier:
        """The tier of a cache over ``space`` (``row_bytes``: per table, a row and its state)."""
        if device.type == "meta":
            raise ValueError("a cache with a disk_dir cannot be built on the meta device; build it on 'cpu' or "
                             "'cuda' (its rows are written to disk at construction)")
        groups = []
        for span in space.groups:
            tables = [(space.tables[i].name, space.host_offset(i), space.tables[i].rows) for i in span.tables]
            groups.append((span.key_hi - span.key_lo, row_bytes[span.tables[0]], span.key_lo,
                           sum(self.host_rows.get(space.tables[i].name, 0) for i in span.tables), tables))
        return DiskTier(self.disk_dir, groups, sketch, lock, self.profile)


class DiskTier:
    """The disk tier of one cache: a :class:`~tightfit.storage.TensorStore` in a fresh directory under
    ``disk_dir`` (removed when the cache goes), one :class:`DiskRows` and one :class:`HostLevel` per group.

    Args:
        disk_dir: an existing directory on a local SSD; refused (one line) if it cannot hold ``need_bytes``.
        groups: per group ``(rows, record_bytes, key_lo, host slots, [(table, first row, rows)])``.
        sketch: the cache's frequency sketch (the host level's admission).
        lock: the cache's lock.
        profile: the disk's profile (I/O workers), or ``None``.
    """

    def __init__(self, disk_dir: str, groups: list[tuple[int, int, int, int, list[tuple[str, int, int]]]],
                 sketch: FrequencySketch | None, lock: threading.RLock, profile: DiskProfile | None = None) -> None:
        need = sum(rows * rec for rows, rec, _, _, _ in groups)
        base = check_disk_dir(disk_dir, need_bytes=need)
        self.path = Path(tempfile.mkdtemp(prefix="torchrec_cache-", dir=base))
        workers = max(READ_WORKERS, profile.queue_depth) if profile is not None else READ_WORKERS
        self.store = TensorStore(self.path, extent_bytes=extent_bytes_for(need), workers=workers,
                                 checksum_block=CHECKSUM_BLOCK)
        self.levels: list[HostLevel] = []
        for gi, (rows, rec, key_lo, slots, tables) in enumerate(groups):
            disk = DiskRows(self.store, f"group{gi}", rows=rows, record_bytes=rec, tables=tables)
            self.levels.append(HostLevel(disk, slots, key_lo, sketch, lock))
        self._finalizer = weakref.finalize(self, _close, self.store, list(self.levels), self.path)

    def issue(self) -> None:
        """Start the write-back of every group's outbox (after a placement); raises a failed write's error once
        every group's writes in flight are settled (theirs failed too: requeued), so a retry starts clean."""
        first: BaseException | None = None
        for level in self.levels:
            try:
                level.issue()
            except BaseException as err:  # noqa: BLE001 - raised below, after the other groups settle
                first = first or err
        if first is None:
            return
        for level in self.levels:
            try:
                with level.lock:
                    level._settle_inflight()
            except BaseException:  # noqa: BLE001, S110 - requeued; the first failure is the one raised
                pass
        raise first

    def stage(self, keys: torch.Tensor, step: int, group_split: list[int]) -> None:
        """Read ahead the rows of sorted host ``keys`` (groups' runs: ``group_split``) for the batch at ``step``."""
        for gi, level in enumerate(self.levels):
            a, b = group_split[gi], group_split[gi + 1]
            if b > a:
                level.stage(keys[a:b] - level.key_lo, step)

    def wait_staged(self, until: int) -> None:
        for level in self.levels:
            level.wait_staged(until)

    def forget_staged(self, before: int) -> None:
        for level in self.levels:
            level.forget_staged(before)

    def persist(self) -> None:
        """Every changed row on disk, durable (:meth:`TensorStore.sync`)."""
        for level in self.levels:
            level.persist()
        self.store.sync()

    def stats(self) -> dict[str, int]:
        """Host-level and disk counters summed over the groups, and the host rows held now."""
        out: dict[str, int] = {}
        for level in self.levels:
            for k, v in list(level.counts.items()) + list(level.disk.counts.items()):
                out[k] = out.get(k, 0) + v
        out["host_rows"] = sum(level.host_rows() for level in self.levels)
        out["host_capacity"] = sum(level.capacity for level in self.levels)
        return out

    def close(self) -> None:
        self._finalizer()


def _close(store: TensorStore, levels: list[HostLevel], path: Path) -> None:
    for level in levels:
        level.close()
    try:
        for level in levels:  # the directory goes: nothing to fold into it or sync (and at exit no I/O thread may start)
            if level.disk.name in store:
                store.delete(level.disk.name)
        store.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
