"""What every benchmark shares (the protocol: ``benchmarks/README.md``): interleaved timing, paired ratios,
machine facts, one JSON file per benchmark under ``benchmarks/results/``, and plots for the report.

A benchmark module ``benchmarks/<name>.py`` defines ``main(argv=None) -> int``, accepts ``--quick``,
and ends by calling :func:`write_result` with its numbers and a Markdown section; ``benchmarks.run``
runs them all and :mod:`benchmarks.report` stitches the sections and plots into ``REPORT.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS = Path(os.environ.get("TIGHTFIT_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))

__all__ = ["RESULTS", "parser", "machine_info", "interleave", "summarize", "write_result", "plot_path",
           "resident_bytes", "measure_peak", "run_two_ranks", "source_commit", "imported_sources", "measured_paths",
           "left_padded", "paired", "format_paired"]

ROOT = Path(__file__).resolve().parent.parent


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="the short version `make bench` runs")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per contender (default: 5 quick, 9 full)")
    return p


def machine_info() -> dict[str, object]:
    info: dict[str, object] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for dist in ("torch", "lightning", "torchrec", "deepspeed", "transformers", "triton"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    try:
        import torch

        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def interleave(
    contenders: dict[str, Callable[[], object]], *, repeats: int = 5, warmup: int = 1,
    timer: Callable[[], float] = time.perf_counter, progress: bool = True,
) -> dict[str, list[float]]:
    """Time each contender ``repeats`` times, alternating A B C A B C … after ``warmup`` rounds.

    A contender may return a float: then that is its measured time (e.g. CUDA-event milliseconds
    converted to seconds, or the per-step median of a training run); otherwise wall time is used.
    """
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(repeats):
        for name, fn in contenders.items():
            start = timer()
            out = fn()
            elapsed = timer() - start
            times[name].append(float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else elapsed)
        if progress:
            print(f"  repeat {i + 1}/{repeats}: " + ", ".join(f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()),
                  file=sys.stderr, flush=True)
    return times


def summarize(samples: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def paired(a: Sequence[float], b: Sequence[float], *, higher_is_better: bool = True) -> dict[str, object]:
    """Contender ``a`` against ``b`` round by round: the ratio ``a_i / b_i`` of each round, their median, min and
    max, and ``wins``, the rounds where ``a`` beat ``b`` (a higher value when ``higher_is_better``, e.g. tokens/s;
    a lower one otherwise, e.g. seconds). Round ``i`` of both must have measured the same work (same prompts, same
    order) close in time, so that whatever the machine did then weighs on both; a ratio of two separately taken
    medians would not cancel it.

    >>> p = paired([10.0, 12.0, 9.0], [10.0, 10.0, 10.0])
    >>> p["median"], p["wins"], p["rounds"]
    (1.0, 1, 3)
    >>> format_paired(p)
    '1.00x (1/3 rounds, 0.90-1.20x)'
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired: {len(a)} rounds against {len(b)}; pair rounds one to one (equal, non-zero counts)")
    if any(y == 0 for y in b):
        raise ValueError(f"paired: a round of the baseline measured 0 ({list(b)}); a ratio needs a non-zero baseline")
    ratios = [float(x) / float(y) for x, y in zip(a, b)]
    wins = sum((x > y) if higher_is_better else (x < y) for x, y in zip(a, b))
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "wins": wins,
            "rounds": len(ratios), "ratios": ratios, "higher_is_better": higher_is_better}


def format_paired(p: dict[str, object], digits: int = 2) -> str:
    """``"1.02x (4/5 rounds, 0.95-1.10x)"``: the median ratio, the rounds ``a`` won out of all, the range."""
    return (f"{p['median']:.{digits}f}x ({p['wins']}/{p['rounds']} rounds, "
            f"{p['min']:.{digits}f}-{p['max']:.{digits}f}x)")


def plot_path(name: str, suffix: str = "") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}{('_' + suffix) if suffix else ''}.png"


