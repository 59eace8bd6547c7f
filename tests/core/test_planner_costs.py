"""The planners' cost models pinned to numbers worked out by hand from their docstrings.

The solver tests compare solvers with each other or with brute force under the *same* cost model, so a
wrong model passes them; these tests write the expected bytes and seconds out from the formula in the
module docstring (pipeline: ``tightfit.planner.pipeline.problem``; cache sizing:
``tightfit.planner.cache``; weight pool: ``tightfit.planner.pool``), and each model has a case that
fits only when the accounting is exact to the byte.
"""

from __future__ import annotations

import pytest
import torch

from tightfit.planner.cache import INDEX_BYTES_PER_ROW, INDEX_BYTES_PER_SLOT, CacheTableSpec, plan_cache
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.planner.pipeline import DeviceSpec, LayerMemory, PipelineProblem, balance, evaluate
from tightfit.planner.pool import PoolInfeasibleError, plan_pool

# ------------------------------------------------------------------------------------------------ pipeline
# Every layer: 10 B of parameters, 100 B saved for backward per microbatch, 7 B of output per microbatch.
# Adam (optimizer_state_factor 2): a layer's static bytes are 10 * (2 + 2) = 40.
LAYER = LayerMemory(param_bytes=10, activation_bytes=100, output_bytes=7)


def _devices(n: int, memory: int | list[int] = 10**6, speeds: list[float] | None = None) -> list[DeviceSpec]:
    mems = memory if isinstance(memory, list) else [memory] * n
    speeds = speeds or [1.0] * n
    return [DeviceSpec(name=f"d{i}", speed=speeds[i], memory_bytes=mems[i]) for i in range(n)]


@pytest.mark.parametrize(("schedule", "microbatches", "expected"), [
    # GPipe: every microbatch is in flight on every stage.
    ("gpipe", 8, [8, 8, 8]),
    # 1F1B at position s of S stages: min(M, S - s); the last stage holds one, the first S.
    ("1f1b", 8, [3, 2, 1]),
    ("1f1b", 2, [2, 2, 1]),
    ("1f1b", 1, [1, 1, 1]),
])
def test_in_flight_microbatches_per_position(schedule, microbatches, expected):
    problem = PipelineProblem(layer_costs=[1.0] * 3, layer_memory=[LAYER] * 3, devices=_devices(3),
                              microbatches=microbatches, schedule=schedule)
    assert [problem.in_flight(k) for k in range(3)] == expected


def test_interleaved_in_flight_spreads_the_warm_up_over_the_chunks():
    # R = 2 ranks, V = 2 chunks: rank r warms up (V - 1) * R + 2 * (R - 1 - r) + 1 chunk-microbatches,
    # rank 0: 2 + 2 + 1 = 5, rank 1: 2 + 0 + 1 = 3; per chunk ceil(min(M * V, warm) / V), capped at M.
    # Positions go round-robin: 0 and 2 are rank 0, 1 and 3 are rank 1.
    def in_flight(m: int) -> list[float]:
        p = PipelineProblem(layer_costs=[1.0] * 8, layer_memory=[LAYER] * 8, devices=_devices(2),
                            microbatches=m, schedule="interleaved", virtual_stages=2)
        return [p.in_flight(k) for k in range(4)]

    assert in_flight(8) == [3, 2, 3, 2]  # ceil(5 / 2), ceil(3 / 2)
    assert in_flight(2) == [2, 2, 2, 2]  # rank 0: min(2, ceil(min(4, 5) / 2)) = 2; rank 1: ceil(3 / 2) = 2
    assert in_flight(1) == [1, 1, 1, 1]  # min(M * V, warm) = 2 -> 1 per chunk


def test_stage_memory_per_schedule_by_hand():
    # Two stages of two layers: static 2 * 40 = 80; activations 2 * 100 = 200 per microbatch in flight;
    # the boundary after layer 1 carries 7 B: the sender keeps 2 * 7 (output + its gradient), the receiver
    # 2 * 7 per microbatch in flight; the first stage receives nothing, the last sends nothing.
    def memory(schedule: str, m: int) -> list[int]:
        p = PipelineProblem(layer_costs=[1.0] * 4, layer_memory=[LAYER] * 4, devices=_devices(2),
                            microbatches=m, schedule=schedule)
        return [s.memory_bytes for s in p.price([0, 2, 4], (0, 1), "by hand").stages]

    assert memory("gpipe", 8) == [80 + 200 * 8 + 14, 80 + 200 * 8 + 14 * 8]  # 1694, 1792
    assert memory("1f1b", 8) == [80 + 200 * 2 + 14, 80 + 200 * 1 + 14 * 1]  # 494, 294
    assert memory("1f1b", 1) == [80 + 200 + 14, 80 + 200 + 14]


