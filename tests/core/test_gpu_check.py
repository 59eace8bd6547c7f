"""``make gpu-check DRY=1``: the prepared GPU check starts, links the checkout, collects every GPU test,
finds every GPU benchmark and writes its summary, on a machine without a GPU (as CI runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_collects_every_gpu_test_and_benchmark(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    out = subprocess.run(["make", "-s", "gpu-check", "DRY=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry"] and summary["verdict"] == "dry run complete"
    # Every package imports through the links (what the GPU machine, with nothing installed, relies on).
    for name in ("tightfit", "lightning_elixir", "energon_infer", "torchrec_cache", "sky_strategy"):
        assert any(line.startswith(f"import {name}: linked from checkout") for line in summary["imports"]), summary
    # Every test pytest finds in tests/gpu is in the summary, and only those.
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    expected = sorted(line for line in listed.stdout.splitlines() if "::" in line)
    got = sorted(t["test"] for t in summary["tests"]["results"])
    assert got == expected and len(got) >= 25
    assert {t["outcome"] for t in summary["tests"]["results"]} == {"collected"}
    # Every benchmarks/gpu script was found and starts.
    scripts = sorted(p.stem for p in (ROOT / "benchmarks" / "gpu").glob("*.py") if p.stem not in ("common", "__init__"))
    assert sorted(b["name"] for b in summary["benchmarks"]) == scripts
    assert all(b["status"] == "found" for b in summary["benchmarks"])
    md = (tmp_path / "gpu_check.md").read_text()
    assert "dry run: nothing ran on a GPU" in md and "| `tests/gpu/test_kernels.py::" in md


def test_gpu_check_rejects_an_unknown_argument():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "unknown argument --quick (use --dry or nothing)" in out.stderr
