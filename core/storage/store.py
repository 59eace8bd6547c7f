"""``TensorStore``: tensors and flat buffers in files of a directory, read and written asynchronously.

Example:
    >>> import tempfile, torch
    >>> with TensorStore(tempfile.mkdtemp()) as store:
    ...     store.put("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))
    ...     store.get("w").tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import functools
import math
import os
import struct
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tightfit.storage.aio import available as aio_available
from tightfit.storage.aio import read_many
from tightfit.storage.checksums import DEFAULT_CHECKSUM, checksum_function
from tightfit.storage.engine import ExtentIO, IOEngine
from tightfit.storage.errors import ChecksumError, DiskFullError, StorageError
from tightfit.storage.fs import (
    ALIGN,
    address,
    check_disk_dir,
    disk_full,
    lock_directory,
    open_data,
    punch_hole,
)
from tightfit.storage.index import DATA, DTYPE_SIZES, INDEX, LOCK, Entry, Extent, Index, Slots, valid_block
from tightfit.storage.ranges import cover, gather, runs
from tightfit.storage.rowlog import DEFAULT_ROW_LOG_BYTES, ROW_LOG, RowLog
from tightfit.storage.rowstore import RowRecords

if TYPE_CHECKING:
    from tightfit.profiler.types import DiskProfile
from tightfit.storage.buffers import aligned_empty, readable, writable

__all__ = ["TensorStore", "TensorInfo", "DEFAULT_EXTENT_BYTES", "DEFAULT_WORKERS", "MIN_PROFILE_EXTENT_BYTES"]

DEFAULT_EXTENT_BYTES = 4 * 2**20
"""Extent (request) size without a disk profile: 4 MiB requests reach the disk's bandwidth
(docs/disk-tier.md); smaller ones pay the per-request latency."""
DEFAULT_WORKERS = 4
"""I/O threads without a disk profile: with MiB-sized tensors two threads leave the disk idle between requests,
four keep it busy; with these defaults the store keeps up with the raw device
(benchmarks/results/REPORT.md#disk_io)."""
# A profile's request size becomes the extent size, but not below 1 MiB: the index holds ~30 bytes of JSON per
# extent, 30 KB per GiB at 1 MiB, 480 KB per GiB at 64 KiB (rewritten at every sync).
MIN_PROFILE_EXTENT_BYTES = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """What the index records about one name: its bytes, and dtype and shape (``None`` for a flat buffer)."""

    nbytes: int
    dtype: str | None
    shape: tuple[int, ...] | None


class TensorStore(RowRecords):
    """Tensors and flat buffers in one directory, with asynchronous checksummed reads and writes.

    Args:
        path: an existing, writable directory (:func:`~tightfit.storage.check_disk_dir`); the store owns
            it while open (a lock file: a second owner gets :class:`StoreLockedError`).
        profile: the disk's :class:`~tightfit.profiler.types.DiskProfile`: request size (a new store's
            extent size), queue depth (at least that many workers) and O_DIRECT or buffered.
        workers: I/O threads (each keeps one request at the device); default: the profile's queue depth
            (at least 2), else :data:`DEFAULT_WORKERS`.
        max_inflight: requests queued or running before ``write``/``read_into`` block (default ``2 * workers``).
        extent_bytes: extent size of a new store (default: the profile's request size but at least 1 MiB,
            else 4 MiB); an existing store keeps the size its index records.
        direct: force O_DIRECT on or off (default: the profile's choice, else on); a filesystem that
            refuses O_DIRECT (tmpfs) gets buffered I/O silently.
        checksum: a new store's per-extent checksum, ``"crc32c"`` or ``"crc32"`` (default: CRC-32C where
            PyPI's ``crc32c`` is installed, else zlib's CRC-32); an existing store keeps the one its index
            records (a ``crc32c`` store where ``crc32c`` is missing is refused: ``pip install crc32c``).
        checksum_block: a new store also checksums every block of this many bytes (a multiple of 4 KiB dividing
            the extent), so :meth:`read_ranges` reads and verifies only the blocks its ranges touch (default
            ``None``: one checksum per extent, and ``read_ranges`` reads whole extents); an existing store keeps
            what its index records.
        row_log_bytes: bytes of row records (:meth:`write_rows`) logged before they are folded into the extents
            (default :data:`~tightfit.storage.rowlog.DEFAULT_ROW_LOG_BYTES`).

    Writes are durable only after :meth:`sync` (or :meth:`close`); after a crash the store reopens at
    its last ``sync()``. Overwrites go to fresh extents, so a failed write (ENOSPC) leaves the previous
    contents readable; the slots they replaced are reused by later writes after the next ``sync()``, their
    blocks still allocated (only :meth:`delete` gives blocks back). A buffer handed to :meth:`write` must
    not change until its future is done. Rows written with :meth:`write_rows` go to a row log beside the
    extents (:mod:`tightfit.storage.rowlog`) and are folded into the extents at the next ``sync()``.
    """

    def __init__(self, path: str | os.PathLike[str], *, profile: DiskProfile | None = None, workers: int | None = None,
                 max_inflight: int | None = None, extent_bytes: int | None = None,
                 direct: bool | None = None, checksum: str | None = None,
                 checksum_block: int | None = None, row_log_bytes: int | None = None) -> None:
        self.path = check_disk_dir(path)
        if profile is not None:
            workers = max(2 if workers is None else workers, profile.queue_depth)
        elif workers is None:
            workers = DEFAULT_WORKERS
        self._lock_fd = lock_directory(self.path, LOCK)
        self._fd = -1
        self._log: RowLog | None = None
        try:
            if (self.path / INDEX).exists():
                self._index = Index.load(self.path / INDEX)
            else:
                size = extent_bytes or (max(profile.request_bytes, MIN_PROFILE_EXTENT_BYTES) if profile is not None
                                        else DEFAULT_EXTENT_BYTES)
                self._index = Index(extent_bytes=max(ALIGN, -(-int(size) // ALIGN) * ALIGN),
                                    checksum=checksum or DEFAULT_CHECKSUM, checksum_block=checksum_block)
                checksum_function(self._index.checksum, f"TensorStore({str(self.path)!r}, checksum=...)")
                if checksum_block is not None and not valid_block(checksum_block, self._index.extent_bytes):
                    raise StorageError(f"TensorStore({str(self.path)!r}): checksum_block={checksum_block!r} must be a "
                                       f"multiple of {ALIGN} that divides the extent ({self._index.extent_bytes} "
                                       f"bytes); pass e.g. checksum_block={ALIGN}")
            want = direct if direct is not None else (profile.direct if profile is not None else True)
            self._fd, self.direct = open_data(self.path / DATA, direct=want)
            self._engine = IOEngine(workers=workers, max_inflight=max_inflight or 2 * workers)
            if row_log_bytes is not None and (not isinstance(row_log_bytes, int) or row_log_bytes < ALIGN):
                raise StorageError(f"TensorStore({str(self.path)!r}): row_log_bytes={row_log_bytes!r} must be a whole "
                                   f"number >= {ALIGN}; pass e.g. row_log_bytes={DEFAULT_ROW_LOG_BYTES}")
            self._log = RowLog(self.path / ROW_LOG, direct=want, checksum=checksum_function(self._index.checksum),
                               algorithm=self._index.checksum, limit=row_log_bytes or DEFAULT_ROW_LOG_BYTES)
        except BaseException:
            self._release_files()
            raise
        self.extent_bytes = self._index.extent_bytes
        self.checksum = self._index.checksum
        self.checksum_block = self._index.checksum_block
        self._io = ExtentIO(self._fd, self.path / DATA, direct=self.direct, extent_bytes=self.extent_bytes,
                            algorithm=self.checksum, block_bytes=self.checksum_block)
        self._slots = Slots(self._index.slots())
        self._deleted: set[int] = set()  # slots of deleted names: their blocks go back to the filesystem at sync
        self._mutex = threading.Lock()
        self._seq = 0
        self._tails: dict[tuple[str, int], Future[int]] = {}  # the last write touching (name, extent)
        self._inflight: set[Future[Any]] = set()
        self._folding = threading.RLock()  # appends to the row log and folds of it, one at a time
        self._closed = False

    @classmethod
    def for_rank(cls, path: str | os.PathLike[str], rank: int, **kwargs: Any) -> TensorStore:
        """The store of one rank: the sub-directory ``rank<rank>`` of ``path`` (created), so ranks never share one."""
        base = check_disk_dir(path)
        if not isinstance(rank, int) or rank < 0:
            raise StorageError(f"for_rank: rank={rank!r} must be a whole number >= 0; pass the process's rank")
        sub = base / f"rank{rank}"
        sub.mkdir(exist_ok=True)
        return cls(sub, **kwargs)

    # ------------------------------------------------------------------ asynchronous I/O

    def write(self, name: str, data: Any, offset: int = 0) -> Future[int]:
        """Write ``data`` (a CPU tensor or any buffer) at byte ``offset`` of ``name``; the future gives the bytes
        written. A new name written at offset 0 with a tensor records its dtype and shape."""
        view, meta = readable(data, f"write({name!r})")
        self._fold(name)
        return self._write(name, view, offset, meta if offset == 0 else None, replace=False)

    def read_into(self, name: str, out: Any, offset: int = 0) -> Future[Any]:
        """Read ``len(out)`` bytes of ``name`` from byte ``offset`` into ``out`` (a CPU tensor or writable
        buffer; pinned memory on CUDA machines); nothing is allocated. The future gives ``out`` back."""
        self._fold(name)
        return self._read_into(name, out, offset)

    def _read_into(self, name: str, out: Any, offset: int = 0) -> Future[Any]:
        what = f"read_into({name!r})"
        view = writable(out, what)
        self._check(name, offset, what)
        size = self.extent_bytes
        with self._mutex:
            entry = self._entry(name)
            if offset + view.nbytes > entry.nbytes:
                raise StorageError(f"{what}: bytes [{offset}, {offset + view.nbytes}) are past its end "
                                   f"({entry.nbytes} bytes); read a smaller range")
            parts = []
            for k in range(offset // size, -(-(offset + view.nbytes) // size)):
                x = entry.extents[k]
                if x is not None:
                    self._slots.read_begin(x.slot)
                a, b = max(offset, k * size) - k * size, min(offset + view.nbytes, (k + 1) * size) - k * size
                parts.append((k, x, a, b))
            job = _ReadJob(self, name, view, offset, parts, result=out)
            self._inflight.add(job.future)
        for i in range(len(parts)):
            self._engine.submit(job.run, i)
        job.start()
        return job.future

    def read_ranges(self, name: str, offsets: Any, length: int, out: Any) -> Future[int]:
        """Read the ``length`` bytes at each of ``offsets`` (byte offsets of ``name``, any order, repeats
        allowed) into ``out``, range ``i`` at ``out[i * length:(i + 1) * length]``; the future gives the bytes
        read from the disk.

        Each block holding a range (``checksum_block`` bytes; a whole extent in a store without block
        checksums) is read once and verified, consecutive blocks of an extent in one request, the requests
        spread over the workers: a scattered batch of 128-byte rows reads a 4 KiB block per row, not an
        extent (``docs/disk-tier.md``). A failed checksum raises :class:`ChecksumError` naming the file and the
        block's byte offset. Rows logged by :meth:`write_rows` are read from the row log (the 4 KiB blocks
        holding them, verified) where the ranges are those rows; other ranges fold them into the extents first.
        """
        m = self._log.maps.get(name) if self._log is not None else None
        if m is not None:
            offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
            if m.length == length and not (offs % length).any():
                return self._read_logged(name, offs, length, out)
            self._fold(name)
        return self._read_ranges(name, offsets, length, out)

    def _read_ranges(self, name: str, offsets: Any, length: int, out: Any) -> Future[int]:
        what = f"read_ranges({name!r})"
        view = writable(out, what)
        self._check(name, 0, what)
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if not isinstance(length, int) or length < 1 or view.nbytes != offs.size * length:
            raise StorageError(f"{what}: out holds {view.nbytes} bytes, {offs.size} ranges of length={length!r} need "
                               f"{offs.size * length if isinstance(length, int) else '?'}; pass a length >= 1 and an "
                               f"out of len(offsets) * length bytes")
        size = self.extent_bytes
        block = self.checksum_block or size
        with self._mutex:
            entry = self._entry(name)
            if offs.size and (int(offs.min()) < 0 or int(offs.max()) + length > entry.nbytes):
                raise StorageError(f"{what}: ranges [{int(offs.min())}, {int(offs.max()) + length}) reach outside "
                                   f"its {entry.nbytes} bytes; read inside the name")
            ids, at = cover(offs, length, block)
            plan = runs(ids, size // block)
            b0 = ids[plan[:, 0]]
            ks, j0s = (b0 * block // size).tolist(), (b0 % (size // block)).tolist()
            xs = [entry.extents[k] for k in ks]
            for x in xs:
                if x is not None:
                    self._slots.read_begin(x.slot)
            parts = list(zip(plan[:, 0].tolist(), plan[:, 1].tolist(), ks, j0s, xs))
            job = _RangeJob(self, name, parts, ids.size * block, block, view, at, length)
            job.plan = _BlockPlan.of(plan[:, 0], plan[:, 1], b0 % (size // block), xs, block, size) if xs else None
            self._inflight.add(job.future)
        batched = aio_available()  # one submission for the whole batch; else spread over the worker threads
        for chunk in job.chunks(1 if batched else self._engine.workers):
            self._engine.submit(job.run, chunk, batched)
        job.start()
        return job.future

    def _write(self, name: str, view: memoryview, offset: int, meta: tuple[str, tuple[int, ...]] | None,
               *, replace: bool) -> Future[int]:
        what = f"write({name!r})"
        self._check(name, offset, what)
        size, end = self.extent_bytes, offset + view.nbytes
        with self._mutex:
            self._seq += 1
            chunks = [(k, self._slots.alloc()) for k in range(offset // size, -(-end // size))]
            job = _WriteJob(self, name, view, offset, chunks, seq=self._seq, meta=meta, replace=replace)
            after = [self._tails.get((name, k)) for k, _ in chunks]
            for k, _ in chunks:
                self._tails[(name, k)] = job.future
            self._inflight.add(job.future)
        for i, prev in enumerate(after):
            if prev is None or job.whole(i):  # backpressure: the caller waits here while max_inflight are out
                self._engine.submit(job.run, i)
            else:  # a partial extent merges with the previous write's result: it runs after it, unbounded
                prev.add_done_callback(functools.partial(self._resume, job, i))
        job.start()
        return job.future

    def _resume(self, job: _WriteJob, i: int, _older: Future[int]) -> None:
        self._engine.submit(job.run, i, bounded=False)

    # ------------------------------------------------------------------ synchronous helpers

    def put(self, name: str, tensor: Any) -> None:
        """Store ``tensor`` (or a buffer) under ``name``, replacing what was there; returns when written."""
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        view, meta = readable(tensor, f"put({name!r})")
        with self._folding:  # replaced whole: its logged rows are stale
            if self._log is not None:
                self._log.take(name)
        self._write(name, view, 0, meta, replace=True).result()

    def get(self, name: str, out: Any = None) -> Any:
        """Read all of ``name`` into ``out``, or into a new (4 KiB-aligned) tensor of its dtype and shape."""
        if out is None:
            info = self.info(name)
            dtype = getattr(torch, info.dtype) if info.dtype else torch.uint8
            out = aligned_empty(info.nbytes, dtype, info.shape if info.dtype else None)
        return self.read_into(name, out).result()

    def info(self, name: str) -> TensorInfo:
        with self._mutex:
            e = self._entry(name)
            return TensorInfo(nbytes=e.nbytes, dtype=e.dtype, shape=e.shape)

    def names(self) -> list[str]:
        with self._mutex:
            return sorted(self._index.entries)

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def __contains__(self, name: object) -> bool:
        with self._mutex:
            return name in self._index.entries

    def delete(self, name: str) -> None:
        """Forget ``name`` (after its writes in flight finish); after the next :meth:`sync` its slots are free
        and their blocks are given back to the filesystem (``FALLOC_FL_PUNCH_HOLE``)."""
        with self._mutex:
            self._entry(name)
            waits = {f for (n, _), f in self._tails.items() if n == name}
        cf.wait(waits)
        with self._folding:
            if self._log is not None:
                self._log.take(name)
        with self._mutex:
            entry = self._index.entries.pop(name, None)
            for x in entry.extents if entry else ():
                if x is not None:
                    if x.slot in self._slots.durable:
                        self._deleted.add(x.slot)
                    self._slots.release(x.slot)

    def sync(self) -> None:
        """Make everything written so far durable: wait for requests in flight, fsync the data file, then
        replace the index atomically (temp file, fsync, rename, fsync of the directory). Logged rows are folded
        into the extents first, so the index never refers to the row log."""
        self._check_open()
        self.fold()
        self.wait()
        with self._mutex:
            text = self._index.to_json()
            referenced = self._index.slots()
            self._slots.durable |= referenced  # until the new index is on disk, both must survive
        try:
            os.fsync(self._fd)
            Index.write_text(self.path, text)
        except OSError as err:
            if isinstance(err, StorageError) or err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise disk_full(self.path / INDEX, len(text), "syncing the index") from err
        with self._mutex:
            self._slots.synced(referenced, self._give_back)
            self._deleted &= self._slots.pending  # deleted after the index text was taken: the next sync

    def _give_back(self, slot: int) -> None:
        """A slot the new index dropped: a deleted name's blocks go back to the filesystem; an overwritten
        extent's stay allocated for the next write to reuse. Punching every freed slot makes each overwrite
        allocate its blocks again, which about halves the write bandwidth (the "hole punching at sync" row of
        benchmarks/results/REPORT.md#disk_io)."""
        if slot in self._deleted:
            self._deleted.discard(slot)
            punch_hole(self._fd, slot * self.extent_bytes, self.extent_bytes)

    def wait(self) -> None:
        """Wait until every read and write submitted so far is done (their errors stay in their futures)."""
        while True:
            with self._mutex:
                pending = set(self._inflight)
            if not pending:
                return
            cf.wait(pending)

    def close(self) -> None:
        """Sync, stop the workers and release the directory. Idempotent."""
        if self._closed:
            return
        try:
            self.sync()
        finally:
            self._closed = True
            self._engine.close()
            self._release_files()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TensorStore({str(self.path)!r}, {len(self._index.entries)} names, extent {self.extent_bytes} B, "
                f"{'O_DIRECT' if self.direct else 'buffered'}, {self._engine.workers} workers)")

    # ------------------------------------------------------------------ internals used by the jobs

    def _release_files(self) -> None:
        if self._log is not None:
            self._log.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = -1

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"{self.path}: the store is closed; open a new TensorStore")

    def _check(self, name: str, offset: int, what: str) -> None:
        self._check_open()
        if not isinstance(name, str) or not name:
            raise StorageError(f"{what}: the name must be a non-empty string, got {name!r}")
        if not isinstance(offset, int) or offset < 0:
            raise StorageError(f"{what}: offset={offset!r} must be a whole number >= 0")

    def _entry(self, name: str) -> Entry:
        try:
            return self._index.entries[name]
        except KeyError:
            known = sorted(self._index.entries)
            shown = ", ".join(known[:5]) + (f" and {len(known) - 5} more" if len(known) > 5 else "")
            raise KeyError(f"no tensor named {name!r} in {self.path}; names: {shown or '(none)'}") from None


def _zero(view: memoryview) -> None:
    if view.nbytes:
        np.frombuffer(view, dtype=np.uint8)[:] = 0


class _Job(ABC):
    """What reads and writes share: a future completed when the last of its extents is done."""

    def __init__(self, store: TensorStore, parts: int) -> None:
        self.store = store
        self.future: Future[Any] = Future()
        self.error: BaseException | None = None
        self._left = parts
        self._empty = parts == 0
        self._count = threading.Lock()

    def start(self) -> None:
        if self._empty:  # nothing to move (an empty tensor): complete now
            self.finish()

    def part_done(self) -> None:
        with self._count:
            self._left -= 1
            last = self._left == 0
        if last:
            self.finish()

    @abstractmethod
    def finish(self) -> None:
        """Complete the future (each kind commits or reports its own way)."""


class _ReadJob(_Job):
    def __init__(self, store: TensorStore, name: str, view: memoryview, offset: int,
                 parts: list[tuple[int, Extent | None, int, int]], result: Any) -> None:
        super().__init__(store, len(parts))
        self.name, self.view, self.offset, self.parts, self.result = name, view, offset, parts, result

    def run(self, i: int) -> None:
        st, (k, x, a, b) = self.store, self.parts[i]
        size = st.extent_bytes
        dst = self.view[k * size + a - self.offset:k * size + b - self.offset]
        try:
            valid = min(b, x.length) if x is not None else 0
            if x is not None and a < valid:
                st._io.read(dst[:valid - a], x.slot * size, x.length, x.crc, skip=a)
            _zero(dst[max(a, valid) - a:])  # never-written bytes read as zeros
        except ChecksumError as err:
            self.error = self.error or ChecksumError(f"{err} [extent {k} of {self.name!r}]", path=err.path,
                                                     offset=err.offset)
        except BaseException as err:
            self.error = self.error or err
        finally:
            if x is not None:
                with st._mutex:
                    st._slots.read_end(x.slot)
            self.part_done()

    def finish(self) -> None:
        with self.store._mutex:
            self.store._inflight.discard(self.future)
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.result)


@dataclass
class _BlockPlan:
    """A range read's parts as arrays (block stores only): per part its first block in the staging buffer,
    its blocks, its file offset and valid bytes; per valid block its byte in the staging buffer, its length
    and the checksum the index holds."""

    start: np.ndarray
    count: np.ndarray
    offset: np.ndarray
    valid: np.ndarray
    block_at: np.ndarray
    block_len: np.ndarray
    sums: np.ndarray

    @staticmethod
    def of(start: np.ndarray, count: np.ndarray, j0: np.ndarray, xs: list[Extent | None], block: int,
           size: int) -> _BlockPlan | None:
        """The plan of parts whose runs start at block ``start`` of the staging buffer, ``count`` blocks from block
        ``j0`` of extents ``xs`` (``None``: never written), or ``None`` where an extent has no block checksums."""
        if any(x is not None and x.blocks is None for x in xs):
            return None
        n = len(xs)
        slot = np.fromiter((-1 if x is None else x.slot for x in xs), dtype=np.int64, count=n)
        length = np.fromiter((0 if x is None else x.length for x in xs), dtype=np.int64, count=n)
        valid = np.clip(np.minimum(count * block, length - j0 * block), 0, None)
        nblk = -(-valid // block)
        sums = np.frombuffer(b"".join([x.blocks[4 * j:4 * (j + m)] for x, j, m in zip(xs, j0.tolist(), nblk.tolist())
                                       if m and x is not None and x.blocks is not None]), dtype="<u4")
        total = int(nblk.sum())
        if sums.size != total:  # an index shorter than its extents: the part-by-part path reports it
            return None
        part = np.repeat(np.arange(n), nblk)
        j = np.arange(total) - np.repeat(np.cumsum(nblk) - nblk, nblk)
        return _BlockPlan(start=start, count=count, offset=slot * size + j0 * block, valid=valid,
                          block_at=(start[part] + j) * block, block_len=np.minimum(block, valid[part] - j * block),
                          sums=sums.astype(np.int64))


class _RangeJob(_Job):
    """A :meth:`TensorStore.read_ranges`: runs of blocks read into one aligned staging buffer by a few
    tasks, then the ranges copied out of it (by the task that finishes last)."""

    def __init__(self, store: TensorStore, name: str, parts: list[tuple[int, int, int, int, Extent | None]],
                 staged_bytes: int, block: int, view: memoryview, at: np.ndarray, length: int) -> None:
        super().__init__(store, 0)
        self.name, self.parts, self.block, self.view, self.at, self.length = name, parts, block, view, at, length
        self.staged = aligned_empty(staged_bytes).numpy()
        self.moved = 0
        self.plan: _BlockPlan | None = None  # read_ranges sets it (under the store's mutex)

    def chunks(self, workers: int) -> list[range]:
        """The parts split into at most ``workers`` tasks of neighbouring runs (each one request at the device)."""
        n = len(self.parts)
        tasks = min(workers, n)
        bounds = [n * i // tasks for i in range(tasks + 1)] if tasks else [0]
        out = [range(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        self._left, self._empty = len(out), not out
        return out

    def run(self, chunk: range, batched: bool = False) -> None:
        """Read the runs ``chunk`` of the parts; ``batched``: all in one kernel AIO submission (:mod:`.aio`)."""
        st, moved = self.store, None
        try:
            if batched and self.plan is not None and len(chunk) == len(self.parts):
                moved = self._run_batched(self.plan)
            if moved is None:  # no block checksums, no AIO, or something failed: part by part (the errors' path)
                moved = self._run_parts(chunk, batched)
        except BaseException as err:
            self.error = self.error or err
        finally:
            with st._mutex:
                for i in chunk:
                    x = self.parts[i][4]
                    if x is not None:
                        st._slots.read_end(x.slot)
                self.moved += moved or 0
            self.part_done()

    def _run_batched(self, plan: _BlockPlan) -> int | None:
        """Every part in one AIO submission and every block verified, without Python per part (the GIL stays
        free for the training step beside it): the bytes read, or ``None`` where anything is off (a short or
        failed read, a checksum mismatch, no AIO here), for :meth:`_run_parts` to redo and report."""
        st, block = self.store, self.block
        sel = np.flatnonzero(plan.valid > 0)
        if sel.size:
            want = plan.valid[sel]
            asked = -(-want // ALIGN) * ALIGN if st._io.direct else want
            res = read_many(st._fd, (self.staged.ctypes.data + plan.start[sel] * block).astype(np.uint64), asked,
                            plan.offset[sel])
            if res is None or bool((res < want).any()):
                return None
        for i in np.flatnonzero(plan.valid < plan.count * block).tolist():  # never written, or an extent's tail
            self.staged[int(plan.start[i]) * block + int(plan.valid[i]):int(plan.start[i] + plan.count[i]) * block] = 0
        if plan.sums.size:
            crc, view = st._io.checksum, memoryview(self.staged)
            got = np.fromiter((crc(view[a:a + n]) for a, n in zip(plan.block_at.tolist(), plan.block_len.tolist())),
                              dtype=np.int64, count=plan.sums.size)
            if not np.array_equal(got, plan.sums):
                return None
        return int(plan.valid.sum())

    def _run_parts(self, chunk: range, batched: bool) -> int:
        st, block, moved = self.store, self.block, 0
        size, io = st.extent_bytes, st._io
        todo = []  # (part, its bytes in the staging buffer, file offset, valid bytes, block checksums)
        for i in chunk:
            start, count, k, j0, x = self.parts[i]
            dst = self.staged[start * block:(start + count) * block].data
            if x is None:  # never written: zeros
                dst[:] = bytes(dst.nbytes)
                continue
            if x.blocks is None:  # no block checksums: the whole extent is the block
                valid, sums = x.length, [x.crc]
            else:
                valid = min(count * block, x.length - j0 * block)
                n = -(-valid // block) if valid > 0 else 0
                sums = list(struct.unpack_from(f"<{n}I", x.blocks, 4 * j0)) if n else []
            todo.append((i, dst, x.slot * size + j0 * block, valid, sums))
        res = None
        if batched:
            sent = [t for t in todo if t[3] > 0]
            res = read_many(st._fd, np.array([address(t[1]) for t in sent], dtype=np.uint64),
                            np.array([io.padded(t[3]) for t in sent], dtype=np.int64),
                            np.array([t[2] for t in sent], dtype=np.int64))
            got = dict(zip((t[0] for t in sent), res.tolist())) if res is not None else {}
        for i, dst, off, valid, sums in todo:
            try:
                if res is None:
                    io.read_blocks(dst, off, valid, sums)
                else:
                    n = got.get(i, 0)
                    if n < 0:
                        raise OSError(-n, f"{st.path / DATA}: reading {valid} bytes at byte offset {off}: "
                                          f"{os.strerror(-n)}")
                    if n < valid:
                        raise ChecksumError(f"{st.path / DATA} is truncated: {valid} bytes expected at byte "
                                            f"offset {off}, the file ends at {off + n}; the store is damaged: "
                                            f"restore it from a checkpoint or rewrite the tensor",
                                            path=str(st.path / DATA), offset=off)
                    io.verify_blocks(dst, off, valid, sums)
            except ChecksumError as err:
                start, count, k, j0, x = self.parts[i]
                assert x is not None
                lo = k * size + j0 * block + max(0, err.offset - off)
                span = (lo, lo + (block if x.blocks is not None else x.length))
                raise ChecksumError(f"{err} [bytes [{span[0]}, {span[1]}) of {self.name!r}, extent {k}]",
                                    path=err.path, offset=err.offset, span=span) from None
            moved += max(0, valid)
        return moved

    def finish(self) -> None:
        try:
            if self.error is None:
                gather(np.frombuffer(self.view, dtype=np.uint8), self.staged, self.at, self.length)
        except BaseException as err:
            self.error = err
        with self.store._mutex:
            self.store._inflight.discard(self.future)
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.moved)


class _WriteJob(_Job):
    def __init__(self, store: TensorStore, name: str, view: memoryview, offset: int, chunks: list[tuple[int, int]],
                 *, seq: int, meta: tuple[str, tuple[int, ...]] | None, replace: bool) -> None:
        super().__init__(store, len(chunks))
        self.name, self.view, self.offset, self.chunks = name, view, offset, chunks
        self.seq, self.meta, self.replace = seq, meta, replace
        self.written: list[tuple[int, Extent]] = []

    def _range(self, k: int) -> tuple[int, int]:
        size = self.store.extent_bytes
        return max(self.offset, k * size) - k * size, min(self.offset + self.view.nbytes, (k + 1) * size) - k * size

    def whole(self, i: int) -> bool:
        """Whether extent ``i`` is written without the old bytes (so it need not wait for older writes)."""
        a, b = self._range(self.chunks[i][0])
        return a == 0 and (self.replace or b == self.store.extent_bytes)

    def run(self, i: int) -> None:
        st, (k, slot) = self.store, self.chunks[i]
        size, (a, b) = st.extent_bytes, self._range(k)
        src = self.view[k * size + a - self.offset:k * size + b - self.offset]
        old = None
        try:
            if not self.replace:
                with st._mutex:
                    e = st._index.entries.get(self.name)
                    old = e.extents[k] if e is not None and k < len(e.extents) else None
                    if old is not None and a == 0 and b >= old.length:
                        old = None  # fully overwritten: no merge
                    if old is not None:
                        st._slots.read_begin(old.slot)
            if old is None and a == 0:
                crc, length = st._io.write(src, slot * size), b
                blocks = st._io.block_sums(src)
            else:  # merge with the extent's current bytes (zeros where never written)
                buf, have = st._io.scratch(), 0
                if old is not None:
                    st._io.read(buf[:old.length], old.slot * size, old.length, old.crc)
                    have = old.length
                _zero(buf[have:a])
                buf[a:b] = src
                length = max(have, b)
                crc = st._io.write_padded(buf, length, slot * size)
                blocks = st._io.block_sums(buf[:length])
            self.written.append((k, Extent(slot=slot, length=length, crc=crc, seq=self.seq, blocks=blocks)))
        except BaseException as err:
            self.error = self.error or err
        finally:
            if old is not None:
                with st._mutex:
                    st._slots.read_end(old.slot)
            self.part_done()

    def finish(self) -> None:
        st = self.store
        with st._mutex:
            for k, _ in self.chunks:
                if st._tails.get((self.name, k)) is self.future:
                    del st._tails[(self.name, k)]
            st._inflight.discard(self.future)
            if self.error is None:
                self._apply(st._index.entries, st._slots)
            else:  # nothing was committed: the new slots were never referenced; give their blocks back
                for _, slot in self.chunks:
                    punch_hole(st._fd, slot * st.extent_bytes, st.extent_bytes)
                    st._slots.release(slot)
        if isinstance(self.error, DiskFullError):
            err = disk_full(st.path / DATA, self.view.nbytes, f"writing {self.view.nbytes} bytes of {self.name!r}")
            err.__cause__ = self.error
            self.future.set_exception(err)
        elif self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.view.nbytes)

    def _apply(self, entries: dict[str, Entry], slots: Slots) -> None:
        """Switch the index to the new extents (under the store's mutex); a newer write to an extent wins."""
        size, e = self.store.extent_bytes, entries.get(self.name)
        if e is not None and self.seq < e.replace_seq:  # a newer put() replaced the tensor meanwhile
            for _, slot in self.chunks:
                slots.release(slot)
            return
        if e is None:
            e = entries[self.name] = Entry(nbytes=0, dtype=self.meta[0] if self.meta else None,
                                           shape=self.meta[1] if self.meta else None)
        end = max(e.nbytes, self.offset + self.view.nbytes)
        if self.replace:
            e.replace_seq, end = self.seq, self.view.nbytes
            e.dtype, e.shape = (self.meta[0], self.meta[1]) if self.meta else (None, None)
            for k in range(-(-end // size), len(e.extents)):
                x = e.extents[k]
                if x is not None and x.seq < self.seq:
                    slots.release(x.slot)
                    e.extents[k] = None
        for k, x in self.written:
            e.extents.extend([None] * (k + 1 - len(e.extents)))
            cur = e.extents[k]
            if cur is None or cur.seq < self.seq:
                if cur is not None:
                    slots.release(cur.slot)
                e.extents[k] = x
            else:
                slots.release(x.slot)
        # The last written extent ends furthest (an extent holds at most ``size`` bytes): scan back to it, not
        # over all of them (a 4 GiB buffer of 16 KiB extents has 250K; every write commit paid that, under the
        # mutex, and write-back of scattered rows commits one write per extent).
        for k in range(len(e.extents) - 1, -1, -1):
            x = e.extents[k]
            if x is not None:
                end = max(end, k * size + x.length)
                break
        e.nbytes = end
        del e.extents[-(-end // size):]
        e.extents.extend([None] * (-(-end // size) - len(e.extents)))
        if e.dtype is not None and e.shape is not None:
            if math.prod(e.shape) * DTYPE_SIZES[e.dtype] != end:
                e.dtype, e.shape = None, None  # resized by a byte-range write: now a flat buffer
