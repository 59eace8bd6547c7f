"""Measure the I/O mechanisms the store could use, on one directory: threads with os.preadv/os.pwritev,
libaio (Debian libaio1, through ctypes) and io_uring (the PyPI ``liburing`` binding), each with 4 MiB
O_DIRECT requests kept ``depth`` deep over a file of ``--gib`` GiB, plus ``dd`` as the raw reference.
Prints one line per (mechanism, op, depth): GB/s and CPU seconds per GB. Results: docs/disk-tier.md.

    python scripts/measure_io_mechanisms.py /var/tmp --gib 1 [--pythonpath /tmp/storage-mech]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time

REQ = 4 * 2**20


def aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n))


def timed(fn) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def threads(path: str, size: int, depth: int, write: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    n = size // REQ
    nxt = iter(range(n))
    lock = threading.Lock()

    def worker() -> None:
        buf = aligned(REQ)
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            (os.pwritev if write else os.preadv)(fd, [buf], i * REQ)

    ts = [threading.Thread(target=worker) for _ in range(depth)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if write:
        os.fsync(fd)
    os.close(fd)


class _Iocb(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_uint32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


def libaio(path: str, size: int, depth: int, write: bool) -> None:
    lib = ctypes.CDLL("libaio.so.1")
    ctx = ctypes.c_void_p()
    assert lib.io_setup(depth, ctypes.byref(ctx)) == 0
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    bufs = [mmap.mmap(-1, REQ) for _ in range(depth)]
    addrs = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in bufs]
    iocbs = [_Iocb() for _ in range(depth)]
    events = (_Event * depth)()
    n, issued, done = size // REQ, 0, 0

    def submit(slot: int) -> None:
        nonlocal issued
        cb = iocbs[slot]
        cb.data, cb.opcode, cb.fildes = slot, 1 if write else 0, fd
        cb.buf, cb.nbytes, cb.offset = addrs[slot], REQ, issued * REQ
        ptr = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(cb))
        assert lib.io_submit(ctx, 1, ptr) == 1
        issued += 1

    for s in range(min(depth, n)):
        submit(s)
    while done < n:
        got = lib.io_getevents(ctx, 1, depth, events, None)
        for e in events[:got]:
            assert e.res == REQ, e.res
            done += 1
            if issued < n:
                submit(e.data)
    lib.io_destroy(ctx)
    if write:
        os.fsync(fd)
    os.close(fd)


def uring(path: str, size: int, depth: int, write: bool) -> None:
    import liburing as L

    # The binding takes only bytearray/bytes buffers, which are not page-aligned, so O_DIRECT is refused
    # (EINVAL): io_uring is measured buffered, its reads after the file's pages were dropped.
    ring, cqe = L.Ring(), L.Cqe()
    L.io_uring_queue_init(max(depth, 2), ring)
    fd = os.open(path, os.O_RDWR)
    bufs = [bytearray(REQ) for _ in range(depth)]
    n, issued, done = size // REQ, 0, 0

    def submit(slot: int) -> None:
        nonlocal issued
        sqe = L.io_uring_get_sqe(ring)
        if write:
            L.io_uring_prep_write(sqe, fd, bufs[slot], issued * REQ)
        else:
            L.io_uring_prep_read(sqe, fd, bufs[slot], issued * REQ)
        L.io_uring_sqe_set_data64(sqe, slot)
        issued += 1

    for s in range(min(depth, n)):
        submit(s)
    L.io_uring_submit(ring)
    while done < n:
        L.io_uring_wait_cqe(ring, cqe)
        c = cqe[0]
        assert c.res == REQ, c.res
        slot = c.user_data
        L.io_uring_cqe_seen(ring, c)
        done += 1
        if issued < n:
            submit(slot)
            L.io_uring_submit(ring)
    L.io_uring_queue_exit(ring)
    if write:
        os.fsync(fd)
    os.close(fd)


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--only", default="dd,threads,libaio,uring")
    args = ap.parse_args()
    if args.pythonpath:
        sys.path.insert(0, args.pythonpath)
    size = int(args.gib * 2**30) // REQ * REQ
    path = os.path.join(args.dir, "mechanisms.bin")
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={size // REQ}", "oflag=direct",
                    "status=none"], check=True)
    only = args.only.split(",")
    if "dd" in only:
        for op, cmd in (("write", ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={size // REQ}",
                                   "oflag=direct", "conv=notrunc,fsync", "status=none"]),
                        ("read", ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct", "status=none"])):
            t, _ = timed(lambda cmd=cmd: subprocess.run(cmd, check=True))
            print(f"dd       {op:5s} qd=1  {size / t / 1e9:5.2f} GB/s", flush=True)
    for name in ("threads", "libaio", "uring"):
        if name not in only:
            continue
        fn = globals()[name]
        for depth in (int(d) for d in args.depths.split(",")):
            for write in (True, False):
                drop(path)
                try:
                    t, cpu = timed(lambda fn=fn, depth=depth, write=write: fn(path, size, depth, write))
                except Exception as err:  # noqa: BLE001 - report and go on to the next mechanism
                    print(f"{name:8s} {'write' if write else 'read':5s} qd={depth}: failed: {err!r}", flush=True)
                    continue
                print(f"{name:8s} {'write' if write else 'read':5s} qd={depth}  {size / t / 1e9:5.2f} GB/s  "
                      f"{cpu / (size / 1e9):.3f} CPU s/GB", flush=True)
    os.unlink(path)


if __name__ == "__main__":
    main()
