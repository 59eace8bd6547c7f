"""The store's row records (:meth:`~tightfit.storage.TensorStore.write_rows`): rows appended to the row log
(:mod:`tightfit.storage.rowlog`), read back from it, and folded into the extents (at ``sync()``, before an
extent-level access of the name, or when the log is full).

A base of :class:`~tightfit.storage.TensorStore`, kept apart so the store's extent machinery reads on its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from tightfit.storage.buffers import aligned_empty, readable, writable
from tightfit.storage.engine import IOEngine
from tightfit.storage.errors import StorageError
from tightfit.storage.index import Entry
from tightfit.storage.rowlog import RowLog

__all__ = ["RowRecords", "FOLD_CHUNK_BYTES"]

FOLD_CHUNK_BYTES = 64 * 2**20
"""Extent bytes a fold reads, patches and writes at once (its host memory)."""


class _Store(Protocol):
    """What the row records use of the store (its extent-level reads and writes, bypassing the log)."""

    extent_bytes: int
    _log: RowLog | None
    _folding: threading.RLock
    _mutex: threading.Lock
    _tails: dict[tuple[str, int], Future[int]]
    _inflight: set[Future[Any]]
    _engine: IOEngine

    def _check(self, name: str, offset: int, what: str) -> None: ...
    def _entry(self, name: str) -> Entry: ...
    def _read_ranges(self, name: str, offsets: Any, length: int, out: Any) -> Future[int]: ...
    def _read_into(self, name: str, out: Any, offset: int = 0) -> Future[Any]: ...
    def _write(self, name: str, view: memoryview, offset: int, meta: tuple[str, tuple[int, ...]] | None,
               *, replace: bool) -> Future[int]: ...
    def _fold(self, name: str) -> None: ...
    def fold(self) -> None: ...
    def _patch(self, name: str, starts: np.ndarray, length: int, recs: np.ndarray) -> None: ...
    def _read_logged(self, name: str, offs: np.ndarray, length: int, out: Any) -> Future[int]: ...


class RowRecords:
    """Row writes and reads of :class:`~tightfit.storage.TensorStore` through its row log."""

    _log: RowLog | None
    _folding: threading.RLock

    def write_rows(self: _Store, name: str, offsets: Any, length: int, data: Any) -> int:
        """Write ``len(offsets)`` rows of ``length`` bytes of ``name`` (a row at each byte offset, a multiple of
        ``length``; no offset twice), ``data`` their bytes in the same order, as row records: appended to the
        row log as their own bytes (padded to 4 KiB per call), not their extents rewritten. Returns the bytes
        written once they are (synchronous: run it behind a :class:`~tightfit.storage.WriteBehind`). Reads see
        them at once; :meth:`sync` folds them into the extents and makes them durable.

        A failed append (ENOSPC) commits none of the rows."""
        what = f"write_rows({name!r})"
        self._check(name, 0, what)
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        view, _ = readable(data, what)
        if not isinstance(length, int) or length < 1 or view.nbytes != offs.size * length or (offs % length).any():
            raise StorageError(f"{what}: {offs.size} rows of length={length!r} at offsets that are multiples of it "
                               f"need {offs.size * length if isinstance(length, int) else '?'} bytes of data, got "
                               f"{view.nbytes}; pass a length >= 1, offsets = row * length and their rows' bytes")
        with self._mutex:
            nbytes = self._entry(name).nbytes
        if offs.size and (int(offs.min()) < 0 or int(offs.max()) + length > nbytes):
            raise StorageError(f"{what}: rows [{int(offs.min())}, {int(offs.max()) + length}) reach outside its "
                               f"{nbytes} bytes; write rows inside the name (write() grows it)")
        rows = offs // length
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        if rows.size > 1 and bool((rows[1:] == rows[:-1]).any()):
            raise StorageError(f"{what}: row {int(rows[1:][rows[1:] == rows[:-1]][0])} is given twice; give each "
                               f"row once (its newest bytes)")
        recs = np.frombuffer(view, dtype=np.uint8).reshape(offs.size, length)[order].reshape(-1)
        if offs.size == 0:
            return 0
        log = self._log
        assert log is not None
        with self._folding:
            m = log.maps.get(name)
            if m is not None and m.length != length:
                self._fold(name)
            if log.full(recs.size):
                self.fold()
            return log.append(name, rows, length, recs)

    def _read_logged(self: _Store, name: str, offs: np.ndarray, length: int, out: Any) -> Future[int]:
        """:meth:`read_ranges` of rows of ``name`` some of which are logged: those from the log (on a worker), the
        rest from the extents, one future for both."""
        view = writable(out, f"read_ranges({name!r})")
        log = self._log
        assert log is not None
        if view.nbytes != offs.size * length:
            return self._read_ranges(name, offs, length, out)  # it reports the mismatch
        at = log.find(name, offs // length)
        hit, rest = np.flatnonzero(at >= 0), np.flatnonzero(at < 0)
        if hit.size == 0:
            return self._read_ranges(name, offs, length, out)
        flat = np.frombuffer(view, dtype=np.uint8).reshape(offs.size, length)
        tmp = aligned_empty(rest.size * length).numpy()
        logged = np.empty(hit.size * length, dtype=np.uint8)
        parts: list[Future[int]] = []
        try:
            parts.append(self._engine.submit(log.read, at[hit], length, logged))
        except BaseException:
            log.read_abandoned()
            raise
        if rest.size:
            parts.append(self._read_ranges(name, offs[rest], length, tmp))
        fut: Future[int] = Future()
        left, lock = [len(parts)], threading.Lock()

        def done(_part: Future[int]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            err = next((p.exception() for p in parts if p.exception() is not None), None)
            try:
                if err is None:
                    flat[hit] = logged.reshape(hit.size, length)
                    if rest.size:
                        flat[rest] = tmp.reshape(rest.size, length)
            except BaseException as copy_err:
                err = copy_err
            with self._mutex:
                self._inflight.discard(fut)
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(sum(int(p.result()) for p in parts))

        with self._mutex:
            self._inflight.add(fut)
        for p in parts:
            p.add_done_callback(done)
        return fut

    def fold(self: _Store) -> None:
        """Fold every logged row into the extents (:meth:`sync` does it first); the log then starts again."""
        log = self._log
        if log is None:
            return
        with self._folding:
            for name in list(log.maps):
                self._fold(name)
            log.rewind()

    def _fold(self: _Store, name: str) -> None:
        """Write the logged rows of ``name`` into its extents (read, patched, written to fresh slots, a chunk at a
        time), then forget them; a failure (ENOSPC) keeps them logged."""
        log = self._log
        if log is None or name not in log.maps:
            return
        with self._folding:
            m = log.maps.get(name)
            if m is None:
                return
            with self._mutex:  # extent writes in flight land first: the fold patches their result
                waits = {f for (n, _), f in self._tails.items() if n == name}
            cf.wait(waits)
            rows, at = m.items()
            length, size = m.length, self.extent_bytes
            ext = rows * length // size
            per = max(1, FOLD_CHUNK_BYTES // size)
            cuts = np.flatnonzero(np.diff(ext // per)) + 1
            for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), rows.size]):
                recs = np.empty((hi - lo) * length, dtype=np.uint8)
                log.read_held(at[lo:hi], length, recs)
                self._patch(name, rows[lo:hi] * length, length, recs)
            log.take(name)

    def _patch(self: _Store, name: str, starts: np.ndarray, length: int, recs: np.ndarray) -> None:
        """Write rows at byte ``starts`` (sorted) of ``name`` through its extents: the extents they touch read,
        patched and written whole, one request per run of neighbouring extents."""
        size = self.extent_bytes
        with self._mutex:
            total = self._entry(name).nbytes
        ext = np.unique(np.concatenate([starts // size, (starts + length - 1) // size]))
        buf = aligned_empty(ext.size * size).numpy()
        full = int((ext * size + size <= total).sum())  # sorted: only the last can be the buffer's partial tail
        if full:
            self._read_ranges(name, ext[:full] * size, size, buf[:full * size]).result()
        if full < ext.size:
            lo = int(ext[full]) * size
            self._read_into(name, buf[full * size:full * size + total - lo], lo).result()
            buf[full * size + total - lo:] = 0
        at = np.searchsorted(ext, starts // size) * size + starts % size
        buf[(at[:, None] + np.arange(length)).reshape(-1)] = recs
        brk = np.flatnonzero(np.diff(ext) != 1) + 1
        futures = []
        for a, b in zip([0, *brk.tolist()], [*brk.tolist(), ext.size]):
            lo, hi = int(ext[a]) * size, min(int(ext[b - 1] + 1) * size, total)
            futures.append(self._write(name, memoryview(buf[a * size:a * size + hi - lo]), lo, None, replace=False))
        errors = [f.exception() for f in futures]  # wait for all: the buffer must outlive every request
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
