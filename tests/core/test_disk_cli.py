"""The disk tier's user-facing side: `tightfit profile disk`, the doctor's disk row, disk presets, cluster_spec's disk."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit.cli import main
from tightfit.profiler.device import add_cluster_arguments, cluster_from_args, cluster_spec
from tightfit.profiler.disk_presets import DISK_DATASHEETS, disk_preset, disk_tier, with_disk
from tightfit.profiler.types import ClusterSpec, DiskProfile

GiB = 2**30


# ---------------------------------------------------------------------------- presets


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(DISK_DATASHEETS)), free=st.integers(0, 2**50), total=st.integers(0, 2**50),
       path=st.text(max_size=40), fs=st.sampled_from(["", "ext4", "xfs", "tmpfs"]))
def test_disk_presets_round_trip_json(name, free, total, path, fs):
    d = disk_preset(name, path=path, free_bytes=free, total_bytes=total, filesystem=fs)
    assert d.source == f"datasheet:{name}" and d.free_bytes == free and d.path == path
    assert DiskProfile.from_json(d.to_json()) == d
    assert d.in_memory is (fs == "tmpfs")
    # a preset's numbers price a transfer: latency + bytes / bandwidth, read and write
    assert d.read_seconds(1e9) == pytest.approx(d.read_fit[0] + 1e9 / d.read_fit[1])
    assert d.read_seconds(0) == 0.0 and d.write_seconds(1e9) > d.write_fit[0]


def test_disk_presets_are_typical_datasheet_figures():
    gen4, gen3, sata = (DISK_DATASHEETS[n] for n in ("nvme-gen4", "nvme-gen3", "sata-ssd"))
    assert gen4.read_fit[1] == 7e9 and gen4.write_fit[1] == 5e9 and gen4.read_fit[0] == pytest.approx(80e-6)
    assert gen3.read_fit[1] == 3.5e9 and gen3.write_fit[1] == 3e9
    assert sata.read_fit[1] == 0.55e9 and sata.write_fit[1] == 0.5e9
    assert DISK_DATASHEETS["hdd"].direct is False and DISK_DATASHEETS["hdd"].read_fit[0] > 1e-3
    with pytest.raises(KeyError, match="unknown disk preset 'nvme9'.*nvme-gen4, nvme-gen3"):
        disk_preset("nvme9", path="/x", free_bytes=1)


# ---------------------------------------------------------------------------- cluster_spec


def test_cluster_spec_with_a_disk_preset_and_a_budget():
    spec = cluster_spec(devices=4, preset="a100-40g", disk_preset="nvme-gen4", disk_space="500GiB")
    disk = spec.devices[0].disk
    assert all(d.disk == disk for d in spec.devices)
    assert disk.free_bytes == 500 * GiB and disk.source == "datasheet:nvme-gen4" and disk.read_fit[1] == 7e9
    assert ClusterSpec.from_json(spec.to_json()) == spec
    # today's behaviour without a disk: no disk tier
    assert all(d.disk is None for d in cluster_spec(devices=2, preset="a100-40g").devices)
    # a budget alone resizes the disk tier a profile already has, and needs one
    resized = cluster_spec(profile=spec, disk_space="100GiB")
    assert resized.devices[3].disk.free_bytes == 100 * GiB and resized.devices[3].disk.read_fit == disk.read_fit
    with pytest.raises(ValueError, match="without a disk tier.*--disk-dir DIR"):
        cluster_spec(devices=2, preset="a100-40g", disk_space="100GiB")
    with pytest.raises(ValueError, match="disk preset 'sata-ssd' without a directory.*--disk-space"):
        cluster_spec(preset="a100-40g", disk_preset="sata-ssd")
    with pytest.raises(ValueError, match="either disk="):
        cluster_spec(preset="a100-40g", disk=disk, disk_preset="hdd")
    assert with_disk(spec, None) is spec


def test_cluster_spec_with_a_directory_and_a_preset_speed(tmp_path):
    spec = cluster_spec(devices=2, preset="l4-24g", disk_dir=tmp_path, disk_preset="sata-ssd")
    disk = spec.devices[0].disk
    free = shutil.disk_usage(tmp_path).free
    assert disk.path == str(tmp_path.resolve()) and disk.source == "datasheet:sata-ssd"
    assert abs(disk.free_bytes - free) < GiB and disk.total_bytes >= disk.free_bytes and disk.filesystem


def test_cluster_arguments_carry_the_disk_tier():
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    args = parser.parse_args(["--devices", "2", "--preset", "a100-80g", "--disk-preset", "nvme-gen3",
                              "--disk-space", "2TiB"])
    spec = cluster_from_args(args)
    assert spec.world_size == 2 and spec.devices[1].disk.free_bytes == 2 * 2**40
    assert cluster_from_args(parser.parse_args(["--preset", "a100-80g"])).devices[0].disk is None


# ---------------------------------------------------------------------------- tightfit profile disk


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One quick measurement of a temporary directory, through the CLI, cached in a temporary cache dir."""
    cache, where = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("disk")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIGHTFIT_CACHE_DIR", str(cache))
        out = where / "disk.json"
        assert main(["-q", "profile", "disk", str(where), "--quick", "--json", str(out)]) == 0
    return cache, where, DiskProfile.from_json(out)


