"""Row records: rows of a flat buffer written as their own bytes into a log beside the extents.

A cache writes back scattered rows of a few hundred bytes. Written through the extents, each row costs its
whole extent (read, patched, written to a fresh slot: the store never overwrites in place). The row log
appends a batch of rows instead, packed one after another and padded to the 4 KiB alignment, with one
checksum per 4 KiB block of the log (kept in memory). A read of a logged row reads and verifies the block or
two holding it, as a read of an extent row reads its checksum block.

The log is a write-back area, not a journal: the store's durable state is its index, and
:meth:`~tightfit.storage.TensorStore.sync` first *folds* the logged rows into the extents (extents read,
patched and written to fresh slots, the index switched at the sync), so the index never refers to the log and
a reopened store starts with an empty one. A crash before a sync leaves the store at its previous sync (every
row its old bytes); a crash during the sync leaves the old index or the new one, both whole. A full log (its
``limit``) is folded the same way before the next append, without a sync.

Which row lives where: per name, levels of sorted ``(row, log byte)`` arrays, the newest level last; a new
batch is a level, and two neighbouring levels merge once the older is at most twice the newer (a binary LSM:
each row is merged ``log2`` times, a lookup searches ``log2`` levels).

Example:
    >>> import numpy as np
    >>> m = RowMap(length=8)
    >>> m.add(np.array([3, 5]), np.array([0, 8]))
    >>> m.add(np.array([5, 9]), np.array([4096, 4104]))
    >>> m.find(np.array([5, 3, 7])).tolist()
    [4096, 0, -1]
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tightfit.storage.aio import read_many
from tightfit.storage.buffers import aligned_empty
from tightfit.storage.errors import ChecksumError
from tightfit.storage.fs import ALIGN, open_data, pread_full, pwrite_full
from tightfit.storage.ranges import cover, gather, runs

__all__ = ["ROW_LOG", "DEFAULT_ROW_LOG_BYTES", "RowMap", "RowLog"]

ROW_LOG = "rows.log"
DEFAULT_ROW_LOG_BYTES = 256 * 2**20
"""Log bytes before the logged rows are folded into the extents (a fold rewrites each extent its rows touch
once, so a longer log folds more rows per extent written; the map costs 16 bytes of RAM per logged row)."""


class RowMap:
    """Where the logged rows of one name are: row ``r`` (bytes ``[r * length, (r + 1) * length)``) at a log byte."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []  # oldest first; each: sorted unique rows, log bytes

    def add(self, rows: np.ndarray, at: np.ndarray) -> None:
        """Rows ``rows`` (sorted, unique) now live at log bytes ``at`` (newer than every row before)."""
        self.levels.append((rows, at))
        while len(self.levels) > 1 and self.levels[-2][0].size <= 2 * self.levels[-1][0].size:
            new, old = self.levels.pop(), self.levels.pop()
            self.levels.append(_merge(old, new))

    def find(self, rows: np.ndarray) -> np.ndarray:
        """The log byte of each of ``rows`` (any order), -1 where it is not logged."""
        out = np.full(rows.size, -1, dtype=np.int64)
        todo = np.arange(rows.size)
        for keys, at in reversed(self.levels):
            if todo.size == 0:
                break
            want = rows[todo]
            i = np.minimum(np.searchsorted(keys, want), keys.size - 1)
            hit = keys[i] == want
            out[todo[hit]] = at[i[hit]]
            todo = todo[~hit]
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every logged row (sorted) and its newest log byte."""
        rows, at = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        for level in self.levels:
            rows, at = _merge((rows, at), level)
        return rows, at

    def __len__(self) -> int:
        return sum(k.size for k, _ in self.levels)


def _merge(old: tuple[np.ndarray, np.ndarray], new: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique rows of both, the newer log byte where a row is in both."""
    rows = np.concatenate([old[0], new[0]])
    at = np.concatenate([old[1], new[1]])
    order = np.argsort(rows, kind="stable")
    rows, at = rows[order], at[order]
    last = np.ones(rows.size, dtype=bool)
    last[:-1] = rows[1:] != rows[:-1]
    return rows[last], at[last]


