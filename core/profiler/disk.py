"""``profile_disk``: the disk tier's measured speed, through the store's own I/O engine.

Measured (``source="measured"``) on a scratch file in the directory, cached under
``$TIGHTFIT_CACHE_DIR`` (or ``~/.cache/tightfit/``) keyed on the filesystem device of the path
(``st_dev``, filesystem type, mounted source, kernel), so a second call on the same disk is instant
(free space is read again each call); ``refresh=True`` re-measures:

* sequential O_DIRECT read and write bandwidth for request sizes 64 KiB .. 16 MiB at queue depths
  1, 2, 4, 8 (``quick``: 256 KiB .. 4 MiB at 1, 2, 4), each request checksummed as the store does;
* ``request_bytes``: the smallest size within 5% of the best (read and write time together), and
  ``queue_depth``: the smallest depth within 5% of the best at that size;
* ``direct``: O_DIRECT against buffered I/O at that size and depth, whichever moves the bytes faster
  (buffered reads come after ``fsync`` + ``POSIX_FADV_DONTNEED``, so not from the page cache; buffered
  writes are timed until ``fsync`` returns);
* ``read_fit`` / ``write_fit``: least squares of ``t = latency + bytes / bandwidth`` over transfers of
  1 .. 32 requests at that size, depth and mode (the collectives' alpha-beta fit);
* ``compute_overlap``: how much of the store's reading hides behind compute on the same machine. A pass of
  reads (``D`` s alone) runs beside a compute loop about twice as long (``C`` s alone) on all of torch's
  threads, and ``o = (C + D - T) / min(C, D)`` where ``T`` is the wall time until both are done: the rule the
  planner prices with (``T = C + D - o * min(C, D)``). Two loops are timed, matmuls (forward and backward) and
  an elementwise AdamW-like update (the optimizer step), and the smaller ``o`` is kept. On a machine whose
  cores also serve the I/O (checksums, copies, the engine's threads) it is well below 1; a cached profile
  without it gains it on its next use;
* ``random_read_bytes_per_s``: scattered reads at a cache's request sizes (:data:`RANDOM_SIZES`: a missed row's
  4 KiB block, a few rows' blocks) at uniform aligned offsets of the scratch file, :data:`RANDOM_DEPTH` in
  flight through kernel AIO as the store reads a batch of misses; the cache planner prices its disk misses
  with them. A cached profile without them gains them on its next use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from tightfit.console import reporter
from tightfit.profiler.calibrate import fit_alpha_beta
from tightfit.profiler.device import cache_dir
from tightfit.profiler.types import DiskProfile
from tightfit.storage import ExtentIO, IOEngine, aligned_empty, check_disk_dir, checksum, free_bytes, mount_of
from tightfit.storage.aio import read_many
from tightfit.storage.fs import open_data, pread_full

_log = logging.getLogger(__name__)

__all__ = ["profile_disk", "disk_cache_file", "disk_key", "overlap_fraction", "smallest_within"]

KiB, MiB = 2**10, 2**20
_SIZES, _QUICK_SIZES = [64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB], [256 * KiB, MiB, 4 * MiB]
_DEPTHS, _QUICK_DEPTHS = [1, 2, 4, 8], [1, 2, 4]
# Scattered reads at a cache's request sizes: a missed row's 4 KiB block, a few neighbouring rows' blocks; as
# many in flight as one batch of misses puts at the device (the store's kernel AIO submission, else its threads).
RANDOM_SIZES, RANDOM_DEPTH = [4 * KiB, 16 * KiB], 16
_WITHIN = 0.05  # "as good as the best" for request size and depth: within 5%


def disk_key(path: str | os.PathLike[str]) -> str:
    """The cache key of the disk holding ``path``: its device number, filesystem, source and the kernel."""
    m = mount_of(path)
    return f"disk {m.device} | {m.filesystem or 'unknown'} {m.source or '?'} | kernel {platform.release()}"


def disk_cache_file(key: str, quick: bool) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", key).strip("-").lower()
    return cache_dir() / f"{slug}{'-quick' if quick else ''}.json"


class _Bench:
    """Passes of sequential requests over one scratch file through an :class:`IOEngine` of ``depth`` workers."""

    def __init__(self, path: Path, max_size: int, file_bytes: int) -> None:
        self.path, self.file_bytes = path, file_bytes
        self.src = aligned_empty(max_size)  # random bytes: a compressing or deduplicating device gains nothing
        self.src.copy_(torch.randint(0, 256, (max_size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
        self.crc: dict[int, int] = {}  # request size -> checksum of the pattern's first ``size`` bytes
        self.view = memoryview(self.src.numpy())

    def run(self, *, size: int, depth: int, nbytes: int, write: bool, direct: bool) -> float:
        """Seconds to move ``nbytes`` (whole requests of ``size``) with ``depth`` in flight; buffered writes
        until fsync returns, buffered reads with the file's pages dropped first."""
        fd, got_direct = open_data(self.path, direct=direct)
        io = ExtentIO(fd, self.path, direct=got_direct, extent_bytes=size)
        engine = IOEngine(workers=depth, max_inflight=depth)
        crc = self.crc.setdefault(size, checksum(self.view[:size]))
        count = max(1, nbytes // size)
        try:
            if not write and not got_direct:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            futures: list[Future[object]] = []
            for i in range(count):
                off = i * size % (self.file_bytes - self.file_bytes % size or size)
                if write:
                    futures.append(engine.submit(io.write, self.view[:size], off))
                else:
                    futures.append(engine.submit(lambda off=off: io.read(io.scratch()[:size], off, size, crc)))
            for f in futures:
                f.result()
            if write and not got_direct:
                os.fsync(fd)
            return time.perf_counter() - start
        finally:
            engine.close()
            os.close(fd)


def smallest_within(score: dict[int, float], within: float = _WITHIN) -> int:
    """The smallest key whose score (a bandwidth: higher is better) is within ``within`` of the best.

    >>> smallest_within({65536: 0.90e9, 262144: 0.97e9, 1048576: 1.0e9, 4194304: 0.99e9})
    262144
    """
    best = max(score.values())
    return min(k for k, v in score.items() if v >= (1 - within) * best)


def _both(r: float, w: float) -> float:
    return 1.0 / (1.0 / r + 1.0 / w)  # bytes/s of reading and writing the same bytes one after the other


def _measure(d: Path, quick: bool, log: Callable[[str], None]) -> DiskProfile:
    sizes, depths = (_QUICK_SIZES, _QUICK_DEPTHS) if quick else (_SIZES, _DEPTHS)
    pass_bytes = 64 * MiB if quick else 256 * MiB
    scratch = d / f".tightfit-disk-profile-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    bench = _Bench(scratch, max(sizes), pass_bytes)
    try:
        log(f"1/5 writing a {pass_bytes // MiB} MiB scratch file in {d}")
        bench.run(size=max(sizes), depth=2, nbytes=pass_bytes, write=True, direct=True)
        rates: dict[str, dict[int, dict[int, float]]] = {"read": {}, "write": {}}
        log(f"2/5 sequential read/write, O_DIRECT, sizes {sizes[0] // KiB} KiB..{sizes[-1] // MiB} MiB, depths {depths}")
        for size in sizes:
            for depth in depths:
                moved = max(pass_bytes, 4 * size * depth)
                for op in ("write", "read"):
                    t = bench.run(size=size, depth=depth, nbytes=moved, write=op == "write", direct=True)
                    rates[op].setdefault(size, {})[depth] = moved // size * size / t
        request = smallest_within({s: _both(max(rates["read"][s].values()), max(rates["write"][s].values())) for s in sizes})
        depth = smallest_within({q: _both(rates["read"][request][q], rates["write"][request][q]) for q in depths})
        log(f"3/5 buffered against O_DIRECT at {request // KiB} KiB x {depth}")
        direct_bw = _both(rates["read"][request][depth], rates["write"][request][depth])
        moved = max(pass_bytes, 4 * request * depth)
        buffered = {op: moved / bench.run(size=request, depth=depth, nbytes=moved, write=op == "write", direct=False)
                    for op in ("write", "read")}  # write first: reads check what this size wrote
        direct = direct_bw >= _both(buffered["read"], buffered["write"])
        log(f"4/5 latency + bandwidth fits ({'O_DIRECT' if direct else 'buffered'})")
        fits: dict[str, tuple[float, float]] = {}
        for op in ("write", "read"):
            counts = [1, depth, 4 * depth, 8 * depth, 32 * depth] if not quick else [1, depth, 4 * depth, 8 * depth]
            xs, ts = [], []
            for n in counts:
                ts.append(bench.run(size=request, depth=depth, nbytes=n * request, write=op == "write", direct=direct))
                xs.append(float(n * request))
            fits[op] = fit_alpha_beta(xs, ts, 1.0)
        log("5/5 reads beside compute (the fraction of I/O hidden behind it), scattered reads")
        overlap = _overlap(bench, request=request, depth=depth, direct=direct, read_bw=fits["read"][1], quick=quick)
        random = _random_reads(scratch, pass_bytes, direct=direct, quick=quick)
    finally:
        scratch.unlink(missing_ok=True)
    free, total = free_bytes(d)
    return DiskProfile(path=str(d), free_bytes=free, total_bytes=total, filesystem=mount_of(d).filesystem,
                       read_fit=fits["read"], write_fit=fits["write"], read_bytes_per_s=rates["read"],
                       write_bytes_per_s=rates["write"], request_bytes=request, queue_depth=depth, direct=direct,
                       source="measured", key=disk_key(d), compute_overlap=overlap, random_read_bytes_per_s=random)


def _random_reads(path: Path, file_bytes: int, *, direct: bool, quick: bool) -> dict[int, float]:
    """Bytes/s of scattered reads of each of :data:`RANDOM_SIZES` over the written file ``path`` (aligned offsets
    drawn uniformly), :data:`RANDOM_DEPTH` in flight: as :meth:`~tightfit.storage.TensorStore.read_ranges` issues
    a batch of missed rows."""
    fd, got_direct = open_data(path, direct=direct)
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    try:
        if not got_direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for size in RANDOM_SIZES:
            count = (1024 if quick else 4096) * 4 * KiB // size
            offsets = rng.integers(0, file_bytes // size, count, dtype=np.int64) * size
            buf = aligned_empty(RANDOM_DEPTH * size).numpy()
            ring = (buf.ctypes.data + (np.arange(count) % RANDOM_DEPTH) * size).astype(np.uint64)
            start = time.perf_counter()
            got = read_many(fd, ring, np.full(count, size, dtype=np.int64), offsets)
            if got is None:  # no kernel AIO here: the store's worker threads, RANDOM_DEPTH of them
                engine = IOEngine(workers=RANDOM_DEPTH, max_inflight=2 * RANDOM_DEPTH)
                views = [memoryview(buf[i * size:(i + 1) * size]) for i in range(RANDOM_DEPTH)]
                try:
                    futures = [engine.submit(pread_full, fd, views[i % RANDOM_DEPTH], int(off), path)
                               for i, off in enumerate(offsets.tolist())]
                    for f in futures:
                        f.result()
                finally:
                    engine.close()
            out[size] = count * size / (time.perf_counter() - start)
    finally:
        os.close(fd)
    return out


def _random_of(d: Path, profile: DiskProfile, quick: bool) -> dict[int, float]:
    """Scattered reads alone (a cached profile that predates them): a scratch file written, read, removed."""
    pass_bytes = 64 * MiB if quick else 256 * MiB
    scratch = d / f".tightfit-disk-profile-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    try:
        _Bench(scratch, 4 * MiB, pass_bytes).run(size=4 * MiB, depth=2, nbytes=pass_bytes, write=True, direct=True)
        return _random_reads(scratch, pass_bytes, direct=profile.direct, quick=quick)
    finally:
        scratch.unlink(missing_ok=True)


def _overlap_of(d: Path, profile: DiskProfile, quick: bool) -> float:
    """``compute_overlap`` alone, on a fresh scratch file, at ``profile``'s request size, depth and mode."""
    pass_bytes = 64 * MiB if quick else 256 * MiB
    scratch = d / f".tightfit-disk-profile-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    bench = _Bench(scratch, profile.request_bytes, pass_bytes)
    try:
        bench.run(size=profile.request_bytes, depth=2, nbytes=pass_bytes, write=True, direct=True)
        return _overlap(bench, request=profile.request_bytes, depth=profile.queue_depth, direct=profile.direct,
                        read_bw=profile.read_fit[1], quick=quick)
    finally:
        scratch.unlink(missing_ok=True)


def _compute_loop(kind: str) -> Callable[[int], None]:
    """``run(n)``: ``n`` rounds of the compute that disk I/O must hide behind: ``"matmul"`` (a 512 x 512 fp32
    product, forward and backward) or ``"update"`` (an AdamW-like elementwise update of 2 M fp32 elements, the
    optimizer step: memory-bound)."""
    g = torch.Generator().manual_seed(0)
    if kind == "matmul":
        a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
        out = torch.empty(512, 512)

        def run(n: int) -> None:
            for _ in range(n):
                torch.mm(a, b, out=out)
        return run
    p, grad, m, v = (torch.randn(2 * MiB, generator=g) for _ in range(4))

    def update(n: int) -> None:
        for _ in range(n):
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=0.001)
            p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)
    return update


