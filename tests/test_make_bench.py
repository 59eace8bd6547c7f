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


def test_disk_io_benchmark_quick_mode_writes_its_result(tmp_path):
    """benchmarks/disk_io.py runs in `make bench`: its quick mode, shrunk (16 MiB, 2 repeats), writes the JSON
    the report is built from, with every repeat of every contender, the commit and the page-cache check."""
    import json
    import os
    import sys

    env = {**os.environ, "TIGHTFIT_BENCH_RESULTS": str(tmp_path / "results"),
           "TIGHTFIT_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-m", "benchmarks.disk_io", "--quick", "--mib", "16", "--sizes", "1,4",
                          "--repeats", "2", "--dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "results" / "disk_io.json").read_text())
    assert data["machine"]["cpu_count"] and data["params"]["commit"] and data["params"]["mib"] == 16
    results = data["results"]
    assert set(results["samples"]) == {"raw", "store 1 MiB", "store 4 MiB",
                                          "store 4 MiB, aligned buffers", "store 4 MiB, checksums off",
                                          "store 4 MiB, no hole punching"}
    assert all(len(s[k]) == 2 for s in results["samples"].values() for k in ("write_s", "read_s", "read_cpu_s"))
    assert results["data_checked"] is True and max(results["resident_bytes_before_reads"]) <= 0
    assert results["headline"]["read"]["vs_raw"] > 0 and results["headline"]["max_cores_busy"] > 0
    assert "| store 4 MiB |" in data["markdown"] and "Store / raw bandwidth" in data["markdown"]
    assert "Where the time goes" in data["markdown"]
    assert not list(tmp_path.glob("tightfit-disk-io-*"))  # its files are removed
