"""The disk tier of the Elixir planner, pinned to numbers worked out by hand.

A unit in state tier 2 (``UnitPlan(tier=Tier.DISK)``) keeps its master parameters and gradients on the
host like an offloaded unit, and its optimizer state on disk between steps, read in and written back during
its host optimizer step. Priced from the disk profile: ``io = read + write`` of ``E * o`` bytes, each
``latency + bytes * sharers / bandwidth`` (the ranks of a node share the disk), ``opt = compute + io - f *
min(compute, io)`` with ``f`` the disk's measured compute overlap (1.0 when unmeasured).

Numbers: precision ``32-true`` (m = c = r = 4 bytes), AdamW (o = 8: a rank's state is 16 bytes per owned
element, 8 of them optimizer state), no fragmentation margin, no reserve. The disk: latency 1e-3 s, read 1e9 B/s,
write 5e8 B/s. Two blocks of P = 1e8 and 2e8 parameters on two ranks of one node (a rank owns E = 5e7 and
1e8), host AdamW 1e8 elements/s per host (5e7 per rank), device AdamW 1e9/s.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.core.test_planner_elixir import device as exact_device
from tests.core.test_planner_elixir_exact import block as exact_block
from tests.core.test_planner_elixir_exact import random_profile
from tightfit.planner.elixir import (
    ElixirConstraints,
    ElixirPlan,
    ElixirProblem,
    PlanInfeasibleError,
    Tier,
    UnitPlan,
    baseline,
    estimate,
    search,
)
from tightfit.planner.elixir.disk import (
    DISK_COPIES,
    DISK_STAGING_BYTES,
    disk_bytes_needed,
    disk_state_budget,
    slowest_disk,
)
from tightfit.planner.elixir.exact import exhaustive
from tightfit.planner.elixir.sim import MODES
from tightfit.planner.elixir.space import Evaluator, compositions
from tightfit.planner.errors import PlanError
from tightfit.profiler.types import (
    BlockProfile,
    ClusterSpec,
    DeviceProfile,
    DiskProfile,
    ModelProfile,
    ParamInfo,
)

NO_MARGIN = dict(fragmentation=0.0, reserved_bytes=0)
EXACT = dict(modes=("reshard",), prefetch_depths=(1,), allow_checkpointing=False, **NO_MARGIN)
STAGING = 2 * 64 * 2**20
DISK = DiskProfile(path="/nvme/tightfit", free_bytes=10**12, filesystem="ext4", read_fit=(1e-3, 1e9),
                   write_fit=(1e-3, 5e8))
BIG = (10**8, 2 * 10**8)   # parameters per block: state dwarfs the staging area
TINY = (1000, 2000)        # the staging area dwarfs everything


def _profile(numels: tuple[int, ...] = BIG) -> ModelProfile:
    params, blocks = [], []
    for i, n in enumerate(numels):
        name = f"layers.{i}"
        params.append(ParamInfo(name=f"{name}.weight", shape=(n,), dtype="float32", numel=n, bytes=4 * n, block=name))
        blocks.append(BlockProfile(
            name=name, type="Block", index=i, params=(f"{name}.weight",), param_numel=n, param_bytes=4 * n,
            fwd_flops=1e12, bwd_flops=2e12, saved_bytes=10**6, checkpoint_bytes=10**5, transient_bytes=10**5,
            output_bytes=10**5))
    return ModelProfile(
        model="disk-blocks", step="train", inputs={"x": [1, 1]}, params=tuple(params), blocks=tuple(blocks),
        forward_order=tuple(p.name for p in params), backward_order=tuple(p.name for p in reversed(params)),
        timeline=(), activation_peak_bytes=2 * 10**6, peak_bytes=0, fwd_flops=2e12, bwd_flops=4e12,
        param_dtype="float32")


def _device(*, cpu: bool = False, disk: DiskProfile | None = DISK, host_memory: int = 0) -> DeviceProfile:
    flat = {1 << 20: 1e9}
    return DeviceProfile(
        name="hand-cpu" if cpu else "hand", kind="cpu" if cpu else "cuda", memory_bytes=10**12, free_bytes=10**12,
        matmul_flops={"float32": 1e12}, h2d_bytes_per_s={} if cpu else {"pinned": 1e10},
        d2h_bytes_per_s={} if cpu else {"pinned": 1e10}, host_adam_elems_per_s=1e8,
        device_adam_elems_per_s=1e8 if cpu else 1e9,
        collective_bytes_per_s={"all_gather": flat, "reduce_scatter": flat}, host_memory_bytes=host_memory,
        unified_memory=cpu, source="datasheet:hand", disk=disk)


def _cluster(*, nodes: int = 1, **kw) -> ClusterSpec:
    return ClusterSpec.uniform(_device(**kw), 2, nodes=nodes)


def _units(t0: dict, t1: dict) -> list[UnitPlan]:
    return [UnitPlan(blocks=("layers.0",), **t0), UnitPlan(blocks=("layers.1",), **t1)]


HOST = dict(tier=Tier.HOST)
ON_DISK = dict(tier=Tier.DISK)


def _estimate(t0: dict, t1: dict, *, numels=BIG, cluster=None, **kw) -> ElixirPlan:
    cons = ElixirConstraints(**{**NO_MARGIN, **kw.pop("constraints", {})})
    return estimate(_profile(numels), cluster or _cluster(), _units(t0, t1), optimizer="adamw", precision="32-true",
                    constraints=cons, **kw)


# ------------------------------------------------------------------------------------------------ optimizer seconds
# Unit layers.1 on disk, 2 ranks of one node: compute = E / host rate per rank = 1e8 / 5e7 = 2 s;
# its optimizer state E * o = 8e8 B: read 1e-3 + 8e8 * 2 / 1e9 = 1.601 s, write 1e-3 + 8e8 * 2 / 5e8 = 3.201 s,
# io = 4.802 s. Resident layers.0: 5e7 / 1e9 = 0.05 s on the device.
@pytest.mark.parametrize(("overlap", "disk_opt"), [
    (-1.0, 4.802),               # unmeasured: full overlap, max(compute, io)
    (1.0, 4.802),
    (0.5, 2 + 4.802 - 0.5 * 2),  # 5.802
    (0.0, 2 + 4.802),            # serialised: 6.802
])
def test_disk_unit_optimizer_seconds_by_hand(overlap, disk_opt):
    cluster = _cluster(disk=dataclasses.replace(DISK, compute_overlap=overlap))
    plan = _estimate({}, ON_DISK, cluster=cluster)
    assert plan.breakdown.optimizer_s == pytest.approx(0.05 + disk_opt, rel=1e-12)
    assert plan.breakdown.disk_io_s == pytest.approx(4.802, rel=1e-12)
    host = _estimate({}, HOST, cluster=cluster)
    assert host.breakdown.optimizer_s == pytest.approx(0.05 + 2.0, rel=1e-12)
    assert host.breakdown.disk_io_s == 0.0
    # The disk unit's optimizer step adds exactly its extra seconds to the step (the schedule adds the steps last).
    assert plan.step_time_s - host.step_time_s == pytest.approx(disk_opt - 2.0, rel=1e-9)


def test_one_rank_per_node_streams_the_disk_alone():
    # Two nodes, one rank each: the host rate is the rank's own (1 s of compute) and the disk is not shared:
    # read 1e-3 + 0.8 = 0.801 s, write 1e-3 + 1.6 = 1.601 s, io = 2.402 s > compute: opt = io.
    plan = _estimate({}, ON_DISK, cluster=_cluster(nodes=2))
    assert plan.breakdown.disk_io_s == pytest.approx(2.402, rel=1e-12)
    assert plan.breakdown.optimizer_s == pytest.approx(0.05 + 2.402, rel=1e-12)


def test_the_slowest_disk_paces_the_step():
    fast = dataclasses.replace(DISK, read_fit=(1e-4, 4e9), write_fit=(1e-4, 2e9), compute_overlap=0.5)
    small = dataclasses.replace(DISK, path="/small", free_bytes=10**9)
    got = slowest_disk([_device(disk=fast), _device(disk=small)])
    assert (got.path, got.free_bytes, got.read_fit, got.write_fit, got.compute_overlap) == (
        "/small", 10**9, (1e-3, 1e9), (1e-3, 5e8), -1.0)
    assert slowest_disk([_device(), _device(disk=None)]) is None  # every rank needs one for the tier to exist


# ------------------------------------------------------------------------------------------------ bytes
def test_disk_unit_bytes_by_hand_gpu():
    # On a GPU, an offloaded unit holds nothing on the device; on disk the host keeps E * 2m, the disk E * o.
    plan = _estimate({}, ON_DISK)
    u0, u1 = plan.units
    assert (u0.device_bytes, u0.host_bytes, u0.disk_bytes, u0.tier.state_on) == (5 * 10**7 * 16, 0, 0, "device")
    assert (u1.device_bytes, u1.host_bytes, u1.disk_bytes, u1.tier.state_on) == (0, 10**8 * 8, 10**8 * 8, "disk")
    assert u1.offload and u1.tier >= Tier.DISK and plan.disk_units == (1,) and plan.offloaded_units == (1,)
    # Per rank: the unit's host state + the staging area; the disk holds its optimizer state.
    assert plan.host_bytes_per_rank == 8 * 10**8 + STAGING
    assert plan.disk_bytes_per_rank == 8 * 10**8 and plan.disk_path == "/nvme/tightfit"
    host = _estimate({}, HOST)
    assert host.host_bytes_per_rank == 16 * 10**8 and host.disk_bytes_per_rank == 0
    assert plan.peak_bytes == host.peak_bytes  # the device holds the same on a GPU either way


def test_staging_area_is_counted_once_in_host_bytes():
    assert DISK_STAGING_BYTES == STAGING
    both = _estimate(ON_DISK, ON_DISK)
    assert both.host_bytes_per_rank == 5 * 10**7 * 8 + 10**8 * 8 + STAGING
    assert both.disk_bytes_per_rank == 5 * 10**7 * 8 + 10**8 * 8
    mixed = _estimate(HOST, ON_DISK)
    assert mixed.host_bytes_per_rank == 5 * 10**7 * 16 + 10**8 * 8 + STAGING


def test_unified_memory_counts_host_state_and_staging_in_the_device_peak():
    # A CPU "device": host-resident state is device memory. Tiny units so the optimizer phase is the peak:
    # state = E0 * 8 + E1 * 8 = 500 * 8 + 1000 * 8 (both on disk: master + grads only), plus the staging area
    # once; a disk unit's update runs in the staging area, so only units in memory add their foreach temporaries
    # (E * t = E * 4); the backward (tens of kB) is far below.
    cpu = _cluster(cpu=True)
    both = _estimate(ON_DISK, ON_DISK, numels=TINY, cluster=cpu)
    assert (both.memory.phase, both.memory.state_bytes) == ("optimizer", 12_000)
    assert both.peak_bytes == 12_000 + STAGING
    one = _estimate({}, ON_DISK, numels=TINY, cluster=cpu)
    assert one.peak_bytes == 500 * 16 + 1000 * 8 + 500 * 4 + STAGING
    assert [u.device_bytes for u in one.units] == [8000, 8000] and [u.host_bytes for u in one.units] == [0, 8000]
    assert one.host_bytes_per_rank == 8000  # unified: the staging area is in the device peak instead
    # Without disk units there is no staging area: the optimizer phase is not the peak any more.
    assert _estimate({}, HOST, numels=TINY, cluster=cpu).peak_bytes < STAGING


# ------------------------------------------------------------------------------------------------ choices
def _search(cluster=None, **kw):
    cons = ElixirConstraints(**{**EXACT, **kw.pop("constraints", {})})
    return search(_profile(kw.pop("numels", BIG)), cluster or _cluster(), optimizer="adamw", precision="32-true",
                  constraints=cons, **kw)


@pytest.mark.parametrize("exhaustive", [True, False])
def test_gpu_plan_goes_to_disk_exactly_when_the_host_budget_forces_it(exhaustive):
    cons = {"exhaustive": exhaustive}
    # The device budget is the peak with layers.1 offloaded (host or disk: the same on a GPU). One unit of both
    # blocks peaks the same (S = 0, gathered 12e8 + gradients 24e8), but its host state is 24e8 B.
    budget = _estimate({}, HOST).peak_bytes
    roomy = _search(memory_budget=budget, constraints=cons)
    assert not roomy.disk_units and roomy.offloaded_units  # fastest first: the host beats the disk
    exact_host = _search(memory_budget=budget, host_budget=16 * 10**8, constraints=cons)
    assert [u.tier.state_on for u in exact_host.units] == ["device", "host"]
    forced = _search(memory_budget=budget, host_budget=16 * 10**8 - 1, constraints=cons)
    assert [u.tier.state_on for u in forced.units] == ["device", "disk"]
    assert forced.host_bytes_per_rank == 8 * 10**8 + STAGING and forced.disk_bytes_per_rank == 8 * 10**8
    # Slower by the disk's I/O beyond the host step: 4.802 - 2 s.
    assert forced.step_time_s - exact_host.step_time_s == pytest.approx(2.802, rel=1e-9)
    # A larger device budget needs no offload at all, whatever the host has.
    assert [u.tier.state_on for u in _search(memory_budget=10**12, host_budget=0, constraints=cons).units] == [
        "device", "device"]
    # Without the disk tier (allow_disk=False) the forced case has no plan.
    with pytest.raises(PlanInfeasibleError):
        _search(memory_budget=budget, host_budget=16 * 10**8 - 1, constraints={"allow_disk": False, **cons})


@pytest.mark.parametrize("exhaustive", [True, False])
def test_unified_plan_goes_to_disk_exactly_when_the_device_budget_forces_it(exhaustive):
    cons = {"exhaustive": exhaustive}
    cpu = _cluster(cpu=True)
    resident = _estimate({}, {}, cluster=cpu).peak_bytes
    assert [u.tier.state_on for u in _search(cpu, memory_budget=resident, constraints=cons).units] == ["device", "device"]
    # One byte less: offloading to the host saves nothing on one memory; the disk does: layers.0's optimizer
    # state (4e8 B) for 2.402 - 0.5 s more, or layers.1's (8e8 B) for 4.802 - 1 s more.
    tight = _search(cpu, memory_budget=resident - 1, constraints=cons)
    assert [u.tier.state_on for u in tight.units] == ["disk", "device"]
    assert tight.peak_bytes == resident - 5 * 10**7 * 8
    tighter = _search(cpu, memory_budget=resident - 5 * 10**7 * 8 - 1, constraints=cons)
    assert [u.tier.state_on for u in tighter.units] == ["device", "disk"]
    assert tighter.peak_bytes == resident - 10**8 * 8 == _estimate({}, ON_DISK, cluster=cpu).peak_bytes
    assert tighter.step_time_s - tight.step_time_s == pytest.approx(3.802 - 1.902, rel=1e-9)
    with pytest.raises(PlanInfeasibleError) as err:
        _search(_cluster(cpu=True, disk=None), memory_budget=resident - 1, constraints=cons)
    assert err.value.tier == "device"


# ------------------------------------------------------------------------------------------------ errors
def test_host_short_without_a_disk_names_the_host_and_suggests_a_disk_dir():
    budget = _estimate({}, HOST).peak_bytes
    with pytest.raises(PlanInfeasibleError, match=r"host memory budget is 1\.49 GiB, the least-memory plan needs "
                                                  r".*disk directory \(disk_dir\)") as err:
        _search(_cluster(disk=None), memory_budget=budget, host_budget=16 * 10**8 - 1)
    assert err.value.tier == "host" and err.value.budget_bytes == 16 * 10**8 - 1
    assert any("disk_dir" in s for s in err.value.suggestions)


def test_host_short_even_with_the_disk_names_the_host():
    # Four blocks of 1e8 parameters on 2 ranks: 2e8 bytes of fp32 per block per rank. With every unit's optimizer
    # state on disk (tier 2) the host holds master weights and gradients, 4 x 4e8; with master weights on disk
    # too (tier 3) the gradients, 4 x 2e8, and two units' shards in flight, 2 x 2e8.
    four = (10**8,) * 4
    tier2 = 16 * 10**8 + STAGING
    with pytest.raises(PlanInfeasibleError, match=r"host memory budget is .*optimizer state of every offloaded "
                                                  r"unit on disk") as err:
        _search(numels=four, memory_budget="2GiB", host_budget=tier2 - 1,
                constraints={"allow_disk_params": False, "allow_disk_grads": False})
    assert err.value.tier == "host"
    assert _search(numels=four, memory_budget="2GiB", host_budget=tier2,
                   constraints={"allow_disk_params": False, "allow_disk_grads": False}).host_bytes_per_rank == tier2
    # With master weights and parameters on disk too (tier 3) the same budgets plan, within the host budget.
    plan = _search(numels=four, memory_budget="2GiB", host_budget=tier2 - 1, constraints={"allow_disk_grads": False})
    assert plan.param_disk_units and plan.host_bytes_per_rank <= tier2 - 1
    assert _search(numels=four, memory_budget="2GiB", host_budget=12 * 10**8 + STAGING,
                   constraints={"allow_disk_grads": False}).host_bytes_per_rank == 12 * 10**8 + STAGING
    # Below what even tier 4 needs (two units' shards and gradients in flight, 2 x 4e8), the error names it.
    with pytest.raises(PlanInfeasibleError, match=r"optimizer state and master weights on disk") as err:
        _search(numels=four, memory_budget="2GiB", host_budget=8 * 10**8 + STAGING - 1)
    assert err.value.tier == "host"
    assert _search(numels=four, memory_budget="2GiB", host_budget=8 * 10**8 + STAGING).grad_disk_units


# Tier 3, layers.1 (E = 1e8 per rank, 2 ranks of a node share the disk): the host keeps the gradients E * m =
# 4e8 B, plus the staging area, plus two parameter shards live while used (this unit's and the one read ahead:
# 2 * 4e8); the disk keeps E * (m + o) = 1.2e9 B. The step streams them: read 1e-3 + 1.2e9 * 2 / 1e9 = 2.401 s,
# write 1e-3 + 1.2e9 * 2 / 5e8 = 4.801 s, io 7.202 s > 2 s of compute (full overlap unmeasured): opt 7.202 s.
# Parameters read ahead of forward and of backward: 2 * (1e-3 + 4e8 * 2 / 1e9) = 1.602 s.
PARAMS_DISK = dict(tier=Tier.DISK_PARAMS)


def test_params_on_disk_unit_by_hand_gpu():
    plan = _estimate({}, PARAMS_DISK)
    u0, u1 = plan.units
    assert (u1.device_bytes, u1.host_bytes, u1.disk_bytes) == (0, 4 * 10**8, 12 * 10**8)
    assert (u1.tier.state_on, u1.tier.params_on, u1.tier) == ("disk", "disk", 3)
    assert u0.tier.params_on == "device"
    assert plan.param_disk_units == (1,) and plan.disk_units == (1,)
    assert plan.host_bytes_per_rank == 4 * 10**8 + STAGING + 4 * 10**8  # gradients, staging, its shards in use
    # (one unit on disk: nothing else is read ahead of it)
    assert plan.disk_bytes_per_rank == 12 * 10**8
    assert plan.breakdown.disk_io_s == pytest.approx(7.202, rel=1e-12)
    assert plan.breakdown.optimizer_s == pytest.approx(0.05 + 7.202, rel=1e-12)
    assert plan.breakdown.param_io_s == pytest.approx(1.602, rel=1e-12)
    tier2 = _estimate({}, ON_DISK)
    # The step pays at least the longer optimizer stream; the reads ahead can only add (max-plus schedule).
    assert plan.step_time_s >= tier2.step_time_s + (7.202 - 4.802) - 1e-9
    text = plan.explain()
    assert "params wait on" in text and "master weights on disk" in text and "units 1:" in text
    assert ElixirPlan.from_json(plan.to_json()) == plan


def test_params_on_disk_shrinks_the_unified_peak_by_the_master_weights():
    cpu = _cluster(cpu=True)
    t2 = _estimate(ON_DISK, ON_DISK, numels=TINY, cluster=cpu)
    t3 = _estimate(PARAMS_DISK, PARAMS_DISK, numels=TINY, cluster=cpu)
    # The optimizer phase peaks: the resident state drops by E * m = (500 + 1000) * 4 bytes.
    assert t2.memory.phase == t3.memory.phase == "optimizer"
    assert t2.peak_bytes - t3.peak_bytes == 1500 * 4
    assert t3.disk_bytes_per_rank - t2.disk_bytes_per_rank == 1500 * 4


def _old_form(plan: ElixirPlan, *flags: tuple[bool, bool, bool, bool]) -> str:
    """``plan``'s JSON as written before ``UnitPlan.tier``: per unit the four chained flags (``flags``, one per unit;
    none given: its tier's)."""
    data = json.loads(plan.to_json())
    for i, unit in enumerate(data["units"]):
        t = unit.pop("tier")
        unit.update(zip(("offload", "disk", "params_disk", "grads_disk"), flags[i] if flags else [t >= k for k in range(1, 5)]))
    return json.dumps(data)


