"""profile_disk(quick=True): positive fits, the cache reused, refresh re-measures, JSON round trip, and the
store configured from the profile."""

from __future__ import annotations

import pytest

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
        assert store.extent_bytes == p.request_bytes
        assert store.direct == p.direct
        assert repr(store).endswith(f"{max(2, p.queue_depth)} workers)")


def test_bad_directory_is_refused_before_measuring(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        profile_disk(tmp_path / "nope", quick=True, progress=False)
