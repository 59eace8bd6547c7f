"""Elixir's cost model pinned to numbers worked out by hand from its docstrings.

The search tests compare the exact search with brute force under the *same* model and the law tests
check orderings, so a wrong term passes them. Here a two-block model on two ranks is priced through
the public API (``estimate`` / ``search`` of :mod:`tightfit.planner.elixir`) and every byte and second
is written out from the formulas in :mod:`tightfit.planner.elixir.sim`: ``UnitTerms`` (per-unit bytes
and durations), ``peak`` (the memory timeline) and ``step_time`` (the list schedule on compute, network
and the two copy engines).

Numbers chosen so the arithmetic is exact: precision ``32-true`` (m = c = r = 4 bytes), AdamW
(o = 8: state ``m + m + o`` = 16 bytes per owned element, foreach temporaries ``t`` = 4), no
fragmentation margin and no reserve, world 2 on one node (a rank owns E = P / 2 of a sharded unit).
Rates: 1e9 FLOP/s, 1000 B/s bus bandwidth for every collective and message size (all-gather and
reduce-scatter of S bytes: S * (W - 1) / W / 1000 s = S / 2000 s), 1000 B/s host<->device copies,
AdamW at 1000 elements/s on the device and 1000/s per host (500/s per rank: two ranks share it).
"""

from __future__ import annotations

import pytest

from tightfit.planner.elixir import ElixirConstraints, PlanInfeasibleError, Tier, UnitPlan, estimate, search
from tightfit.profiler.types import BlockProfile, ClusterSpec, DeviceProfile, ModelProfile, ParamInfo

# Two blocks (bytes at fp32; the compute dtype is fp32 too, so activations are not rescaled):
#   layers.0: P = 1000, forward 1e9 FLOPs (1 s), backward 2 s, saved 10_000, checkpoint 1_000,
#             backward transient 500, forward transient 0;
#   layers.1: P = 2000, forward 2 s, backward 4 s, saved 20_000, checkpoint 2_000,
#             backward transient 3_000, forward transient 5_000.
BLOCKS = (
    dict(name="layers.0", numel=1000, fwd=1e9, saved=10_000, ckpt=1_000, transient=500, fwd_transient=0),
    dict(name="layers.1", numel=2000, fwd=2e9, saved=20_000, ckpt=2_000, transient=3_000, fwd_transient=5_000),
)
NO_MARGIN = dict(fragmentation=0.0, reserved_bytes=0)


def _profile(fwd_transient_1: int = 5_000) -> ModelProfile:
    params, blocks = [], []
    for i, b in enumerate(BLOCKS):
        if i == 1:
            b = dict(b, fwd_transient=fwd_transient_1)
        pname = f"{b['name']}.weight"
        params.append(ParamInfo(name=pname, shape=(b["numel"],), dtype="float32", numel=b["numel"],
                                bytes=4 * b["numel"], block=b["name"]))
        blocks.append(BlockProfile(
            name=b["name"], type="Block", index=i, params=(pname,), param_numel=b["numel"],
            param_bytes=4 * b["numel"], fwd_flops=b["fwd"], bwd_flops=2 * b["fwd"], saved_bytes=b["saved"],
            checkpoint_bytes=b["ckpt"], transient_bytes=b["transient"], output_bytes=b["ckpt"],
            fwd_transient_bytes=b["fwd_transient"]))
    return ModelProfile(
        model="two-blocks", step="train", inputs={"x": [1, 1]}, params=tuple(params), blocks=tuple(blocks),
        forward_order=tuple(p.name for p in params), backward_order=tuple(p.name for p in reversed(params)),
        timeline=(), activation_peak_bytes=30_000, peak_bytes=0, fwd_flops=3e9, bwd_flops=6e9,
        param_dtype="float32")


def _cluster(host_memory: int = 0) -> ClusterSpec:
    flat = {1 << 20: 1000.0}  # one measured size: the same bus bandwidth for every message
    dev = DeviceProfile(
        name="hand", kind="cuda", memory_bytes=10**9, free_bytes=10**9, matmul_flops={"float32": 1e9},
        h2d_bytes_per_s={"pinned": 1000.0}, d2h_bytes_per_s={"pinned": 1000.0}, host_adam_elems_per_s=1000.0,
        device_adam_elems_per_s=1000.0, collective_bytes_per_s={"all_gather": flat, "reduce_scatter": flat},
        host_memory_bytes=host_memory, source="datasheet:hand")
    return ClusterSpec.uniform(dev, 2)