def test_params_disk_needs_the_disk_tier_flag():
    # Only an old plan file can say it (one tier per unit cannot): refused, naming the unit and the fix.
    with pytest.raises(ValueError, match=r"unit 1 \['layers.1'\] has \(offload, disk, params_disk, grads_disk\) = "
                                         r"\(True, False, True, False\), but each flag needs the one before it"):
        ElixirPlan.from_json(_old_form(_estimate({}, HOST), (False,) * 4, (True, False, True, False)))


@pytest.mark.parametrize("flags", list(itertools.product((False, True), repeat=4)))
def test_old_plan_json_with_four_flags_per_unit_loads_as_the_tier_they_chain_to(flags):
    plan = _estimate({}, PARAMS_DISK)
    chained = list(flags) == sorted(flags, reverse=True)
    if not chained:
        with pytest.raises(ValueError, match="each flag needs the one before it; re-plan"):
            ElixirPlan.from_json(_old_form(plan, (False,) * 4, flags))
        return
    old = ElixirPlan.from_json(_old_form(plan, (False,) * 4, flags))
    assert isinstance(old.units[1].tier, Tier) and old.units[0].tier is Tier.DEVICE
    assert old == dataclasses.replace(plan, units=(plan.units[0], dataclasses.replace(plan.units[1], tier=sum(flags))))


