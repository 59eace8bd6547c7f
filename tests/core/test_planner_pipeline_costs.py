"""Sky's step model: per-device layer timings, link latency, the per-step tail, gradient copies."""

from __future__ import annotations

import random

import pytest

from tightfit.planner.errors import PlanError
from tightfit.planner.pipeline import (
    DeviceSpec,
    LayerMemory,
    PipelineProblem,
    balance,
    brute_force,
    evaluate,
    even,
    merge_latency,
    merge_replicas,
)

GIB = 2**30


def _devices(*timings, speeds=None, **kw):
    return [DeviceSpec(name=f"d{i}", speed=(speeds or [1.0] * len(timings))[i], memory_bytes=GIB,
                       layer_seconds=t, **kw) for i, t in enumerate(timings)]


def test_measured_layer_timings_replace_costs_over_speed_and_the_plan_says_so():
    costs = [1.0] * 6
    mems = [LayerMemory(param_bytes=100)] * 6
    plain = PipelineProblem(layer_costs=costs, layer_memory=mems, devices=_devices(None, None, speeds=[1.0, 0.5]),
                            microbatches=4, schedule="1f1b")
    # device 1 is 2x slower by its speed, but its own timings say the first three layers (say, an embedding
    # it handles well) cost it 0.5 s and the last three 3 s: one speed cannot express that
    timed = PipelineProblem(layer_costs=costs, layer_memory=mems, microbatches=4, schedule="1f1b",
                            devices=_devices((1.0,) * 6, (0.5, 0.5, 0.5, 3.0, 3.0, 3.0), speeds=[1.0, 0.5]))
    p, t = evaluate(plain, [0, 3, 6]), evaluate(timed, [0, 3, 6])
    assert [s.compute_s for s in p.stages] == [3.0, 6.0]  # costs / speed, as before
    assert [s.compute_s for s in t.stages] == [3.0, 9.0]  # that device's own seconds
    assert "layer costs / device speed" in p.cost_model and p.cost_model == plain.cost_model
    assert t.cost_model.startswith("measured per-device layer timings")
    # the planner follows the measurement: the slow-on-late-layers device takes the early layers
    best = balance(timed)
    assert best.step_time_s == pytest.approx(brute_force(timed).step_time_s)
    first = best.stages[0]
    assert best.order[0] == 1 and first.stop - first.start >= 3


def test_per_device_timings_stay_exact_against_brute_force():
    rng = random.Random(3)
    for _ in range(15):
        n, d = rng.randint(3, 7), rng.randint(2, 3)
        timings = [tuple(rng.uniform(0.1, 2.0) for _ in range(n)) for _ in range(d)]
        problem = PipelineProblem(layer_costs=[1.0] * n, layer_memory=[LayerMemory(param_bytes=10)] * n,
                                  devices=_devices(*timings), microbatches=rng.randint(1, 6),
                                  schedule=rng.choice(["gpipe", "1f1b"]), links=rng.choice([None, 50.0]),
                                  link_latency=rng.choice([None, 0.05]))
        assert balance(problem).step_time_s == pytest.approx(brute_force(problem).step_time_s, rel=1e-9)


def test_link_latency_delays_the_step_once_per_boundary_and_direction():
    mems = [LayerMemory(param_bytes=1, output_bytes=1000)] * 4
    devs = _devices(None, None)
    args = dict(layer_costs=[1.0] * 4, layer_memory=mems, devices=devs, microbatches=3, schedule="gpipe", links=1e4)
    bw_only = evaluate(PipelineProblem(**args), [0, 2, 4])
    with_alpha = evaluate(PipelineProblem(**args, link_latency=0.25), [0, 2, 4])
    # the bytes occupy the sending stage every microbatch (activation out, gradient back) ...
    assert bw_only.stages[0].comm_s == with_alpha.stages[0].comm_s == pytest.approx(2 * 1000 / 1e4)
    # ... the latency delays the step once per boundary and direction (fill and drain), 3x without pipelining
    assert bw_only.step_time_s == pytest.approx(4.2 + 2 * 2.2)
    assert with_alpha.step_time_s == pytest.approx(4.2 + 2 * 2.2 + 2 * 0.25)
    assert with_alpha.sequential_time_s == pytest.approx(bw_only.sequential_time_s + 3 * 2 * 0.25)
    assert "links alpha-beta" in with_alpha.cost_model and "bandwidth-only" in bw_only.cost_model
    with pytest.raises(PlanError, match="link_latency"):
        PipelineProblem(**args, link_latency=-1.0)