def _estimate(u0: dict, u1: dict, **kw):
    units = [UnitPlan(blocks=("layers.0",), **u0), UnitPlan(blocks=("layers.1",), **u1)]
    cons = ElixirConstraints(**{**NO_MARGIN, **kw.pop("constraints", {})})
    return estimate(_profile(), _cluster(), units, optimizer="adamw", precision="32-true", constraints=cons, **kw)


# ------------------------------------------------------------------------------------------------ bytes per unit
def test_unit_bytes_on_device_and_host_by_hand():
    # Resident sharded unit: E * (m + m + o) on the device; gathered P * c while live.
    plan = _estimate({}, {})
    assert [u.device_bytes for u in plan.units] == [500 * 16, 1000 * 16]
    assert [u.host_bytes for u in plan.units] == [0, 0]
    assert [u.gathered_bytes for u in plan.units] == [1000 * 4, 2000 * 4]
    # Offloaded: the same E * (m + m + o) on the host -- parameters, gradients AND optimizer state --, none
    # on the device; gathered parameters still come to the device while the unit runs.
    off = _estimate({}, {"tier": Tier.HOST})
    assert [u.device_bytes for u in off.units] == [8000, 0]
    assert [u.host_bytes for u in off.units] == [0, 1000 * (4 + 4 + 8)]
    assert off.host_bytes_per_rank == 16_000
    assert [u.gathered_bytes for u in off.units] == [4000, 8000]
    # Replicate: a rank owns the whole unit.
    rep = _estimate({"mode": "replicate"}, {"mode": "replicate", "tier": Tier.HOST})
    assert [u.device_bytes for u in rep.units] == [1000 * 16, 0]
    assert [u.host_bytes for u in rep.units] == [0, 2000 * 16]


# ------------------------------------------------------------------------------------------------ memory timeline
# S = device state of all units; params(t), acts(t) as in the docstring of the peak. With both units resident
# and resharded, prefetch 1: S = 8000 + 16000 = 24_000; gathered g = (4000, 8000); grads P * (c + r) =
# (8000, 16000); reduce buffer P * r = (4000, 8000).
#   forward  layers.0: params g0 + g1 (prefetched) = 12_000;             acts 10_000 + 0
#   forward  layers.1: params g1 = 8000;                                 acts a0 + 20_000 + 5000
#   backward layers.1: params g1 + grads1 + g0 (prefetched) = 28_000;    acts a0 + 20_000 + (3000, or
#                      max(3000, 5000) when it is checkpointed: its forward re-runs)
#   backward layers.0: params g0 + grads0 + red_buf1 = 20_000;           acts 0 + 10_000 + 500
# with a0 = 1000 when layers.0 is checkpointed, else 10_000. A checkpointed block is recomputed to its full
# saved size for its own backward: checkpointing only lowers what the blocks *after* it see.
@pytest.mark.parametrize(("checkpoint", "peak", "acts"), [
    ((), 24_000 + 28_000 + 10_000 + 20_000 + 3000, 33_000),                        # 85_000
    (("layers.0",), 24_000 + 28_000 + 1000 + 20_000 + 3000, 24_000),              # 76_000
    (("layers.1",), 24_000 + 28_000 + 10_000 + 20_000 + 5000, 35_000),            # 87_000
    (("layers.0", "layers.1"), 24_000 + 28_000 + 1000 + 20_000 + 5000, 26_000),   # 78_000
])
def test_backward_peak_with_and_without_recompute_by_hand(checkpoint, peak, acts):
    u0 = {"checkpoint": tuple(b for b in checkpoint if b == "layers.0")}
    u1 = {"checkpoint": tuple(b for b in checkpoint if b == "layers.1")}
    plan = _estimate(u0, u1)
    assert plan.peak_bytes == peak
    m = plan.memory
    assert (m.phase, m.block, m.state_bytes, m.params_bytes, m.activation_bytes, m.margin_bytes) == (
        "backward", "layers.1", 24_000, 28_000, acts, 0)


def test_offloaded_unit_leaves_only_its_gathered_parameters_on_the_device():
    # layers.1 offloaded and layers.0 checkpointed: S = 8000 (layers.0 only).
    #   forward layers.1: 8000 + 8000 + (1000 + 20_000 + 5000)   = 42_000
    #   backward layers.1: 8000 + 28_000 + (1000 + 20_000 + 3000) = 60_000  <- peak
    #   backward layers.0: 8000 + 20_000 + 10_500                 = 38_500
    plan = _estimate({"checkpoint": ("layers.0",)}, {"tier": Tier.HOST})
    assert plan.peak_bytes == 60_000
    assert (plan.memory.state_bytes, plan.memory.params_bytes, plan.memory.activation_bytes) == (8000, 28_000, 24_000)