def test_old_plan_files_of_every_tier_read_back_equal(tmp_path):
    for t0, t1 in ((Tier.DEVICE, Tier.HOST), (Tier.DISK, Tier.DISK_PARAMS), (Tier.HOST, Tier.DISK_GRADS)):
        plan = _estimate({"tier": t0}, {"tier": t1})
        path = tmp_path / f"plan{t0}{t1}.json"
        path.write_text(_old_form(plan))
        assert "params_disk" in path.read_text() and '"tier"' not in path.read_text()
        assert ElixirPlan.from_json(path) == plan
        assert ElixirPlan.from_json(path).to_json() == plan.to_json()  # written again in the one-field form


def test_disk_short_names_the_disk_its_path_and_what_the_plan_needs():
    budget = _estimate({}, HOST).peak_bytes
    # 800 MB of state on disk: the disk holds it twice at a step's end (the store frees the old copy at its sync).
    with pytest.raises(PlanInfeasibleError, match=r"disk has 1\.49 GiB free in /nvme/tightfit, the fastest plan "
                                                  r"within the device and host budgets \(762\.94 MiB of state, held "
                                                  r"twice.*needs 1\.49 GiB") as err:
        _search(memory_budget=budget, host_budget=16 * 10**8 - 1, disk_budget=16 * 10**8 - 1)
    assert (err.value.tier, err.value.needed_bytes, err.value.budget_bytes) == ("disk", 16 * 10**8, 16 * 10**8 - 1)
    # With exactly that much disk it plans.
    assert _search(memory_budget=budget, host_budget=16 * 10**8 - 1, disk_budget=16 * 10**8).disk_units == (1,)


