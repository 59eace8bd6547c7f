"""The full tables of a cached collection on disk: one record per row, read and written in batches.

A record is a row's weights and its optimizer state side by side (``dim`` weights of the table's
dtype, then the state's fp32 columns), so a row moves with its state in one piece. One flat buffer per
slot-tensor group lives in a :class:`tightfit.storage.TensorStore` (the plugin never opens a file
itself), row ``p`` at byte ``p * record_bytes``. A batch of rows is read with the store's
:meth:`~tightfit.storage.TensorStore.read_ranges`: only the checksum blocks holding them (4 KiB), each
verified. A batch of rows is written as row records (:meth:`~tightfit.storage.TensorStore.write_rows`): the
rows' own bytes appended to the store's row log in one request, folded into the extents at the store's next
``sync()`` (the store never overwrites in place, so a failed write leaves the previous rows readable).

Example:
    >>> import tempfile
    >>> from tightfit.storage import TensorStore
    >>> store = TensorStore(tempfile.mkdtemp(), extent_bytes=4096)
    >>> t = DiskRows(store, "g0", rows=100, record_bytes=8, tables=[("t", 0, 100)])
    >>> t.fill(0, torch.arange(800, dtype=torch.int64).remainder(256).to(torch.uint8).view(100, 8))
    >>> t.read(torch.tensor([3, 99]))[:, 0].tolist(), t.counts["rows_read"]
    [24, 24]
    >>> store.close()
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from tightfit.storage import ChecksumError, TensorStore, aligned_empty

__all__ = ["DiskRows", "RowRead", "RowFileError", "records", "split_records"]


class RowFileError(ChecksumError):
    """A row file on disk failed its checksum (or is short): names the table and the rows it held."""


def records(weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``(n, record_bytes)`` uint8 records of rows ``weight`` (n, dim) and their fp32 ``state`` (n, cols)."""
    w = weight.contiguous().view(torch.uint8).reshape(weight.shape[0], -1)
    if state.shape[1] == 0:
        return w
    return torch.cat([w, state.contiguous().float().view(torch.uint8).reshape(state.shape[0], -1)], dim=1)