def overlap_fraction(compute_s: float, io_s: float, both_s: float) -> float:
    """The fraction ``o`` of the shorter of compute and I/O hidden when both ran together in ``both_s`` seconds
    (``both_s = compute_s + io_s - o * min(compute_s, io_s)``), clamped to [0, 1].

    >>> overlap_fraction(1.0, 0.5, 1.0), overlap_fraction(1.0, 0.5, 1.5), overlap_fraction(1.0, 0.5, 1.25)
    (1.0, 0.0, 0.5)
    """
    shorter = min(compute_s, io_s)
    if not shorter > 0:
        return 1.0
    return min(1.0, max(0.0, (compute_s + io_s - both_s) / shorter))


def _overlap(bench: _Bench, *, request: int, depth: int, direct: bool, read_bw: float, quick: bool) -> float:
    """The measured ``compute_overlap`` (see the module docstring): the smaller over the two compute loops, each
    from the medians over 3 (``quick``) or 5 rounds of compute alone, reads alone and both together. The compute
    loop runs about twice as long as the reads, so the reads run wholly beside it and the fraction is the
    compute's slowdown over the reads' time (what the planner charges the compute stream)."""
    target = 0.15 if quick else 0.3  # seconds of reading per round
    nbytes = max(request * depth, int(target * read_bw) // request * request)
    if not direct:  # buffered passes would re-read pages the first pass cached
        nbytes = min(nbytes, bench.file_bytes // request * request)
    rounds = 3 if quick else 5

    def read_beside(run: Callable[[int], None], n: int) -> float:
        failed: list[BaseException] = []

        def read() -> None:
            try:
                bench.run(size=request, depth=depth, nbytes=nbytes, write=False, direct=direct)
            except BaseException as exc:  # noqa: BLE001 - raised again on the measuring thread
                failed.append(exc)
        reader = threading.Thread(target=read, name="tightfit-disk-overlap")
        start = time.perf_counter()
        reader.start()
        run(n)
        reader.join()
        if failed:
            raise failed[0]
        return time.perf_counter() - start

    fractions = []
    for kind in ("matmul", "update"):
        run = _compute_loop(kind)
        run(3)  # warm: the first rounds pay allocation and thread start-up
        start = time.perf_counter()
        run(3)
        one = max((time.perf_counter() - start) / 3, 1e-6)
        io_alone = bench.run(size=request, depth=depth, nbytes=nbytes, write=False, direct=direct)
        n = max(2, round(2 * io_alone / one))
        compute, io, both = [], [], []
        for _ in range(rounds):
            start = time.perf_counter()
            run(n)
            compute.append(time.perf_counter() - start)
            io.append(bench.run(size=request, depth=depth, nbytes=nbytes, write=False, direct=direct))
            both.append(read_beside(run, n))
        fractions.append(overlap_fraction(statistics.median(compute), statistics.median(io), statistics.median(both)))
    return min(fractions)


def profile_disk(path: str | os.PathLike[str], *, quick: bool = False, refresh: bool = False,
                 progress: bool = True) -> DiskProfile:
    """Measure (or load from the cache) the disk tier of directory ``path``.

    Args:
        path: an existing, writable directory (:func:`tightfit.storage.check_disk_dir` refuses others
            before any work); the measurement writes a scratch file there (256 MiB, ``quick``: 64 MiB)
            and removes it.
        quick: fewer sizes and depths, smaller passes (under ~10 s on this project's disk).
        refresh: ignore the cache and measure again.
        progress: log each step at INFO (:func:`tightfit.console.reporter`).

    Example:
        >>> import tempfile
        >>> p = profile_disk(tempfile.gettempdir(), quick=True, progress=False)  # doctest: +SKIP
        >>> p.read_seconds(2**30) > 0  # doctest: +SKIP
        True
    """
    d = check_disk_dir(path, need_bytes=(64 if quick else 256) * MiB)
    key = disk_key(d)
    files = [disk_cache_file(key, False)] + ([disk_cache_file(key, True)] if quick else [])
    say = reporter(_log, "profile_disk", enabled=progress)
    if not refresh:
        for f in files:
            if f.is_file():
                try:
                    cached = DiskProfile.from_json(f)
                except (ValueError, TypeError, KeyError):
                    say(f"ignoring unreadable cache file {f}")
                    continue
                if not cached.random_read_bytes_per_s and cached.source == "measured":
                    say(f"cached: {f}; measuring scattered reads at a cache's request sizes, which it lacks")
                    cached = dataclasses.replace(cached, random_read_bytes_per_s=_random_of(d, cached, quick))
                    cached.to_json(f)
                if cached.compute_overlap < 0 and cached.source == "measured":
                    # Cached before the overlap was measured: measure it alone (a few seconds) and keep it.
                    say(f"cached: {f}; measuring reads beside compute, which it lacks")
                    cached = dataclasses.replace(cached, compute_overlap=_overlap_of(d, cached, quick))
                    cached.to_json(f)
                free, total = free_bytes(d)
                say(f"cached: {f}")
                return dataclasses.replace(cached, path=str(d), free_bytes=free, total_bytes=total)
    start = time.perf_counter()
    profile = _measure(d, quick, say)
    files[-1].parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(files[-1])
    say(f"done in {time.perf_counter() - start:.1f} s: read {profile.read_fit[1] / 1e9:.2f} GB/s, write "
        f"{profile.write_fit[1] / 1e9:.2f} GB/s at {profile.request_bytes // KiB} KiB x {profile.queue_depth}, "
        f"{'O_DIRECT' if profile.direct else 'buffered'}, {profile.compute_overlap:.2f} of reading hidden behind "
        f"compute; cached in {files[-1]}")
    return profile
