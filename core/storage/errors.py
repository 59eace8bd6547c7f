"""The store's error types: every message names the file (and byte offset where one applies) and the fix."""

from __future__ import annotations

__all__ = ["StorageError", "ChecksumError", "DiskFullError", "StoreLockedError"]


class StorageError(OSError):
    """A store directory, file or request that cannot be used as asked (the message says why and what to do)."""


class ChecksumError(StorageError):
    """Data read back is not what was written: a checksum mismatch or a file shorter than its index says.

    Args:
        path: the data file.
        offset: byte offset in that file of the extent (or block) that failed.
        span: the bytes ``(start, end)`` of the tensor or buffer that failed, where known (``None``).
    """

    def __init__(self, message: str, *, path: str = "", offset: int = -1,
                 span: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset
        self.span = span

    def __reduce__(self) -> tuple[object, ...]:  # keep path/offset/span across processes
        return (_rebuild, (type(self), str(self), self.path, self.offset, self.span))


class DiskFullError(StorageError):
    """Too little free space for a write (ENOSPC mid-write, or refused before starting).

    The store's previous consistent state stays readable: nothing it referenced was overwritten.

    Args:
        path: the directory or file.
        needed_bytes: bytes the write needed.
        free_bytes: bytes free there when it failed.
    """

    def __init__(self, message: str, *, path: str = "", needed_bytes: int = 0, free_bytes: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_full, (str(self), self.path, self.needed_bytes, self.free_bytes))


class StoreLockedError(StorageError):
    """Another owner (process, or another ``TensorStore`` in this one) holds the directory's lock.

    Args:
        path: the directory.
        pid: the holder's process id (0 when it could not be read).
    """

    def __init__(self, message: str, *, path: str = "", pid: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid


def _rebuild(cls: type[ChecksumError], message: str, path: str, offset: int,
             span: tuple[int, int] | None = None) -> ChecksumError:
    return cls(message, path=path, offset=offset, span=span)


def _rebuild_full(message: str, path: str, needed: int, free: int) -> DiskFullError:
    return DiskFullError(message, path=path, needed_bytes=needed, free_bytes=free)
