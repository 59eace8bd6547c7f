"""``tightfit bench``: run the benchmark suite of the current source checkout into a run directory.

The benchmarks live in the repository (``benchmarks/``), not in the installed package. The checkout
is the one holding the current directory (``--root`` to name another), so a branch's benchmarks
run on that branch's code. Results go to ``runs/bench-<time>/`` (git-ignored): JSON per benchmark,
plots and a ``REPORT.md``. The committed results (``benchmarks/results/``) change only with
``--update-report``, which copies the run's JSON and plots there and runs ``python -m benchmarks.report``:
it regenerates ``benchmarks/results/REPORT.md`` and the README's results table (the block between
``<!-- generated: results-table -->`` and ``<!-- end generated: results-table -->``) from the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tightfit.commands.args import UsageError
from tightfit.console import log

__all__ = ["add_arguments", "run", "find_checkout"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", action="store_true", help="full-size runs instead of --quick")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only benchmarks/NAME.py (repeatable)")
    parser.add_argument("--root", type=Path, default=None,
                        help="the source checkout (default: the one holding the current directory)")
    parser.add_argument("--out", type=Path, default=None,
                        help="run directory for the results (default: ROOT/runs/bench-YYYYmmdd-HHMMSS)")
    parser.add_argument("--update-report", action="store_true",
                        help="after a run without failures, copy its JSON and plots into benchmarks/results/ and "
                             "regenerate benchmarks/results/REPORT.md and the README's results table from them")


def find_checkout(start: Path) -> Path | None:
    """The nearest directory at or above ``start`` with ``benchmarks/run.py`` and ``pyproject.toml``."""
    for parent in (start, *start.parents):
        if (parent / "benchmarks" / "run.py").is_file() and (parent / "pyproject.toml").is_file():
            return parent
    return None


def run(args: argparse.Namespace) -> int:
    root = (args.root or find_checkout(Path.cwd().resolve()))
    if root is None or find_checkout(root.resolve()) != root.resolve():
        where = f"--root {args.root}" if args.root else f"the current directory ({Path.cwd()})"
        raise UsageError(f"tightfit bench: {where} is not inside a tightfit source checkout (no benchmarks/run.py "
                         "next to pyproject.toml); cd into a clone of the repository or pass --root PATH")
    root = root.resolve()
    out = (args.out or root / "runs" / time.strftime("bench-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log.info("[bench] checkout %s; results -> %s", root, out)
    cmd = [sys.executable, "-m", "benchmarks.run"] + ([] if args.full else ["--quick"])
    for name in args.only:
        cmd += ["--only", name]
    installed = Path(__file__).resolve().parents[1]  # the `core/` folder this tightfit runs from
    if not installed.is_relative_to(root):
        log.warning("tightfit bench: tightfit is imported from %s, not from this checkout (%s): the benchmarks "
                    "measure that code; run `pip install -e .` here to measure this checkout", installed.parent, root)
    env = {**os.environ, "TIGHTFIT_BENCH_RESULTS": str(out)}
    rc = subprocess.call(cmd, cwd=root, env=env)
    pictures = sorted(out.glob("*.png"))
    for png in pictures:
        print(f"picture: {png}")
    print(f"report: {out / 'REPORT.md'}")
    if rc != 0:
        log.error("tightfit bench: a benchmark failed (exit %d); the committed report was not touched", rc)
        return 1
    if args.update_report:
        committed = root / "benchmarks" / "results"
        for item in [*out.glob("*.json"), *pictures]:
            shutil.copy2(item, committed / item.name)
        subprocess.check_call([sys.executable, "-m", "benchmarks.report"], cwd=root,
                              env={**env, "TIGHTFIT_BENCH_RESULTS": str(committed)})
        print(f"updated the committed report: {committed / 'REPORT.md'} and the README's results table "
              "(review and commit them)")
    else:
        print("the committed report (benchmarks/results/) is unchanged; rerun with --update-report to replace it")
    return 0
