"""Run every ``benchmarks/*.py`` (quick mode with ``--quick``), then write ``results/REPORT.md``.

    python -m benchmarks.run --quick            # what `make bench` runs
    python -m benchmarks.run --only torchrec_cache
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import report

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"__init__", "common", "run", "report"}


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
    for i, name in enumerate(selected, 1):
        print(f"[bench {i}/{len(selected)}] {name}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if args.quick else []),
                             cwd=HERE.parent)
        print(f"[bench {i}/{len(selected)}] {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} "
              f"in {time.perf_counter() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    out = report.write_report()
    print(f"report: {out}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
