"""State tier 4 of the Elixir planner (``Tier.DISK_GRADS``): gradients on disk between backward and the step,
priced by hand on the two-block model of :mod:`tests.core.test_planner_elixir_disk`, and chosen by the search
only where the host budget needs it.

Tier 4, layers.1 (E = 1e8 per rank, 2 ranks of a node share the disk, m = 4, o = 8): the host keeps no state of
the unit; while it runs it holds two parameter shards (the unit's and the one read ahead) and two gradient
shards (the unit's, and the one still being written behind it): 2 * (4e8 + 4e8), plus the staging area. The disk
keeps E * (m + o + m) = 1.6e9 B. The step reads m + o + m (1.6e9 B: 1e-3 + 1.6e9 * 2 / 1e9 = 3.201 s) and writes
m + o back (1.2e9 B: 1e-3 + 1.2e9 * 2 / 5e8 = 4.801 s): io 8.002 s. Backward writes the gradient shard, 4e8 B:
1e-3 + 4e8 * 2 / 5e8 = 1.601 s on the disk, beside the parameter reads 2 * (1e-3 + 4e8 * 2 / 1e9) = 1.602 s.
"""

from __future__ import annotations

import pytest

from tests.core.test_planner_elixir_disk import (
    EXACT,
    HOST,
    PARAMS_DISK,
    STAGING,
    _cluster,
    _estimate,
    _old_form,
    _profile,
)
from tightfit.planner.elixir import (
    ElixirConstraints,
    ElixirPlan,
    PlanInfeasibleError,
    Tier,
    UnitPlan,
    estimate,
    search,
)

GRADS_DISK = dict(tier=Tier.DISK_GRADS)
FOUR = (10**8,) * 4  # four blocks: a rank owns E = 5e7 of each


def test_grads_on_disk_unit_by_hand_gpu():
    plan = _estimate({}, GRADS_DISK)
    u0, u1 = plan.units
    assert (u1.device_bytes, u1.host_bytes, u1.disk_bytes) == (0, 0, 16 * 10**8)
    assert (u1.tier.state_on, u1.tier.params_on, u1.tier.grads_on, u1.tier) == ("disk", "disk", "disk", 4)
    assert u0.tier.grads_on == "device"
    assert plan.grad_disk_units == (1,) and plan.param_disk_units == (1,) and plan.disk_units == (1,)
    assert plan.host_bytes_per_rank == STAGING + 4 * 10**8 + 4 * 10**8  # its shards and gradients: one unit on disk
    assert plan.disk_bytes_per_rank == 16 * 10**8
    assert plan.breakdown.disk_io_s == pytest.approx(8.002, rel=1e-12)
    assert plan.breakdown.optimizer_s == pytest.approx(0.05 + 8.002, rel=1e-12)
    assert plan.breakdown.param_io_s == pytest.approx(1.602 + 1.601, rel=1e-12)
    tier3 = _estimate({}, PARAMS_DISK)
    assert plan.step_time_s >= tier3.step_time_s + (8.002 - 7.202) - 1e-9  # the gradients' extra read, at least
    assert plan.grads_accumulate_on_host  # no host budget given: the sums fit
    text = plan.explain()
    assert "grads wait on" in text and "gradients on disk from backward to the step" in text
    assert ElixirPlan.from_json(plan.to_json()) == plan
    assert any("DISK_GRADS" in gap for gap in plan.deepspeed_gaps())  # ZeRO-Infinity cannot say it


def test_grads_disk_needs_params_disk():
    # Only an old plan file can say it (one tier per unit cannot): refused.
    with pytest.raises(ValueError, match=r"\(True, True, False, True\), but each flag needs the one before it"):
        ElixirPlan.from_json(_old_form(_estimate({}, HOST), (False,) * 4, (True, True, False, True)))


def _search4(**kw):
    cons = ElixirConstraints(**{**EXACT, "exhaustive": False, **kw.pop("constraints", {})})
    return search(_profile(FOUR), _cluster(), optimizer="adamw", precision="32-true", constraints=cons, **kw)


def test_search_puts_gradients_on_disk_only_where_the_host_needs_it():
    # Device budget: the peak of every unit offloaded (the device holds no state).
    units = [UnitPlan(blocks=(f"layers.{i}",), **HOST) for i in range(4)]
    budget = estimate(_profile(FOUR), _cluster(), units, optimizer="adamw", precision="32-true",
                      constraints=ElixirConstraints(**EXACT)).peak_bytes
    # Tier 3 everywhere needs 4 * 2e8 of gradients + 2 * 2e8 of parameter shards + staging = 1.2e9 + staging;
    # tier 4 everywhere 2 * (2e8 + 2e8) + staging = 8e8 + staging.
    tight = 10**9 + STAGING
    plan = _search4(memory_budget=budget, host_budget=tight)
    assert plan.grad_disk_units and plan.host_bytes_per_rank <= tight
    # Accumulating every tier-4 gradient in RAM would not fit beside that: the plan says read-add-write.
    assert not plan.grads_accumulate_on_host
    assert "each micro-batch reads, adds and writes" in plan.explain()
    with pytest.raises(PlanInfeasibleError) as err:
        _search4(memory_budget=budget, host_budget=tight, constraints={"allow_disk_grads": False})
    assert err.value.tier == "host"
    # With the host to spare the same search keeps today's plans: no gradient on disk.
    roomy = _search4(memory_budget=budget, host_budget=10**12)
    assert not roomy.grad_disk_units and roomy.grads_accumulate_on_host
