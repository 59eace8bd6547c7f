"""Byte ranges of a file the store does not own (a checkpoint's safetensors file), read in place, read-only.

The store's own files have aligned extents; a foreign file's ranges start anywhere. :meth:`ExternalFile.read`
reads the aligned superset of a range (whole :data:`~tightfit.storage.fs.ALIGN` blocks) with ``O_DIRECT`` into an
aligned part of the caller's buffer and returns the range as a view inside it: no bounce copy, no page cache (a
streamed range is read again next pass anyway, and cached pages count against a memory limit). A buffer of
:func:`direct_buffer_bytes` of the range always has room. Where the buffer has no room, the range is not aligned
for its dtype, or the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems; from then on for this
file), the read is buffered, with readahead off (``POSIX_FADV_RANDOM``) and, with ``drop_page_cache``, the
range dropped from the page cache after it (``POSIX_FADV_DONTNEED``).

A file shorter than a range raises :class:`~tightfit.storage.ChecksumError` naming the file and offset (the
caller says what that means for its file: changed, truncated).

Example:
    >>> import tempfile, torch
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     _ = f.write(bytes(range(100))); f.flush()
    ...     file = ExternalFile(f.name, direct=True)
    ...     file.read(10, 5, torch.empty(direct_buffer_bytes(5), dtype=torch.uint8)).tolist()
    ...     file.close()
    [10, 11, 12, 13, 14]
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from tightfit.storage.fs import ALIGN, pread_full

__all__ = ["ExternalFile", "direct_buffer_bytes"]


def direct_buffer_bytes(nbytes: int) -> int:
    """A read buffer's size that holds any ``nbytes``-byte range read directly: the range widened to whole aligned
    blocks at both ends, plus the slack to align the buffer's own address."""
    return nbytes + 3 * ALIGN


class ExternalFile:
    """One foreign file, opened read-only, read by byte range (see the module docstring).

    Args:
        path: the file.
        direct: read with ``O_DIRECT`` where the filesystem allows it; ``False``: buffered reads only.
        drop_page_cache: after each buffered read, ``POSIX_FADV_DONTNEED`` its range.
    """

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = False, drop_page_cache: bool = False) -> None:
        self.path = Path(path)
        self.drop_page_cache = drop_page_cache
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.direct_fd: int | None = None
        flag = getattr(os, "O_DIRECT", 0)
        if direct and flag:
            try:
                self.direct_fd = os.open(self.path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # EINVAL: the filesystem has no direct I/O (tmpfs); buffered reads it is
                pass
        if direct and self.direct_fd is None:
            self._random()
        self.direct_reads = 0
        self.buffered_reads = 0

    @property
    def direct(self) -> bool:
        """Whether reads may go around the page cache."""
        return self.direct_fd is not None

    def _random(self) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is asked

    def read(self, start: int, nbytes: int, out: torch.Tensor, itemsize: int = 1) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` as a ``uint8`` view of ``out`` (a contiguous CPU ``uint8`` tensor of at
        least ``nbytes``); direct where the file allows, ``out`` has room (:func:`direct_buffer_bytes`) and the
        range's place in its block keeps an ``itemsize`` alignment, else buffered into ``out[:nbytes]``."""
        if self.direct_fd is not None:
            got = self._read_direct(start, nbytes, out, itemsize)
            if got is not None:
                return got
        buf = out[:nbytes]
        pread_full(self.fd, memoryview(buf.numpy()), start, self.path)  # type: ignore[arg-type]
        self.buffered_reads += 1
        if self.drop_page_cache and nbytes and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, start, nbytes, os.POSIX_FADV_DONTNEED)
        return buf

    def _read_direct(self, start: int, nbytes: int, out: torch.Tensor, itemsize: int) -> torch.Tensor | None:
        lead, skew = start % ALIGN, (-out.data_ptr()) % ALIGN
        span = -(-(lead + nbytes) // ALIGN) * ALIGN
        # not viewable in place, or no room (an empty buffer has no address to align: torch gives it 0)
        if lead % itemsize or skew + span > out.numel() or not out.numel():
            return None
        window = out[skew: skew + span]
        assert self.direct_fd is not None
        try:  # a short read only at the file's end (its last block is partial)
            pread_full(self.direct_fd, memoryview(window.numpy()), start - lead, self.path,  # type: ignore[arg-type]
                       need=lead + nbytes)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            os.close(self.direct_fd)  # this filesystem or device refuses the alignment: buffered from now on
            self.direct_fd = None
            self._random()
            return None
        self.direct_reads += 1
        return window[lead: lead + nbytes]

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.direct_fd = -1, None