def split_records(recs: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`records`: ``(weight (n, dim) of dtype, state (n, cols) fp32)``."""
    wb = dim * torch.empty((), dtype=dtype).element_size()
    w = recs[:, :wb].contiguous().view(dtype)
    st = recs[:, wb:].contiguous().view(torch.float32)
    return w, st


@dataclass
class RowRead:
    """A batched read in flight: its records land in ``out`` once ``future`` is done (rows ``[lo, hi)`` span it)."""

    out: torch.Tensor
    future: Future[Any]
    lo: int
    hi: int
    started: int
    ended: int = 0

    def stop(self, _future: Future[Any]) -> None:
        self.ended = time.perf_counter_ns()


@dataclass
class DiskRows:
    """One group's rows in the store under ``name``: ``rows`` records of ``record_bytes``.

    ``tables``: ``(name, first row, rows)`` of each table in the group (for error messages).
    ``counts``: rows and bytes read and written so far (bytes: what the store moved: the 4 KiB checksum blocks
    holding the rows read, the row log's padded appends written), batched reads (``disk_reads``: one per batch of rows) and
    write requests, and the wall nanoseconds from the start of each batched read to its end (``read_ns``; reads overlap).
    """

    store: TensorStore
    name: str
    rows: int
    record_bytes: int
    tables: list[tuple[str, int, int]]
    counts: dict[str, int] = field(default_factory=lambda: {"rows_read": 0, "bytes_read": 0, "rows_written": 0,
                                                            "bytes_written": 0, "disk_reads": 0, "disk_writes": 0,
                                                            "read_ns": 0})

    @property
    def nbytes(self) -> int:
        return self.rows * self.record_bytes

    def fill(self, first: int, recs: torch.Tensor, *, wait: bool = True) -> Future[int] | None:
        """Write records ``recs`` at rows ``first...`` (set-up and checkpoint loading: contiguous rows); with
        ``wait=False`` the write's future (``recs`` must not change until it is done)."""
        if recs.shape[0] == 0:
            return None
        data = recs.contiguous().view(-1)
        fut = self.store.write(self.name, data, offset=first * self.record_bytes)
        self.counts["rows_written"] += recs.shape[0]
        self.counts["bytes_written"] += data.numel()
        if wait:
            fut.result()
            return None
        return fut

    def read_range(self, first: int, n: int) -> torch.Tensor:
        """Records of rows ``[first, first + n)`` (checkpoints: contiguous rows)."""
        out = aligned_empty(n * self.record_bytes)
        self._wait(self.store.read_into(self.name, out, offset=first * self.record_bytes), first, first + n)
        self.counts["rows_read"] += n
        self.counts["bytes_read"] += out.numel()
        return out.view(n, self.record_bytes)

    # ------------------------------------------------------------------ batches of scattered rows
    def read(self, pos: torch.Tensor) -> torch.Tensor:
        """Records of rows ``pos`` (any order, int64): the store reads only the checksum blocks holding them
        (4 KiB in a tier's store; neighbours in one request, spread over its workers)."""
        return self.read_finish(self.read_start(pos))

    def read_start(self, pos: torch.Tensor) -> RowRead:
        """Start reading the records of rows ``pos`` (:meth:`read` without waiting); :meth:`read_finish` waits."""
        R = self.record_bytes
        out = torch.empty(pos.numel(), R, dtype=torch.uint8)
        if pos.numel() == 0:
            done: Future[Any] = Future()
            done.set_result(0)
            return RowRead(out=out, future=done, lo=0, hi=0, started=time.perf_counter_ns())
        read = RowRead(out=out, future=self.store.read_ranges(self.name, (pos * R).numpy(), R, out),
                       lo=int(pos.min()), hi=int(pos.max()) + 1, started=time.perf_counter_ns())
        read.future.add_done_callback(read.stop)
        return read

    def read_finish(self, read: RowRead) -> torch.Tensor:
        """Wait for a read :meth:`read_start` began and count it; a corrupted block raises :class:`RowFileError`."""
        moved = self._wait(read.future, read.lo, read.hi)
        if read.hi > read.lo:
            self.counts["rows_read"] += read.out.shape[0]
            self.counts["disk_reads"] += 1
            self.counts["bytes_read"] += int(moved)
            self.counts["read_ns"] += max(0, read.ended - read.started)
        return read.out

    def write(self, pos: torch.Tensor, recs: torch.Tensor) -> None:
        """Write records ``recs`` of rows ``pos`` (unique) as row records (:meth:`TensorStore.write_rows
        <tightfit.storage.TensorStore.write_rows>`): their own bytes appended to the store's row log, not their
        extents rewritten; returns once written (raises :class:`~tightfit.storage.DiskFullError` with none of
        them committed)."""
        if pos.numel() == 0:
            return
        R = self.record_bytes
        self.counts["bytes_written"] += self.store.write_rows(self.name, (pos * R).numpy(), R, recs.contiguous())
        self.counts["rows_written"] += pos.numel()
        self.counts["disk_writes"] += 1

    # ------------------------------------------------------------------ errors
    def _wait(self, fut: Future[Any], row_lo: int, row_hi: int) -> Any:
        try:
            return fut.result()
        except ChecksumError as err:
            if err.span is not None:  # the block that failed: the rows it holds
                R = self.record_bytes
                row_lo, row_hi = max(row_lo, err.span[0] // R), min(row_hi, -(-err.span[1] // R))
            raise RowFileError(f"{self.describe(row_lo, row_hi)} failed its checksum on disk ({err}); the row file "
                               "is corrupted: restore the collection from a checkpoint", path=err.path,
                               offset=err.offset, span=err.span) from err

    def describe(self, row_lo: int, row_hi: int) -> str:
        """``table 'a' rows [lo, hi)`` for the tables group rows ``[row_lo, row_hi)`` cover."""
        parts = []
        for name, first, n in self.tables:
            lo, hi = max(row_lo, first), min(row_hi, first + n)
            if lo < hi:
                parts.append(f"table {name!r} rows [{lo - first}, {hi - first})")
        return ", ".join(parts) or f"rows [{row_lo}, {row_hi}) of {self.name!r}"
