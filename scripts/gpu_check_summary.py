"""Summarise one ``make gpu-check`` run: ``gpu_check.json`` and ``gpu_check.md`` in ``--dest``.

    python scripts/gpu_check_summary.py --work WORK --dest DEST --elapsed SECONDS [--dry]

Reads what scripts/gpu_check.sh left in ``WORK``: ``tests.jsonl`` (one line per finished GPU test,
written by tests/gpu/conftest.py), ``collected.txt`` (every GPU test's id), ``tests.rc``,
``imports.txt``, ``bench/*.json`` (one per benchmark, benchmarks/gpu/common.py's format) or, in dry
mode, ``bench/found.txt``. A collected test with no result ran out of the time budget and is reported
as ``not run``. Exit status: 0 when every GPU test passed or was skipped with a reason and every
benchmark finished (dry: every test was collected and every benchmark answered ``--help``), else 1.
Uses the standard library and torch only (the GPU image has nothing of ours installed).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["machine", "collect", "render_markdown", "main"]


def machine() -> dict[str, Any]:
    """GPU name and memory, CUDA, driver-visible capability, and the versions that matter."""
    info: dict[str, Any] = {"host": platform.node(), "python": sys.version.split()[0]}
    for dist in ("torch", "triton", "lightning", "transformers", "deepspeed", "torchrec"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    try:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                        capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count())
    except Exception as exc:  # the summary is written even when torch itself is broken
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def collect(work: Path, dry: bool) -> dict[str, Any]:
    """Everything the run left in ``work``, as one JSON-able dict (without the machine)."""
    collected = [line.strip() for line in _lines(work / "collected.txt") if "::" in line]
    results: dict[str, dict[str, Any]] = {}
    for line in _lines(work / "tests.jsonl"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        results.setdefault(row["test"], row)  # the first report of a test decides (call, or failed setup)
    tests = []
    for test in collected or sorted(results):
        row = results.get(test) or {"test": test, "outcome": "collected" if dry else "not run",
                                    "detail": "" if dry else "the test budget ran out first", "seconds": 0.0}
        tests.append(row)
    counts: dict[str, int] = {}
    for row in tests:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    benchmarks = []
    if dry:
        for line in _lines(work / "bench" / "found.txt"):
            name, _, status = line.partition(" ")
            benchmarks.append({"name": name, "status": status, "summary": "answers --help (dry: not run)"})
    else:
        for path in sorted((work / "bench").glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except ValueError:
                data = {"name": path.stem, "status": "failed", "summary": "unreadable result file"}
            benchmarks.append(data)
    rc = _lines(work / "tests.rc")
    return {"tests": {"counts": counts, "pytest_exit": int(rc[0]) if rc else None, "results": tests},
            "benchmarks": benchmarks, "imports": _lines(work / "imports.txt")}


def _ok(summary: dict[str, Any], dry: bool) -> bool:
    tests, benches = summary["tests"]["results"], summary["benchmarks"]
    if dry:
        return bool(tests) and all(b["status"] == "found" for b in benches) and bool(benches)
    return (bool(tests) and all(t["outcome"] in ("passed", "skipped") for t in tests)
            and all(b.get("status") in ("ok", "skipped") for b in benches))


def _cell(text: Any, width: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def render_markdown(summary: dict[str, Any]) -> str:
    m, t = summary["machine"], summary["tests"]
    gpu = f"{m.get('gpu')} ({m.get('gpu_memory_gib')} GiB, sm {m.get('capability')}, CUDA {m.get('cuda')})" \
        if m.get("gpu") else "no CUDA device"
    out = [f"# GPU check ({'dry run: nothing ran on a GPU' if summary['dry'] else 'on a GPU'})", "",
           f"- date: {summary['date']}; took {summary['elapsed_s']} s; verdict: **{summary['verdict']}**",
           f"- device: {gpu}",
           "- versions: " + ", ".join(f"{k} {m.get(k) or 'absent'}" for k in
                                      ("torch", "triton", "lightning", "transformers", "deepspeed", "torchrec")),
           "- tests: " + (", ".join(f"{n} {k}" for k, n in sorted(t["counts"].items())) or "none"), ""]
    if summary["imports"]:
        out += ["## Imports (the checkout, linked under its import names)", "", "```", *summary["imports"], "```", ""]
    out += ["## Tests (tests/gpu)", "", "| test | outcome | s | detail |", "|---|---|---|---|"]
    for row in t["results"]:
        out.append(f"| `{row['test']}` | {row['outcome']} | {row.get('seconds', 0):.1f} | {_cell(row.get('detail', ''))} |")
    out += ["", "## Benchmarks (benchmarks/gpu, quick)", "", "| benchmark | status | summary |", "|---|---|---|"]
    for b in summary["benchmarks"]:
        out.append(f"| {b.get('name')} | {b.get('status')} | {_cell(b.get('summary', ''), 400)} |")
    for b in summary["benchmarks"]:
        if b.get("results"):
            text = json.dumps(b["results"], indent=1, default=str)
            lines = text.splitlines()
            if len(lines) > 80:
                lines = lines[:80] + [f"... ({len(lines) - 80} more lines in gpu_check.json)"]
            out += ["", f"### {b.get('name')}: {b.get('title', '')}", "", "```json", *lines, "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--elapsed", type=int, default=0)
    p.add_argument("--dry", action="store_true")
    args = p.parse_args(argv)
    summary: dict[str, Any] = {"dry": args.dry, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                               "elapsed_s": args.elapsed, "machine": machine(), **collect(args.work, args.dry)}
    ok = _ok(summary, args.dry)
    ran = any(t["outcome"] == "passed" for t in summary["tests"]["results"])
    summary["verdict"] = ("dry run complete" if ok else "dry run incomplete") if args.dry else \
        ("failures" if not ok else "all passed" if ran else "nothing ran (every test skipped: see the reasons)")
    args.dest.mkdir(parents=True, exist_ok=True)
    (args.dest / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    (args.dest / "gpu_check.md").write_text(render_markdown(summary))
    counts = summary["tests"]["counts"]
    print(f"[gpu-check] {summary['verdict']}: tests {counts}; benchmarks "
          + ", ".join(f"{b.get('name')} {b.get('status')}" for b in summary["benchmarks"]))
    print(f"[gpu-check] wrote {args.dest / 'gpu_check.json'} and {args.dest / 'gpu_check.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