def test_disk_inputs_are_validated():
    with pytest.raises(ValueError, match=r"\(False, True, False, False\), but each flag needs the one before it"):
        ElixirPlan.from_json(_old_form(_estimate({}, HOST), (False,) * 4, (False, True, False, False)))
    with pytest.raises(ValueError, match=r"tier=5\): use a Tier, 0 DEVICE, 1 HOST, 2 DISK, 3 DISK_PARAMS, 4 DISK_GRADS"):
        UnitPlan(blocks=("a",), tier=5)
    with pytest.raises(ValueError, match=r"ElixirPlan.units\[1\].tier: 7 is not a Tier; use one of \[0, 1, 2, 3, 4\]"):
        ElixirPlan.from_json(_estimate({}, HOST).to_json().replace('"tier": 1', '"tier": 7'))
    with pytest.raises(ValueError, match="no disk tier"):
        _estimate({}, ON_DISK, cluster=_cluster(disk=None))
    with pytest.raises(PlanError, match="disk_budget=.*no disk tier"):
        _search(_cluster(disk=None), disk_budget="1GiB")
    with pytest.raises(PlanError, match="host_budget='lots'"):
        _search(host_budget="lots")
    with pytest.raises(PlanError, match="force_disk=True.*allow_disk"):
        ElixirConstraints(force_disk=True, allow_disk=False)
    with pytest.raises(PlanError, match="RAM"):
        _search(_cluster(disk=dataclasses.replace(DISK, filesystem="tmpfs")))
    with pytest.raises(Exception, match="compute_overlap"):
        dataclasses.replace(DISK, compute_overlap=1.5)
    forced = _search(memory_budget=10**12, constraints={"force_disk": True})
    assert [u.tier.state_on for u in forced.units] == ["disk", "disk"]