def test_margin_and_reserve_by_hand():
    # peak = raw * (1 + fragmentation) + reserved = 85_000 * 1.25 + 1000 (0.25: exact in binary)
    plan = _estimate({}, {}, constraints={"fragmentation": 0.25, "reserved_bytes": 1000})
    assert plan.peak_bytes == 107_250
    assert plan.memory.margin_bytes == 107_250 - 85_000


# ------------------------------------------------------------------------------------------------ step time
# Durations: compute cf = (1, 2) s, cb = (2, 4) s; all-gather of P * c bytes: (4000, 8000) / 2000 =
# (2, 4) s; reduce-scatter of P * r: (2, 4) s; device AdamW E / 1000 = (0.5, 1) s.
def test_step_time_resident_resharded_by_hand():
    # Forward: fetch u0 on the net [0, 2]; u0 computes [2, 3] and issues u1's fetch [2, 6]; u1 computes [6, 8].
    # Backward: u1's re-gather [8, 12]; u1 computes [12, 16] and issues u0's re-gather [12, 14];
    # u1's reduce-scatter [16, 20]; u0 computes [16, 18]; its reduce-scatter [20, 22];
    # optimizer after everything landed: 22 + 0.5 + 1 = 23.5.
    plan = _estimate({}, {})
    assert plan.step_time_s == pytest.approx(23.5)
    b = plan.breakdown
    assert (b.compute_s, b.recompute_s, b.optimizer_s) == pytest.approx((9.0, 0.0, 1.5))
    assert b.exposed_comm_s == pytest.approx(13.0)


def test_step_time_with_offload_and_recompute_by_hand():
    # layers.1 offloaded: H2D of E * m = 4000 B takes 4 s before each of its all-gathers, D2H of its gradient
    # shard 4 s after its reduce-scatter, host AdamW 1000 / 500 = 2 s. layers.0 checkpointed: +1 s recompute.
    # Forward: u0 gathered [0, 2], computes [2, 3]; u1 copied [2, 6], gathered [6, 10], computes [10, 12].
    # Backward: u1 copied [12, 16], gathered [16, 20], computes [20, 24]; u0 re-gathered [20, 22];
    # u1 reduce-scatter [24, 28], D2H [28, 32]; u0 computes 2 + 1 s [24, 27], reduce-scatter [28, 30].
    # Optimizer from 32: 0.5 + 2 = 2.5 -> 34.5.
    plan = _estimate({"checkpoint": ("layers.0",)}, {"tier": Tier.HOST})
    assert plan.step_time_s == pytest.approx(34.5)
    b = plan.breakdown
    assert (b.compute_s, b.recompute_s, b.optimizer_s) == pytest.approx((9.0, 1.0, 2.5))
    assert b.exposed_comm_s == pytest.approx(22.0)


def test_step_time_replicated_units_all_reduce_by_hand():
    # Replicate: no all-gathers; gradients all-reduced: 2 * P * r * (W - 1) / W / busbw = (4, 8) s, with the
    # all-reduce's bus bandwidth the harmonic mean of reduce-scatter's and all-gather's (both 1000 B/s).
    # Compute [0, 3] forward, backward u1 [3, 7], u0 [7, 9]; all-reduces [7, 15], [15, 19]; AdamW on
    # E = P: 1 + 2 s -> 22.
    plan = _estimate({"mode": "replicate"}, {"mode": "replicate"})
    assert plan.step_time_s == pytest.approx(22.0)
    assert plan.breakdown.optimizer_s == pytest.approx(3.0)


# ------------------------------------------------------------------------------------------------ exact fits
EXACT = dict(modes=("reshard",), prefetch_depths=(1,), **NO_MARGIN)


def test_the_only_plan_that_fits_is_found_at_its_exact_peak():
    # With layers.1's forward transient at 0 (so recomputing it costs no extra bytes), the two-unit plans
    # peak at 85_000 (none checkpointed), 76_000 (layers.0), 85_000 (layers.1), 76_000 (both); one unit of
    # both blocks peaks higher (gathered 12_000 + grads 24_000 in its backward: >= 84_000). At 76_000 bytes
    # the fastest fitting plan recomputes layers.0 only (1 s of recompute against 3 s for both); at one
    # byte less nothing fits.
    cons = ElixirConstraints(allow_offload=False, **EXACT)
    plan = search(_profile(fwd_transient_1=0), _cluster(), optimizer="adamw", precision="32-true",
                  memory_budget=76_000, constraints=cons)
    assert plan.peak_bytes == 76_000 and plan.fits
    assert [u.blocks for u in plan.units] == [("layers.0",), ("layers.1",)]
    assert plan.checkpointed_blocks == ("layers.0",)
    with pytest.raises(PlanInfeasibleError):
        search(_profile(fwd_transient_1=0), _cluster(), optimizer="adamw", precision="32-true",
               memory_budget=75_999, constraints=cons)


