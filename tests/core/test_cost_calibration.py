"""The calibrated cost model: measured block timings replace FLOPs / rate when present (and only then),
collectives get a latency term from an alpha-beta fit, a CPU "device" pays no offload copies, and a run
produces a prediction-vs-measurement record with advice when it is off."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from tightfit.models import GPTConfig, build_gpt
from tightfit.planner import cost
from tightfit.planner.check import StepMonitor
from tightfit.planner.elixir import Tier, UnitPlan, estimate, search
from tightfit.profiler import device_preset, profile_model, time_blocks
from tightfit.profiler.calibrate import fit_alpha_beta
from tightfit.profiler.types import ClusterSpec

CFG = GPTConfig(vocab_size=128, n_positions=16, hidden=32, layers=2, heads=2, name="tiny-cost")
IDS = torch.zeros(2, 16, dtype=torch.long)


@pytest.fixture(scope="module")
def flops_profile():
    return profile_model(build_gpt(CFG, device="meta"), IDS)


def _one_unit(profile) -> list[UnitPlan]:
    return [UnitPlan(blocks=tuple(b.name for b in profile.blocks), mode="replicate")]


def test_time_blocks_measures_every_block_once_per_type(flops_profile, tmp_path, monkeypatch):
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))
    timed = time_blocks(build_gpt(CFG, device="meta"), IDS, flops_profile, repeats=1, warmup=0, cache=True)
    assert timed.timed and not flops_profile.timed
    layers = [b for b in timed.blocks if b.type == "Block"]
    assert len(layers) == 2 and layers[0].fwd_s == layers[1].fwd_s  # one type, timed once
    assert all(b.bwd_s > 0 and b.recompute_s == b.fwd_s for b in layers)
    assert list(tmp_path.glob("blocks-*.json"))  # cached like the device profile
    with pytest.raises(ValueError, match="repeats=0"):
        time_blocks(build_gpt(CFG, device="meta"), IDS, flops_profile, repeats=0)


def test_block_timings_replace_flops_and_the_plan_says_so(flops_profile):
    cluster = ClusterSpec.uniform(device_preset("a100-40g"), 1)
    kw = dict(precision="32-true", optimizer="adamw")
    # Hand-set timings far from what FLOPs / rate gives: the prediction must follow them exactly.
    timed = dataclasses.replace(flops_profile, blocks=tuple(
        dataclasses.replace(b, fwd_s=0.001 * (i + 1), bwd_s=0.002 * (i + 1), recompute_s=0.001 * (i + 1))
        for i, b in enumerate(flops_profile.blocks)))
    with_timings = estimate(timed, cluster, _one_unit(timed), **kw)
    assert with_timings.cost_model.startswith("measured block timings")
    assert with_timings.breakdown.compute_s == pytest.approx(sum(b.fwd_s + b.bwd_s for b in timed.blocks))
    # Without timings the numbers are today's: FLOPs over the preset's fp32 rate.
    plain = estimate(flops_profile, cluster, _one_unit(flops_profile), **kw)
    assert plain.cost_model == "FLOPs / rate"
    rate = device_preset("a100-40g").matmul_flops["float32"]
    assert plain.breakdown.compute_s == pytest.approx((flops_profile.fwd_flops + flops_profile.bwd_flops) / rate)
    # Recompute is priced from the measured re-run forward.
    ckpt = [dataclasses.replace(_one_unit(timed)[0], checkpoint=tuple(b.name for b in timed.blocks if b.checkpointable))]
    recomputed = estimate(timed, cluster, ckpt, **kw)
    assert recomputed.breakdown.recompute_s == pytest.approx(sum(b.recompute_s for b in timed.blocks
                                                                 if b.checkpointable))
    assert "measured block timings" in search(timed, cluster, **kw).explain()


def test_collective_fit_adds_latency_and_is_absent_by_default():
    dev = device_preset("a100-40g")
    size = 64 * 2**10
    plain = cost.collective_time(dev, "all_gather", size, 2)
    assert plain == pytest.approx(size / 2 / (300e9))  # bandwidth only: today's formula
    fitted = dataclasses.replace(dev, collective_fit={"all_gather": {2: [1e-4, 1e9]}})
    assert cost.collective_time(fitted, "all_gather", size, 2) == pytest.approx(1e-4 + size / 2 / 1e9)
    # An all-reduce without its own fit: reduce-scatter then all-gather (latencies add).
    both = dataclasses.replace(dev, collective_fit={"all_gather": {2: [1e-4, 1e9]}, "reduce_scatter": {2: [2e-4, 1e9]}})
    assert cost.collective_time(both, "all_reduce", size, 2) == pytest.approx(3e-4 + 2 * size / 2 / 1e9)
    alpha, bw = fit_alpha_beta([1e4, 1e5, 1e6], [5e-4 + x / 2e9 for x in (1e4, 1e5, 1e6)], 1.0)
    assert alpha == pytest.approx(5e-4) and bw == pytest.approx(2e9)


def test_unified_memory_offload_has_no_copy_cost_and_overlap_serialises(flops_profile):
    cpu = dataclasses.replace(device_preset("a100-40g"), kind="cpu", name="cpu", h2d_bytes_per_s={},
                              d2h_bytes_per_s={})
    kw = dict(precision="32-true", optimizer="adamw")
    units = [UnitPlan(blocks=(b.name,), mode="reshard", tier=Tier.HOST) for b in flops_profile.blocks]
    old = estimate(flops_profile, ClusterSpec.uniform(cpu, 2), units, **kw)
    new = estimate(flops_profile, ClusterSpec.uniform(dataclasses.replace(cpu, unified_memory=True), 2), units, **kw)
    assert new.step_time_s < old.step_time_s  # the assumed 10 GB/s host copies are gone
    assert "no copy cost" in new.cost_model and "no copy cost" not in old.cost_model
    # Measured overlap 0: every collective also occupies the compute stream, so the step grows.
    serial = dataclasses.replace(cpu, comm_overlap=0.0)
    slow = estimate(flops_profile, ClusterSpec.uniform(serial, 2), units, **kw)
    assert slow.step_time_s > old.step_time_s and "overlap 0.00 (measured)" in slow.cost_model


def test_step_monitor_records_and_advises():
    ticks = iter(float(i) * 0.2 for i in range(20))
    mon = StepMonitor(planner="elixir", predicted_step_s=0.1, predicted_peak_bytes=100, cost_model="FLOPs / rate",
                      warmup=1, steps=3, clock=lambda: next(ticks), peak=lambda: 100)
    records = [mon.step_started() for _ in range(5)]
    assert records[:4] == [None] * 4 and records[4] is not None
    rec = records[4]
    assert rec.measured_step_s == pytest.approx(0.2) and rec.time_error == pytest.approx(-0.5)
    assert not rec.within_tolerance and "refresh=True" in rec.advice and "FLOPs" in rec.advice
    assert rec.metrics()["elixir/measured_step_s"] == pytest.approx(0.2)
    assert mon.step_started() is None  # once per run
    with pytest.raises(ValueError, match="tolerance"):
        StepMonitor(planner="x", predicted_step_s=1, predicted_peak_bytes=0, tolerance=0)


def test_prediction_record_is_logged_once_and_warns_beyond_tolerance(caplog):
    import types

    from tightfit.planner.check import on_step_start

    ticks = iter(float(i) * 0.2 for i in range(20))
    mon = StepMonitor(planner="sky", predicted_step_s=0.1, predicted_peak_bytes=0, cost_model="measured",
                      warmup=0, steps=2, clock=lambda: next(ticks))
    trainer = types.SimpleNamespace(global_rank=0, logger=None, global_step=3)  # what on_step_start reads
    with caplog.at_level(logging.INFO, logger="tightfit.planner.check"), pytest.warns(UserWarning, match="off by"):
        records = [on_step_start(mon, trainer) for _ in range(4)]
    assert records[:2] == [None, None] and records[2] is not None and records[3] is None
    lines = [r.getMessage() for r in caplog.records if r.name == "tightfit.planner.check"]
    assert lines == ["[sky] predicted vs measured over 2 steps: step 100.0 ms vs 200.0 ms (-50%); cost model: measured"]


def test_plan_cli_refuses_cpu_profile_for_accelerator_memory_and_checks_presets_first(monkeypatch, capsys):
    from tightfit.cli import main

    profiled: list[str] = []

    def no_model_profiling(*_a, **_k):
        profiled.append("model")
        raise AssertionError("the preset must be checked before the model is profiled")

    monkeypatch.setattr("tightfit.profiler.profile_model", no_model_profiling)
    # User errors are one line on stderr and exit code 2 (tightfit's CLI convention), before any profiling.
    assert main(["plan", "elixir", "--model", "gpt2", "--preset", "a100-41g"]) == 2
    assert "unknown device preset 'a100-41g'" in capsys.readouterr().err
    assert not profiled
    monkeypatch.undo()
    # This machine's own (CPU) profile, measured or cached, asked to stand for 1 GiB accelerators: refused.
    assert main(["plan", "elixir", "--model", "gpt2", "--batch", "1", "--seq", "64", "--devices", "4",
                 "--device-memory", "1GiB"]) == 2
    assert re.search("--preset .*--device-profile", capsys.readouterr().err)


def test_calibrated_memory_model_frees_gradients_until_backward(flops_profile):
    kw = dict(precision="32-true", optimizer="adamw")
    dev = device_preset("a100-40g")
    units = [UnitPlan(blocks=(b.name,), mode="reshard") for b in flops_profile.blocks]
    plain = estimate(flops_profile, ClusterSpec.uniform(dev, 2), units, **kw)
    calibrated = dataclasses.replace(dev, unit_overhead_s={"reshard": [0.0, 0.0, 0.0]})
    assert calibrated.calibrated and not dev.calibrated
    lazy = estimate(flops_profile, ClusterSpec.uniform(calibrated, 2), units, **kw)
    grads = flops_profile.param_numel / 2 * 4  # this rank's fp32 gradient shard
    reduce_buffer = max(b.param_numel for b in flops_profile.blocks) * 4  # a unit's, only in its reduction
    assert lazy.step_time_s == pytest.approx(plain.step_time_s)  # zero overhead: same time
    assert lazy.peak_bytes < plain.peak_bytes and plain.peak_bytes - lazy.peak_bytes <= (grads + reduce_buffer) * 1.1 + 1


def test_replan_in_place_prices_the_measured_speed_and_keeps_units(flops_profile):
    from tightfit.planner.elixir.replan import replan_in_place, scale_profile

    kw = dict(precision="32-true", optimizer="adamw")
    dev = device_preset("a100-40g")
    units = [UnitPlan(blocks=(b.name,), mode="keep", tier=i == 0, checkpoint=(b.name,) if b.checkpointable else ())
             for i, b in enumerate(flops_profile.blocks)]
    plan = estimate(flops_profile, ClusterSpec.uniform(dev, 2), units, **kw)
    slow = scale_profile(flops_profile, time_ratio=1000.0)
    assert slow.blocks[2].fwd_flops == pytest.approx(1000 * flops_profile.blocks[2].fwd_flops)
    assert slow.blocks[2].saved_bytes == flops_profile.blocks[2].saved_bytes  # memory untouched
    new = replan_in_place(slow, ClusterSpec.uniform(dev, 2), plan)
    assert new is not None and new.search_method == "replan in place"
    # Units, offload and replication are what the running model has; recomputation, now 1000x dearer, is gone.
    assert [(u.blocks, u.offload) for u in new.units] == [(u.blocks, u.offload) for u in plan.units]
    assert not new.checkpointed_blocks and plan.checkpointed_blocks
    assert new.step_time_s < estimate(slow, ClusterSpec.uniform(dev, 2), units, **kw).step_time_s
    # A budget below the least-memory plan: nothing to switch to.
    assert replan_in_place(slow, ClusterSpec.uniform(dev, 2), plan, memory_budget=1) is None
    with pytest.raises(ValueError, match="time_ratio"):
        scale_profile(flops_profile, time_ratio=0)


def test_unified_memory_counts_offloaded_state_in_the_device_peak(flops_profile):
    # A CPU "device" is the host: offloading moves nothing, so the peak must not drop by the offloaded state.
    kw = dict(precision="32-true", optimizer="adamw")
    cpu = dataclasses.replace(device_preset("a100-40g"), kind="cpu", name="cpu", h2d_bytes_per_s={},
                              d2h_bytes_per_s={}, unified_memory=True, unit_overhead_s={"reshard": [0.0, 0.0, 0.0]})
    split = [UnitPlan(blocks=(b.name,), mode="reshard") for b in flops_profile.blocks]
    off = [dataclasses.replace(u, tier=Tier.HOST) for u in split]
    resident = estimate(flops_profile, ClusterSpec.uniform(cpu, 2), split, **kw)
    offloaded = estimate(flops_profile, ClusterSpec.uniform(cpu, 2), off, **kw)
    assert offloaded.peak_bytes == resident.peak_bytes and offloaded.host_bytes_per_rank > 0
    discrete = dataclasses.replace(cpu, unified_memory=False)
    assert estimate(flops_profile, ClusterSpec.uniform(discrete, 2), off, **kw).peak_bytes < resident.peak_bytes



def _overlaps(rank: int, world: int) -> list[float]:
    from tightfit.profiler import calibrate
    from tightfit.profiler.timing import clock_of

    calibrate._NOW[0] = clock_of("wall")
    return [calibrate._overlap(torch.device("cpu"), 7) for _ in range(3)]


def test_measured_overlap_repeats_on_gloo():
    # Three calibrations on 2 real gloo ranks: every rank reports the same overlap (the slowest rank's timings, so
    # the plan every rank derives is the same), a fraction, and the three agree: the planner prices every step with
    # it, so a figure that swings by more than this from one calibration to the next flips plans by chance. The
    # bound is about six standard deviations of the figure on a busy 2-core machine (21 trials a calibration).
    from tests.helpers.multiprocess import run_distributed

    first, second = run_distributed(_overlaps, world_size=2)
    assert first == second
    assert len(first) == 3 and all(0.0 <= x <= 1.0 for x in first), first
    assert max(first) - min(first) <= 0.4, first