def test_step_tail_prices_optimizer_all_reduce_and_per_step_overhead():
    mems = [LayerMemory(param_bytes=400)] * 4
    devs = _devices(None, None, optimizer_bytes_per_s=100.0)
    base = dict(layer_costs=[1.0] * 4, layer_memory=mems, devices=devs, microbatches=2, schedule="1f1b")
    none = evaluate(PipelineProblem(layer_costs=[1.0] * 4, layer_memory=mems, devices=_devices(None, None),
                                    microbatches=2, schedule="1f1b"), [0, 1, 4])
    assert none.step_tail_s == 0.0 and none.step_time_s == pytest.approx(1 + 3 + 3)
    opt = evaluate(PipelineProblem(**base), [0, 1, 4])
    # device 1 holds 1200 bytes of parameters: 12 s of optimizer step, the slowest device's
    assert opt.step_tail_s == pytest.approx(12.0) and opt.step_time_s == pytest.approx(7 + 12)
    dp = evaluate(PipelineProblem(**base, replicas=2, allreduce=(0.5, 600.0), step_overhead_s=1.0), [0, 1, 4])
    # + 1 s per step + two all-reduces' latency + 2 (R-1)/R x 1200 B / 600 B/s
    assert dp.step_tail_s == pytest.approx(1.0 + 12.0 + 2 * 0.5 + 2.0)
    assert dp.step_time_s == pytest.approx(7 + dp.step_tail_s)
    assert "optimizer step" in dp.cost_model and "all-reduce over 2 replicas" in dp.cost_model
    assert dp.sequential_time_s == pytest.approx(2 * (1 + 3) + dp.step_tail_s)


def test_schedule_overhead_from_a_stand_in_step_adds_to_the_step_and_is_named():
    mems = [LayerMemory(param_bytes=400)] * 4
    base = dict(layer_costs=[1.0] * 4, layer_memory=mems, devices=_devices(None, None), microbatches=2,
                schedule="1f1b")
    plain = evaluate(PipelineProblem(**base), [0, 1, 4])
    with_it = evaluate(PipelineProblem(**base, pipeline_overhead_s=0.25), [0, 1, 4])
    # inside the pipeline (not the tail after it), once per step whatever the partition
    assert with_it.step_time_s == pytest.approx(plain.step_time_s + 0.25) and with_it.step_tail_s == 0.0
    assert "0.25" not in plain.cost_model and "250.00 ms schedule overhead (stand-in step)" in with_it.cost_model
    with pytest.raises(PlanError, match="pipeline_overhead_s"):
        PipelineProblem(**base, pipeline_overhead_s=-1.0)


def test_a_gradient_kept_from_the_last_step_is_counted_in_memory():
    mems = [LayerMemory(param_bytes=100, activation_bytes=10)] * 2
    args = dict(layer_costs=[1.0] * 2, layer_memory=mems, devices=_devices(None), microbatches=1, schedule="gpipe",
                optimizer_state_factor=1.0)
    one = evaluate(PipelineProblem(**args), [0, 2])
    two = evaluate(PipelineProblem(**args, gradient_copies=2), [0, 2])
    assert one.stages[0].memory_bytes == 200 * 3 + 20  # weights, one gradient, momentum, activations
    assert two.stages[0].memory_bytes == 200 * 4 + 20 and two.peak_bytes == two.stages[0].memory_bytes


