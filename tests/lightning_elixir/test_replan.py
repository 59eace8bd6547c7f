"""``ElixirStrategy(replan=True)`` with a real Trainer: a deliberately wrong device calibration makes the
prediction miss the measured step; the strategy re-plans from the measurement, switches to the new plan
at the next checkpoint (end of the first epoch) and training continues with the same math.

Runs in a spawned rank (world size 1), so Lightning's global state and the group never leak into pytest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed

ENV = {"GROUP_RANK": "0"}


def _replan(rank: int, world: int, tmp: str) -> dict:
    import dataclasses

    import lightning as L
    from torch.distributed._composable import checkpoint
    from torch.utils.data import DataLoader

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.planning import make_plan, profile_module
    from tests.lightning_elixir.common import BATCH, TinyGPT, cpu_device, token_data, trainer
    from tightfit.profiler.types import ClusterSpec

    # The wrong calibration: this CPU priced as multiplying matrices 10^5 x faster than it does, so every
    # predicted step is far below the measured one. The given plan recomputes every block; with compute
    # that cheap, recomputing costs nothing in the prediction.
    wrong = dataclasses.replace(cpu_device(), matmul_flops={"float32": 5e15})
    batch = next(iter(DataLoader(token_data(8), batch_size=BATCH)))
    plan = make_plan(profile_module(TinyGPT(), batch), ClusterSpec.uniform(wrong, 1), activation_checkpointing=True)
    out: dict = {"planned_ckpt": list(plan.checkpointed_blocks)}
    for name, replan in (("fixed", False), ("replan", True)):
        L.seed_everything(0)
        model = TinyGPT(samples=40)  # 10 steps per epoch, 2 epochs; ModelCheckpoint saves after each
        strategy = ElixirStrategy(plan=plan, device_profile=wrong, replan=replan, verbose=False)
        trainer(strategy, Path(tmp) / name, devices=1, max_steps=20, enable_checkpointing=True).fit(model)
        out[name] = model.losses
        if replan:
            assert strategy.replanner is not None and strategy.plan is not None
            out["records"] = [(r.measured_at_step, r.applied_at_step, r.boundary, list(r.changes), r.time_ratio,
                               Path(r.plan_path).name) for r in strategy.replanner.records]
            out["final_ckpt"] = list(strategy.plan.checkpointed_blocks)
            out["hooks_on"] = sorted(n for n in plan.checkpointed_blocks
                                     if checkpoint.state(model.get_submodule(n)).enable_hook)
            out["prediction_after"] = strategy.prediction.predicted_step_s if strategy.prediction else None
            out["new_step_s"] = strategy.plan.step_time_s
        else:
            assert strategy.replanner is None
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_replan_switches_plan_at_the_checkpoint_and_keeps_the_math(tmp_path):
    (r,) = run_distributed(_replan, 1, args=(str(tmp_path),), timeout=300, env=ENV)
    assert r["planned_ckpt"], "the given plan recomputes blocks"
    (measured_at, applied_at, boundary, changes, ratio, path), = r["records"]
    # Measured after 2 warm-up + 5 timed steps; applied when the first epoch's checkpoint was written.
    assert measured_at == 7 and (applied_at, boundary) == (10, "checkpoint"), r["records"]
    assert ratio > 10, ratio  # measured / predicted: the calibration was 10^5 x too fast
    # Priced with the measured speed, recomputation is no longer free: the new plan drops it (memory allows).
    assert r["final_ckpt"] == [] and r["hooks_on"] == []
    assert sorted(changes) == sorted(f"{b}: recompute off" for b in r["planned_ckpt"]), changes
    assert path == "plan-replan.json"
    # The new plan's own prediction is checked after the switch, and it comes from the scaled profile.
    assert r["prediction_after"] == pytest.approx(r["new_step_s"])
    # Same math: recomputation changes no value; every step's loss equals the run that kept the plan.
    assert len(r["fixed"]) == len(r["replan"]) == 20
    assert max(abs(a - b) for a, b in zip(r["fixed"], r["replan"])) <= 1e-6, (r["fixed"], r["replan"])
