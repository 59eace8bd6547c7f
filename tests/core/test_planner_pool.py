"""The weight-pool planner (moved from tests/energon_infer/test_engine_pool.py; assertions unchanged)."""

from __future__ import annotations

import pickle

import pytest

from tightfit.planner.errors import PlanInfeasibleError
from tightfit.planner.pool import PoolInfeasibleError, PoolPlan, plan_pool


def test_plan_pools_the_fewest_layers_that_fit():
    layers = [100] * 6
    free = plan_pool(layers, resident_bytes=50, budget_bytes=650)
    assert free.pooled == () and free.device_bytes == 650
    # 600 bytes: pool k layers, keep (6-k) * 100 + 3 slots * 100; the first k that fits is 4 (50+200+300).
    plan = plan_pool(layers, resident_bytes=50, budget_bytes=600, lookahead=2)
    assert plan.pooled == (0, 1, 3, 4) and plan.device_bytes == 550 and plan.pool_bytes == 400
    assert plan_pool(layers, fraction=0.5).pooled == (0, 2, 4)  # spread evenly between resident layers
    with pytest.raises(PoolInfeasibleError, match=r"needs at least 150 B .* the budget is 100 B"):
        plan_pool(layers, resident_bytes=50, budget_bytes=100, lookahead=0)


def test_infeasible_pool_is_a_plan_infeasible_error_with_its_numbers():
    with pytest.raises(PlanInfeasibleError) as info:
        plan_pool([100] * 6, resident_bytes=50, budget_bytes=100, lookahead=0)
    # Every layer pooled: 50 resident + 1 slot of 100 = 150 bytes.
    assert (info.value.needed_bytes, info.value.budget_bytes) == (150, 100)
    again = pickle.loads(pickle.dumps(info.value))  # workers raise it in another process
    assert isinstance(again, PoolInfeasibleError) and (again.needed_bytes, again.budget_bytes) == (150, 100)


def test_pool_plan_round_trips_through_json():
    plan = plan_pool([100, 300, 200, 100], resident_bytes=10, fraction=0.5, lookahead=1)
    assert plan.pooled == (0, 2)
    assert PoolPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"pooled=\(3, 1\)"):
        PoolPlan(pooled=(3, 1), n_layers=4, lookahead=1, device_bytes=0, pool_bytes=0, slot_bytes=0)
