"""The serving planner (core/planner/serving.py): the whole serving process fitted line by line, knobs that only fall
as memory falls, and one refusal naming the floor below it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.serving import ServingPlan, StageShape, plan_serving
from tightfit.profiler.types import DiskProfile
from tightfit.units import format_bytes

MiB = 2**20
DISK = DiskProfile(path="/nvme", free_bytes=10**12, read_fit=(1e-4, 1e9))


@st.composite
def stages(draw):
    """One to three pipeline stages of a model: layers of a few MiB, packed copies on some, caches per token."""
    n_stages = draw(st.integers(1, 3))
    layer = draw(st.integers(MiB // 4, 64 * MiB))
    tp = draw(st.integers(1, 2))
    out = []
    for _ in range(n_stages):
        n = draw(st.integers(1, 8))
        packed = draw(st.booleans())
        out.append(StageShape(layer_bytes=(layer,) * n, resident_bytes=draw(st.integers(0, 64 * MiB)),
                              kept_extra_bytes=(layer * 9 // 10,) * n if packed else (),
                              read_buffer_bytes=draw(st.integers(0, 8 * MiB)),
                              read_work_bytes=draw(st.integers(0, 8 * MiB)),
                              kv_bytes_per_token=draw(st.integers(0, 64 * 1024)),
                              activation_bytes_per_token=draw(st.integers(0, 256 * 1024)),
                              logits_bytes_per_row=draw(st.integers(0, 512 * 1024)), ranks=tp))
    return out


knobs = st.fixed_dictionaries({"lookahead": st.integers(0, 4), "max_batch_tokens": st.integers(1, 16384),
                               "kv_cache_tokens": st.integers(16, 65536), "max_running": st.integers(1, 512),
                               "worker_bytes": st.integers(0, 512 * MiB)})
budgets = st.integers(0, 16 * 1024).map(lambda m: m * MiB)


def _plan(shapes, free, k, **extra):
    return plan_serving(shapes, free_bytes=free, disk=DISK, **k, **extra)


def _check_lines(plan: ServingPlan, shapes: list[StageShape], k: dict) -> None:
    for s, lines, pool in zip(shapes, plan.lines, plan.pools):
        named = dict(lines)
        items = [b for w, b in lines if w not in ("total", "this rank's share of the limit")]
        assert named["total"] == sum(items) <= named["this rank's share of the limit"]
        assert named["this rank's share of the limit"] == plan.free_bytes // plan.ranks
        kept = [i for i in range(len(s.layer_bytes)) if i not in pool.disk_layers]
        slots = min(plan.lookahead + 1, len(pool.disk_layers)) if pool.disk_layers else 0
        weights = (s.resident_bytes + sum(s.layer_bytes[i] + (s.kept_extra_bytes[i] if s.kept_extra_bytes else 0)
                                          for i in kept) + slots * max(s.layer_bytes)
                   + (s.read_buffer_bytes + s.read_work_bytes if pool.disk_layers else 0))
        planned = weights + plan.kv_cache_tokens * s.kv_bytes_per_token + \
            s.activation_bytes(plan.max_batch_tokens, k["max_running"]) + k["worker_bytes"]
        assert planned <= named["total"]  # every line counted, and the lines are what the plan holds
        assert plan.kv_cache_tokens >= min(plan.max_batch_tokens, k["kv_cache_tokens"])  # at least one step fits


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=stages(), k=knobs, free=budgets)
def test_a_plan_it_returns_fits_its_budget_line_by_line(shapes, k, free):
    try:
        plan = _plan(shapes, free, k)
    except PlanInfeasibleError as err:
        assert err.needed_bytes > free
        assert format_bytes(err.needed_bytes) in str(err) and "cheapest change" in str(err)
        assert "\n" not in str(err)
        return
    _check_lines(plan, shapes, k)
    assert plan.lookahead <= k["lookahead"] and plan.max_batch_tokens <= k["max_batch_tokens"]
    assert ServingPlan.from_json(plan.to_json()) == plan


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=stages(), k=knobs, free=budgets, cut=st.floats(0.05, 0.95))
def test_lowering_the_budget_never_raises_lookahead_slots_or_the_token_budget(shapes, k, free, cut):
    try:
        high = _plan(shapes, free, k)
    except PlanInfeasibleError:
        return
    try:
        low = _plan(shapes, int(free * cut), k)
    except PlanInfeasibleError:
        return
    assert low.lookahead <= high.lookahead
    assert low.max_batch_tokens <= high.max_batch_tokens
    for lo, hi in zip(low.pools, high.pools):
        assert lo.device_bytes <= hi.device_bytes  # the weights held (kept layers, slots) never grow as it shrinks
        if lo.lookahead == hi.lookahead:  # a slot given up may keep a layer: layers leave only at the same slots
            assert len(lo.disk_layers) >= len(hi.disk_layers)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=stages(), k=knobs)
def test_below_the_floor_it_refuses_naming_the_floor_and_the_floor_fits(shapes, k):
    with pytest.raises(PlanInfeasibleError) as err:
        _plan(shapes, 0, k)
    floor = err.value.needed_bytes
    assert format_bytes(floor) in str(err.value)
    plan = _plan(shapes, floor + sum(s.ranks for s in shapes), k)  # the floor (rounded to whole bytes per rank)
    _check_lines(plan, shapes, k)
    with pytest.raises(PlanInfeasibleError):
        _plan(shapes, floor * 99 // 100, k)


def test_the_token_budget_and_kv_cache_are_kept_where_the_user_gave_them():
    shape = StageShape(layer_bytes=(8 * MiB,) * 4, resident_bytes=4 * MiB, kv_bytes_per_token=1024,
                       activation_bytes_per_token=4096)
    plan = plan_serving([shape], free_bytes=170 * MiB, worker_bytes=100 * MiB, disk=DISK, max_batch_tokens=4096,
                        fix_batch_tokens=True, kv_cache_tokens=2048, fix_kv_tokens=True)
    assert (plan.max_batch_tokens, plan.kv_cache_tokens) == (4096, 2048)
    with pytest.raises(PlanInfeasibleError, match="a smaller --max-batch-tokens"):
        plan_serving([shape], free_bytes=140 * MiB, worker_bytes=100 * MiB, disk=DISK, max_batch_tokens=4096,
                     fix_batch_tokens=True)


def test_a_users_weights_budget_is_checked_against_the_limit_and_lookahead_chosen_within_it():
    shape = StageShape(layer_bytes=(8 * MiB,) * 4, resident_bytes=4 * MiB, read_buffer_bytes=MiB)
    # 3 slots (lookahead 2) would need 29 MiB: the planner fetches fewer ahead instead of refusing.
    plan = plan_serving([shape], free_bytes=1024 * MiB, worker_bytes=100 * MiB, disk=DISK, weight_budget_bytes=22 * MiB)
    assert plan.lookahead == 1 and plan.pools[0].device_bytes <= 22 * MiB
    with pytest.raises(PlanInfeasibleError, match=r"--memory-budget 2.00 MiB is too small: .* needs at least 13.00 MiB"):
        plan_serving([shape], free_bytes=1024 * MiB, worker_bytes=100 * MiB, disk=DISK, weight_budget_bytes=2 * MiB)
    with pytest.raises(PlanInfeasibleError, match=r"--memory-budget 900.00 MiB .* is more than the .*; lower it"):
        plan_serving([shape], free_bytes=1024 * MiB, worker_bytes=100 * MiB, disk=DISK,
                     weight_budget_bytes=900 * MiB)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=stages(), k=knobs, free=budgets, user=st.integers(1, 2048).map(lambda m: m * MiB))
def test_a_users_weights_budget_is_given_whole_and_the_token_budget_takes_the_rest(shapes, k, free, user):
    """The weights budget a user gives is the pool's, whole, wherever some token budget leaves room for it: the
    planner lowers the token budget first, not the budget (a plan made for less than the user gave)."""
    try:
        plan = _plan(shapes, free, k, weight_budget_bytes=user)
    except PlanInfeasibleError:
        return
    _check_lines(plan, shapes, k)
    assert plan.weight_budgets == (user,) * len(shapes)
    for pool in plan.pools:
        assert pool.device_bytes + pool.host_bytes <= user


def test_streaming_keeps_a_token_budget_beside_a_users_weights_budget():
    """A model of 41 layers streamed under a weights budget that holds two prefetch slots: the rest of the limit
    goes to the token budget and KV cache (each step reads every layer once: a small token budget multiplies the
    reads of a prompt), not left unused beside a budget the layers cannot exceed."""
    layer = 93 * MiB
    shape = StageShape(layer_bytes=(layer,) * 41, resident_bytes=72 * MiB, read_buffer_bytes=48 * MiB,
                       read_work_bytes=48 * MiB, kv_bytes_per_token=80 * 1024, activation_bytes_per_token=88 * 1024,
                       logits_bytes_per_row=48 * 1024)
    plan = plan_serving([shape], free_bytes=1126 * MiB, worker_bytes=221 * MiB, disk=DISK,
                        weight_budget_bytes=384 * MiB, max_batch_tokens=4096, max_running=64)
    assert plan.weight_budgets == (384 * MiB,) and plan.lookahead == 1  # three slots do not fit 384 MiB
    assert plan.max_batch_tokens >= 1024 and len(plan.pools[0].disk_layers) == 41


def test_without_a_disk_tier_every_layer_stays_and_the_refusal_says_so():
    shape = StageShape(layer_bytes=(8 * MiB,) * 4, resident_bytes=4 * MiB)
    assert plan_serving([shape], free_bytes=512 * MiB, worker_bytes=100 * MiB).pools[0].disk_layers == ()
    with pytest.raises(PlanInfeasibleError, match="needs .* but free memory leaves 120.00 MiB"):
        plan_serving([shape], free_bytes=120 * MiB, worker_bytes=100 * MiB)


@pytest.mark.parametrize("bad, match", [
    (dict(free_bytes=-1), "free_bytes"),
    (dict(lookahead=-1), "lookahead"),
    (dict(max_batch_tokens=0), "max_batch_tokens"),
    (dict(slack_fraction=1.5), "slack_fraction"),
])
def test_bad_numbers_are_refused_naming_them(bad, match):
    shape = StageShape(layer_bytes=(MiB,), resident_bytes=0)
    with pytest.raises(PlanError, match=match):
        plan_serving([shape], **{"free_bytes": 10**9, "worker_bytes": 0, **bad})
    with pytest.raises(PlanError, match="kept_extra_bytes has 2 entries for 1 layers"):
        StageShape(layer_bytes=(MiB,), resident_bytes=0, kept_extra_bytes=(1, 2))