# ------------------------------------------------------------------------------------------------ views, JSON
def test_plan_with_disk_units_round_trips_and_explains_its_tiers():
    budget = _estimate({}, HOST).peak_bytes
    plan = _search(memory_budget=budget, host_budget=16 * 10**8 - 1)
    again = ElixirPlan.from_json(plan.to_json())
    assert again == plan and again.units[1].tier == Tier.DISK and again.units[1].tier.state_on == "disk"
    text = plan.explain()
    assert "disk state 762.94 MiB per rank in /nvme/tightfit" in text
    assert "(disk I/O 4.802 s of reads and write-backs" in text
    rows = [r for r in (line.split() for line in text.splitlines()) if len(r) > 3 and r[1].startswith("layers.")]
    assert [r[3] for r in rows] == ["device", "disk"]
    cfg = plan.to_deepspeed_config()["zero_optimization"]
    assert cfg["offload_optimizer"]["device"] == "nvme"
    assert cfg["offload_optimizer"]["nvme_path"] == "/nvme/tightfit"


def test_old_plan_json_without_the_disk_fields_still_loads():
    data = json.loads(_estimate({}, HOST).to_json())
    for key in ("disk_bytes_per_rank", "disk_path"):
        del data[key]
    del data["breakdown"]["disk_io_s"]
    for unit in data["units"]:
        unit["offload"] = unit.pop("tier") >= Tier.HOST  # before the disk tier: one flag
        del unit["disk_bytes"]
    old = ElixirPlan.from_json(json.dumps(data))
    assert [u.tier.state_on for u in old.units] == ["device", "host"] and old.disk_bytes_per_rank == 0 and not old.disk_units