def test_interleaved_stage_memory_and_caps_by_hand():
    # 8 layers in 4 chunks of 2 on 2 devices of 2000 B: each chunk may use 2000 / 2 = 1000 B.
    # No outputs: static 80 + 200 per microbatch in flight (3 on rank 0's chunks, 2 on rank 1's).
    layer = LayerMemory(param_bytes=10, activation_bytes=100)
    p = PipelineProblem(layer_costs=[1.0] * 8, layer_memory=[layer] * 8, devices=_devices(2, 2000),
                        microbatches=8, schedule="interleaved", virtual_stages=2)
    plan = p.price([0, 2, 4, 6, 8], (0, 1), "by hand")
    assert [s.memory_bytes for s in plan.stages] == [680, 480, 680, 480]
    assert [s.memory_cap_bytes for s in plan.stages] == [1000] * 4
    assert [s.device for s in plan.stages] == [0, 1, 0, 1]
    # Each rank runs two chunks of 2 s: load 4 s each; M * max(R) + (sum(R) - max(R)) / V = 32 + 2.
    assert plan.step_time_s == pytest.approx(34.0)
    assert plan.bottleneck_s == pytest.approx(4.0)


def test_step_time_with_links_and_speeds_by_hand():
    # Stage 0 on a speed-1 device: 2 s of compute + 2 * 7 B / 7 B/s = 2 s sending = 4 s.
    # Stage 1 on a speed-0.5 device: 2 / 0.5 = 4 s, nothing to send.
    # GPipe and 1F1B: sum(t) + (M - 1) * max(t) = 8 + 7 * 4 = 36; without pipelining M * sum(t) = 64.
    for schedule in ("gpipe", "1f1b"):
        p = PipelineProblem(layer_costs=[1.0] * 4, layer_memory=[LAYER] * 4,
                            devices=_devices(2, speeds=[1.0, 0.5]), microbatches=8, schedule=schedule, links=7.0)
        plan = evaluate(p, [0, 2, 4], order=(0, 1))
        assert [(s.compute_s, s.comm_s) for s in plan.stages] == [(2.0, 2.0), (4.0, 0.0)]
        assert plan.step_time_s == pytest.approx(36.0)
        assert plan.sequential_time_s == pytest.approx(64.0)


def test_a_1f1b_plan_fits_only_if_every_position_is_counted_exactly():
    # One layer per stage, 1F1B, 8 microbatches, Adam:
    #   stage 0: 40 static + 100 * 2 in flight + 2 * 7 sent       = 254
    #   stage 1: 40 static + 100 * 1 in flight + 2 * 7 * 1 received = 154
    costs, mems = [1.0, 1.0], [LAYER, LAYER]
    plan = balance(PipelineProblem(layer_costs=costs, layer_memory=mems, devices=_devices(2, [254, 154]),
                                   microbatches=8, schedule="1f1b"), order="given")
    assert plan.feasible and [s.memory_bytes for s in plan.stages] == [254, 154]
    for short in ([253, 154], [254, 153]):
        with pytest.raises(PlanInfeasibleError):
            balance(PipelineProblem(layer_costs=costs, layer_memory=mems, devices=_devices(2, short),
                                    microbatches=8, schedule="1f1b"), order="given")


# ------------------------------------------------------------------------------------------------ cache sizing
# Bytes of one slot: dim * weight_bytes + 4 * state_columns + INDEX_BYTES_PER_SLOT.
A = CacheTableSpec(name="a", rows=10, dim=4)  # 16 + 0 + 24 = 40
B = CacheTableSpec(name="b", rows=20, dim=2, state_columns=1)  # 8 + 4 + 24 = 36
# The fixed part: the index of every row plus one slot per table: 10 * 4 + 40 + 20 * 4 + 36 = 196.
FIXED = 196
FREQ = {"a": torch.tensor([9, 0, 5, 0, 0, 0, 0, 0, 0, 1]),
        "b": torch.tensor([4, 4, 0, 0, 3] + [0] * 15)}


def test_slot_bytes_and_index_by_hand():
    assert INDEX_BYTES_PER_SLOT == 24 and INDEX_BYTES_PER_ROW == 4  # the numbers below are worked with these
    assert (A.slot_bytes, B.slot_bytes) == (40, 36)
    plan = plan_cache([A, B], budget_bytes=FIXED)
    assert plan.slots == {"a": 1, "b": 1} and plan.used_bytes == FIXED
    with pytest.raises(PlanInfeasibleError) as err:
        plan_cache([A, B], budget_bytes=FIXED - 1)
    assert (err.value.needed_bytes, err.value.budget_bytes) == (FIXED, FIXED - 1)


