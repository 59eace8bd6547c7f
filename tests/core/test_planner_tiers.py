"""Three-tier planning (device, host, disk): the shared pricing and the pool and cache planners' disk terms,
each against numbers computed by hand."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.distributed import decide_on_rank0
from tightfit.planner.cache import DISK_PAGE_BYTES, HOST_INDEX_BYTES_PER_ROW, CacheTableSpec, plan_cache
from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.pool import PoolInfeasibleError, PoolPlan, plan_pool
from tightfit.planner.tiers import MemoryTiers, disk_seconds, memory_tiers, tier_error
from tightfit.profiler.types import DiskProfile, ProfileError

GiB = 2**30
# Round numbers: 1 ms per request, reads at 1 GB/s, writes at 0.5 GB/s.
DISK = DiskProfile(path="/nvme/tf", free_bytes=12 * GiB, filesystem="ext4", read_fit=(1e-3, 1e9),
                   write_fit=(1e-3, 5e8))


# ----------------------------------------------------------------------------- shared pricing


def test_disk_seconds_is_latency_plus_bytes_over_bandwidth_split_between_sharers():
    assert disk_seconds(DISK, 0) == 0.0
    assert disk_seconds(DISK, 2e9) == pytest.approx(1e-3 + 2.0)
    assert disk_seconds(DISK, 2e9, write=True) == pytest.approx(1e-3 + 4.0)
    # two ranks of a node streaming at once: each sees half the bandwidth, the latency once
    assert disk_seconds(DISK, 2e9, sharers=2) == pytest.approx(1e-3 + 4.0)
    assert DISK.read_seconds(2e9) == disk_seconds(DISK, 2e9)


def test_memory_tiers_split_the_disk_between_ranks_and_refuse_ram():
    t = memory_tiers(device_bytes="8GiB", host_bytes=4 * GiB, disk=DISK, sharers=2)
    assert (t.device_bytes, t.host_bytes, t.disk_bytes) == (8 * GiB, 4 * GiB, 6 * GiB)
    assert memory_tiers(device_bytes=None, disk=DISK, disk_bytes="1GiB").disk_bytes == GiB
    assert memory_tiers(device_bytes=None, disk=DISK, disk_bytes="100GiB").disk_bytes == 12 * GiB  # capped at free
    assert not memory_tiers(device_bytes=1).has_disk
    ram = DiskProfile(path="/dev/shm/x", free_bytes=GiB, filesystem="tmpfs")
    with pytest.raises(PlanError, match=r"'/dev/shm/x' is on tmpfs \(RAM\).*saves no memory"):
        memory_tiers(device_bytes=1, disk=ram)
    with pytest.raises(PlanError, match=r"host budget: .*"):
        memory_tiers(device_bytes=1, host_bytes="lots")
    with pytest.raises(PlanError, match="disk_bytes=5 without a disk profile"):
        MemoryTiers(device_bytes=1, host_bytes=None, disk_bytes=5)


def test_tier_errors_name_the_tier_what_it_has_and_what_is_needed():
    t = memory_tiers(device_bytes=8 * GiB, host_bytes=4 * GiB, disk=DISK)
    err = tier_error(t, "disk", needed=int(31.5 * GiB), what="the plan")
    assert str(err).startswith("disk has 12.00 GiB free in /nvme/tf, the plan needs 31.50 GiB (19.50 GiB short)")
    assert (err.tier, err.needed_bytes, err.budget_bytes, err.short_bytes) == ("disk", int(31.5 * GiB), 12 * GiB,
                                                                               int(19.5 * GiB))
    host = tier_error(memory_tiers(device_bytes=1, host_bytes=GiB), "host", needed=3 * GiB)
    assert host.tier == "host" and "give a disk directory (disk_dir)" in str(host)
    with pytest.raises(ValueError, match="tier='ssd'"):
        PlanInfeasibleError("x", needed_bytes=1, budget_bytes=0, tier="ssd")


def test_the_short_tier_crosses_ranks_with_the_error():
    def decide():
        raise tier_error(memory_tiers(device_bytes=1, host_bytes=10, disk=DISK), "disk", needed=13 * GiB)

    with pytest.raises(PlanInfeasibleError) as info:
        decide_on_rank0(decide, encode=str, decode=str)
    assert info.value.tier == "disk" and info.value.budget_bytes == 12 * GiB


def test_disk_profile_refuses_numbers_no_planner_can_use():
    with pytest.raises(ProfileError, match=r"read_fit\[1\] \(bandwidth\)=0"):
        DiskProfile(path="/x", free_bytes=1, read_fit=(0.0, 0.0))
    with pytest.raises(ProfileError, match="queue_depth=0"):
        DiskProfile(path="/x", free_bytes=1, queue_depth=0)
    with pytest.raises(ProfileError, match=r"write_fit=\(1.0,\) must be \[latency_s, bytes_per_s\]"):
        DiskProfile(path="/x", free_bytes=1, write_fit=(1.0,))  # type: ignore[arg-type]
    assert DiskProfile.from_json(DISK.to_json()) == DISK


# ----------------------------------------------------------------------------- the weight pool


def test_pool_without_tiers_is_the_plan_it_always_was():
    plan = plan_pool([100] * 6, resident_bytes=50, budget_bytes=600, lookahead=2)
    assert plan.pooled == (0, 1, 3, 4) and plan.tiers == () and plan.host_bytes == 0 and plan.io_seconds == 0
    assert plan.tier_of(0) == "host" and plan.tier_of(2) == "device"


def test_pool_keeps_what_the_host_holds_and_reads_the_rest_from_disk():
    # 8 layers of 1 MB, resident 0.5 MB, device budget 5.5 MB, lookahead 1 (2 slots):
    # device = 0.5 + (8 - k) + 2 <= 5.5 -> k = 5 pooled, spread: 0, 1, 3, 4, 6 (5 MB).
    mb = 10**6
    layers = [mb] * 8
    free_host = plan_pool(layers, resident_bytes=mb // 2, budget_bytes=11 * mb // 2, lookahead=1,
                          host_budget_bytes=10 * mb, disk=DISK)
    assert free_host.pooled == (0, 1, 3, 4, 6) and free_host.tiers == ("host",) * 5 and free_host.io_seconds == 0
    # Host budget 4 MB: j disk layers need 5 - j layers + min(2, j) staging slots on the host:
    # j=1: 4 + 1 = 5, j=2: 3 + 2 = 5, j=3: 2 + 2 = 4 MB -> 3 disk layers, spread over the pooled: 0, 1, 3 of them.
    plan = plan_pool(layers, resident_bytes=mb // 2, budget_bytes=11 * mb // 2, lookahead=1,
                     host_budget_bytes=4 * mb, disk=DISK, layer_seconds=[1e-3] * 8)
    assert plan.tiers == ("disk", "disk", "host", "disk", "host")
    assert plan.disk_layers == (0, 1, 4) and plan.tier_of(4) == "disk" and plan.tier_of(3) == "host"
    assert (plan.host_bytes, plan.disk_bytes, plan.device_bytes) == (4 * mb, 3 * mb, 11 * mb // 2)
    # each read: 1 ms + 1 MB / 1 GB/s = 2 ms; compute 8 ms hides all 6 ms
    assert plan.io_seconds == pytest.approx(3 * 2e-3) and plan.compute_seconds == pytest.approx(8e-3)
    assert plan.stall_seconds == 0.0
    assert plan.io_roofline(16) == pytest.approx(16 / 6e-3)
    slow = plan_pool(layers, resident_bytes=mb // 2, budget_bytes=11 * mb // 2, lookahead=1,
                     host_budget_bytes=4 * mb, disk=DISK, layer_seconds=[1e-4] * 8, sharers=2)
    # two ranks share the disk: each read 1 ms + 2 ms; compute 0.8 ms hides 0.8 of 9 ms
    assert slow.io_seconds == pytest.approx(9e-3) and slow.stall_seconds == pytest.approx(9e-3 - 8e-4)
    assert PoolPlan.from_json(plan.to_json()) == plan


def test_pool_host_short_names_the_host_tier():
    with pytest.raises(PlanInfeasibleError, match=r"host memory budget is 100 B, pooling 3 layers needs 300 B") as info:
        plan_pool([100] * 4, resident_bytes=0, budget_bytes=250, lookahead=0, host_budget_bytes=100)
    assert info.value.tier == "host" and "disk_dir" in str(info.value)
    # with a disk the staging slot alone (100 B) must fit: a 50 B host cannot take even that
    with pytest.raises(PlanInfeasibleError, match="staging") as info:
        plan_pool([100] * 4, resident_bytes=0, budget_bytes=250, lookahead=0, host_budget_bytes=50, disk=DISK)
    assert info.value.tier == "host" and info.value.needed_bytes == 100


def test_pool_on_one_memory_reads_from_disk_exactly_what_does_not_fit():
    # A CPU "device": 6 layers of 100 B, resident 50, budget 450 for everything held, lookahead 1.
    # k disk layers hold 50 + (6 - k) * 100 + min(2, k) * 100: k=1: 650, k=2: 650, k=3: 550, k=4: 450.
    plan = plan_pool([100] * 6, resident_bytes=50, budget_bytes=450, lookahead=1, disk=DISK, unified=True)
    assert plan.pooled == plan.disk_layers == (0, 1, 3, 4) and plan.host_bytes == 0
    assert plan.device_bytes == 450 and plan.disk_bytes == 400
    with pytest.raises(PoolInfeasibleError) as info:
        plan_pool([100] * 6, resident_bytes=50, budget_bytes=200, lookahead=1, disk=DISK, unified=True)
    assert (info.value.needed_bytes, info.value.budget_bytes) == (250, 200)
    assert pickle.loads(pickle.dumps(info.value)).needed_bytes == 250
    # One memory: the message says so rather than naming a device the machine does not have.
    assert "on a CPU the device and the host are one memory" in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).unified
    with pytest.raises(PoolInfeasibleError, match="on the device with every layer pooled"):
        plan_pool([100] * 6, resident_bytes=50, budget_bytes=10, lookahead=1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.integers(0, 500), st.integers(0, 3),
       st.integers(0, 12000), st.integers(0, 12000))
def test_pool_plans_stay_within_every_budget_they_are_given(layers, resident, lookahead, budget, host):
    try:
        plan = plan_pool(layers, resident_bytes=resident, budget_bytes=budget, lookahead=lookahead,
                         host_budget_bytes=host, disk=DISK)
    except PlanInfeasibleError as err:
        assert err.needed_bytes > err.budget_bytes and err.tier in ("device", "host")
        return
    assert plan.device_bytes <= budget and plan.host_bytes <= host
    assert plan.disk_bytes == sum(layers[i] for i in plan.disk_layers)
    assert sorted(plan.disk_layers) == list(plan.disk_layers) and set(plan.disk_layers) <= set(plan.pooled)
    # the fewest disk layers: one fewer would not fit the host
    if plan.disk_layers:
        fewer = plan_pool(layers, resident_bytes=resident, budget_bytes=budget, lookahead=lookahead, disk=DISK)
        assert fewer.host_bytes > host


# ----------------------------------------------------------------------------- the embedding cache


def test_cache_without_disk_keeps_full_tables_in_host_memory_or_names_the_host_tier():
    t = [CacheTableSpec(name="a", rows=1000, dim=16), CacheTableSpec(name="b", rows=3000, dim=16, state_columns=16)]
    plan = plan_cache(t, budget_bytes=64_000)
    assert plan.host_bytes == 1000 * 64 + 3000 * 128 and plan.disk_bytes == 0 and plan.host_rows == {}
    with pytest.raises(PlanInfeasibleError, match=r"host memory budget is .*storing the full tables \(2\) needs") as info:
        plan_cache(t, budget_bytes=64_000, host_budget_bytes=100_000)
    assert info.value.tier == "host" and info.value.needed_bytes == 448_000
    small = DiskProfile(path="/small", free_bytes=400_000)
    with pytest.raises(PlanInfeasibleError, match=r"disk has .* free in /small, storing the full tables \(2\) needs") as info:
        plan_cache(t, budget_bytes=64_000, host_budget_bytes=100_000, disk=small)
    assert info.value.tier == "disk" and info.value.short_bytes == 48_000


def test_cache_host_level_takes_the_next_most_used_rows_and_prices_the_misses():
    # One table of 100 rows, dim 4 fp32 (16 B rows), used 100, 99, ..., 1 times (5050 ids).
    t = [CacheTableSpec(name="t", rows=100, dim=4, index_bytes_per_slot=0)]
    freq = {"t": torch.arange(100, 0, -1)}
    # Device: index 100 * 4 B, slots 16 B: 400 + 10 * 16 = 560 B -> 10 slots (rows used 100..91).
    # Host: 20 rows of 16 + 16 B = 640 B -> rows used 90..71.
    plan = plan_cache(t, budget_bytes=560, frequencies=freq, host_budget_bytes=20 * (16 + HOST_INDEX_BYTES_PER_ROW),
                      disk=DISK)
    assert plan.slots == {"t": 10} and plan.host_rows == {"t": 20}
    assert plan.host_bytes == 640 and plan.disk_bytes == 1600
    assert plan.predicted_hit_rate == pytest.approx(sum(range(91, 101)) / 5050)
    assert plan.predicted_host_hit_rate == pytest.approx(sum(range(71, 101)) / 5050)
    missed_ids = sum(range(1, 71))  # each miss reads a 4 KiB page at 1 GB/s
    assert plan.disk_seconds_per_id == pytest.approx(missed_ids * DISK_PAGE_BYTES / 1e9 / 5050)
    assert "host level 20 rows" in plan.explain()


def test_cache_plan_prices_disk_misses_at_the_profiled_random_reads_of_their_size():
    import dataclasses

    # The plan above, on a disk whose scattered 4 KiB reads run at 0.2 GB/s (16 KiB: 0.6 GB/s) though it streams
    # at 1 GB/s: a miss costs a 4 KiB block at the random-read rate, rows of 4-8 KiB two blocks at the 16 KiB rate.
    disk = dataclasses.replace(DISK, random_read_bytes_per_s={4096: 2e8, 16384: 6e8})
    freq = {"t": torch.arange(100, 0, -1)}
    t = [CacheTableSpec(name="t", rows=100, dim=4, index_bytes_per_slot=0)]
    plan = plan_cache(t, budget_bytes=560, frequencies=freq, host_budget_bytes=20 * (16 + HOST_INDEX_BYTES_PER_ROW),
                      disk=disk)
    missed_ids = sum(range(1, 71))
    assert plan.disk_seconds_per_id == pytest.approx(missed_ids * 4096 / 2e8 / 5050)
    wide = [CacheTableSpec(name="t", rows=100, dim=1500, index_bytes_per_slot=0)]  # 6000-byte rows: 8 KiB each
    plan = plan_cache(wide, budget_bytes=400 + 10 * 6000, frequencies=freq, host_budget_bytes=0, disk=disk)
    missed = sum(range(1, 91))
    assert plan.slots == {"t": 10} and plan.disk_seconds_per_id == pytest.approx(missed * 8192 / 6e8 / 5050)


def test_cache_host_level_without_statistics_is_the_same_fraction_of_each_table():
    t = [CacheTableSpec(name="a", rows=1000, dim=16), CacheTableSpec(name="b", rows=3000, dim=16)]
    plan = plan_cache(t, budget_bytes=64_000, host_budget_bytes=100_000, disk=DISK)
    room_a, room_b = 1000 - plan.slots["a"], 3000 - plan.slots["b"]
    frac = 100_000 / ((room_a + room_b) * (64 + HOST_INDEX_BYTES_PER_ROW))
    assert plan.host_rows == {"a": int(room_a * frac), "b": int(room_b * frac)}
    assert plan.host_bytes <= 100_000 and plan.predicted_host_hit_rate is None
    everything = plan_cache(t, budget_bytes=64_000, disk=DISK)  # unbounded host: every row has a host copy
    assert everything.host_rows == {"a": room_a, "b": room_b}