class RowLog:
    """The log file of one store: batches of rows appended, each padded to :data:`ALIGN`, 4 KiB blocks checksummed.

    Args:
        path: the log file (created, emptied: nothing durable refers to it).
        direct: open it with ``O_DIRECT`` where the filesystem takes it.
        checksum: the store's checksum function of a buffer.
        algorithm: its name (for messages).
        limit: bytes the log may hold before its rows must be folded (:attr:`full`).
    """

    def __init__(self, path: Path, *, direct: bool, checksum: Callable[[memoryview], int], algorithm: str,
                 limit: int) -> None:
        self.path, self.checksum, self.algorithm, self.limit = path, checksum, algorithm, limit
        self.fd, self.direct = open_data(path, direct=direct)
        os.ftruncate(self.fd, 0)
        self.lock = threading.Lock()  # the maps, the end, the block sums and the readers
        self.maps: dict[str, RowMap] = {}
        self.end = 0
        self.sums = np.zeros(0, dtype=np.uint32)
        self.readers = 0

    def full(self, nbytes: int) -> bool:
        """Whether appending ``nbytes`` of rows would take the log past its limit (an empty log takes any batch)."""
        return self.end > 0 and self.end + _padded(nbytes) > self.limit

    def append(self, name: str, rows: np.ndarray, length: int, data: np.ndarray) -> int:
        """Append rows ``rows`` (sorted, unique) of ``name``, ``data`` their bytes (``rows.size * length``); they
        are visible to :meth:`find` once written. Returns the bytes written (padded)."""
        nbytes = rows.size * length
        padded = _padded(nbytes)
        with self.lock:
            at, self.end = self.end, self.end + padded
        buf = aligned_empty(padded).numpy()
        buf[:nbytes] = data
        buf[nbytes:] = 0
        view = memoryview(buf)
        pwrite_full(self.fd, view, at, self.path)
        sums = np.fromiter((self.checksum(view[i:i + ALIGN]) for i in range(0, padded, ALIGN)), dtype=np.uint32,
                           count=padded // ALIGN)
        with self.lock:
            top = (at + padded) // ALIGN
            if self.sums.size < top:
                grown = np.zeros(max(top, 2 * self.sums.size), dtype=np.uint32)
                grown[:self.sums.size] = self.sums
                self.sums = grown
            self.sums[at // ALIGN:top] = sums
            m = self.maps.setdefault(name, RowMap(length))
            m.add(rows, at + np.arange(rows.size, dtype=np.int64) * length)
        return padded

    def find(self, name: str, rows: np.ndarray) -> np.ndarray:
        """The log byte of each of ``rows`` of ``name``, -1 where not logged; a caller that reads the found rows
        holds a reader (:meth:`read` releases it) so the log is not reused under it."""
        with self.lock:
            m = self.maps.get(name)
            found = m.find(rows) if m is not None else np.full(rows.size, -1, dtype=np.int64)
            if (found >= 0).any():
                self.readers += 1
            return found

    def read(self, at: np.ndarray, length: int, out: np.ndarray) -> int:
        """Read the rows at log bytes ``at`` (``length`` bytes each) into ``out`` (uint8, ``at.size * length``),
        every 4 KiB block holding them verified; releases the reader :meth:`find` took. Returns bytes read."""
        try:
            return self._read(at, length, out)
        finally:
            with self.lock:
                self.readers -= 1

    def read_abandoned(self) -> None:
        """Release the reader :meth:`find` took for a read that will not run."""
        with self.lock:
            self.readers -= 1

    def read_held(self, at: np.ndarray, length: int, out: np.ndarray) -> int:
        """:meth:`read` for a caller that keeps the log from being rewound otherwise (a fold, under the store's
        fold lock)."""
        return self._read(at, length, out)

    def _read(self, at: np.ndarray, length: int, out: np.ndarray) -> int:
        ids, where = cover(at, length, ALIGN)
        plan = runs(ids, 2**62)
        staged = aligned_empty(ids.size * ALIGN).numpy()
        offsets, nbytes = ids[plan[:, 0]] * ALIGN, plan[:, 1] * ALIGN
        res = read_many(self.fd, (staged.ctypes.data + plan[:, 0] * ALIGN).astype(np.uint64), nbytes, offsets)
        if res is None or bool((res < nbytes).any()):  # no AIO, or a failed read: one by one, raising its error
            view = memoryview(staged)
            for (s, c), off in zip(plan.tolist(), offsets.tolist()):
                pread_full(self.fd, view[s * ALIGN:(s + c) * ALIGN], off, self.path)
        with self.lock:
            want = self.sums[ids]
        view = memoryview(staged)
        got = np.fromiter((self.checksum(view[j * ALIGN:(j + 1) * ALIGN]) for j in range(ids.size)), dtype=np.uint32,
                          count=ids.size)
        bad = np.flatnonzero(got != want)
        if bad.size:
            j = int(bad[0])
            off = int(ids[j]) * ALIGN
            raise ChecksumError(f"{self.path}: checksum mismatch in the {ALIGN}-byte row-log block at byte offset "
                                f"{off} ({self.algorithm} {int(got[j]):08x}, expected {int(want[j]):08x}): the "
                                f"logged rows changed on disk since they were written; restore the store from a "
                                f"checkpoint", path=str(self.path), offset=off)
        gather(out, staged, where, length)
        return ids.size * ALIGN

    def take(self, name: str) -> RowMap | None:
        """Forget the logged rows of ``name`` (folded or deleted); their map, or ``None``."""
        with self.lock:
            return self.maps.pop(name, None)

    def rewind(self) -> None:
        """Start the log again from byte 0 where no row is logged and no read is using it."""
        with self.lock:
            if not self.maps and self.readers == 0:
                self.end = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