def test_search_finds_the_plan_when_recompute_raises_a_blocks_own_peak():
    # Same as above with layers.1's forward transient at 5000: peaks 85_000 / 76_000 / 87_000 / 78_000.
    cons = ElixirConstraints(allow_offload=False, **EXACT)
    plan = search(_profile(), _cluster(), optimizer="adamw", precision="32-true", memory_budget=76_000,
                  constraints=cons)
    assert plan.peak_bytes == 76_000 and plan.checkpointed_blocks == ("layers.0",)


def test_offloading_fits_the_host_only_if_the_optimizer_state_is_counted():
    # No checkpointing. Device peaks: nothing offloaded 85_000; layers.1 offloaded 85_000 - 16_000 = 69_000;
    # layers.0 offloaded 77_000; both 61_000; one offloaded unit of both blocks 69_000 (S = 0, backward
    # 36_000 + 33_000). Host per rank: layers.1 16_000, both 24_000. With a 69_000 B device budget, the host
    # holding exactly 16_000 B per rank (32_000 B shared by two ranks) admits one plan: layers.1 offloaded.
    cons = ElixirConstraints(allow_checkpointing=False, host_memory_fraction=1.0, **EXACT)
    plan = search(_profile(), _cluster(host_memory=32_000), optimizer="adamw", precision="32-true",
                  memory_budget=69_000, constraints=cons)
    assert [u.offload for u in plan.units] == [False, True]
    assert (plan.peak_bytes, plan.host_bytes_per_rank) == (69_000, 16_000)
    for host, budget in ((31_998, 69_000), (32_000, 68_999)):
        with pytest.raises(PlanInfeasibleError):
            search(_profile(), _cluster(host_memory=host), optimizer="adamw", precision="32-true",
                   memory_budget=budget, constraints=cons)


# ------------------------------------------------------------------------------------------------ the loss's backward
# layers.1 is the head the loss is folded into: its backward transient is 3000, the loss's own 40_000 (say, the
# cross-entropy's gradients of the logits). Calibrated (a measured overlap): gradients exist from their backward on
# (state before backward S - E * m = 24_000 - 6000 = 18_000) and the loss's backward runs before the head unit's
# pre-backward hook: nothing of the unit gathered, no gradients, the prefetch not yet issued.
#   full shard, loss:  18_000 + acts 10_000 + 20_000 + 40_000                         = 88_000 (the peak)
#   full shard, head:  18_000 + acts 33_000 + params g1 + grads1 + g0 28_000         = 79_000
#   keep, loss:        18_000 + acts 70_000 + kept g0 + g1 12_000                     = 100_000
# Uncalibrated: the whole backward at once with every gradient resident, as before: 24_000 + 28_000 + 70_000.
@pytest.mark.parametrize(("mode", "calibrated", "peak", "params"), [
    ("reshard", True, 88_000, 0), ("keep", True, 100_000, 12_000), ("reshard", False, 122_000, 28_000)])
def test_the_loss_backward_runs_before_the_head_unit_gathers(mode, calibrated, peak, params):
    import dataclasses

    prof = _profile()
    blocks = (prof.blocks[0], dataclasses.replace(prof.blocks[1], loss_transient_bytes=40_000))
    prof = dataclasses.replace(prof, blocks=blocks)
    cluster = _cluster()
    if calibrated:
        cluster = ClusterSpec.uniform(dataclasses.replace(cluster.devices[0], comm_overlap=0.0), 2)
    units = [UnitPlan(blocks=("layers.0",), mode=mode), UnitPlan(blocks=("layers.1",), mode=mode)]
    plan = estimate(prof, cluster, units, optimizer="adamw", precision="32-true",
                    constraints=ElixirConstraints(**NO_MARGIN))
    m = plan.memory
    assert (plan.peak_bytes, m.phase, m.block, m.params_bytes, m.activation_bytes) == (
        peak, "backward", "layers.1", params, 70_000)


