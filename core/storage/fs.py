"""The filesystem side of the disk tier: checking a directory, what it is mounted as, raw full-length I/O.

``check_disk_dir`` refuses a directory before any work (missing, not a directory, not writable, too
little free space), one line each naming the path, the rule and the fix, and warns when the directory
is RAM (tmpfs, ramfs: a disk tier there saves no memory).

Example:
    >>> import tempfile
    >>> d = check_disk_dir(tempfile.gettempdir())
    >>> d.is_absolute()
    True
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tightfit.storage.errors import ChecksumError, DiskFullError, StorageError, StoreLockedError
from tightfit.units import format_bytes

__all__ = ["ALIGN", "Mount", "mount_of", "free_bytes", "check_disk_dir", "open_data", "aligned_buffer",
           "address", "pread_full", "pwrite_full", "disk_full", "punch_hole",
           "lock_directory"]

ALIGN = 4096
"""Alignment of O_DIRECT buffer addresses, file offsets and lengths, in bytes. O_DIRECT needs them aligned to
the device's logical block (512 B or 4 KiB); 4 KiB is safe on every device and costs nothing at MiB-sized
requests."""
_RAM_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass(frozen=True, kw_only=True, slots=True)
class Mount:
    """The mount a path lives on (from ``/proc/mounts``).

    Args:
        point: the mount point.
        filesystem: its type (``"ext4"``, ``"tmpfs"``...); ``""`` when ``/proc/mounts`` is unreadable.
        source: the mounted device (``"/dev/nvme0n1p2"``).
        device: ``st_dev`` of the path, as ``"major:minor"`` (what a cache key can rely on).
    """

    point: str
    filesystem: str
    source: str
    device: str


def _unescape(field: str) -> str:  # /proc/mounts escapes spaces and tabs as octal
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")


def mount_of(path: str | os.PathLike[str]) -> Mount:
    """The mount holding ``path`` (the longest mount point that is a prefix of its real path)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    best = Mount(point="/", filesystem="", source="", device=device)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = _unescape(parts[1])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.point):  # later lines over-mount earlier ones at the same point
            best = Mount(point=point, filesystem=parts[2], source=_unescape(parts[0]), device=device)
    return best


def free_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(free, total)`` bytes of the filesystem holding ``path``, as an unprivileged writer sees them."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check_disk_dir(path: str | os.PathLike[str], need_bytes: int = 0) -> Path:
    """Return ``path`` as an absolute :class:`~pathlib.Path` if a store can live there, else raise.

    Refuses, before any work, with one line naming the path, the rule and the fix: a missing path, a
    file, a directory that cannot be written (read-only mount, permissions), fewer than ``need_bytes``
    free (:class:`DiskFullError`). Warns (``warnings.warn``) when the directory is RAM (tmpfs, ramfs).
    """
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise StorageError(f"disk directory {p} does not exist: a store needs an existing directory; "
                           f"create it (mkdir -p {p}) or pass another path")
    if not p.is_dir():
        raise StorageError(f"disk directory {p} is not a directory: a store needs a directory; "
                           f"pass its parent or another path")
    try:  # os.access answers for permissions; only creating a file proves a read-only mount or ACL lets us write
        fd, probe = tempfile.mkstemp(prefix=".tightfit-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise StorageError(f"disk directory {p} is not writable ({err.strerror}): a store writes files there; "
                           f"pass a writable directory or fix its mount/permissions") from err
    free, _ = free_bytes(p)
    if need_bytes > free:
        raise DiskFullError(f"disk directory {p} has {format_bytes(free)} free, {format_bytes(need_bytes)} are "
                            f"needed: free space there or pass a directory on a larger disk",
                            path=str(p), needed_bytes=int(need_bytes), free_bytes=free)
    fs = mount_of(p).filesystem
    if fs in _RAM_FILESYSTEMS:
        warnings.warn(f"disk directory {p} is on {fs}, which is RAM: a disk tier there saves no memory; "
                      f"pass a directory on an SSD/NVMe", stacklevel=2)
    return p


def open_data(path: Path, *, direct: bool) -> tuple[int, bool]:
    """Open (creating) a data file for reading and writing; ``(fd, direct)`` with ``O_DIRECT`` where asked
    and the filesystem takes it (tmpfs and some network filesystems refuse it: buffered then, silently)."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o644), False


def lock_directory(path: Path, name: str) -> int:
    """Take the owner's lock of store directory ``path`` (``fcntl.flock`` of ``path / name``, which holds the pid);
    a second owner gets :class:`StoreLockedError` naming the holder. Closing the descriptor releases it."""
    fd = os.open(path / name, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        pid = int(text) if text.isdigit() else 0
        raise StoreLockedError(f"{path} is in use by process {pid or '?'} (lock {path / name}): one TensorStore "
                               f"owns a directory; close the other store, or give each process its own "
                               f"directory (TensorStore.for_rank(path, rank))", path=str(path), pid=pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the blocks of ``[offset, offset + length)`` back to the filesystem (``FALLOC_FL_PUNCH_HOLE``), the
    file's size unchanged; False where the filesystem or platform cannot (the space then stays allocated)."""
    try:
        libc = _libc()
        return libc.fallocate(fd, 3, ctypes.c_int64(offset), ctypes.c_int64(length)) == 0  # KEEP_SIZE | PUNCH_HOLE
    except (OSError, AttributeError):
        return False


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable, page-aligned (hence :data:`ALIGN`-aligned) buffer of ``nbytes`` (anonymous mmap)."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    return memoryview(mmap.mmap(-1, size))[:nbytes]


def address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def disk_full(path: Path, needed: int, what: str) -> DiskFullError:
    try:
        free = free_bytes(path.parent)[0]
    except OSError:
        free = 0
    return DiskFullError(f"{path}: disk full (ENOSPC) while {what}: {format_bytes(needed)} needed, "
                         f"{format_bytes(free)} free; free space on that disk or move the store "
                         f"(the previous consistent state is still readable)",
                         path=str(path), needed_bytes=needed, free_bytes=free)


def pread_full(fd: int, view: memoryview, offset: int, path: Path, need: int | None = None) -> None:
    """Read ``len(view)`` bytes at ``offset`` (at least ``need`` of them: an O_DIRECT read of a padded tail may
    end at the file's end); a file that ends first raises :class:`ChecksumError` naming the file and offset."""
    done, n = 0, view.nbytes
    need = n if need is None else need
    while done < need:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as err:  # O_DIRECT after a short read: the next offset is unaligned, i.e. we were at EOF
            if err.errno != errno.EINVAL or done == 0:
                raise
            got = 0
        if got == 0:
            break
        done += got
    if done < need:
        raise ChecksumError(f"{path} is truncated: {need} bytes expected at byte offset {offset}, the file ends "
                            f"at {offset + done}; the store is damaged: restore it from a checkpoint or rewrite "
                            f"the tensor", path=str(path), offset=offset)


def pwrite_full(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Write all of ``view`` at ``offset`` (short writes continue); ENOSPC raises :class:`DiskFullError`."""
    done, n = 0, view.nbytes
    try:
        while done < n:
            done += os.pwritev(fd, [view[done:]], offset + done)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full(path, n - done, f"writing {n} bytes at byte offset {offset}") from err
        raise