def test_replicas_keep_each_layers_slowest_copy_and_largest_latency():
    devs = _devices((1.0, 2.0), (1.0, 1.0), (3.0, 1.0), (1.0, 1.0), optimizer_bytes_per_s=10.0)
    devs[2] = DeviceSpec(name="d2", memory_bytes=GIB, layer_seconds=(3.0, 1.0), optimizer_bytes_per_s=5.0)
    merged, _ = merge_replicas(devs, None, replicas=2)
    assert merged[0].layer_seconds == (3.0, 2.0) and merged[0].optimizer_bytes_per_s == 5.0
    assert merged[1].layer_seconds == (1.0, 1.0)
    lat = [[0, 1, 2, 3], [1, 0, 4, 5], [2, 4, 0, 6], [3, 5, 6, 0]]
    assert merge_latency(lat, replicas=2) == [[0, 6], [6, 0]]
    assert merge_latency(0.1, replicas=2) == 0.1
    # a rank without timings: the merged position falls back to costs / speed
    mixed, _ = merge_replicas([devs[0], DeviceSpec(name="x", memory_bytes=GIB)], None, replicas=2)
    assert mixed[0].layer_seconds is None


def test_bad_timings_name_the_value_and_the_fix():
    with pytest.raises(PlanError, match=r"layer_seconds\[1\]"):
        DeviceSpec(name="a", memory_bytes=GIB, layer_seconds=(1.0, -2.0))
    with pytest.raises(PlanError, match="2 layer_seconds for 3 layers"):
        PipelineProblem(layer_costs=[1.0] * 3, layer_memory=[1] * 3, devices=_devices((1.0, 1.0)), microbatches=1,
                        schedule="gpipe")
    with pytest.raises(PlanError, match="allreduce"):
        PipelineProblem(layer_costs=[1.0] * 3, layer_memory=[1] * 3, devices=_devices(None), microbatches=1,
                        schedule="gpipe", allreduce=(0.1, 0.0))


def test_without_calibration_the_numbers_are_the_old_ones():
    devs = [DeviceSpec(name="a", speed=1.0, memory_bytes=GIB), DeviceSpec(name="b", speed=0.25, memory_bytes=GIB)]
    problem = PipelineProblem(layer_costs=[1.0] * 10, layer_memory=[1000] * 10, devices=devs, microbatches=8,
                              schedule="1f1b", links=1e6)
    plan = even(problem)
    t = [5.0 + 2 * 0 / 1e6, 20.0]  # 1000-byte params, no outputs: no transfer cost
    assert plan.step_time_s == pytest.approx(sum(t) + 7 * max(t)) and plan.step_tail_s == 0.0
    assert plan.stages[0].memory_bytes == 5 * 1000 * 4  # weights, gradients, Adam's two states


def test_accumulating_microbatch_gradients_counts_the_largest_layer_once_more():
    mems = [LayerMemory(param_bytes=b) for b in (100, 300, 200)]
    args = dict(layer_costs=[1.0] * 3, layer_memory=mems, devices=_devices(None, None), schedule="gpipe",
                optimizer_state_factor=0.0)
    plain = evaluate(PipelineProblem(**args, microbatches=2), [0, 2, 3])
    acc = evaluate(PipelineProblem(**args, microbatches=2, accumulation_buffer=True), [0, 2, 3])
    assert [a.memory_bytes - p.memory_bytes for a, p in zip(acc.stages, plain.stages)] == [300, 200]
    one = evaluate(PipelineProblem(**args, microbatches=1, accumulation_buffer=True), [0, 2, 3])
    assert one.stages[0].memory_bytes == evaluate(PipelineProblem(**args, microbatches=1), [0, 2, 3]).stages[0].memory_bytes
    # the solver sees the same memory as the pricing: a cap between the two excludes the split
    problem = PipelineProblem(**args, microbatches=2, accumulation_buffer=True)
    _, mem, _ = problem.matrices((0, 1))
    assert mem[0, 0, 2] == acc.stages[0].memory_bytes and mem[1, 2, 3] == acc.stages[1].memory_bytes
