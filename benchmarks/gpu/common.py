"""What every GPU benchmark shares: CUDA-event timing, interleaved contenders, JSON under ``$OUT``.

A GPU benchmark is ``benchmarks/gpu/<name>.py`` with ``main(argv=None) -> int``; it runs on the GPU
machine's image alone (torch, Triton, Lightning, transformers; no TorchRec or DeepSpeed), skips
what that image lacks with :func:`skip`, and ends with :func:`write_result`. ``run_all.sh`` runs
them all and prints :func:`print_table` last. The tree is copied, not installed, onto that machine,
so :func:`ensure_tightfit` makes ``import tightfit`` work from the checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ROOT", "ensure_tightfit", "out_dir", "parser", "machine_info", "cuda_time", "interleave_cuda",
           "summarize", "write_result", "skip", "print_table"]


def ensure_tightfit() -> None:
    """Make ``import tightfit`` work from this checkout when the package is not installed."""
    if "tightfit" in sys.modules or importlib.util.find_spec("tightfit") is not None:
        return
    spec = importlib.util.spec_from_file_location("tightfit", ROOT / "core" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "core")])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tightfit"] = module
    spec.loader.exec_module(module)


def out_dir() -> Path:
    """``$OUT`` when set (the GPU machine copies it back), else ``benchmarks/results/gpu``."""
    path = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results" / "gpu"
    path.mkdir(parents=True, exist_ok=True)
    return path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per contender (default 7, quick 5)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on the CPU (Triton's interpreter): checks the script runs; numbers mean nothing")
    return p


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "python": sys.version.split()[0],
                            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    for dist in ("torch", "triton", "lightning", "transformers"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
    return info


def cuda_time(fn: Callable[[], object], *, iters: int = 10) -> float:
    """Seconds per call of ``fn``, timed with CUDA events over ``iters`` back-to-back calls.

    Without a CUDA device (the ``--smoke`` runs that check a script on CPU) it falls back to wall time.
    """
    import time

    import torch

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def interleave_cuda(contenders: dict[str, Callable[[], object]], *, repeats: int = 7, warmup: int = 2,
                    iters: int = 10) -> dict[str, list[float]]:
    """Seconds per call for each contender, alternating A B A B ... after ``warmup`` rounds (../shared/BENCHMARKS.md)."""
    for _ in range(warmup):
        for fn in contenders.values():
            cuda_time(fn, iters=iters)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            times[name].append(cuda_time(fn, iters=iters))
    return times


def summarize(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def write_result(name: str, *, title: str, results: Any, summary: str, status: str = "ok", reason: str = "",
                 params: dict[str, Any] | None = None) -> Path:
    """Write ``<out_dir>/<name>.json``; ``summary`` is the one line ``run_all.sh`` prints in its table."""
    path = out_dir() / f"{name}.json"
    payload = {"name": name, "title": title, "status": status, "reason": reason, "summary": summary,
               "machine": machine_info(), "params": params or {}, "results": results}
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}", flush=True)
    return path


def skip(name: str, title: str, reason: str) -> int:
    """Record a benchmark that cannot run on this machine (exit code 0: a skip is not a failure)."""
    print(f"[{name}] skipped: {reason}", flush=True)
    write_result(name, title=title, results={}, summary=f"skipped: {reason}", status="skipped", reason=reason)
    return 0


def print_table(folder: Path) -> None:
    """The short table ``run_all.sh`` ends with: one line per JSON result in ``folder``."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "summary" in data:
            rows.append((data.get("name", path.stem), data.get("status", "?"), data["summary"]))
    if not rows:
        print("no GPU benchmark results")
        return
    widths = [max(len(str(r[i])) for r in rows + [("benchmark", "status", "")]) for i in range(2)]
    print(f"{'benchmark'.ljust(widths[0])}  {'status'.ljust(widths[1])}  summary")
    for name, status, summary in rows:
        print(f"{str(name).ljust(widths[0])}  {str(status).ljust(widths[1])}  {summary}")


if __name__ == "__main__":
    print_table(Path(sys.argv[1]) if len(sys.argv) > 1 else out_dir())
