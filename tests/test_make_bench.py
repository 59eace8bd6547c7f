"""`make bench`: one benchmark on request, and each benchmark's wall time measured and reported."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_bench_only_selects_benchmarks():
    dry = subprocess.run(["make", "-n", "bench", "ONLY=sky_simulation cost_model"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "tightfit bench --only sky_simulation --only cost_model" in dry.stdout
    plain = subprocess.run(["make", "-n", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--only" not in plain.stdout


def test_suite_times_table_sorts_totals_and_marks_failures():
    from benchmarks.run import _times_table

    table = _times_table({"sky_simulation": 41.2, "cost_model": 330.0, "torchrec_cache": 75.0}, ["torchrec_cache"])
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| cost_model", "| torchrec_cache (failed)", "| sky_simulation",
                                                   "| **total**"]
    assert rows[0] == "| cost_model | 330 | 5.5 |" and rows[-1] == "| **total** | 446 | 7.4 |"
