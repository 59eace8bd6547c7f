"""The disk tier's store against the raw device: read and write throughput, and CPU time per GB moved.

Question: does ``tightfit.storage.TensorStore`` at its default settings move tensors of the sizes the planners
use (a unit's state, a layer, a table shard: 1 to 64 MiB) at the speed of the disk it sits on, without eating
the cores the model needs? Target: >= 80% of the raw read and write bandwidth (the paired median), at most one
core busy.

Contenders, interleaved in every repeat (raw, store 1 MiB, store 4 MiB, ..., then again, the order rotated by one
each repeat so that none is always first after the caches are dropped):
    * raw: one thread, ``O_DIRECT``, 4 MiB requests (``os.pwrite``/``os.preadv`` on a page-aligned buffer),
      ``fsync`` after writing: what ``dd bs=4M oflag=direct`` / ``iflag=direct`` measures.
    * store T MiB (the headline): ``TensorStore(dir)`` at its defaults (``--profile``: with the disk's measured
      profile), the same bytes as float32 tensors of T MiB, used as docs/disk-tier.md tells users to: writes from
      the tensors as they come (ordinary torch tensors, 64-byte aligned: each O_DIRECT request goes through the
      store's bounce buffer), every write submitted (``store.write``), waited, then ``store.sync()`` (durable, as
      a checkpoint); reads with ``store.read_into`` into buffers from ``tightfit.storage.aligned_empty``
      (4 KiB-aligned, allocated once: no bounce copy), all submitted, then waited.
    * diagnostics, not in the headline, each one change from ``store 4 MiB``: ``aligned buffers`` (writes from
      4 KiB-aligned tensors too: the write bounce copy's cost), ``unaligned buffers`` (reads into ordinary torch
      tensors: the read bounce copy's cost, what a caller who ignores ``aligned_empty`` gets), ``checksums off``
      (the checksum replaced by a constant), ``zlib crc32`` (a store created with ``checksum="crc32"``, the
      fallback without PyPI's ``crc32c``), ``hole punching at sync`` (after each ``sync()`` every free slot's
      blocks are punched back to the filesystem, so each overwrite allocates again: what reusing slots saves)
      and ``no hole punching`` (the same settings as ``store 4 MiB``: a control for the run's noise).
Fresh data: every repeat overwrites the files with new contents (a random buffer plus the repeat number), and
before the reads every file's page cache is dropped (``posix_fadvise(DONTNEED)`` after the fsync); the bytes
still resident are counted with ``fincore`` and recorded (0 expected), so no read is served from RAM.
Measured: wall time (the headline ratio is store bandwidth / raw bandwidth, paired per repeat:
:func:`benchmarks.common.paired`), process CPU seconds (every thread, kernel time included) per GB moved, and cores
busy (CPU s / wall s).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from benchmarks.common import format_paired, paired, parser, plot_path, summarize, write_result

MiB = 2**20
GB = 1e9
RAW_REQUEST = 4 * MiB
TENSOR_MIB = (1, 4, 16, 64)
TARGET = 0.80


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "core", "benchmarks/disk_io.py"],
                               capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (uncommitted changes in core/ or this file)" if dirty else "")


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds of every thread) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


# ---------------------------------------------------------------------------- raw device


def raw_write(path: Path, buf: mmap.mmap, nbytes: int) -> None:
    """``nbytes`` of ``buf`` to ``path`` with O_DIRECT, 4 MiB requests, one thread, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        view = memoryview(buf)
        for off in range(0, nbytes, RAW_REQUEST):
            done = os.pwrite(fd, view[off:off + RAW_REQUEST], off)
            if done != min(RAW_REQUEST, nbytes - off):
                raise OSError(f"short write at {off} of {path}: {done} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, buf: mmap.mmap, nbytes: int) -> None:
    """``nbytes`` of ``path`` into ``buf`` with O_DIRECT, 4 MiB requests, one thread."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        view = memoryview(buf)
        for off in range(0, nbytes, RAW_REQUEST):
            done = os.preadv(fd, [view[off:off + RAW_REQUEST]], off)
            if done != min(RAW_REQUEST, nbytes - off):
                raise OSError(f"short read at {off} of {path}: {done} bytes")
    finally:
        os.close(fd)


def drop_cache(root: Path) -> int:
    """Drop the page cache of every file under ``root``; return the bytes ``fincore`` still finds resident."""
    files = [Path(d) / f for d, _, names in os.walk(root) for f in names]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not files or shutil.which("fincore") is None:
        return -1
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True, timeout=60)
    return sum(int(x) for x in out.stdout.split() if x.isdigit()) if out.returncode == 0 else -1


# ---------------------------------------------------------------------------- the store


@contextlib.contextmanager
def _diagnostic(*, checksums: bool) -> Iterator[None]:
    """While the block runs, with ``checksums=False`` every per-extent checksum is a constant (a diagnostic of
    where the time goes, never done outside this benchmark)."""
    from tightfit.storage import checksums as registry

    real = dict(registry.CHECKSUMS)
    if not checksums:
        for name in real:
            registry.CHECKSUMS[name] = lambda view, start=0: 0
    try:
        yield
    finally:
        registry.CHECKSUMS.update(real)


def _punch_free_slots(store: object) -> None:
    """A store without slot reuse, for the ``hole punching at sync`` diagnostic: give the blocks of
    every free slot back to the filesystem (``FALLOC_FL_PUNCH_HOLE``), so the next overwrite allocates them again."""
    from tightfit.storage.fs import punch_hole

    size = store.extent_bytes  # type: ignore[attr-defined]
    for slot in store._slots.free:  # type: ignore[attr-defined]
        punch_hole(store._fd, slot * size, size)  # type: ignore[attr-defined]


class StoreContender:
    """One store in its own sub-directory, holding the run's bytes as float32 tensors of ``tensor_mib`` MiB,
    written from views of ``src`` and read into views of ``out``."""

    def __init__(self, root: Path, label: str, tensor_mib: int, src: torch.Tensor, out: torch.Tensor,
                 profile: object, *, checksums: bool = True, punch: bool = False, checksum: str | None = None) -> None:
        from tightfit.storage import TensorStore

        self.checksums, self.punch = checksums, punch
        self.dir = root / label.replace(" ", "_").replace(",", "")
        self.dir.mkdir()
        self.store = TensorStore(self.dir, profile=profile, checksum=checksum)  # type: ignore[arg-type]
        self.out = out
        numel = tensor_mib * MiB // 4
        flat_src, flat_out = src.view(torch.float32), out.view(torch.float32)
        self.sources = [flat_src[i:i + numel] for i in range(0, flat_src.numel(), numel)]
        self.outs = [flat_out[i:i + numel] for i in range(0, flat_out.numel(), numel)]
        self.names = [f"t{i}" for i in range(len(self.sources))]

    def write(self) -> None:
        with _diagnostic(checksums=self.checksums):
            futures = [self.store.write(n, t) for n, t in zip(self.names, self.sources)]
            for f in futures:
                f.result()
            self.store.sync()
            if self.punch:
                _punch_free_slots(self.store)

    def read(self) -> None:
        with _diagnostic(checksums=self.checksums):
            futures = [self.store.read_into(n, o) for n, o in zip(self.names, self.outs)]
            for f in futures:
                f.result()

    def close(self) -> None:
        self.store.close()


def _disk_profile(root: Path, quick: bool):
    """The disk's measured profile (cached by the profiler), or None where profiling is not available."""
    try:
        from tightfit.profiler import profile_disk  # type: ignore[attr-defined]
    except ImportError:
        return None
    return profile_disk(root, quick=True, progress=not quick)


# ---------------------------------------------------------------------------- the run


ALIGNED = "store 4 MiB, aligned buffers"
NO_CRC = "store 4 MiB, checksums off"
NO_PUNCH = "store 4 MiB, no hole punching"
UNALIGNED = "store 4 MiB, unaligned buffers"
ZLIB = "store 4 MiB, zlib crc32"
PUNCH = "store 4 MiB, hole punching at sync"
# not the store as users run it: where its time goes. The first three are results["samples"] (the contenders of
# the first version of this benchmark, which tests/test_make_bench.py lists); the others results["more_samples"].
DIAGNOSTICS = (ALIGNED, NO_CRC, NO_PUNCH)
MORE_DIAGNOSTICS = (UNALIGNED, ZLIB, PUNCH)


def run_repeats(root: Path, nbytes: int, repeats: int, sizes: tuple[int, ...], profile: object) -> dict:
    """Interleaved repeats: every contender writes, then the caches are dropped, then every contender reads.

    The ``store T MiB`` contenders write ordinary torch tensors (64-byte aligned, as model state is: every
    O_DIRECT request then goes through the store's bounce buffer) and read into one ``aligned_empty`` buffer
    (what the docs tell callers to read into); the diagnostics change one thing each (module docstring).
    """
    from tightfit.storage import aligned_empty

    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    out = torch.empty(nbytes, dtype=torch.uint8)  # ordinary (64-byte aligned): the unaligned diagnostic's
    aligned_out = aligned_empty(nbytes)
    raw_buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT requires
    raw_view = torch.frombuffer(raw_buf, dtype=torch.uint8)
    raw_file = root / "raw.bin"
    stores = {f"store {t} MiB": StoreContender(root, f"store {t} MiB", t, src, aligned_out, profile) for t in sizes}
    if 4 in sizes:  # aligned: written from the raw buffer (aligned, this repeat's contents), read into an aligned one
        stores[ALIGNED] = StoreContender(root, "aligned", 4, raw_view, aligned_empty(nbytes), profile)
        stores[NO_CRC] = StoreContender(root, "nocrc", 4, src, aligned_out, profile, checksums=False)
        stores[NO_PUNCH] = StoreContender(root, "nopunch", 4, src, aligned_out, profile)
        stores[UNALIGNED] = StoreContender(root, "unaligned", 4, src, out, profile)
        stores[ZLIB] = StoreContender(root, "zlib", 4, src, aligned_out, profile, checksum="crc32")
        stores[PUNCH] = StoreContender(root, "punch", 4, src, aligned_out, profile, punch=True)
    names = ["raw", *stores]
    samples: dict[str, dict[str, list[float]]] = {
        n: {"write_s": [], "write_cpu_s": [], "read_s": [], "read_cpu_s": []} for n in names}
    resident: list[int] = []
    checked: list[bool] = []
    fresh_write_s: dict[str, float] = {}
    try:
        for i in range(repeats + 1):  # round 0 is the warm-up: it allocates the files, not timed
            src.add_(1)  # fresh contents every repeat (uint8 wraps)
            raw_view.copy_(src)
            order = names[i % len(names):] + names[:i % len(names)]  # rotated: no contender always goes first
            for name in order:
                fn = (lambda: raw_write(raw_file, raw_buf, nbytes)) if name == "raw" else stores[name].write
                wall, cpu = _timed(fn)
                if i:
                    samples[name]["write_s"].append(wall)
                    samples[name]["write_cpu_s"].append(cpu)
                else:  # a store's first write fills fresh slots (blocks allocated); the second allocates the
                    fresh_write_s[name] = wall  # slots an overwrite uses until the next sync: steady state after
                    fn()
            resident.append(drop_cache(root))
            for name in order:
                back = raw_view if name == "raw" else stores[name].out
                back.zero_()
                fn = (lambda: raw_read(raw_file, raw_buf, nbytes)) if name == "raw" else stores[name].read
                wall, cpu = _timed(fn)
                checked.append(bool(torch.equal(back[:4096], src[:4096]) and torch.equal(back[-4096:], src[-4096:])))
                if i:
                    samples[name]["read_s"].append(wall)
                    samples[name]["read_cpu_s"].append(cpu)
            if i:
                line = ", ".join(f"{n.removeprefix('store ')} w {nbytes / samples[n]['write_s'][-1] / GB:.2f} r "
                                 f"{nbytes / samples[n]['read_s'][-1] / GB:.2f}" for n in names)
                print(f"  repeat {i}/{repeats} (GB/s): {line}", file=sys.stderr, flush=True)
    finally:
        for s in stores.values():
            s.close()
        del raw_view
        raw_buf.close()
    more = {n: samples.pop(n) for n in MORE_DIAGNOSTICS if n in samples}
    return {"samples": samples, "more_samples": more, "fresh_write_s": fresh_write_s, "resident_bytes_before_reads": resident,
            "data_checked": all(checked)}


def cpu_costs(repeats: int = 5) -> dict[str, float]:
    """One core's rate (GB/s) for the CPU work the store adds per byte: the checksums (CRC-32C from PyPI's
    ``crc32c``, the default where installed; zlib's CRC-32, the fallback) and the copy into an aligned bounce
    buffer (an O_DIRECT request from or into an unaligned buffer)."""
    from tightfit.storage import checksums

    src = memoryview(os.urandom(64 * MiB))
    bounce = memoryview(mmap.mmap(-1, RAW_REQUEST))
    best = {name: float("inf") for name in (*checksums.CHECKSUMS, "bounce_copy")}
    for _ in range(repeats):
        for name, fn in checksums.CHECKSUMS.items():
            start = time.perf_counter()
            fn(src)
            best[name] = min(best[name], time.perf_counter() - start)
        start = time.perf_counter()
        for off in range(0, src.nbytes, RAW_REQUEST):
            bounce[:] = src[off:off + RAW_REQUEST]
        best["bounce_copy"] = min(best["bounce_copy"], time.perf_counter() - start)
    return {f"{name}_gb_per_s": src.nbytes / t / GB for name, t in best.items()}


def analyse(samples: dict[str, dict[str, list[float]]], nbytes: int) -> dict:
    """Per contender and direction: bandwidth, ratio to raw (paired per repeat, wins = repeats faster than raw),
    CPU s per GB, cores busy."""
    raw = samples["raw"]
    out: dict[str, dict] = {}
    for name, s in samples.items():
        row: dict[str, dict] = {}
        for d in ("write", "read"):
            walls, cpus = s[f"{d}_s"], s[f"{d}_cpu_s"]
            row[d] = {
                "gb_per_s": summarize([nbytes / w / GB for w in walls]),
                "vs_raw": paired([1 / w for w in walls], [1 / r for r in raw[f"{d}_s"]]),
                "cpu_s_per_gb": summarize([c / (nbytes / GB) for c in cpus]),
                "cores_busy": summarize([c / w for c, w in zip(cpus, walls)]),
            }
        out[name] = row
    return out


def _markdown(stats: dict, run: dict, params: dict) -> tuple[str, dict]:
    stores = {n: v for n, v in stats.items() if n != "raw" and n not in DIAGNOSTICS + MORE_DIAGNOSTICS}
    worst = {d: min(stores.items(), key=lambda kv: kv[1][d]["vs_raw"]["median"]) for d in ("write", "read")}
    busiest = max(v[d]["cores_busy"]["median"] for v in stores.values() for d in ("write", "read"))
    headline = {d: {"worst_size": n, "vs_raw": v[d]["vs_raw"]["median"]} for d, (n, v) in worst.items()}
    headline["max_cores_busy"] = busiest  # type: ignore[assignment]
    met = all(h["vs_raw"] >= TARGET for h in headline.values() if isinstance(h, dict)) and busiest <= 1.0
    raw = stats["raw"]
    lines = [
        f"**Store / raw bandwidth, worst tensor size:** reads {format_paired(worst['read'][1]['read']['vs_raw'])} "
        f"({worst['read'][0]}), writes {format_paired(worst['write'][1]['write']['vs_raw'])} ({worst['write'][0]}); "
        f"at most "
        f"{busiest:.2f} cores busy. Target: {TARGET:.2f}x of raw, at most 1 core: "
        f"{'met' if met else 'missed'}.",
        "",
        f"Raw device in the same run (1 thread, O_DIRECT, 4 MiB requests): reads {raw['read']['gb_per_s']['median']:.2f}"
        f" GB/s, writes {raw['write']['gb_per_s']['median']:.2f} GB/s. {params['mib']} MiB per contender per "
        f"repeat, median of {params['repeats']} interleaved repeats [min-max]; ratios to raw paired per repeat "
        f"(median, repeats faster than raw, range); "
        f"store settings: {params['store_settings']}, checksum {params['checksum']}. The `store T MiB` rows "
        f"are the store as docs/disk-tier.md tells users to run it: writes from the tensors as they come "
        f"(ordinary torch tensors), reads into `aligned_empty` buffers; each `store 4 MiB, ...` row below them "
        f"is a diagnostic that changes one thing (benchmarks/disk_io.py says what).",
        "",
        "| contender | write GB/s | write / raw | read GB/s | read / raw | CPU s/GB write | CPU s/GB read "
        "| cores busy write | cores busy read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in stats.items():
        cells = [name]
        for d in ("write", "read"):
            g, r = v[d]["gb_per_s"], v[d]["vs_raw"]
            cells += [f"{g['median']:.2f} [{g['min']:.2f}-{g['max']:.2f}]",
                      "-" if name == "raw" else format_paired(r)]
        cells += [f"{v[d]['cpu_s_per_gb']['median']:.3f}" for d in ("write", "read")]
        cells += [f"{v[d]['cores_busy']['median']:.2f}" for d in ("write", "read")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", _where_time_goes(stats, met)]
    resident = run["resident_bytes_before_reads"]
    costs = run["cpu_costs"]
    crcs = ", ".join(f"{n} {costs[f'{n}_gb_per_s']:.2f} GB/s" for n in ("crc32c", "crc32") if f"{n}_gb_per_s" in costs)
    fresh = run.get("fresh_write_s", {})
    if "store 4 MiB" in fresh and "raw" in fresh:
        lines += ["", f"First write of each store (fresh slots, blocks allocated by the filesystem; not in the "
                      f"table): store 4 MiB {params['mib'] * MiB / fresh['store 4 MiB'] / GB:.2f} GB/s, raw's first "
                      f"write {params['mib'] * MiB / fresh['raw'] / GB:.2f} GB/s (one sample each)."]
    lines += ["", f"Page cache before the reads (fincore, every repeat): {max(resident)} bytes resident at most"
              + (" (fincore missing: not checked)" if min(resident) < 0 else "")
              + f"; data read back checked: {run['data_checked']}; filesystem {params['filesystem']}.",
              f"CPU work the store adds per byte, one core: {crcs}, "
              f"copy through the aligned bounce buffer {costs['bounce_copy_gb_per_s']:.2f} GB/s "
              f"(load average {params['load_average_before'][0]:.1f} before, "
              f"{params['load_average_after'][0]:.1f} after, on {os.cpu_count()} cores)."]
    return "\n".join(lines), headline


def _where_time_goes(stats: dict, met: bool) -> str:
    """CPU seconds per GB of the 4 MiB store against raw, and what each diagnostic changes."""
    if "store 4 MiB" not in stats or not all(d in stats for d in DIAGNOSTICS + MORE_DIAGNOSTICS):
        return ""

    def cpu(name: str, d: str) -> float:
        return stats[name][d]["cpu_s_per_gb"]["median"]

    def ratio(name: str) -> str:
        return " and ".join(f"{d}s {stats[name][d]['vs_raw']['median']:.2f}x" for d in ("write", "read"))

    def busy(name: str) -> float:
        return max(stats[name][d]["cores_busy"]["median"] for d in ("write", "read"))

    base = "store 4 MiB"
    text = (f"Where the time goes (4 MiB tensors): the store {ratio(base)} of raw, spending {cpu(base, 'write'):.3f}"
            f" / {cpu(base, 'read'):.3f} CPU s/GB (write / read) against raw's {cpu('raw', 'write'):.3f} / "
            f"{cpu('raw', 'read'):.3f}, at most {busy(base):.2f} cores busy. Checksums off: {ratio(NO_CRC)}. "
            f"zlib's CRC-32 instead of CRC-32C: {ratio(ZLIB)} (read CPU {cpu(ZLIB, 'read'):.3f} s/GB). Writes from "
            f"4 KiB-aligned tensors (no write bounce copy): {ratio(ALIGNED)} (write CPU {cpu(ALIGNED, 'write'):.3f}"
            f" s/GB). Reads into ordinary tensors (bounce copy): {ratio(UNALIGNED)} (read CPU "
            f"{cpu(UNALIGNED, 'read'):.3f} s/GB). Hole punching at every sync (no slot reuse): "
            f"{ratio(PUNCH)}. The same settings again (control for noise): {ratio(NO_PUNCH)}.")
    if not met:
        text += (" A diagnostic that reaches the target names the cause; where none does, the store waits on the "
                 "machine's other load (CPU or disk) more than the one-thread raw loop, which needs a fraction of "
                 "the CPU.")
    return text


def _plot(stats: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = list(stats)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, d in enumerate(("write", "read")):
        ax.bar([x + 0.4 * i for x in range(len(names))], [stats[n][d]["gb_per_s"]["median"] for n in names],
               width=0.4, label=d)
    ax.set_xticks([x + 0.2 for x in range(len(names))], names, rotation=15)
    ax.set_ylabel("GB/s, median of repeats")
    ax.set_title("TensorStore vs raw O_DIRECT on the same disk")
    ax.legend()
    fig.tight_layout()
    path = plot_path("disk_io")
    fig.savefig(path)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary directory)")
    p.add_argument("--mib", type=int, default=None, help="MiB each contender moves per repeat (default 128 quick, "
                                                         "512 full)")
    p.add_argument("--profile", action="store_true",
                   help="open the stores with the disk's measured profile (profile_disk, cached: its request size "
                        "as extent size, its queue depth as workers) instead of the defaults (4 MiB extents, 4 "
                        "workers, O_DIRECT)")
    p.add_argument("--sizes", default=",".join(map(str, TENSOR_MIB)), help="tensor sizes in MiB (default 1,4,16,64)")
    args = p.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    mib = args.mib or (128 if args.quick else 512)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    if any(mib % s for s in sizes) or mib < 4:
        p.error(f"--mib {mib} must be a multiple of every tensor size {sizes} and of the raw 4 MiB request")
    from tightfit.storage import DEFAULT_CHECKSUM, mount_of

    base = Path(args.dir or tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="tightfit-disk-io-", dir=base))
    fs = mount_of(root).filesystem
    if fs in ("tmpfs", "ramfs"):
        shutil.rmtree(root)
        p.error(f"{base} is {fs} (RAM): it has no device to measure and refuses O_DIRECT; pass --dir on a disk")
    load_before = os.getloadavg()
    try:
        profile = _disk_profile(root, args.quick) if args.profile else None
        settings = "defaults (4 MiB extents, 4 workers, O_DIRECT)" if profile is None else (
            f"measured profile: {profile.request_bytes // MiB} MiB requests, queue depth {profile.queue_depth}, "
            f"{'O_DIRECT' if profile.direct else 'buffered'}")
        print(f"[disk_io] {mib} MiB per contender (raw, store at {sizes} MiB tensors, diagnostics) x {repeats} repeats in {root} ({fs}); "
              f"store: {settings}", file=sys.stderr, flush=True)
        run = run_repeats(root, mib * MiB, repeats, sizes, profile)
        run["cpu_costs"] = cpu_costs()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    stats = analyse({**run["samples"], **run["more_samples"]}, mib * MiB)
    params = {"quick": args.quick, "repeats": repeats, "mib": mib, "tensor_mib": list(sizes), "dir": str(base),
              "filesystem": fs, "raw": "1 thread, O_DIRECT, 4 MiB requests, fsync after writing",
              "store_settings": settings, "checksum": DEFAULT_CHECKSUM, "commit": _commit(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "target_vs_raw": TARGET,
              "disk_profile": None if profile is None else profile.to_json()}
    markdown, headline = _markdown(stats, run, params)
    write_result("disk_io", title="Disk tier: TensorStore vs the raw device (read/write bandwidth, CPU per GB)",
                 params=params, results={"headline": headline, "stats": stats, **run}, markdown=markdown,
                 plots=_plot(stats))
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