def test_profile_disk_prints_the_measured_profile(measured, monkeypatch, capsys):
    cache, where, prof = measured
    assert prof.source == "measured" and prof.path == str(where.resolve()) and prof.free_bytes > 0
    assert prof.read_fit[1] > 0 and prof.write_fit[1] > 0 and prof.read_bytes_per_s and prof.write_bytes_per_s
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(cache))
    assert main(["profile", "disk", str(where), "--quick"]) == 0  # cached now: instant
    out = capsys.readouterr().out
    for label in ("path", "filesystem", "free", "read fit", "write fit", "request size", "queue depth", "I/O",
                  "read GB/s", "write GB/s", "<- chosen"):
        assert label in out, (label, out)
    assert str(where.resolve()) in out and ("O_DIRECT" in out or "buffered" in out)
    assert main(["profile", "disk", str(where), "--quick", "--json"]) == 0
    same = lambda d: dataclasses.replace(d, free_bytes=prof.free_bytes)  # noqa: E731 (free space is read anew)
    assert same(DiskProfile.from_json(capsys.readouterr().out)) == prof
    # the cached measurement is what cluster_spec(disk_dir=) uses
    assert same(cluster_spec(devices=2, preset="a100-40g", disk_dir=where).devices[1].disk) == prof


def test_profile_disk_preset_and_list(tmp_path, capsys):
    assert main(["profile", "disk", str(tmp_path), "--preset", "nvme-gen4"]) == 0
    out = capsys.readouterr().out
    assert "datasheet:nvme-gen4" in out and "7.00 GB/s" in out and "80 us" in out
    assert main(["profile", "disk", "--list-presets"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in DISK_DATASHEETS) and "(typical)" in listing


def _one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_profile_disk_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    missing = _one_line_error(["profile", "disk", str(tmp_path / "nope"), "--quick"], capsys)
    assert missing.startswith("tightfit profile disk:") and "nope" in missing
    (tmp_path / "f").write_text("x")
    a_file = _one_line_error(["profile", "disk", str(tmp_path / "f"), "--quick"], capsys)
    assert "f" in a_file and "director" in a_file
    readonly = _one_line_error(["profile", "disk", "/proc/self", "--quick"], capsys)  # root cannot write there
    assert "/proc/self" in readonly
    assert "give the directory" in _one_line_error(["profile", "disk"], capsys)
    assert "nvme-gen4" in _one_line_error(["profile", "disk", str(tmp_path), "--preset", "nvme9"], capsys)


# ---------------------------------------------------------------------------- tightfit doctor


def _doctor(capsys, *extra: str) -> dict:
    assert main(["doctor", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["disk"]


def test_doctor_says_how_to_measure_the_disk(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path / "cache"))  # does not exist yet: its disk does
    row = _doctor(capsys)
    assert row["measured"] is False and "tightfit profile disk" in row["detail"] and row["free_bytes"] > 0
    assert main(["doctor"]) == 0
    assert "disk tier" in capsys.readouterr().out
    assert "not a directory" in _one_line_error(["doctor", "--disk-dir", str(tmp_path / "nope")], capsys)


def test_doctor_shows_a_cached_disk_profile(measured, tmp_path, monkeypatch, capsys):
    cache, where, prof = measured
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(cache))
    row = _doctor(capsys, "--disk-dir", str(where))
    assert row["measured"] is True and row["read_bytes_per_s"] == prof.read_fit[1]
    assert row["write_bytes_per_s"] == prof.write_fit[1] and row["filesystem"] == prof.filesystem
    assert main(["doctor", "--disk-dir", str(where)]) == 0
    assert f"read {prof.read_fit[1] / 1e9:.2f} GB/s" in capsys.readouterr().out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.one_of(st.binary(max_size=300), st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(
    st.sampled_from(["__type__", "path", "read_fit", "write_fit", "filesystem"]),
    st.one_of(st.just("DiskProfile"), st.text(max_size=10), st.integers(), st.lists(st.floats(), max_size=3))))))
def test_doctor_survives_any_cache_file(junk, tmp_path, monkeypatch, capsys):
    """A cache file that is not a readable disk profile is skipped, never a crash (the cache is on disk)."""
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "disk-junk.json").write_bytes(b'{"__type__": "DiskProfile", ' + junk)
    (cache / "disk-junk2.json").write_bytes(junk)
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(cache))
    row = _doctor(capsys, "--disk-dir", str(tmp_path))
    assert isinstance(row["measured"], bool)


def test_doctor_prefers_the_profile_of_the_directory_itself(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    other = tmp_path / "other"
    other.mkdir()
    disk_preset("sata-ssd", path=str(other), free_bytes=1).to_json(cache / "disk-a.json")
    disk_preset("nvme-gen4", path=str(tmp_path), free_bytes=1).to_json(cache / "disk-b.json")
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(cache))
    assert _doctor(capsys, "--disk-dir", str(tmp_path))["read_bytes_per_s"] == 7e9
    assert _doctor(capsys, "--disk-dir", str(other))["read_bytes_per_s"] == 0.55e9
    assert disk_tier() is None and Path(_doctor(capsys)["path"]).exists()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_profile_disk_on_tmpfs_warns_that_it_is_ram(capsys):
    import tempfile

    from tightfit.storage import mount_of

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        if mount_of(d).filesystem != "tmpfs":
            pytest.skip("/dev/shm is not tmpfs here")
        assert main(["profile", "disk", d, "--preset", "nvme-gen4"]) == 0
        captured = capsys.readouterr()
    assert "tmpfs (RAM: a disk tier here saves no memory)" in captured.out
    [warning] = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert warning.startswith("tightfit profile disk:") and "RAM" in warning and "Traceback" not in warning


def test_the_parsers_disk_preset_names_are_the_presets():
    from tightfit.commands.args import DISK_PRESETS
    from tightfit.profiler.disk_presets import DISK_DATASHEETS

    assert DISK_PRESETS == tuple(DISK_DATASHEETS)