def test_nvme_baseline_is_zero3_offload_with_optimizer_state_on_disk():
    kw = dict(optimizer="adamw", precision="32-true", checkpoint=False,
              constraints=ElixirConstraints(**NO_MARGIN))
    nvme = baseline(_profile(), _cluster(), "zero3-offload-nvme", **kw)
    off = baseline(_profile(), _cluster(), "zero3-offload", **kw)
    assert all(u.tier >= Tier.DISK and u.mode == "reshard" for u in nvme.units)
    assert nvme.peak_bytes == off.peak_bytes and nvme.host_bytes_per_rank < off.host_bytes_per_rank
    # Optimizer: 1 s and 2 s of host compute against io of (1e-3 + 0.8) + (1e-3 + 1.6) s and 4.802 s: io wins.
    assert nvme.breakdown.optimizer_s == pytest.approx(2.402 + 4.802, rel=1e-12)


# ------------------------------------------------------------------------------------------------ property
# Ranges where the tiers bind: a rank's state is 2.8e9 B (3.5e8 parameters x 16 / 2 ranks); sampled this way
# about a third of the problems have a plan, a sixth of them only with the disk.
budgets = st.fixed_dictionaries({
    "device": st.integers(2 * 10**9, 6 * 10**9),
    "host": st.integers(10**8, 3 * 10**9),
    "disk": st.integers(0, 3 * 10**9),
    "cpu": st.booleans(),
    "exhaustive": st.booleans(),
})


