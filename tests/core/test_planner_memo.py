"""The planners' memo of budget-independent work: Elixir's greedy pool is computed once per profile and reused at
every device budget, and a reused pool gives the plan a fresh search gives (same units, times, runner-ups, errors).
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.test_planner_elixir import NO_RESERVE, device, random_instance
from tightfit.planner.cost import CollectiveTimes
from tightfit.planner.elixir import ElixirConstraints, ElixirPlan, PlanInfeasibleError, frontier, search
from tightfit.planner.elixir.space import pool_memo
from tightfit.planner.memo import LruMemo, frozen
from tightfit.profiler.types import ClusterSpec

GREEDY = dataclasses.replace(NO_RESERVE, exhaustive=False)


def _answer(prof, cluster, budget: int, cons: ElixirConstraints, host: int | None) -> ElixirPlan | str:
    """The plan (its search time zeroed: the one field a reused pool changes) or the infeasibility message."""
    try:
        plan = search(prof, cluster, memory_budget=budget, constraints=cons, host_budget=host)
    except PlanInfeasibleError as exc:
        return str(exc)
    return dataclasses.replace(plan, search_seconds=0.0)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), fracs=st.lists(st.floats(-0.2, 1.2), min_size=2, max_size=6),
       host_frac=st.sampled_from([None, 0.5, 2.0]))
def test_a_reused_pool_gives_the_plan_a_fresh_search_gives(seed, fracs, host_frac):
    rng = random.Random(seed)
    prof, cluster = random_instance(rng, rng.randint(3, 7))
    plans = frontier(prof, cluster, constraints=GREEDY)
    low, top = plans[0].peak_bytes, plans[-1].peak_bytes
    budgets = [max(1, int(low + f * (top - low))) for f in fracs]
    # A host budget a fraction of what the fastest plan offloads at most makes the host bind for some budgets.
    host = None if host_frac is None else max(1, int(host_frac * max(p.host_bytes_per_rank for p in plans)))
    fresh = []
    for b in budgets:
        pool_memo.clear()
        fresh.append(_answer(prof, cluster, b, GREEDY, host))
    assert pool_memo.info().hits == 0
    pool_memo.clear()
    reused = [_answer(prof, cluster, b, GREEDY, host) for b in budgets]
    assert pool_memo.info().misses == 1 and pool_memo.info().hits >= len(budgets) - 1
    assert reused == fresh


def test_the_pool_is_computed_once_per_profile_across_budgets():
    rng = random.Random(7)
    (prof, cluster), (other, other_cluster) = random_instance(rng, 9), random_instance(rng, 9)
    pool_memo.clear()
    plans = frontier(prof, cluster, constraints=GREEDY)
    low, top = plans[0].peak_bytes, plans[-1].peak_bytes
    budgets = [int(low + (top - low) * k / 12) for k in range(13)]
    times = [search(prof, cluster, memory_budget=b, constraints=GREEDY).step_time_s for b in budgets]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    assert pool_memo.info().misses == 1 and pool_memo.info().hits == len(budgets)
    search(other, other_cluster, memory_budget=10**15, constraints=GREEDY)  # another profile: its own pool
    assert pool_memo.info().misses == 2
    search(prof, cluster, memory_budget=budgets[5], constraints=GREEDY, host_budget=10**13)  # another host budget
    assert pool_memo.info().misses == 3


def test_the_pool_memo_tells_clusters_apart_by_their_collective_tables():
    """Two clusters that differ only in collective bandwidth price every plan differently: each its own pool."""
    prof, _ = random_instance(random.Random(3), 8)
    fast, slow = (ClusterSpec.uniform(device(bus=bus), 4) for bus in (200e9, 2e9))
    budget = frontier(prof, fast, constraints=GREEDY)[-1].peak_bytes // 2
    pool_memo.clear()
    fresh_slow = _answer(prof, slow, budget, GREEDY, None)
    pool_memo.clear()
    _answer(prof, fast, budget, GREEDY, None)
    assert _answer(prof, slow, budget, GREEDY, None) == fresh_slow
    assert pool_memo.info().misses == 2


def test_collective_times_key_on_their_inputs_by_value():
    dev = device(bus=50e9)
    a, b = CollectiveTimes(dev, 4), CollectiveTimes(dataclasses.replace(dev), 4)
    assert frozen(a) == frozen(b) and hash(frozen(a)) == hash(frozen(b))
    assert frozen(a) != frozen(CollectiveTimes(dev, 8))
    assert frozen(a) != frozen(CollectiveTimes(device(bus=60e9), 4))
    assert a("all_gather", 1 << 24) == b("all_gather", 1 << 24) > 0


def test_lru_memo_drops_the_least_recently_used():
    memo = LruMemo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # "a" is now the most recent
    memo.put("c", 3)
    assert memo.get("b") is None and memo.get("a") == 1 and memo.get("c") == 3
    assert memo.info() == (3, 1, 2)
    memo.clear()
    assert memo.info() == (0, 0, 0)


@pytest.mark.parametrize("value", [{"x": [1, 2.5]}, (1, {"y": (3,)}), device()])
def test_frozen_is_hashable_and_equal_for_equal_inputs(value):
    copy = copy_module.deepcopy(value)
    assert hash(frozen(value)) == hash(frozen(copy)) and frozen(value) == frozen(copy)
