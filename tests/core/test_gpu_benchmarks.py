"""Every benchmarks/gpu script starts and finishes on the CPU (``--smoke``: tiny sizes, Triton's interpreter).

The GPU runs them once, inside a short loan (``make gpu-check``): a script that cannot even start
would waste it. Numbers from these runs mean nothing; what is checked is that each writes its
result with the fields the GPU summary reads. (``kernels`` has its own smoke test in test_kernels.py.)
"""

from __future__ import annotations

import importlib.util
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
    # no GPU here: TorchRec's FUSED_UVM_CACHING is skipped with the reason; where TorchRec imports its
    # configuration is still built and recorded. The markdown table has a row per timed contender.
    uvm = r["fused_uvm_caching"]
    assert uvm["status"] == "skipped" and "no CUDA device" in uvm["reason"], uvm
    if importlib.util.find_spec("torchrec") is not None:
        assert uvm["config"]["compute_kernel"] == "fused_uvm_caching" and uvm["config"]["load_factor"] == 0.015
    assert all(f"| {name} |" in r["table_md"] for name in r["samples_per_s"])


@RunIf(lightning=True)
def test_elixir_benchmark_smoke(tmp_path):
    data = _smoke("elixir", tmp_path)
    [case] = data["results"]["cases"]
    assert {"elixir", "fsdp2 full offload", "fsdp2 resident"} <= set(case["contenders"])
    el = case["contenders"]["elixir"]
    assert el["ok"] and el["step_s"] > 0 and el["predicted_step_s"] > 0, el  # prediction beside measurement
    assert "predicted" in data["summary"]


# energon: packed prefill and generate tokens/s beside batched transformers; the engine: the request stream
# (continuous / static / transformers per request) and the pooling sweep; graphs: decode steps with and without
ENERGON_FIELDS = {"energon": {"prefill", "generate", "attention_kernel"}, "energon_engine": {"stream", "pool"},
                  "energon_graphs": {"batches", "captured", "step_floor_s"}}


@RunIf(triton=True, transformers=True)
@pytest.mark.parametrize("name", list(ENERGON_FIELDS))
def test_energon_benchmarks_smoke(tmp_path, name):
    results = _smoke(name, tmp_path)["results"]
    assert ENERGON_FIELDS[name] <= set(results), results
    if name == "energon_graphs":  # batch 5 ran padded to the bucket of 8, with the eager step's tokens
        assert results["batches"]["5"]["bucket"] == 8 and results["batches"]["5"]["greedy_agreement"] == 1.0


def test_fused_uvm_skip_reason_names_what_is_missing(monkeypatch):
    import torch

    from benchmarks.gpu.torchrec_cache import fused_uvm_skip_reason

    reason = fused_uvm_skip_reason() or ""
    assert ("no CUDA device" in reason) == (not torch.cuda.is_available()), reason
    for mod in ("torchrec", "fbgemm_gpu"):
        assert (f"import {mod} failed" in reason) == (importlib.util.find_spec(mod) is None), reason
    # a package that will not import is named with its error, beside the other missing pieces
    # (sys.modules[name] = None is how Python itself marks a module as unimportable)
    monkeypatch.setitem(sys.modules, "torchrec", None)
    blocked = fused_uvm_skip_reason()
    assert blocked is not None and "import torchrec failed (ModuleNotFoundError: import of torchrec halted" in blocked, blocked
    assert ("no CUDA device" in blocked) == (not torch.cuda.is_available()), blocked


@RunIf(torchrec=True)
def test_fused_uvm_caching_contender_config_builds_and_plans():
    """TorchRec's contender as the GPU script builds it, planned for real on the CPU (planning needs no GPU)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from benchmarks.gpu.torchrec_cache import torchrec_setup

    rows, ratio = [3, 40, 1000, 20000], 0.015
    setup = torchrec_setup(rows, 16, ratio, lr=1e-3, eps=1e-8, batch=64, hbm_cap_bytes=8 << 30)
    assert set(setup["constraints"]) == {"t0", "t1", "t2", "t3"}
    for c in setup["constraints"].values():
        assert c.compute_kernels == ["fused_uvm_caching"] and c.sharding_types == ["table_wise"]
        assert c.cache_params.load_factor == ratio
    fp = setup["sharder"].fused_params
    assert fp["optimizer"] == EmbOptimType.ADAM and fp["learning_rate"] == 1e-3 and fp["eps"] == 1e-8
    assert (fp["beta1"], fp["beta2"]) == (0.9, 0.999)
    assert setup["topology"].world_size == 1 and setup["topology"].compute_device == "cuda"
    plan = setup["planner"].plan(setup["model"], [setup["sharder"]])
    shards = plan.get_plan_for_module("ebc")
    assert shards is not None and set(shards) == {"t0", "t1", "t2", "t3"}
    for ps in shards.values():
        assert ps.compute_kernel == "fused_uvm_caching" and ps.sharding_type == "table_wise", ps
        assert ps.cache_params is not None and ps.cache_params.load_factor == ratio
        assert ps.ranks == [0]
    assert setup["config"]["load_factor"] == ratio and setup["config"]["compute_kernel"] == "fused_uvm_caching"


@RunIf(torchrec=True)
def test_torchrec_contender_trains_through_dmp_on_cpu():
    """The contender's DMP path (1-rank group, sharded model, batches, fused update in the backward) run for
    real on TorchRec's CPU kernel; only the kernel and optimizer differ from the GPU run (FBGEMM's CPU
    kernels have no UVM cache and no Adam)."""
    import torch

    from benchmarks.gpu.torchrec_cache import _zipf, torchrec_contender, torchrec_setup

    rows, batch = [3, 40, 1000, 5000], 32
    setup = torchrec_setup(rows, 8, 0.015, lr=0.1, eps=1e-8, batch=batch, hbm_cap_bytes=8 << 30, kernel="fused",
                           compute_device="cpu", optimizer="exact_sgd")
    gen = torch.Generator().manual_seed(0)
    ids = [[_zipf(batch, r, gen, "cpu") for r in rows] for _ in range(2)]
    state = {"i": 0}
    tr = torchrec_contender(setup, [torch.cat(b) for b in ids], torch.ones(len(rows) * batch, dtype=torch.int64),
                            torch.device("cpu"), state)
    try:
        assert "fused" in tr["plan"] and len(tr["tbes"]) == 1
        tbe = tr["tbes"][0]  # the sharder's fused_params reached FBGEMM's module
        assert tbe.optimizer.name == "EXACT_SGD" and tbe.get_learning_rate() == pytest.approx(0.1)
        assert tbe.gather_uvm_cache_stats
        before = [w.clone() for w in tr["tbes"][0].split_embedding_weights()]
        tr["step"]()
        after = tr["tbes"][0].split_embedding_weights()
        assert state["i"] == 1
        for t, (w0, w1) in enumerate(zip(before, after)):
            touched = torch.zeros(rows[t], dtype=torch.bool)
            touched[ids[0][t]] = True
            moved = (w0 != w1).any(dim=1)
            assert moved[touched].all() and not moved[~touched].any(), t  # exactly the batch's rows updated
        assert isinstance(tr["hit_rate"](), str) and "not exposed" in tr["hit_rate"]()  # no UVM cache on CPU
    finally:
        tr["close"]()
    assert not torch.distributed.is_initialized()
