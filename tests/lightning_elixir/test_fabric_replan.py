"""``ElixirFabricStrategy(replan=True)``: the Trainer's re-planning (``tests/lightning_elixir/test_replan.py``) under
Fabric, with ``fabric.save`` as the checkpoint boundary.

On two gloo ranks a deliberately wrong device calibration makes the prediction miss the measured step; rank 0
re-plans from the measurement, every rank switches to the new plan right after the next ``fabric.save`` and the loop
goes on with the same math: every loss equals the loop that kept its plan, and the final weights equal a loop resumed
from that checkpoint with the new plan (``plan-replan.json``) given.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

ENV = {"GROUP_RANK": "0"}
STEPS, SAVE = 16, 8  # 2 warm-up + 5 timed steps end at the 8th backward; the save after 8 steps is the boundary
MICRO = 4


def _loop(strategy, checkpoint: Path, *, resume: bool = False) -> dict:
    """A Fabric loop on fixed per-rank batches, saving at step ``SAVE`` (or resuming from there)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.lightning_elixir.common import CONFIG, token_data
    from tightfit.models import GPT

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(GPT(CONFIG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    x_all, y_all = token_data(STEPS * MICRO * fabric.world_size).tensors
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(checkpoint, state)
    losses = []
    for step in range(state["step"], STEPS):
        at = (step * fabric.world_size + fabric.global_rank) * MICRO
        logits = model(x_all[at:at + MICRO])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[at:at + MICRO].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        state["step"] = step + 1
        if state["step"] == SAVE and not resume:
            fabric.save(checkpoint, state)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses, "weights": weights if fabric.global_rank == 0 else {}, "model": model}


def _replan(rank: int, world: int, tmp: str) -> dict:
    import dataclasses

    import torch
    from torch.distributed._composable import checkpoint

    from lightning_elixir import ElixirFabricStrategy
    from lightning_elixir.planning import FORWARD, make_plan, profile_module
    from tests.lightning_elixir.common import CONFIG, cpu_device, token_data
    from tightfit.models import GPT
    from tightfit.planner.elixir import ElixirPlan
    from tightfit.profiler.types import ClusterSpec

    root = Path(tmp)
    example = token_data(MICRO).tensors[0]
    # The wrong calibration: this CPU priced as multiplying matrices 10^5 x faster than it does, so every predicted
    # step is far below the measured one; recomputing every block (the given plan) then costs nothing in the
    # prediction.
    wrong = dataclasses.replace(cpu_device(), matmul_flops={"float32": 5e15})
    with torch.device("meta"):
        profile = profile_module(GPT(CONFIG), example, stage_method=FORWARD)
    plan = make_plan(profile, ClusterSpec.uniform(wrong, world), activation_checkpointing=True)
    out: dict = {"planned_ckpt": list(plan.checkpointed_blocks)}

    def strategy(given, replan: bool = False) -> ElixirFabricStrategy:
        return ElixirFabricStrategy(plan=given, device_profile=wrong, replan=replan, example_input=example,
                                    verbose=False)

    fixed = _loop(strategy(plan), root / "fixed" / "ckpt")
    replanning = strategy(plan, replan=True)
    run = _loop(replanning, root / "replan" / "ckpt")
    assert replanning.replanner is not None and replanning.plan is not None
    out["fixed"], out["replan"] = fixed["losses"], run["losses"]
    out["records"] = [(r.measured_at_step, r.applied_at_step, r.boundary, list(r.changes), r.time_ratio,
                       Path(r.plan_path).name if r.plan_path else "") for r in replanning.replanner.records]
    out["final_ckpt"] = list(replanning.plan.checkpointed_blocks)
    out["hooks_on"] = sorted(n for n in plan.checkpointed_blocks
                             if checkpoint.state(run["model"].get_submodule(n)).enable_hook)
    out["prediction_after"] = replanning.prediction.predicted_step_s if replanning.prediction else None
    out["new_step_s"] = replanning.plan.step_time_s
    out["runtime"] = replanning.runtime
    out["files"] = sorted(p.name for p in (root / "replan").iterdir())
    if rank == 0:
        written = ElixirPlan.from_json(root / "replan" / "plan-replan.json")
        out["written_is_running"] = written == replanning.plan
        out["plan_json_is_given"] = ElixirPlan.from_json(root / "replan" / "plan.json") == plan
    # A fresh loop that starts from the boundary's checkpoint with the new plan given: the re-planned run's weights.
    resumed = _loop(strategy(root / "replan" / "plan-replan.json"), root / "replan" / "ckpt", resume=True)
    out["resumed"] = resumed["losses"]
    if rank == 0:
        out["weights_diff"] = max((run["weights"][k] - v).abs().max().item() for k, v in resumed["weights"].items())
        out["same_keys"] = sorted(run["weights"]) == sorted(resumed["weights"])
    return out


@RunIf(lightning=True, min_world=2)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fabric_replan_switches_at_fabric_save_and_keeps_the_math(tmp_path):
    results = run_distributed(_replan, 2, args=(str(tmp_path),), timeout=420, env=ENV)
    for rank, r in enumerate(results):
        assert r["planned_ckpt"], "the given plan recomputes blocks"
        assert r["runtime"] == "FSDP2"  # replan=True keeps switchable FSDP2 units, as under the Trainer
        (measured_at, applied_at, boundary, changes, ratio, path), = r["records"]
        # Measured at the 8th backward (2 warm-up + 5 timed steps); applied by the fabric.save after step 8.
        assert measured_at == 7 and (applied_at, boundary) == (SAVE, "checkpoint"), r["records"]
        assert ratio > 10, ratio  # measured / predicted: the calibration was 10^5 x too fast
        # Priced with the measured speed, recomputation is no longer free: the new plan drops it.
        assert r["final_ckpt"] == [] and r["hooks_on"] == []
        assert sorted(c for c in changes if "recompute" in c) == sorted(f"{b}: recompute off"
                                                                       for b in r["planned_ckpt"]), changes
        assert path == ("plan-replan.json" if rank == 0 else "")  # rank 0 writes it
        assert {"ckpt", "plan.json", "plan-replan.json"} <= set(r["files"]), r["files"]
        # The new plan's own prediction is checked after the switch, and it comes from the scaled profile.
        assert r["prediction_after"] == pytest.approx(r["new_step_s"])
        # Same math: every loss equals the loop that kept its plan; resumed with the new plan, the same weights.
        assert len(r["fixed"]) == len(r["replan"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["fixed"], r["replan"])) <= 1e-6, (r["fixed"], r["replan"])
        assert r["resumed"] == r["replan"][SAVE:], (r["resumed"], r["replan"][SAVE:])
    r0 = results[0]
    assert r0["written_is_running"] and r0["plan_json_is_given"]
    assert r0["same_keys"] and r0["weights_diff"] == 0.0, r0["weights_diff"]


@RunIf(lightning=True)
def test_fabric_replan_refuses_what_the_trainer_refuses(tmp_path):
    from lightning_elixir import ElixirFabricStrategy, ElixirStrategy

    # One options object: the same refusal, named for each front door, before anything runs.
    for cls in (ElixirStrategy, ElixirFabricStrategy):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\(replan=True, disk_dir=\.\.\.\): re-planning does "
                                             "not move") as info:
            cls(disk_dir=tmp_path, replan=True)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"ElixirFabricStrategy\(replan='yes'\): use True or False"):
        ElixirFabricStrategy(replan="yes")  # type: ignore[arg-type]
