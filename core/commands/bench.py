"""``tightfit bench``: run the benchmark suite of a source checkout (``make bench``).

The benchmarks live in the repository (``benchmarks/``), not in the installed package; this
command finds the checkout the package was installed from in editable mode.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", action="store_true", help="full-size runs instead of --quick")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only benchmarks/NAME.py")
    parser.add_argument("--root", type=Path, default=None, help="the source checkout (default: found)")


def _checkout() -> Path | None:
    for start in (Path(__file__).resolve().parent, Path.cwd()):
        for parent in (start, *start.parents):
            if (parent / "benchmarks" / "run.py").is_file() and (parent / "pyproject.toml").is_file():
                return parent
    return None


def run(args: argparse.Namespace) -> int:
    root = args.root or _checkout()
    if root is None:
        print("tightfit bench: no source checkout found. The benchmarks ship with the repository: clone it, "
              "then run `make bench` there (or `tightfit bench --root PATH`).", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "benchmarks.run"] + ([] if args.full else ["--quick"])
    for name in args.only:
        cmd += ["--only", name]
    return subprocess.call(cmd, cwd=root)
