"""profile_device: measurement, cache, progress, collectives on 2 gloo ranks; presets and ClusterSpec."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from tests.helpers.multiprocess import run_distributed
from tightfit.profiler import ClusterSpec, DeviceProfile
from tightfit.profiler import device as device_mod
from tightfit.profiler.device import (
    DATASHEETS,
    add_cluster_arguments,
    cluster_from_args,
    cluster_spec,
    device_preset,
    profile_device,
)


def test_quick_cpu_profile_is_measured_cached_and_refreshable(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="tightfit")  # progress is logged (tests/core/test_console.py: shown)
    prof = profile_device("cpu", quick=True)
    err = caplog.text
    assert "[profile_device] 1/4 memory" in err and "matmul rate" in err and "cached in" in err
    assert prof.kind == "cpu" and prof.source == "measured" and prof.world_size == 1
    assert prof.memory_bytes >= prof.free_bytes > 0 and prof.host_memory_bytes == prof.memory_bytes
    assert prof.matmul_flops["float32"] > 1e8 and prof.matmul_flops["bfloat16"] > 0
    assert prof.host_adam_elems_per_s > 0 and prof.collective_bytes_per_s == {}
    assert "torch " + torch.__version__ in prof.key
    files = list(tmp_path.glob("device-*-quick.json"))
    assert len(files) == 1 and DeviceProfile.from_json(files[0]) == prof

    calls = []
    real = device_mod._matmul
    monkeypatch.setattr(device_mod, "_matmul", lambda *a: calls.append(a) or real(*a))
    assert profile_device("cpu", quick=True, progress=False) == prof  # from the cache: nothing measured
    assert calls == []
    profile_device("cpu", quick=True, refresh=True, progress=False)
    assert len(calls) == 2  # fp32 and bf16 measured again


def _collective_rank(rank: int, world: int, cache: str) -> dict:
    import os

    os.environ["TIGHTFIT_CACHE_DIR"] = cache
    first = profile_device("cpu", quick=True, progress=False)
    again = profile_device("cpu", quick=True, progress=False)  # every rank agrees to use the cache
    # Rank 0 wrote the file, so it reads back its own profile; other ranks read rank 0's numbers.
    same = again == first if rank == 0 else again.collective_bytes_per_s == first.collective_bytes_per_s
    return {"coll": first.collective_bytes_per_s, "world": first.world_size, "same": same}


def test_collectives_measured_with_a_process_group(tmp_path):
    outs = run_distributed(_collective_rank, world_size=2, args=(str(tmp_path),), timeout=240)
    for out in outs:
        assert out["world"] == 2 and out["same"]
        assert set(out["coll"]) == {"all_gather", "reduce_scatter"}
        for per_size in out["coll"].values():
            assert sorted(per_size) == [2**20, 2**24] and all(v > 0 for v in per_size.values())
    assert outs[0]["coll"] == outs[1]["coll"]  # the slowest rank's time, shared
    assert len(list(tmp_path.glob("device-*world-2-quick.json"))) == 1  # rank 0 wrote it


def test_presets_are_datasheets():
    expected = {"a100-40g", "a100-80g", "h100-80g", "h200-141g", "rtx4090-24g", "l4-24g"}
    assert expected <= set(DATASHEETS)
    for name, prof in DATASHEETS.items():
        assert prof.source == f"datasheet:{name}" and prof.kind == "cuda"
        assert prof.matmul_flops["float16"] > prof.matmul_flops["float32"]
    assert device_preset("h200-141g").memory_bytes == 141 * 10**9
    assert device_preset("A100-40G").memory_bytes == 40 * 2**30
    assert device_preset("h100-80g").matmul_flops["bfloat16"] == 989e12
    with pytest.raises(KeyError, match=r"unknown device preset 'tpu'; presets: a100-40g, a100-80g"):
        device_preset("tpu")


def test_cluster_spec_from_arguments_and_files(tmp_path, monkeypatch):
    spec = cluster_spec(devices=4, device_memory="24GiB", preset="a100-40g")
    assert spec.world_size == 4 and {d.memory_bytes for d in spec.devices} == {24 * 2**30}
    assert spec.devices[0].source == "datasheet:a100-40g"
    mixed = cluster_spec(preset="a100-40g:2,rtx4090-24g:2", nodes=2)
    assert [d.source.split(":")[1] for d in mixed.devices] == ["a100-40g"] * 2 + ["rtx4090-24g"] * 2
    path = tmp_path / "cluster.json"
    mixed.to_json(path)
    assert cluster_spec(profile=path) == mixed
    one = tmp_path / "dev.json"
    device_preset("l4-24g").to_json(one)
    assert cluster_spec(devices=3, profile=one, host_memory="64GiB").devices[2].host_memory_bytes == 64 * 2**30
    with pytest.raises(ValueError, match=r"describes 4 devices but devices=2"):
        cluster_spec(devices=2, profile=path)
    with pytest.raises(ValueError, match=r"lists 2 devices but devices=3"):
        cluster_spec(devices=3, preset="a100-40g:1,l4-24g:1")
    with pytest.raises(ValueError, match=r"either preset= or profile="):
        cluster_spec(preset="a100-40g", profile=one)
    # No preset and no file: this machine, measured (quick) and cached.
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path / "cache"))
    local = cluster_spec(devices=2)
    assert local.world_size == 2 and local.devices[0].source == "measured"


def test_cli_arguments_helper():
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    args = parser.parse_args(["--devices", "4", "--device-memory", "24GiB", "--preset", "a100-40g"])
    spec = cluster_from_args(args)
    assert isinstance(spec, ClusterSpec) and spec.world_size == 4
    assert spec.devices[0].memory_bytes == 24 * 2**30