def source_commit(paths: Sequence[str]) -> dict[str, object]:
    """The commit a result measured: HEAD, and whether ``paths`` (the code measured) had uncommitted changes.

    A result whose ``dirty`` is true measured code no commit holds; the report says so beside its figures.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=ROOT,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--", *paths))
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None, "paths": list(paths)}
    return {"sha": head, "dirty": dirty, "paths": list(paths)}


def imported_sources(root: Path = ROOT, modules: dict | None = None) -> list[str]:
    """The project's source files this process imported: ``root``-relative paths of the modules in
    ``sys.modules`` whose file lies under ``root`` (the virtual environment and other hidden folders left out),
    sorted, with the files each lists in ``__source_files__`` (``tightfit.kernels.sources``: the C sources). ``python -m
    benchmarks.NAME`` makes the script itself ``__main__``, so it is among them."""
    root = root.resolve()
    found = set()
    for module in list((sys.modules if modules is None else modules).values()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        try:
            rel = Path(file).resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        if any(part.startswith(".") or part in ("site-packages", "__pycache__") for part in rel.parts[:-1]):
            continue
        found.add(rel.as_posix())
        # Files a module runs that are not Python (tightfit.kernels.sources: the C sources the native libraries are built from).
        extras = getattr(module, "__source_files__", ())
        for extra in extras if isinstance(extras, tuple) else ():
            found.add(Path(extra).resolve().relative_to(root).as_posix())
    return sorted(found)


# Sources that child processes (run_two_ranks' ranks) imported; write_result adds them to the measured paths.
_CHILD_SOURCES: set[str] = set()


def measured_paths(name: str, measures: Sequence[str] = (), root: Path = ROOT) -> list[str]:
    """What a result of benchmark ``name`` measured: the project files this process (and the ranks it spawned
    through :func:`run_two_ranks`) imported, the benchmark's own script, and ``measures`` (the child scripts it
    runs in subprocesses and the code those import), sorted and without repeats."""
    own = f"benchmarks/{name}.py"
    paths = set(imported_sources(root)) | _CHILD_SOURCES | set(measures) | {"benchmarks/common.py"}
    if (root / own).exists():
        paths.add(own)
    return sorted(paths)


def write_result(name: str, *, title: str, params: dict, results: object, markdown: str,
                 plots: Sequence[Path] = (), measures: Sequence[str] = ()) -> Path:
    """Write ``benchmarks/results/<name>.json`` (machine info, versions, every repeat, the report section).

    The JSON records the commit and the paths whose code the figures measured (:func:`measured_paths`: what was
    imported, plus ``measures``, e.g. a child script run by ``subprocess`` and the plugin it imports), whether
    those were clean, and the machine's load average. A figure goes stale only when one of those paths changes.
    """
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "name": name,
        "title": title,
        "commit": source_commit(measured_paths(name, measures)),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "machine": machine_info(),
        "params": params,
        "results": results,
        "markdown": markdown,
        "plots": [Path(p).name for p in plots],
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)
    print(f"wrote {path}")
    return path


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = local.untyped_storage().data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += local.untyped_storage().nbytes()
    return total


def measure_peak(step, state) -> int:
    """Resident state + the highest the step's CPU allocations rise (torch.profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    base = resident_bytes(state())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return base + peak


def _rank_entry(rank: int, rank_fn: Callable[..., None], world: int, port: int, quick: bool, repeats: int,
                out_path: str) -> None:
    rank_fn(rank, world, port, quick, repeats, out_path)
    Path(f"{out_path}.sources.{rank}").write_text(json.dumps(imported_sources()))


def run_two_ranks(rank_fn: Callable[..., None], quick: bool, repeats: int) -> dict:
    """Spawn ``rank_fn(rank, 2, port, quick, repeats, out_path)`` on 2 gloo ranks (a free port on
    127.0.0.1); rank 0 writes its results as JSON to ``out_path``, returned here. The project files each rank
    imported join what the result records as measured (:func:`measured_paths`)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "results.json"
    mp.spawn(_rank_entry, args=(rank_fn, 2, port, quick, repeats, str(out)), nprocs=2, join=True)
    for rank in range(2):
        _CHILD_SOURCES.update(json.loads(Path(f"{out}.sources.{rank}").read_text()))
    return json.loads(out.read_text())


def left_padded(prompts: Sequence[Sequence[int]]):
    """``(input_ids, attention_mask)`` of prompts left-padded to the longest (``generate``'s batched form).

    torch is imported here, not at the top: this module must import with the standard library alone (the
    peer venvs and the GPU image run it)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask
