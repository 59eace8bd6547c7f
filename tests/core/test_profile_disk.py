"""profile_disk(quick=True): positive fits, the overlap with compute measured (and added to a profile cached
without it), the cache reused, refresh re-measures, JSON round trip, and the store configured from the profile."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tightfit.profiler import DiskProfile, profile_disk
from tightfit.profiler.disk import disk_cache_file, disk_key
from tightfit.storage import StorageError, TensorStore


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    disk = tmp_path_factory.mktemp("disk")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIGHTFIT_CACHE_DIR", str(cache))
        yield profile_disk(disk, quick=True, progress=False), disk, cache


def test_quick_profile_has_positive_fits_and_a_choice(measured):
    p, disk, _ = measured
    assert p.source == "measured" and p.path == str(disk) and p.filesystem
    assert p.free_bytes > 0 and p.total_bytes >= p.free_bytes
    for latency, bandwidth in (p.read_fit, p.write_fit):
        assert latency >= 0 and bandwidth > 1e6
    assert p.read_seconds(2**30) > p.read_seconds(2**20) > 0
    assert p.request_bytes in p.read_bytes_per_s and p.queue_depth in p.read_bytes_per_s[p.request_bytes]
    assert all(rate > 0 for per in p.write_bytes_per_s.values() for rate in per.values())
    assert not any(f.name.startswith(".tightfit-disk-profile") for f in disk.iterdir())  # scratch removed
    assert 0.0 <= p.compute_overlap <= 1.0  # measured (-1 would mean not measured: full overlap assumed)


def test_a_profile_cached_without_the_overlap_gains_it_and_keeps_the_rest(measured, monkeypatch):
    p, disk, cache = measured
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(cache))
    f = disk_cache_file(disk_key(disk), True)
    dataclasses.replace(p, compute_overlap=-1.0).to_json(f)  # as a profile cached by an earlier version
    got = profile_disk(disk, quick=True, progress=False)
    assert 0.0 <= got.compute_overlap <= 1.0
    assert (got.read_fit, got.write_fit, got.request_bytes, got.queue_depth) == (
        p.read_fit, p.write_fit, p.request_bytes, p.queue_depth)  # only the overlap was measured
    assert DiskProfile.from_json(f).compute_overlap == got.compute_overlap  # and kept in the cache
    assert not any(x.name.startswith(".tightfit-disk-profile") for x in disk.iterdir())


def test_scattered_reads_are_measured_at_the_cache_request_sizes_and_added_to_an_older_profile(measured,
                                                                                             monkeypatch):
    from tightfit.profiler.disk import RANDOM_SIZES

    p, disk, cache = measured
    assert sorted(p.random_read_bytes_per_s) == RANDOM_SIZES and all(r > 0 for r in p.random_read_bytes_per_s.values())
    # a scattered 4 KiB read costs at least what its share of a sequential pass does at the profile's best size
    assert p.random_read_seconds(1000, 4096) > 0
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(cache))
    f = disk_cache_file(disk_key(disk), True)
    dataclasses.replace(p, random_read_bytes_per_s={}).to_json(f)  # cached before they were measured
    got = profile_disk(disk, quick=True, progress=False)
    assert sorted(got.random_read_bytes_per_s) == RANDOM_SIZES and got.read_fit == p.read_fit
    assert DiskProfile.from_json(f).random_read_bytes_per_s == got.random_read_bytes_per_s
    assert not any(x.name.startswith(".tightfit-disk-profile") for x in disk.iterdir())
    with pytest.raises(ValueError, match=r"random_read_bytes_per_s\[4096\]"):
        dataclasses.replace(p, random_read_bytes_per_s={4096: 0.0})


@given(st.floats(1e-4, 1e3), st.floats(1e-4, 1e3), st.floats(0.0, 1.0))
def test_overlap_fraction_inverts_the_rule_the_planner_prices_with(compute, io, o):
    from tightfit.planner.elixir.disk import disk_optimizer_seconds
    from tightfit.profiler.disk import overlap_fraction

    both = compute + io - o * min(compute, io)  # disk_optimizer_seconds' rule
    assert overlap_fraction(compute, io, both) == pytest.approx(o, abs=1e-6)
    disk = DiskProfile(path="/x", free_bytes=1, read_fit=(0.0, 1e9), write_fit=(0.0, 1e9))
    opt, io_s = disk_optimizer_seconds(disk, 1e9 * io / 2, compute=compute, sharers=1, overlap=o)
    assert opt == pytest.approx(compute + io_s - o * min(compute, io_s))


@given(st.floats(0.0, 1e3), st.floats(0.0, 1e3), st.floats(0.0, 1e4))
def test_overlap_fraction_is_a_fraction_for_any_timing(compute, io, both):
    from tightfit.profiler.disk import overlap_fraction

    assert 0.0 <= overlap_fraction(compute, io, both) <= 1.0


def test_second_call_uses_the_cache_and_refresh_measures_again(measured, monkeypatch):
    p, disk, cache = measured
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(cache))
    f = disk_cache_file(disk_key(disk), True)
    assert f.is_file()
    stamp = f.stat().st_mtime_ns
    again = profile_disk(disk, quick=True, progress=False)
    assert f.stat().st_mtime_ns == stamp  # nothing re-measured or re-written
    assert again.read_bytes_per_s == p.read_bytes_per_s and again.read_fit == p.read_fit
    fresh = profile_disk(disk, quick=True, refresh=True, progress=False)
    assert f.stat().st_mtime_ns != stamp
    assert fresh.read_bytes_per_s != p.read_bytes_per_s  # a new measurement (timings never repeat exactly)


def test_json_round_trip(measured, tmp_path):
    p, _, _ = measured
    assert DiskProfile.from_json(p.to_json()) == p
    p.to_json(tmp_path / "disk.json")
    assert DiskProfile.from_json(tmp_path / "disk.json") == p


def test_store_follows_the_profile(measured, tmp_path):
    p, _, _ = measured
    with TensorStore(tmp_path, profile=p) as store:
        assert store.extent_bytes == max(p.request_bytes, 2**20)  # small requests: 1 MiB extents, a small index
        assert store.direct == p.direct
        assert repr(store).endswith(f"{max(2, p.queue_depth)} workers)")


def test_bad_directory_is_refused_before_measuring(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        profile_disk(tmp_path / "nope", quick=True, progress=False)


def test_request_size_and_depth_rule_by_hand():
    from tightfit.profiler.disk import smallest_within

    rates = {65536: 0.50e9, 262144: 0.96e9, 1048576: 1.00e9, 4194304: 0.99e9}
    assert smallest_within(rates) == 262144  # 0.96 >= 0.95 x the best 1.00
    assert smallest_within(rates, within=0.02) == 1048576
    assert smallest_within({1: 0.7e9, 2: 1.2e9, 4: 1.19e9, 8: 1.21e9}) == 2
