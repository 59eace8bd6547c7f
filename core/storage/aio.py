"""Many short reads in one system call: Linux kernel AIO (``io_submit`` / ``io_getevents``) through libc's
``syscall``, no library needed.

Why: :meth:`~tightfit.storage.TensorStore.read_ranges` reads a cache's missed rows, thousands of 4 KiB
blocks per batch. A thread per request needs the GIL back after every ``preadv``; while the training step
holds it (Python between kernels) each return waits up to the interpreter's switch interval (5 ms), so
16 threads reached 25k blocks/s under a training step here. One ``io_submit`` puts every block of a batch at
the device and one ``io_getevents`` waits for all, both with the GIL released (ctypes), whatever the step
does. With O_DIRECT the reads are asynchronous in the kernel; on a buffered file (tmpfs) ``io_submit``
performs them itself, still correct.

Unavailable (another OS or architecture, a kernel or sandbox refusing ``io_setup``): :func:`read_many`
returns ``None`` and the store reads with its worker threads.

Example:
    >>> import os, tempfile, numpy as np
    >>> from tightfit.storage.fs import aligned_buffer, address
    >>> fd, path = tempfile.mkstemp(); _ = os.write(fd, bytes(range(256)) * 32)
    >>> buf = aligned_buffer(8192)
    >>> res = read_many(fd, np.array([address(buf), address(buf) + 4096], dtype=np.uint64),
    ...                 np.array([4096, 4096]), np.array([4096, 0]))
    >>> res is None or (res.tolist() == [4096, 4096] and buf[4096] == 0 and buf[0] == 0)
    True
    >>> os.close(fd); os.unlink(path)
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import sys
from typing import Any

import numpy as np

__all__ = ["read_many", "available"]

# syscall numbers: io_setup, io_destroy, io_getevents, io_submit
_NUMBERS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<u4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                  ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                  ("flags", "<u4"), ("resfd", "<u4")])  # struct iocb, 64 bytes
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])  # struct io_event
_PREAD = 0  # IOCB_CMD_PREAD
_DEPTH = 1024  # requests at the device per io_submit (the context's size)


@functools.cache
def _syscall() -> tuple[Any, tuple[int, int, int, int]] | None:
    numbers = _NUMBERS.get(platform.machine())
    if not sys.platform.startswith("linux") or numbers is None or sys.byteorder != "little":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn, numbers


def available() -> bool:
    """Whether this process can use kernel AIO (tried once: a context set up and destroyed); the environment
    variable ``TIGHTFIT_AIO=0`` turns it off (the store's worker threads read instead)."""
    return os.environ.get("TIGHTFIT_AIO", "1") != "0" and _probe()


@functools.cache
def _probe() -> bool:
    found = _syscall()
    if found is None:
        return False
    ctx = _setup(found, 1)
    if ctx is None:
        return False
    found[0](ctypes.c_long(found[1][1]), ctypes.c_ulong(ctx))
    return True


def _setup(found: tuple[Any, tuple[int, int, int, int]], depth: int) -> int | None:
    fn, (setup, _, _, _) = found
    ctx = ctypes.c_ulong(0)
    if fn(ctypes.c_long(setup), ctypes.c_uint(depth), ctypes.byref(ctx)) != 0:
        return None
    return ctx.value


def read_many(fd: int, bufs: np.ndarray, nbytes: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """Read ``nbytes[i]`` bytes at file offset ``offsets[i]`` into address ``bufs[i]`` for every ``i`` (at most
    :data:`_DEPTH` at the device at once); each result is the bytes read, or ``-errno``. ``None``: kernel AIO
    is not available here (read some other way). The buffers must stay alive until this returns."""
    found = _syscall() if available() else None
    if found is None:
        return None
    fn, (_, destroy, getevents, submit) = found
    n = int(bufs.size)
    res = np.zeros(n, dtype=np.int64)
    if n == 0:
        return res
    depth = min(n, _DEPTH)
    ctx = _setup(found, depth)
    if ctx is None:
        return None
    iocbs = np.zeros(n, dtype=_IOCB)
    iocbs["data"] = np.arange(n, dtype=np.uint64)
    iocbs["opcode"] = _PREAD
    iocbs["fildes"] = fd
    iocbs["buf"] = bufs
    iocbs["nbytes"] = nbytes
    iocbs["offset"] = offsets
    ptrs = (iocbs.ctypes.data + np.arange(n, dtype=np.uint64) * _IOCB.itemsize).astype(np.uint64)
    events = np.zeros(depth, dtype=_EVENT)
    try:
        sent = done = 0
        while done < n:
            room = min(n - sent, depth - (sent - done))
            if room > 0:
                got = fn(ctypes.c_long(submit), ctypes.c_ulong(ctx), ctypes.c_long(room),
                         ctypes.c_void_p(int(ptrs.ctypes.data) + 8 * sent))
                if got < 0:
                    err = ctypes.get_errno()
                    if err != errno.EAGAIN or sent == done:
                        raise OSError(err, f"io_submit: {os.strerror(err)}")
                else:
                    sent += got
            # Wait for all in flight: every return needs the GIL back, which a busy step holds for up to 5 ms.
            got = fn(ctypes.c_long(getevents), ctypes.c_ulong(ctx), ctypes.c_long(sent - done), ctypes.c_long(depth),
                     ctypes.c_void_p(events.ctypes.data), None)
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, f"io_getevents: {os.strerror(err)}")
            ev = events[:got]
            res[ev["data"].astype(np.int64)] = ev["res"]
            done += got
    finally:
        fn(ctypes.c_long(destroy), ctypes.c_ulong(ctx))  # waits for (or cancels) what is still in flight
    return res