@settings(max_examples=25, deadline=None, phases=(Phase.explicit, Phase.generate), database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(budgets)
def test_a_disk_tier_never_makes_the_best_plan_slower(b):
    # Adding a tier only adds choices: under the same device and host budgets the best plan is as fast or faster
    # (the exact search's space is a superset; the greedy pool holds the pool without the tier).
    prof = _profile((10**8, 2 * 10**8, 5 * 10**7))
    kw = dict(optimizer="adamw", precision="32-true", memory_budget=b["device"], host_budget=b["host"])
    cons = ElixirConstraints(prefetch_depths=(1,), exhaustive=b["exhaustive"], **NO_MARGIN)

    def best(cluster, **extra):
        try:
            return search(prof, cluster, constraints=cons, **kw, **extra)
        except PlanInfeasibleError:
            return None

    without = best(_cluster(cpu=b["cpu"], disk=None))
    with_disk = best(_cluster(cpu=b["cpu"]), disk_budget=b["disk"])
    if without is not None:
        assert with_disk is not None
        assert with_disk.step_time_s <= without.step_time_s * (1 + 1e-9)
    if with_disk is not None:
        assert with_disk.fits and with_disk.host_bytes_per_rank <= b["host"]
        assert with_disk.disk_bytes_per_rank * DISK_COPIES <= b["disk"]  # both copies fit at a step's end


@settings(max_examples=20, deadline=None, phases=(Phase.explicit, Phase.generate), database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(exact_block, min_size=1, max_size=3), world=st.sampled_from([1, 2]), unified=st.booleans(),
       q=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)))
