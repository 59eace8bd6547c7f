"""`tightfit bench` runs the checkout it is pointed at into a run directory; the committed report changes only
with --update-report. Runs on a copy of the benchmarks, so the repository's own report is never touched."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tightfit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tightfit.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_bench_outside_a_checkout_says_how(tmp_path):
    out = _tightfit("bench", cwd=tmp_path)
    assert out.returncode == 2 and "not inside a tightfit source checkout" in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_writes_a_run_directory_and_updates_the_report_only_when_asked(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(ROOT / "pyproject.toml", checkout)
    shutil.copytree(ROOT / "benchmarks", checkout / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    committed = checkout / "benchmarks" / "results" / "sky_simulation.json"
    before = committed.read_bytes()

    run = _tightfit("bench", "--only", "sky_simulation", cwd=checkout)  # found from the current directory
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    pictures = [Path(line.split("picture: ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("picture: ")]
    assert pictures and all(p.is_file() and p.parent.parent == checkout / "runs" for p in pictures), run.stdout
    assert (pictures[0].parent / "sky_simulation.json").is_file()
    assert committed.read_bytes() == before and "unchanged" in run.stdout

    update = _tightfit("bench", "--only", "sky_simulation", "--update-report", "--out", str(tmp_path / "run2"),
                       cwd=checkout)
    assert update.returncode == 0, update.stderr[-2000:]
    assert committed.read_bytes() == (tmp_path / "run2" / "sky_simulation.json").read_bytes() != before
    assert "sky_simulation.png" in (checkout / "benchmarks" / "results" / "REPORT.md").read_text()
