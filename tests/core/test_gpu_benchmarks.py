"""Every benchmarks/gpu script starts and finishes on the CPU (``--smoke``: tiny sizes, Triton's interpreter).

The GPU runs them once, inside a short loan (``make gpu-check``): a script that cannot even start
would waste it. Numbers from these runs mean nothing; what is checked is that each writes its
result with the fields the GPU summary reads. (``kernels`` has its own smoke test in test_kernels.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[2]


def _smoke(name: str, out: Path) -> dict:
    env = {**os.environ, "OUT": str(out)}
    run = subprocess.run([sys.executable, "-m", f"benchmarks.gpu.{name}", "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads((out / f"{name}.json").read_text())
    assert data["status"] == "ok" and data["summary"], data
    return data


@RunIf(triton=True)
def test_cache_benchmark_smoke(tmp_path):
    r = _smoke("torchrec_cache", tmp_path)["results"]
    assert set(r["samples_per_s"]) == {"full_tables_sparseadam", "cached_1.5pct_fused_adam"}
    assert 0 < r["hit_rate"] <= 1 and r["cache_stats"]["lookups"] > 0
    # host reads per cached step through the plugin's counted helper (<= 2 by design); CUDA's sync debug
    # count is -1 off a GPU. The copy/compute overlap is timed both ways.
    assert 0 <= r["host_reads_per_step"] <= 2 and isinstance(r["cuda_sync_debug_warnings"], int)
    assert set(r["overlap_summary"]) == {"prefetch_then_step", "prefetch_beside_step"}
    assert r["fused_uvm_caching"].startswith("skipped")


@RunIf(lightning=True)
def test_elixir_benchmark_smoke(tmp_path):
    data = _smoke("elixir", tmp_path)
    [case] = data["results"]["cases"]
    assert {"elixir", "fsdp2 full offload", "fsdp2 resident"} <= set(case["contenders"])
    el = case["contenders"]["elixir"]
    assert el["ok"] and el["step_s"] > 0 and el["predicted_step_s"] > 0, el  # prediction beside measurement
    assert "predicted" in data["summary"]


@RunIf(triton=True, transformers=True)
@pytest.mark.parametrize("name", ["energon", "energon_engine"])
def test_energon_benchmarks_smoke(tmp_path, name):
    results = _smoke(name, tmp_path)["results"]
    # energon: packed prefill and generate tokens/s beside batched transformers; the engine: the request
    # stream (continuous / static / transformers per request) and the pooling sweep
    assert {"prefill", "generate", "attention_kernel"} <= set(results) if name == "energon" else \
        {"stream", "pool"} <= set(results), results