def test_budget_goes_to_uses_per_byte_by_hand():
    # Beyond each table's first slot, rows by uses per byte: a's 5 (5/40), b's 4 (4/36), b's 3 (3/36),
    # a's 1 (1/40). 86 spare bytes buy a's 5 (40) and b's 4 (36); the last 10 B buy no further whole slot.
    plan = plan_cache([A, B], budget_bytes=FIXED + 86, frequencies=FREQ)
    assert plan.slots == {"a": 2, "b": 2}
    assert plan.used_bytes == 10 * 4 + 2 * 40 + 20 * 4 + 2 * 36  # 272
    # The planned rows cover 9 + 5 of a's 15 uses and 4 + 4 of b's 11.
    assert plan.predicted_hit_rate == pytest.approx(22 / 26)


def test_a_cache_plan_takes_a_slot_only_if_its_bytes_are_counted_exactly():
    # 112 spare bytes = 40 + 36 + 36 buy exactly three more slots; one byte less buys two.
    exact = plan_cache([A, B], budget_bytes=FIXED + 112, frequencies=FREQ)
    assert exact.slots == {"a": 2, "b": 3} and exact.used_bytes == exact.budget_bytes == 308
    short = plan_cache([A, B], budget_bytes=FIXED + 111, frequencies=FREQ)
    assert short.slots == {"a": 2, "b": 2}


def test_without_statistics_the_spare_bytes_buy_the_same_fraction_of_every_table():
    # Rows left after the first slot: a 9, b 19; all of them cost 9 * 40 + 19 * 36 = 1044 B. 522 spare bytes
    # are half of that: a gets int(4.5) = 4 more, b int(9.5) = 9 more.
    plan = plan_cache([A, B], budget_bytes=FIXED + 522)
    assert plan.slots == {"a": 5, "b": 10}
    assert plan.used_bytes == 10 * 4 + 5 * 40 + 20 * 4 + 10 * 36  # 680
    assert plan.predicted_hit_rate is None


# ------------------------------------------------------------------------------------------------ weight pool
# device bytes = resident + sum(kept layers) + min(lookahead + 1, pooled) * max(pooled layer bytes)
LAYERS = [100, 300, 200, 100]


def test_pool_device_bytes_by_hand():
    # k pooled (spread evenly), resident 10, lookahead 1 (two slots):
    #   k=0: 10 + 700 = 710;  k=1 (0): 10 + 600 + 1 * 100 = 710;  k=2 (0, 2): 10 + 400 + 2 * 200 = 810;
    #   k=3 (0, 1, 2): 10 + 100 + 2 * 300 = 710;  k=4: 10 + 0 + 2 * 300 = 610.
    assert plan_pool(LAYERS, resident_bytes=10, budget_bytes=710, lookahead=1).pooled == ()
    plan = plan_pool(LAYERS, resident_bytes=10, budget_bytes=700, lookahead=1)
    assert (plan.pooled, plan.device_bytes, plan.pool_bytes, plan.slot_bytes) == ((0, 1, 2, 3), 610, 700, 300)
    two = plan_pool(LAYERS, resident_bytes=10, fraction=0.5, lookahead=1)
    assert (two.pooled, two.device_bytes, two.pool_bytes, two.slot_bytes) == ((0, 2), 810, 300, 200)
    # lookahead 0 (one slot): k=1 (0): 10 + 600 + 100 = 710 > 709; k=2 (0, 2): 10 + 400 + 200 = 610.
    one = plan_pool(LAYERS, resident_bytes=10, budget_bytes=709, lookahead=0)
    assert (one.pooled, one.device_bytes, one.slot_bytes) == ((0, 2), 610, 200)


def test_a_pool_plan_fits_only_if_the_slots_are_counted_exactly():
    # Every layer pooled needs 610 B (above); 610 fits, 609 does not and says so.
    assert plan_pool(LAYERS, resident_bytes=10, budget_bytes=610, lookahead=1).device_bytes == 610
    with pytest.raises(PoolInfeasibleError) as err:
        plan_pool(LAYERS, resident_bytes=10, budget_bytes=609, lookahead=1)
    assert (err.value.needed_bytes, err.value.budget_bytes) == (610, 609)
    # lookahead 0: one slot of 300 -> 310 with every layer pooled; k=3 (0, 1, 2): 10 + 100 + 300 = 410.
    assert plan_pool(LAYERS, resident_bytes=10, budget_bytes=410, lookahead=0).pooled == (0, 1, 2)
    assert plan_pool(LAYERS, resident_bytes=10, budget_bytes=409, lookahead=0).pooled == (0, 1, 2, 3)
