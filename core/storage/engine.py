"""The store's I/O engine: a few worker threads issuing ``os.preadv`` / ``os.pwritev``, a bound on
requests in flight, and the extent-level read and write with alignment and checksums.

Why threads: they matched libaio when measured against it, and PyPI's io_uring binding cannot do O_DIRECT
(docs/disk-tier.md, "Design choices"); each blocking ``preadv``/``pwritev`` releases the GIL, so ``workers`` threads keep ``workers``
requests at the device, and at MiB-sized requests the system-call cost is noise.

O_DIRECT needs aligned buffers, offsets and lengths (:data:`~tightfit.storage.fs.ALIGN`). Extents
start at aligned file offsets; an aligned caller buffer is read into / written from directly, and
what is not aligned (an unaligned caller buffer, the tail of an extent whose length is not a multiple
of the alignment) goes through the worker's own aligned bounce buffer, allocated once and reused.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tightfit.storage.checksums import DEFAULT_CHECKSUM, checksum_function
from tightfit.storage.errors import ChecksumError, StorageError
from tightfit.storage.fs import ALIGN, address, aligned_buffer, pread_full, pwrite_full

__all__ = ["IOEngine", "ExtentIO", "checksum"]

T = TypeVar("T")


def checksum(view: memoryview, start: int = 0) -> int:
    """The default checksum of ``view`` (:data:`~tightfit.storage.checksums.DEFAULT_CHECKSUM`: CRC-32C where
    ``crc32c`` is installed, else zlib's CRC-32), what a new store's extents get."""
    return checksum_function(DEFAULT_CHECKSUM)(view, start)


class IOEngine:
    """A pool of ``workers`` I/O threads with at most ``max_inflight`` requests queued or running.

    :meth:`submit` blocks the caller while ``max_inflight`` requests are outstanding (backpressure);
    :meth:`drain` waits until none are. ``name`` prefixes the threads' names; ``initializer`` runs once on each
    thread first (a plugin whose requests also compute gives each thread one intra-op thread with it).
    """

    def __init__(self, *, workers: int, max_inflight: int, name: str = "tightfit-io",
                 initializer: Callable[[], object] | None = None) -> None:
        if workers < 1 or max_inflight < 1:
            raise StorageError(f"IOEngine: workers={workers}, max_inflight={max_inflight} must both be >= 1; "
                               f"give at least one worker and one request in flight")
        self.workers = workers
        self.max_inflight = max_inflight
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=initializer)
        self._room = threading.Semaphore(max_inflight)
        self._idle = threading.Condition()
        self._outstanding = 0

    def submit(self, fn: Callable[..., T], *args: Any, bounded: bool = True) -> Future[T]:
        """Run ``fn(*args)`` on a worker, first waiting for a place among ``max_inflight`` (backpressure).

        ``bounded=False`` skips the wait and takes no place: for a continuation submitted from a worker
        (a partial extent that runs after an older write), which must never block on the bound, or
        two callers could each hold the places the other's continuation needs.
        """
        if bounded:
            self._room.acquire()
        with self._idle:
            self._outstanding += 1
        try:
            fut = self._pool.submit(fn, *args)
        except BaseException:
            self._done(bounded)
            raise
        fut.add_done_callback(lambda _f: self._done(bounded))
        return fut

    def _done(self, bounded: bool) -> None:
        if bounded:
            self._room.release()
        with self._idle:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    def drain(self) -> None:
        """Wait until no request is queued or running."""
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ExtentIO:
    """Reads and writes whole extents of one data file, checksummed, on any worker thread.

    Args:
        fd: the open data file.
        path: its path (for messages).
        direct: whether ``fd`` was opened with ``O_DIRECT``.
        extent_bytes: the largest extent (the size of each worker's bounce buffer).
        algorithm: the checksum (``"crc32c"`` or ``"crc32"``), computed on the worker thread that moves the
            extent, so it overlaps the other workers' I/O.
        block_bytes: the block of the per-block checksums (:meth:`block_sums`), or ``None``.
    """

    def __init__(self, fd: int, path: Path, *, direct: bool, extent_bytes: int,
                 algorithm: str = DEFAULT_CHECKSUM, block_bytes: int | None = None) -> None:
        self.algorithm = algorithm
        self.block_bytes = block_bytes
        self.checksum = checksum_function(algorithm, str(path))
        self.fd = fd
        self.path = path
        self.direct = direct
        self.extent_bytes = extent_bytes
        self._local = threading.local()

    def bounce(self) -> memoryview:
        """This thread's aligned bounce buffer of ``extent_bytes``."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_buffer(self.extent_bytes)
        return buf

    def write(self, src: memoryview, file_offset: int) -> int:
        """Write ``src`` (at most one extent) at an aligned ``file_offset``; returns its checksum."""
        n = src.nbytes
        if not self.direct:
            pwrite_full(self.fd, src, file_offset, self.path)
            return self.checksum(src)
        head = n // ALIGN * ALIGN if address(src) % ALIGN == 0 else 0
        crc = 0
        if head:
            crc = self.checksum(src[:head])
            pwrite_full(self.fd, src[:head], file_offset, self.path)
        rest = n - head
        if rest:
            buf = self.bounce()
            padded = -(-rest // ALIGN) * ALIGN
            buf[:rest] = src[head:]
            # checksummed after the copy, from the bounce buffer the copy left in cache: faster than
            # checksumming the source first and copying after
            crc = self.checksum(buf[:rest], crc)
            buf[rest:padded] = bytes(padded - rest)  # the pad stays inside this extent's own slot
            pwrite_full(self.fd, buf[:padded], file_offset + head, self.path)
        return crc

    def block_sums(self, view: memoryview) -> bytes | None:
        """The little-endian 32-bit checksum of each ``block_bytes`` of ``view`` (the last block may be short);
        ``None`` without blocks. A 4 KiB block's checksum costs ~1 us of Python beside the extent's own."""
        b = self.block_bytes
        if b is None:
            return None
        return struct.pack(f"<{-(-view.nbytes // b)}I", *(self.checksum(view[i:i + b]) for i in range(0, view.nbytes, b)))

    def read_blocks(self, dst: memoryview, file_offset: int, valid: int, sums: list[int]) -> None:
        """Read ``valid`` bytes of consecutive blocks at ``file_offset`` into ``dst`` (aligned, whole blocks long),
        verify each block against ``sums`` (one per block: ``block_bytes``, or all of ``dst`` without blocks)
        and zero ``dst`` past ``valid`` (never-written bytes)."""
        if valid > 0:
            pread_full(self.fd, dst[:self.padded(valid)], file_offset, self.path, need=valid)
        self.verify_blocks(dst, file_offset, valid, sums)

    def padded(self, valid: int) -> int:
        """Bytes to request for ``valid`` bytes: rounded up to the alignment under O_DIRECT."""
        return -(-valid // ALIGN) * ALIGN if self.direct else valid

    def verify_blocks(self, dst: memoryview, file_offset: int, valid: int, sums: list[int]) -> None:
        """Verify the ``valid`` bytes read into ``dst`` from ``file_offset`` against ``sums`` (:meth:`read_blocks`)
        and zero ``dst`` past them."""
        b = self.block_bytes or dst.nbytes
        if valid > 0:
            for j, want in enumerate(sums):
                lo = j * b
                if lo >= valid:
                    break
                got = self.checksum(dst[lo:min(valid, lo + b)])
                if got != want:
                    raise ChecksumError(
                        f"{self.path}: checksum mismatch in the {min(valid, lo + b) - lo}-byte block at byte offset "
                        f"{file_offset + lo} ({self.algorithm} {got:08x}, index says {want:08x}): the data on disk "
                        f"changed since it was written; restore the store from a checkpoint or rewrite the tensor",
                        path=str(self.path), offset=file_offset + lo)
        if valid < dst.nbytes:
            dst[max(0, valid):] = bytes(dst.nbytes - max(0, valid))

    def scratch(self) -> memoryview:
        """A second aligned buffer of ``extent_bytes`` for this thread (merging a partial extent: the old
        extent is read into it while :meth:`read` may use the bounce buffer)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None:
            buf = self._local.scratch = aligned_buffer(self.extent_bytes)
        return buf

    def write_padded(self, buf: memoryview, length: int, file_offset: int) -> int:
        """Write ``buf[:length]`` (an aligned buffer of ``extent_bytes``) at ``file_offset``, zero-padded to the
        alignment in place; returns the checksum of the ``length`` bytes."""
        crc = self.checksum(buf[:length])
        padded = -(-length // ALIGN) * ALIGN if self.direct else length
        buf[length:padded] = bytes(padded - length)
        pwrite_full(self.fd, buf[:padded], file_offset, self.path)
        return crc

    def read(self, dst: memoryview, file_offset: int, length: int, crc: int, skip: int = 0) -> None:
        """Read the extent of ``length`` bytes at ``file_offset``, verify ``crc``, and place its bytes
        ``[skip, skip + len(dst))`` in ``dst``."""
        n = dst.nbytes
        whole = skip == 0 and n == length
        if whole and not self.direct:
            pread_full(self.fd, dst, file_offset, self.path)
            self._verify(self.checksum(dst), crc, file_offset, length)
            return
        head = length // ALIGN * ALIGN if whole and address(dst) % ALIGN == 0 else 0
        got = 0
        if head:
            pread_full(self.fd, dst[:head], file_offset, self.path)
            got = self.checksum(dst[:head])
        if head < length:
            buf = self.bounce()
            rest = length - head
            padded = -(-rest // ALIGN) * ALIGN if self.direct else rest
            pread_full(self.fd, buf[:padded], file_offset + head, self.path, need=rest)
            got = self.checksum(buf[:rest], got)
            if whole:
                dst[head:] = buf[:rest]
            else:
                self._verify(got, crc, file_offset, length)
                dst[:] = buf[skip:skip + n]
                return
        self._verify(got, crc, file_offset, length)

    def _verify(self, got: int, want: int, offset: int, length: int) -> None:
        if got != want:
            raise ChecksumError(f"{self.path}: checksum mismatch in the extent at byte offset {offset} "
                                f"({length} bytes; {self.algorithm} {got:08x}, index says {want:08x}): the data on disk "
                                f"changed since it was written; restore the store from a checkpoint or rewrite "
                                f"the tensor", path=str(self.path), offset=offset)
