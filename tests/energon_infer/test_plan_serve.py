"""``tightfit plan serve DIR``: the serving plan and an MoE model's expert placement, printed before anything loads;
bad input refused in one line (exit 2), a budget nothing fits refused naming the floor (exit 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.energon_infer.tiny import save_tiny

TIGHTFIT = str(Path(sys.executable).with_name("tightfit"))


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TIGHTFIT, "plan", "serve", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return save_tiny("qwen2_moe", tmp_path_factory.mktemp("plan_serve") / "qwen2_moe")


def test_an_moe_model_gets_its_hot_experts_in_memory_and_the_cold_on_disk(moe, tmp_path):
    from tightfit.planner.experts import ExpertPlan
    from tightfit.planner.serving import ServingPlan
    from tightfit.profiler.experts import ExpertPopularity

    uniform = _plan(str(moe), "--memory-budget", "150KiB", "--json", str(tmp_path / "uniform.json"))
    assert uniform.returncode == 0, uniform.stderr
    assert "popularity uniform" in uniform.stdout and "serving memory" in uniform.stdout
    # Layer 0 (qwen2_moe's MoE layers: 0 and 2) routes almost only to experts 3 and 4, the other MoE layer to 0 and 1.
    pop = ExpertPopularity(num_layers=2, num_experts=5, experts_per_token=2)
    for _ in range(200):
        pop.add(0, [3, 4])
        pop.add(1, [0, 1])
    pop.add(0, [0, 1])
    pop.save(moe)
    try:
        run = _plan(str(moe), "--memory-budget", "150KiB", "--json", str(tmp_path / "plan.json"))
    finally:
        (moe / "tightfit-expert-popularity.json").unlink()
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "plan.json").read_text())
    serving = ServingPlan.from_json(json.dumps(out["serving"]))
    experts = ExpertPlan.from_json(json.dumps(out["experts"]))
    assert serving.weight_budgets == (150 * 1024,)
    kept = experts.experts_in("device")
    assert kept[0] and set(kept[0]) <= {3, 4} and kept[1] and set(kept[1]) <= {0, 1}
    assert any(tier == "disk" for row in experts.placement for tier in row)  # the budget holds only some
    uniform_plan = ExpertPlan.from_json(json.dumps(json.loads((tmp_path / "uniform.json").read_text())["experts"]))
    assert experts.tokens_per_s[0] > uniform_plan.tokens_per_s[0]  # the hot experts served from memory


def test_a_dense_model_prints_its_serving_plan_and_no_expert_section(tmp_path):
    dense = save_tiny("llama", tmp_path / "llama")
    run = _plan(str(dense))
    assert run.returncode == 0, run.stderr
    assert "serving memory" in run.stdout and "layers kept in memory" in run.stdout
    assert "expert placement" not in run.stdout


@pytest.mark.parametrize("args, code, match", [
    (["{missing}"], 2, "is not a model directory (no config.json)"),
    (["{moe}", "--memory-budget", "lots"], 2, "--memory-budget"),
    (["{moe}", "--memory-budget", "1KiB"], 3, "--memory-budget 1.00 KiB is too small"),
    (["{moe}", "--popularity-file-that-does-not-exist"], 2, "unrecognized arguments"),
], ids=["not-a-model", "bad-size", "budget-below-floor", "unknown-flag"])
def test_bad_input_is_refused_in_one_line(moe, tmp_path, args, code, match):
    run = _plan(*[a.format(moe=moe, missing=tmp_path / "nothing") for a in args])
    assert run.returncode == code, (run.stdout, run.stderr)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in run.stderr, run.stderr


def test_a_corrupted_popularity_profile_is_refused_naming_the_file(moe):
    path = moe / "tightfit-expert-popularity.json"
    path.write_text('{"kind": "tightfit-expert-popularity", "version": 1')
    try:
        run = _plan(str(moe))
    finally:
        path.unlink()
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "tightfit-expert-popularity.json" in run.stderr and "Traceback" not in run.stderr
