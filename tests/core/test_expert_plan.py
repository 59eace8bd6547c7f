"""The expert placement planner (tightfit.planner.experts): budgets, monotonicity, hot experts first, prices."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.experts import ExpertPlan, MoELayerShape, plan_experts
from tightfit.profiler.experts import ExpertPopularity
from tightfit.profiler.types import DiskProfile

DISK = DiskProfile(path="/nvme", free_bytes=10**12, read_fit=(1e-4, 2e3))


@st.composite
def problems(draw, equal_sizes: bool = False):
    n_layers, n_experts = draw(st.integers(1, 3)), draw(st.integers(2, 6))
    k = draw(st.integers(1, min(3, n_experts)))
    size = draw(st.integers(1, 100))
    layers = [MoELayerShape(dense_bytes=draw(st.integers(0, 200)),
                            expert_bytes=(size,) * n_experts if equal_sizes else
                            tuple(draw(st.lists(st.integers(1, 100), min_size=n_experts, max_size=n_experts))))
              for _ in range(n_layers)]
    counts = draw(st.none() | st.lists(st.lists(st.integers(0, 1000), min_size=n_experts, max_size=n_experts),
                                       min_size=n_layers, max_size=n_layers))
    pop = None if counts is None else ExpertPopularity(num_layers=n_layers, num_experts=n_experts,
                                                       experts_per_token=k, counts=counts)
    unified = draw(st.booleans())
    kwargs = dict(experts_per_token=k, popularity=pop, unified=unified, disk=DISK,
                  resident_bytes=draw(st.integers(0, 100)), device_bytes_per_s=draw(st.floats(1e2, 1e5)),
                  token_seconds=draw(st.floats(0, 1e-2)), cache_slots=draw(st.none() | st.integers(1, 3)))
    if not unified:
        kwargs["host_bytes_per_s"] = draw(st.floats(1e2, 1e5))
    return layers, kwargs


def _floor(layers, kw) -> int:
    """Dense parts, what always stays, and every layer's slots with every expert streamed."""
    slots = kw["cache_slots"] or kw["experts_per_token"]
    return kw["resident_bytes"] + sum(s.dense_bytes + min(slots, len(s.expert_bytes)) * max(s.expert_bytes)
                                      for s in layers)


def _held(layers, kw, plan: ExpertPlan) -> tuple[int, int]:
    """Device and host bytes recounted from the placement alone."""
    slots = kw["cache_slots"] or kw["experts_per_token"]
    device = kw["resident_bytes"] + sum(s.dense_bytes for s in layers)
    host, staging = 0, 0
    for s, tiers in zip(layers, plan.placement):
        off = [b for b, t in zip(s.expert_bytes, tiers) if t != "device"]
        on_disk = [b for b, t in zip(s.expert_bytes, tiers) if t == "disk"]
        device += sum(b for b, t in zip(s.expert_bytes, tiers) if t == "device") + min(slots, len(off)) * max(off,
                                                                                                             default=0)
        host += sum(b for b, t in zip(s.expert_bytes, tiers) if t == "host")
        staging = max(staging, min(slots, len(on_disk)) * max(on_disk, default=0))
    return device, 0 if kw["unified"] else host + staging


def _probs(layers, kw):
    pop, k = kw["popularity"], kw["experts_per_token"]
    return [pop.token_probabilities(i) if pop else (k / len(s.expert_bytes),) * len(s.expert_bytes)
            for i, s in enumerate(layers)]


@settings(max_examples=150, deadline=None)
@given(problems(), st.integers(0, 3000), st.none() | st.integers(0, 2000))
def test_a_plan_never_exceeds_its_budgets(problem, extra, host_budget):
    layers, kw = problem
    budget = _floor(layers, kw) + extra
    try:
        plan = plan_experts(layers, budget_bytes=budget, host_budget_bytes=None if kw["unified"] else host_budget, **kw)
    except PlanInfeasibleError as err:
        assert err.tier == "host" and "\n" not in str(err)  # the device floor fits by construction
        return
    device, host = _held(layers, kw, plan)
    assert (plan.device_bytes, plan.host_bytes) == (device, host)
    assert device <= budget and (host_budget is None or kw["unified"] or host <= host_budget)
    assert math.isclose(sum(plan.served), 1.0)
    assert ExpertPlan.from_json(plan.to_json()) == plan


