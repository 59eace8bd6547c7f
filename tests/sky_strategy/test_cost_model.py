"""Sky's calibrated step model on real gloo ranks: each rank's own per-layer timings price its stages, the
plan says which model priced it, and the strategy records predicted vs measured after warm-up."""

from __future__ import annotations

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

STEPS = 9  # 2 warm-up steps + 5 timed (the monitor's defaults) + the step start that closes the last


def _fit_and_report(rank: int, world: int) -> dict:
    import sky_strategy
    from tests.sky_strategy.models import loader, make_net
    from tests.sky_strategy.ranks import trainer

    strategy = sky_strategy.SkyStrategy(verbose=False, speed_factors=[1.0, 0.5], microbatches=4, profile_repeats=2)
    trainer(world, strategy, STEPS).fit(make_net(), loader())
    plan, rec = strategy.plan, strategy.prediction
    return {"cost_model": plan.cost_model, "step_time_s": plan.step_time_s, "tail_s": plan.step_tail_s,
            "stages": [(s.device, s.start, s.stop, s.compute_s) for s in plan.stages],
            "layer_seconds": [list(p.layer_seconds) for p in strategy.profiles],
            "raw_seconds": [[m.seconds for m in p.layers] for p in strategy.profiles],
            "speeds": [p.speed_factor for p in strategy.profiles],
            "record": None if rec is None else {
                "planner": rec.planner, "cost_model": rec.cost_model, "predicted": rec.predicted_step_s,
                "measured": rec.measured_step_s, "steps": rec.steps, "error": rec.time_error}}


@RunIf(lightning=True, min_world=2)
def test_ranks_price_their_own_stages_and_a_prediction_record_is_produced():
    out = run_distributed(_fit_and_report, 2, timeout=600)
    r0 = out[0]
    assert out[1]["cost_model"] == r0["cost_model"] and out[1]["stages"] == r0["stages"]  # one plan everywhere
    model = r0["cost_model"]
    assert model.startswith("measured per-device layer timings"), model
    assert "links alpha-beta" in model and "optimizer step" in model and "per-step overhead" in model
    assert "schedule overhead (stand-in step)" in model  # the stand-in pipeline step was timed and priced
    seconds = r0["layer_seconds"]
    # identical blocks (layers 1..6) share one pooled time per rank; the embedding and head have their own
    for per_rank in seconds:
        assert len(set(per_rank[1:7])) == 1 and len(per_rank) == 8
    # every stage is priced with the seconds its own rank measured, not with one speed per rank
    for device, start, stop, compute in r0["stages"]:
        assert compute == pytest.approx(sum(seconds[device][start:stop]), rel=1e-12)
    assert r0["tail_s"] > 0  # optimizer step + per-step collectives
    rec = r0["record"]
    assert rec is not None, "SkyStrategy produced no predicted-vs-measured record after warm-up"
    assert rec["planner"] == "sky" and rec["cost_model"] == model and rec["steps"] == 5
    assert rec["predicted"] == pytest.approx(r0["step_time_s"]) and rec["measured"] > 0
    assert rec["error"] == pytest.approx(rec["predicted"] / rec["measured"] - 1)


def _stand_in(rank: int, world: int) -> float:
    import torch

    from sky_strategy.profiling import pipeline_overhead

    return pipeline_overhead(3, "1f1b", device=torch.device("cpu"), group=None,
                             slowdown=lambda: 3.0 if rank == 1 else 1.0, warmup=1, repeats=2)


@RunIf(min_world=2)
def test_stand_in_step_times_the_real_schedule_on_every_rank():
    out = run_distributed(_stand_in, 2, timeout=300)
    # one number everywhere (the slowest rank's median), and a real schedule step takes time
    assert out[0] == out[1] and 0 < out[0] < 5.0


def test_pooled_seconds_share_one_time_per_layer_kind():
    from sky_strategy.layers import LayerMeasurement
    from sky_strategy.profiling import pooled_seconds

    def m(kind, samples):
        return LayerMeasurement(seconds=sorted(samples)[len(samples) // 2], param_bytes=0, activation_bytes=0,
                                output_bytes=0, kind=kind, samples=tuple(samples))

    # one block was preempted in two of its repeats (9 s): pooled with its twins it no longer stands out
    layers = [m("embed", [0.5, 0.5, 0.5]), m("block", [1.0, 1.1, 0.9]), m("block", [9.0, 9.0, 1.0]),
              m("block", [1.0, 1.0, 1.0]), m("block", [1.0, 0.9, 1.1]), m("head", [0.2, 0.2, 0.2])]
    pooled = pooled_seconds(layers)
    assert pooled[0] == 0.5 and pooled[-1] == pytest.approx(0.2)
    assert pooled[1] == pooled[2] == pooled[3] == pooled[4] and 0.9 < pooled[1] < 1.1
    assert layers[2].seconds == 9.0  # the layer's own median would have priced it 9x
    legacy = [LayerMeasurement(seconds=2.0, param_bytes=0, activation_bytes=0, output_bytes=0)]
    assert pooled_seconds(legacy) == (2.0,)


def test_profile_clock_is_validated():
    from sky_strategy.config import SkyConfig

    with pytest.raises(ValueError, match="profile_clock='gpu'"):
        SkyConfig(profile_clock="gpu")
