"""Cache sizing from a byte budget (tightfit.planner.cache)."""

from __future__ import annotations

import pytest
import torch

from tightfit.planner.cache import INDEX_BYTES_PER_ROW, CacheTableSpec, plan_cache
from tightfit.planner.errors import PlanInfeasibleError


def test_budget_goes_to_the_most_used_rows_per_byte():
    tables = [CacheTableSpec(name="hot", rows=1000, dim=8), CacheTableSpec(name="cold", rows=1000, dim=8)]
    freq = {"hot": torch.arange(1000, 0, -1), "cold": torch.ones(1000, dtype=torch.int64)}
    plan = plan_cache(tables, budget_bytes=2 * 1000 * INDEX_BYTES_PER_ROW + 200 * tables[0].slot_bytes,
                      frequencies=freq)
    assert plan.slots["hot"] > plan.slots["cold"] >= 1
    assert plan.used_bytes <= plan.budget_bytes
    # the planned rows are the hot table's top rows: their share of all counted ids
    hot_top = float(freq["hot"][: plan.slots["hot"]].sum() + plan.slots["cold"])
    assert plan.predicted_hit_rate == pytest.approx(hot_top / float(freq["hot"].sum() + 1000))
    assert "slots" in plan.explain()


def test_without_statistics_every_table_gets_the_same_fraction():
    tables = [CacheTableSpec(name="a", rows=1000, dim=16), CacheTableSpec(name="b", rows=4000, dim=16)]
    plan = plan_cache(tables, budget_bytes=200_000)
    assert plan.slots["b"] == pytest.approx(4 * plan.slots["a"], rel=0.02)


def test_a_budget_below_the_index_says_what_it_needs():
    tables = [CacheTableSpec(name="a", rows=10_000, dim=16)]
    with pytest.raises(PlanInfeasibleError, match="cannot hold the index of 1 tables") as err:
        plan_cache(tables, budget_bytes=1000)
    assert err.value.needed_bytes == 10_000 * INDEX_BYTES_PER_ROW + tables[0].slot_bytes