@settings(max_examples=150, deadline=None)
@given(problems(), st.integers(0, 2000), st.integers(0, 2000), st.none() | st.integers(0, 2000), st.integers(0, 500))
def test_more_memory_never_slows_nor_holds_fewer(problem, extra, more, host_budget, more_host):
    layers, kw = problem
    budget = _floor(layers, kw) + extra
    hb = None if kw["unified"] else host_budget
    try:
        small = plan_experts(layers, budget_bytes=budget, host_budget_bytes=hb, **kw)
    except PlanInfeasibleError:
        return
    bigger = [plan_experts(layers, budget_bytes=budget + more, host_budget_bytes=hb, **kw)]
    if hb is not None:
        bigger.append(plan_experts(layers, budget_bytes=budget, host_budget_bytes=hb + more_host, **kw))
    for big in bigger:
        assert big.count("device") >= small.count("device")
        assert big.count("disk") <= small.count("disk")
        for fast, slow in zip(big.tokens_per_s, small.tokens_per_s):
            assert fast >= slow * (1 - 1e-9)


@settings(max_examples=100, deadline=None)
@given(problems(equal_sizes=True), st.integers(0, 3000))
def test_hot_experts_live_in_the_fastest_tier(problem, extra):
    layers, kw = problem
    plan = plan_experts(layers, budget_bytes=_floor(layers, kw) + extra, **kw)
    probs = _probs(layers, kw)
    by_tier = {t: [p for ps, tiers in zip(probs, plan.placement) for p, tt in zip(ps, tiers) if tt == t]
               for t in ("device", "host", "disk")}
    assert min(by_tier["device"], default=1) >= max(by_tier["host"] + by_tier["disk"], default=0)
    assert min(by_tier["host"], default=1) >= max(by_tier["disk"], default=0)


def test_zipf_popularity_keeps_the_hottest_experts_on_the_device():
    counts = [[0] * 16 for _ in range(2)]
    hot = [[3, 11, 7, 0], [5, 9, 2, 14]]
    for layer in range(2):
        for rank, e in enumerate(hot[layer]):
            counts[layer][e] = 1000 // (rank + 1)
        for e in range(16):
            counts[layer][e] = counts[layer][e] or 10  # a cold tail
    pop = ExpertPopularity(num_layers=2, num_experts=16, experts_per_token=2, counts=counts)
    layers = [MoELayerShape(dense_bytes=1000, expert_bytes=(100,) * 16)] * 2
    # dense 2000 + 8 experts + 2 layers x 2 slots
    plan = plan_experts(layers, experts_per_token=2, popularity=pop, budget_bytes=2000 + 800 + 400,
                        device_bytes_per_s=1e6, unified=True, disk=DISK)
    assert [sorted(e) for e in plan.experts_in("device")] == [sorted(h) for h in hot]
    uniform = plan_experts(layers, experts_per_token=2, budget_bytes=3200, device_bytes_per_s=1e6, unified=True,
                           disk=DISK)
    assert plan.served[0] > 2 * uniform.served[0]
    assert plan.tokens_per_s[0] > uniform.tokens_per_s[0] and plan.tokens_per_s[1] > uniform.tokens_per_s[1]


@settings(max_examples=100, deadline=None)
@given(problems(equal_sizes=True))
def test_below_the_floor_is_refused_naming_it(problem):
    layers, kw = problem
    floor = _floor(layers, kw)
    with pytest.raises(PlanInfeasibleError) as err:
        plan_experts(layers, budget_bytes=floor - 1, **kw)
    assert (err.value.needed_bytes, err.value.budget_bytes, err.value.tier) == (floor, floor - 1, "device")
    assert "\n" not in str(err.value) and "raise the budget" in str(err.value)


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from([1, 4, 32]))
def test_prices_follow_the_stated_model(problem, batch):
    """Everything on the device: a step reads the dense parts once and each touched expert once."""
    layers, kw = problem
    plan = plan_experts(layers, budget_bytes=10**9, batches=(batch,), **kw)
    assert plan.count("device") == sum(len(s.expert_bytes) for s in layers)
    touched = sum((1 - (1 - p) ** batch) * b for s, ps in zip(layers, _probs(layers, kw))
                  for p, b in zip(ps, s.expert_bytes))
    step = (sum(s.dense_bytes for s in layers) + touched) / kw["device_bytes_per_s"] + batch * kw["token_seconds"]
    assert plan.tokens_per_s[0] == pytest.approx(batch / step)
    assert plan.disk_bytes_per_token == (0.0,) and plan.served[0] == pytest.approx(1.0)


def test_disk_reads_per_token_and_the_cpu_explanation():
    layers = [MoELayerShape(dense_bytes=100, expert_bytes=(50,) * 4)] * 2
    plan = plan_experts(layers, experts_per_token=1, budget_bytes=400, device_bytes_per_s=1e4, unified=True,
                        disk=DISK)
    assert plan.experts_in("disk") == ((2, 3), (0, 1, 2, 3))
    assert plan.disk_bytes_per_token[0] == pytest.approx(6 * 0.25 * 50)  # six experts, each picked 1 in 4
    text = plan.explain()
    assert "memory (device and host are one)" in text and "disk: 6 experts" in text and "host:" not in text


def test_a_gpu_plan_without_disk_puts_the_rest_on_the_host_or_refuses():
    layers = [MoELayerShape(dense_bytes=100, expert_bytes=(50,) * 4)] * 2
    kw = dict(experts_per_token=1, budget_bytes=400, device_bytes_per_s=1e4, host_bytes_per_s=1e3)
    plan = plan_experts(layers, **kw)
    assert (plan.count("host"), plan.count("disk"), plan.host_bytes) == (6, 0, 300)
    assert "host: 300 B (no limit): 6 experts" in plan.explain()
    with pytest.raises(PlanInfeasibleError, match=r"host memory budget is 200 B, the 6 experts the device leaves "
                                                  r"needs 300 B \(100 B short\)") as err:
        plan_experts(layers, host_budget_bytes=200, **kw)
    assert err.value.tier == "host"
    staged = plan_experts(layers, host_budget_bytes=200, disk=DISK, **kw)  # 3 on the host + one slot of staging
    assert (staged.count("host"), staged.count("disk"), staged.host_bytes) == (3, 3, 200)


LAYERS = [MoELayerShape(dense_bytes=1, expert_bytes=(1, 1))]


@pytest.mark.parametrize(("call", "match"), [
    (lambda: MoELayerShape(dense_bytes=-1, expert_bytes=(1,)), r"dense_bytes=-1 must be a whole number >= 0"),
    (lambda: MoELayerShape(dense_bytes=1, expert_bytes=()), r"expert_bytes=\(\) must name at least one expert"),
    (lambda: plan_experts([], experts_per_token=1, budget_bytes=9, device_bytes_per_s=1.0, unified=True),
     r"layers must be a non-empty sequence"),
    (lambda: plan_experts(LAYERS, experts_per_token=3, budget_bytes=9, device_bytes_per_s=1.0, unified=True),
     r"experts_per_token=3 must be a whole number >= 1 and <= 2"),
    (lambda: plan_experts(LAYERS, experts_per_token=1, budget_bytes=9, device_bytes_per_s=0.0, unified=True),
     r"device_bytes_per_s=0.0 must be a finite number > 0"),
    (lambda: plan_experts(LAYERS, experts_per_token=1, budget_bytes=9, device_bytes_per_s=1.0),
     r"host_bytes_per_s=None .*or unified=True on a CPU machine"),
    (lambda: plan_experts(LAYERS, experts_per_token=1, budget_bytes=9, device_bytes_per_s=1.0, unified=True,
                          host_budget_bytes=5), r"host_budget_bytes=5 with unified=True"),
    (lambda: plan_experts(LAYERS, experts_per_token=1, budget_bytes=9, device_bytes_per_s=1.0, unified=True,
                          batches=(0,)), r"batch=0 must be a whole number >= 1"),
    (lambda: plan_experts(LAYERS, experts_per_token=1, budget_bytes=9, device_bytes_per_s=1.0, unified=True,
                          popularity=ExpertPopularity(num_layers=2, num_experts=2, experts_per_token=1)),
     r"the popularity profile .* is not of this model"),
])
def test_bad_arguments_are_refused_in_one_line(call, match):
    with pytest.raises(PlanError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_one_memory_without_a_disk_must_hold_every_expert():
    with pytest.raises(PlanInfeasibleError, match=r"needs at least 3 B in memory .*every expert, with no disk tier"):
        plan_experts(LAYERS, experts_per_token=1, budget_bytes=2, device_bytes_per_s=1.0, unified=True)
