"""Run every ``benchmarks/*.py`` (quick mode with ``--quick``), then write ``results/REPORT.md``.

    python -m benchmarks.run --quick            # what `make bench` runs
    python -m benchmarks.run --only torchrec_cache

Each benchmark's wall time is printed as it ends and again in a table at the end; a run of the whole suite
also records them as ``suite.json`` (a section of the report), so how long ``make bench`` takes is measured,
not guessed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import report
from benchmarks.common import write_result

HERE = Path(__file__).resolve().parent
# Modules of benchmarks/ that are not benchmarks: the shared helpers, the runner, the report and its staleness check.
NOT_BENCHMARKS = {"__init__", "common", "run", "report", "staleness", "memlimit", "peers", "proc_tree"}
SUITE = "suite"  # results/suite.json: the time of each benchmark in the last whole-suite run


def discover() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in NOT_BENCHMARKS and not p.stem.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", action="append", default=[])
    args = p.parse_args(argv)
    names = discover()
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {', '.join(names) or 'none yet'}", file=sys.stderr)
        return 2
    selected = args.only or names
    if not selected:
        print("no benchmarks yet: each plugin adds benchmarks/<name>.py")
    failed = []
    seconds: dict[str, float] = {}
    for i, name in enumerate(selected, 1):
        print(f"[bench {i}/{len(selected)}] {name}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if args.quick else []),
                             cwd=HERE.parent)
        seconds[name] = time.perf_counter() - start
        print(f"[bench {i}/{len(selected)}] {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} "
              f"in {seconds[name]:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    table = _times_table(seconds, failed)
    print(table)
    if not args.only:  # a partial run must not replace the whole suite's times
        write_result(SUITE, title=f"make bench: wall time per benchmark ({'quick' if args.quick else 'full'} mode)",
                     params={"quick": args.quick}, results={"seconds": seconds, "failed": failed}, markdown=table)
    out = report.write_report()
    print(f"report: {out}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _times_table(seconds: dict[str, float], failed: list[str]) -> str:
    total = sum(seconds.values())
    rows = [f"| {name}{' (failed)' if name in failed else ''} | {s:.0f} | {s / 60:.1f} |"
            for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])]
    return "\n".join(["Wall time of each benchmark, run one after another:", "",
                      "| benchmark | s | min |", "|---|---|---|", *rows, f"| **total** | {total:.0f} | {total / 60:.1f} |"])


if __name__ == "__main__":
    raise SystemExit(main())