# Found by the draw: the search once left tier 3/4's shards in flight out of its host sum and kept a plan past
# the host budget.
@example(blocks=[{"saved": 111388327, "ckpt_frac": 0.05, "transient": 700, "fwd_transient": 2812, "checkpointable": True,
                  "numel": 1000000, "fwd": 2843040652363.797},
                 {"fwd_transient": 324, "transient": 1295, "ckpt_frac": 0.3, "fwd": 10000000000.0, "numel": 20000000,
                  "checkpointable": False, "saved": 137994521}],
         world=1, unified=False, q=(1.1754943508222875e-38, 0.22832597165271867, 0.6529725947161263))
@example(blocks=[{"transient": 1496, "numel": 1000000, "checkpointable": False, "ckpt_frac": 0.05, "saved": 10507271,
                  "fwd_transient": 76, "fwd": 3489548857679.7314},
                 {"fwd_transient": 343536, "saved": 752942283, "transient": 75, "fwd": 2222455861787.799,
                  "ckpt_frac": 1.0, "checkpointable": False, "numel": 3000000},
                 {"ckpt_frac": 0.05, "checkpointable": True, "fwd": 458253880876.2829, "saved": 1000000,
                  "fwd_transient": 3628801, "numel": 100000, "transient": 2941}],
         world=2, unified=True, q=(0.15237529195620805, 0.014279091560357008, 0.9509219713740034))
def test_branch_and_bound_with_the_disk_tier_equals_brute_force(blocks, world, unified, q):
    # Every plan of the space with four state tiers priced without pruning; budgets drawn among their bytes so
    # the host and the disk bind as often as the device. The exact search must find each family's best.
    dev = dataclasses.replace(exact_device(), unified_memory=unified, disk=DISK)
    cons = ElixirConstraints(reserved_bytes=0, prefetch_depths=(1,), exhaustive=True)
    problem = ElixirProblem(model=random_profile(blocks), cluster=ClusterSpec.uniform(dev, world), optimizer="adamw",
                            precision="32-true", constraints=cons)
    _, ctx, tiers = problem.prepare_tiers()
    space = cons.space(disk=tiers.has_disk)
    assert space.offload == (False, True, 2, 3, 4)  # tier 3: master weights and parameters on disk too; 4: gradients
    ev = Evaluator(ctx)
    everything = []
    ck_ids = [i for i in range(len(blocks)) if ctx.checkpointable[i]]
    for units in compositions(len(blocks)):
        for choice in itertools.product(itertools.product(MODES, space.offload), repeat=len(units)):
            for bits in itertools.product((False, True), repeat=len(ck_ids)):
                ck = [False] * len(blocks)
                for i, bit in zip(ck_ids, bits):
                    ck[i] = bit
                everything.append(ev.make(units, [m for m, _ in choice], [o for _, o in choice], ck, 1, 1))

    def pick(values, x):
        values = sorted(values)
        return values[int(x * (len(values) - 1))]

    budget, host, disk = (pick([c.peak for c in everything], q[0]), pick([c.host for c in everything], q[1]),
                          pick([c.disk for c in everything], q[2]))
    fitting = [c for c in everything if c.peak <= budget and c.fits(host, disk)]
    per_family = exhaustive(Evaluator(ctx), space, budget, host, disk_budget=disk)
    for label, found in per_family.items():
        mine = [c for c in fitting if "|".join(f"{a}-{b}" for a, b in c.units) + "@1/1" == label]
        if not mine:
            assert found is None, label
        else:
            assert found is not None and found.peak <= budget and found.fits(host, disk), label
            assert found.key == min(c.key for c in mine), label
            # Its host bytes as the plan is priced (tier 3/4 shards in flight included), not the search's sum.
            again = ev.make(found.units, found.modes, found.offload, found.ckpt, found.df, found.db)
            assert found.host == pytest.approx(again.host, rel=1e-12), label


@given(state=st.floats(0, 1e15, allow_nan=False), free=st.integers(0, 1 << 52))
def test_the_disk_copies_rule_reads_the_same_both_ways(state, free):
    # The solver filters plans by disk_state_budget, the diagnosis names disk_bytes_needed: one rule, so a plan the
    # solver keeps is never one the diagnosis calls too large, and the other way round.
    assert (state <= disk_state_budget(free)) == (disk_bytes_needed(state) <= free)
    assert disk_bytes_needed(state) >= state * DISK_COPIES