# layers.0 recomputed, with a backward transient of 100_000 so its backward is the peak. Calibrated, its re-run
# forward prefetches layers.1's unit again (forward prefetch 1): state 18_000 + layers.1's gradient shard 4000 + acts
# 10_000 + 100_000 + params g0 + unsharded grads0 + red_buf1 16_000 (layers.0's own reduce buffer comes in its
# reduction, after its blocks) + g1 8000 = 156_000; without forward prefetch 148_000.
# Uncalibrated, as before: 24_000 + 110_000 + 20_000 whatever the prefetch.
@pytest.mark.parametrize(("calibrated", "df", "peak"), [(True, 1, 156_000), (True, 0, 148_000), (False, 1, 154_000)])
def test_a_recomputed_forward_prefetches_the_next_unit_again(calibrated, df, peak):
    import dataclasses

    prof = _profile()
    prof = dataclasses.replace(prof, blocks=(dataclasses.replace(prof.blocks[0], transient_bytes=100_000),
                                             prof.blocks[1]))
    cluster = _cluster()
    if calibrated:
        cluster = ClusterSpec.uniform(dataclasses.replace(cluster.devices[0], comm_overlap=0.0), 2)
    units = [UnitPlan(blocks=("layers.0",), checkpoint=("layers.0",)), UnitPlan(blocks=("layers.1",))]
    plan = estimate(prof, cluster, units, forward_prefetch=df, optimizer="adamw", precision="32-true",
                    constraints=ElixirConstraints(**NO_MARGIN))
    assert (plan.peak_bytes, plan.memory.phase, plan.memory.block) == (peak, "backward", "layers.0")


def test_replicated_units_hold_copies_unless_the_whole_plan_runs_on_ddp():
    # Calibrated, one dtype: a plan that replicates every unit on the device without recompute runs on DDP, which
    # computes on the master parameters (no gathered copy); any other plan runs its replicate units as FSDP2 groups
    # of one rank, which gather into a copy (P * c) and reduce through their own buffers.
    import dataclasses

    from tightfit.planner.elixir.replan import replan_in_place

    cluster = _cluster()
    cluster = ClusterSpec.uniform(dataclasses.replace(cluster.devices[0], comm_overlap=0.0), 2)

    def plan(u0: dict, u1: dict):
        units = [UnitPlan(blocks=("layers.0",), **u0), UnitPlan(blocks=("layers.1",), **u1)]
        return estimate(_profile(), cluster, units, optimizer="adamw", precision="32-true",
                        constraints=ElixirConstraints(**NO_MARGIN))

    ddp = plan({"mode": "replicate"}, {"mode": "replicate"})
    assert [u.gathered_bytes for u in ddp.units] == [0, 0]
    mixed = plan({"mode": "replicate"}, {"mode": "reshard"})
    assert [u.gathered_bytes for u in mixed.units] == [1000 * 4, 2000 * 4]
    recomputed = plan({"mode": "replicate", "checkpoint": ("layers.0",)}, {"mode": "replicate"})
    assert [u.gathered_bytes for u in recomputed.units] == [1000 * 4, 2000 * 4]
    # The same state per unit either way: only the copies differ, and they raise the peak.
    assert [u.device_bytes for u in mixed.units][0] == [u.device_bytes for u in ddp.units][0]
    assert recomputed.peak_bytes > ddp.peak_bytes
    # Re-planning keeps FSDP2 groups: the all-replicate plan, re-planned in place, is priced with its copies.
    again = replan_in_place(_profile(), cluster, ddp, memory_budget=10**9, constraints=ElixirConstraints(**NO_MARGIN))
    assert again is not None and [u.gathered_bytes for u in again.units] == [1000 * 4, 2000 * 4]
    assert again.peak_bytes > ddp.peak_bytes
    # An all-replicate plan that runs on FSDP2 (ElixirStrategy(replan=True)) is priced with its copies from the start.
    on_fsdp2 = estimate(_profile(), cluster, [UnitPlan(blocks=("layers.0",), mode="replicate"),
                                              UnitPlan(blocks=("layers.1",), mode="replicate")],
                        optimizer="adamw", precision="32-true",
                        constraints=ElixirConstraints(**NO_MARGIN, replicate_on_ddp=False))
    assert [u.gathered_bytes for u in on_fsdp2.units] == [1000 * 4, 2000 * 4]
    assert on_fsdp2.peak_bytes == again.peak_bytes
    with pytest.raises(ValueError, match="replicate_on_ddp=.no.*True"):
        ElixirConstraints(replicate_on_ddp="no")  # type: ignore[arg-type]
    # Uncalibrated, every replicate unit is priced with its copies, as before.
    plain = estimate(_profile(), _cluster(), [UnitPlan(blocks=("layers.0",), mode="replicate"),
                                              UnitPlan(blocks=("layers.1",), mode="replicate")],
                     optimizer="adamw", precision="32-true", constraints=ElixirConstraints(**NO_MARGIN))
    assert [u.gathered_bytes for u in plain.units] == [1000 * 4, 2000 * 4]
