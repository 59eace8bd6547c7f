"""The shared frequency policy (tightfit.policy.frequency) and the expert cache's rules (tightfit.policy.experts).

Hit counts are checked against an exhaustive search over every cache state on small traces, and against
`belady_hits` on hypothesis-drawn traces with hints, right or wrong.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit.policy import ExpertCache, FrequencySketch, belady_hits, mix_hash

_M32 = 0xFFFFFFFF


def _mix_reference(k: int) -> int:
    """The hash written out on Python ints (exact: every product below stays under 2**63)."""
    k = (k ^ (k >> 32)) & _M32
    k = (((k >> 16) ^ k) * 0x45D9F3B) & _M32
    k = (((k >> 16) ^ k) * 0x45D9F3B) & _M32
    return (k >> 16) ^ k


@given(st.lists(st.integers(0, 2**62), min_size=1, max_size=50))
def test_mix_hash_matches_its_definition(keys):
    assert mix_hash(torch.tensor(keys)).tolist() == [_mix_reference(k) for k in keys]


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 50)), min_size=1, max_size=60),
       st.integers(1, 64))
def test_sketch_never_underestimates(uses, slots):
    sketch = FrequencySketch(slots)
    truth = Counter()
    for key, n in uses:
        sketch.add(torch.tensor([key]), torch.tensor([n]))
        truth[key] += n
    keys = sorted(truth)
    est = sketch.estimate(torch.tensor(keys)).tolist()
    assert all(e >= truth[k] for e, k in zip(est, keys))


def test_embedding_cache_uses_the_core_sketch():
    sketch = pytest.importorskip("torchrec_cache.sketch")
    layout = pytest.importorskip("torchrec_cache.layout")
    assert sketch.FrequencySketch is FrequencySketch and layout.mix_hash is mix_hash


def _optimal_hits(trace: list[list[int]], capacity: int) -> int:
    """Every cache state after every step: a cache keeps at most `capacity` of what it held and what the step read."""
    best = {frozenset(): 0}
    for step in trace:
        need = set(step)
        nxt: dict[frozenset, int] = {}
        for held, hits in best.items():
            gained = hits + len(need & held)
            pool = sorted(held | need)
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    key = frozenset(keep)
                    nxt[key] = max(nxt.get(key, -1), gained)
        best = nxt
    return max(best.values())


small_traces = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(small_traces, st.integers(0, 3))
def test_belady_hits_is_the_optimum(trace, capacity):
    assert belady_hits(trace, capacity) == _optimal_hits(trace, capacity)


hinted_traces = st.lists(
    st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4),  # the step's experts
              st.lists(st.integers(0, 7), max_size=3),  # a hint, right or wrong
              st.integers(0, 2)),  # for which later lookup
    min_size=1, max_size=40)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hinted_traces, st.integers(0, 5))
def test_hits_never_exceed_belady(steps, capacity):
    cache = ExpertCache(num_layers=1, num_experts=8, slots=capacity)
    for experts, hint, ahead in steps:
        cache.prefetch(0, hint, steps_ahead=ahead)
        result = cache.lookup(0, experts)
        assert len(cache.resident(0)) <= capacity
        assert sorted(result.hits + result.ready + result.loads + result.streamed) == sorted(set(experts))
    assert cache.stats().hits <= belady_hits([e for e, _, _ in steps], capacity)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=6), min_size=1, max_size=30), st.integers(16, 20))
def test_room_for_every_expert_only_misses_cold(trace, capacity):
    cache = ExpertCache(num_layers=1, num_experts=16, slots=capacity)
    for step in trace:
        cache.lookup(0, step)
    stats = cache.stats()
    distinct = len({e for step in trace for e in step})
    assert (stats.loads, stats.streamed, stats.evictions) == (distinct, 0, 0)
    assert stats.hits == stats.uses - distinct == belady_hits(trace, capacity)


def _routing(skew: float, seed: int, experts: int = 64, k: int = 4, steps: int = 600) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    p = np.arange(1, experts + 1, dtype=float) ** -skew
    perm = rng.permutation(experts)  # the hot experts are not the low ids
    return [perm[rng.choice(experts, size=k, replace=False, p=p / p.sum())].tolist() for _ in range(steps)]


def _hit_rate(trace: list[list[int]], slots: int) -> float:
    cache = ExpertCache(num_layers=1, num_experts=64, slots=slots)
    for step in trace:
        cache.lookup(0, step)
    return cache.stats().hit_rate


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_skewed_routing_hits_far_more_than_uniform(seed):
    skewed, uniform = _routing(1.0, seed), _routing(0.0, seed)
    assert _hit_rate(skewed, 16) > _hit_rate(uniform, 16) + 0.2
    uses = sum(len(s) for s in skewed)
    assert _hit_rate(skewed, 16) >= 0.75 * belady_hits(skewed, 16) / uses


def test_one_off_expert_does_not_push_out_a_hot_one():
    cache = ExpertCache(num_layers=2, num_experts=8, slots=1)
    for _ in range(3):
        cache.lookup(1, [5])
    step = cache.lookup(1, [2])
    assert (step.streamed, step.evicted, cache.resident(1)) == ((2,), (), (5,))
    assert cache.resident(0) == ()  # layers are separate


def _run(hinted: bool) -> tuple[bool, tuple[int, ...]]:
    """Expert 0 (used 3 times) is needed again after five steps of expert 7, which grows hotter than it."""
    cache = ExpertCache(num_layers=1, num_experts=8, slots=1)
    for _ in range(3):
        cache.lookup(0, [0])
    if hinted:
        cache.prefetch(0, [0], steps_ahead=5)
    for _ in range(5):
        cache.lookup(0, [7])
    return cache.lookup(0, [0]).hits == (0,), cache.resident(0)


def test_a_hinted_expert_stays_until_its_use():
    assert _run(hinted=True) == (True, (0,))
    assert _run(hinted=False) == (False, (7,))  # without the hint the hotter expert takes the slot


def test_inside_the_window_the_expert_needed_sooner_wins():
    cache = ExpertCache(num_layers=1, num_experts=8, slots=1)
    cache.lookup(0, [0])
    cache.prefetch(0, [0], steps_ahead=2)
    late = cache.prefetch(0, [1], steps_ahead=3)
    assert (late.loads, cache.resident(0)) == ((), (0,))  # needed after 0: not read ahead
    soon = cache.prefetch(0, [2], steps_ahead=0)
    assert (soon.loads, soon.evicted, cache.resident(0)) == ((2,), (0,), (2,))
    step = cache.lookup(0, [2])
    assert (step.ready, step.hits) == ((2,), ())  # read ahead: served, but not a hit
    assert cache.lookup(0, [2]).hits == (2,)


def test_a_wrong_hint_expires_after_its_step():
    cache = ExpertCache(num_layers=1, num_experts=8, slots=1)
    cache.lookup(0, [0])
    cache.prefetch(0, [0], steps_ahead=0)
    cache.lookup(0, [3])  # the hint was wrong: 0 is not needed now
    cache.lookup(0, [3])
    assert cache.resident(0) == (3,)  # 3 now counts more than 0, and nothing protects 0 any more


@pytest.mark.parametrize(("make", "match"), [
    (lambda: ExpertCache(num_layers=0, num_experts=8, slots=1), r"num_layers=0 must be a whole number >= 1"),
    (lambda: ExpertCache(num_layers=2, num_experts=8, slots=[1]), r"slots has 1 entries for 2 layers"),
    (lambda: ExpertCache(num_layers=1, num_experts=8, slots=-1), r"slots\[0\]=-1 must be a whole number >= 0"),
    (lambda: ExpertCache(num_layers=1, num_experts=8, slots=1).lookup(1, [0]), r"layer=1 must be .*<= 0"),
    (lambda: ExpertCache(num_layers=1, num_experts=8, slots=1).lookup(0, [8]), r"expert=8 .*\[0, 8\)"),
    (lambda: ExpertCache(num_layers=1, num_experts=8, slots=1).prefetch(0, [1], steps_ahead=-1), r"steps_ahead=-1"),
    (lambda: belady_hits([[1]], capacity=-2), r"capacity=-2 must be a whole number >= 0"),
])
def test_bad_arguments_are_refused_in_one_line(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make()
    assert "\n" not in str(err.value)
