"""Inside a hard memory limit (a cgroup v1 group, ``benchmarks/memlimit.py``), every default path reads the limit and
is never OOM-killed: it fits, giving what the unlimited run gives, or it refuses in one line before any work.

The paths (``tests/helpers/memory_limit_children.py``), each under a limit smaller than what it uses unlimited:
``Trainer(strategy=ElixirStrategy(disk_dir=D))`` on a GPT whose fp32 AdamW state is larger than the limit; the cached
DLRM with a ``disk_dir``; ``SkyStrategy()`` on two ranks sharing one limit; and ``tightfit profile device`` /
``tightfit plan elixir`` on this machine, which show and plan within the limit.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks.memlimit import LimitedRun, last_json_line, limit_unavailable, run_limited
from tests.helpers.multiprocess import free_port, unlaunched_env
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.skipif(limit_unavailable() is not None, reason=str(limit_unavailable()))

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _child(kind: str, work: Path, limit: int, env: dict[str, str] | None = None) -> LimitedRun:
    # The child starts its own ranks: a launcher's variables left by an earlier in-process Trainer must not reach it.
    return run_limited([sys.executable, "-m", "tests.helpers.memory_limit_children", kind, str(work)], limit,
                       name=f"test-{kind}", cwd=ROOT, env=env if env is not None else unlaunched_env(), timeout=300)


@pytest.fixture(scope="module")
def elixir_cache(tmp_path_factory) -> Path:
    """The measurements (``TIGHTFIT_CACHE_DIR``) of this machine and of the Elixir GPT's blocks, shared by
    this module's Elixir children: the first run measures them under its limit, the later ones read them."""
    return tmp_path_factory.mktemp("elixir-cache")


def _fits_or_refuses(run: LimitedRun) -> dict:
    """The run was not killed by the limit and either finished or refused in one line (exit code 3)."""
    assert run.enforced and not run.oom_killed, (run.returncode, run.peak_bytes, run.stderr[-3000:])
    assert run.returncode in (0, 3), run.stderr[-3000:]
    out = last_json_line(run.stdout)
    if run.returncode == 3:
        assert "\n" not in out["refused"] and out["refused"], out
    assert run.peak_bytes is not None and run.peak_bytes <= run.limit_bytes
    return out


@RunIf(lightning=True)
def test_elixir_with_only_a_disk_dir_trains_a_model_whose_state_exceeds_the_limit(tmp_path, elixir_cache):
    from tests.helpers.memory_limit_children import ELIXIR_GPT

    # The tied embedding's backward holds three table-sized copies: the least-memory plan needs about 976 MiB of the
    # budget (the limit less 10%), which 1150 MiB gives with some margin while the fp32 AdamW state (1.25 GiB) does not fit.
    limit = 1150 * MiB
    # A first run on a fresh machine, as CI's: nothing cached, so the device and its blocks are measured in this
    # process before it plans (what those measurements import stays resident and counts against the limit). It
    # measures into the module's cache when first to use it (the later children read it), else into its own.
    cache = elixir_cache if not any(elixir_cache.iterdir()) else tmp_path / "cache"
    env = unlaunched_env(TIGHTFIT_CACHE_DIR=str(cache))
    limited = _child("elixir", tmp_path / "limited", limit, env=env)
    got = _fits_or_refuses(limited)
    assert limited.returncode == 0, got  # the disk tier makes it fit: no refusal here
    tables = 1 if ELIXIR_GPT["tie_embeddings"] else 2  # the head shares the token embedding (GPT-2's tie)
    hidden = ELIXIR_GPT["hidden"]
    params = ELIXIR_GPT["vocab_size"] * hidden * tables + ELIXIR_GPT["layers"] * 12 * hidden ** 2
    assert 16 * params > limit  # fp32 AdamW state alone is larger than the limit
    assert got["disk_units"] > 0 and got["budget_bytes"] <= limit and got["peak_bytes"] <= got["budget_bytes"]
    explain = got["explain"]
    assert "whole process per device" in explain and "memory limit" in explain and "reserve" in explain
    # Unlimited, the same script keeps everything in RAM and uses more than the limit; the losses are the same.
    free = _child("elixir", tmp_path / "free", 1 << 50, env=env)
    ref = _fits_or_refuses(free)
    assert free.returncode == 0 and ref["disk_units"] == 0 and free.peak_bytes > limit
    assert got["losses"] == ref["losses"]


@RunIf(lightning=True)
def test_elixir_refuses_a_limit_below_its_floor_and_a_budget_above_the_limit_in_one_line(tmp_path,
                                                                                         elixir_cache):
    # The device's and the disk's measurements from the module's cache, no block timings (as on a first run: a
    # child that timed its blocks before refusing would be killed by the limit instead).
    cache = tmp_path / "cache"
    cache.mkdir()
    for measured in elixir_cache.glob("*.json"):
        if not measured.name.startswith("blocks-"):
            shutil.copy(measured, cache)
    env = unlaunched_env(TIGHTFIT_CACHE_DIR=str(cache))
    floor = _fits_or_refuses(_child("elixir", tmp_path / "floor", 600 * MiB, env=env))
    assert "refused" in floor, floor
    assert floor["type"] == "MemoryLimitError" and "memory limit of 600.00 MiB" in floor["refused"]
    assert "least-memory plan" in floor["refused"] and "Cheapest change" in floor["refused"]
    over = _fits_or_refuses(_child("elixir-budget-2GiB", tmp_path / "over", 900 * MiB, env=env))
    assert over["type"] == "MemoryLimitError", over
    assert "memory_budget='2GiB'" in over["refused"] and "give at most" in over["refused"]


@RunIf(torchrec=True)
def test_cached_dlrm_with_a_disk_dir_fits_the_limit_its_tables_exceed_and_without_one_refuses(tmp_path):
    from tests.helpers.memory_limit_children import DLRM_DIM, DLRM_ROWS

    limit = 450 * MiB
    assert 2 * DLRM_ROWS * DLRM_DIM * 4 > 0.7 * limit  # the tables alone take most of the limit
    on_disk = _child("dlrm", tmp_path / "disk", limit)
    got = _fits_or_refuses(on_disk)
    assert on_disk.returncode == 0, got
    free = _child("dlrm", tmp_path / "free", 1 << 50)
    assert free.returncode == 0 and last_json_line(free.stdout)["losses"] == got["losses"]
    in_ram = _child("dlrm-in-ram", tmp_path / "ram", limit)
    refused = _fits_or_refuses(in_ram)
    assert in_ram.returncode == 3 and "give CacheConfig(disk_dir=" in refused["refused"], refused
    assert "memory limit of 450.00 MiB" in refused["refused"]


@RunIf(lightning=True, min_world=2)
def test_sky_on_two_ranks_sharing_a_limit_fits_it_or_refuses_in_one_line(tmp_path):
    def run(limit: int, sub: str) -> tuple[LimitedRun, list[dict]]:
        env = unlaunched_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        r = _child("sky", tmp_path / sub, limit, env=env)
        assert r.enforced and not r.oom_killed and r.returncode in (0, 3), (r.returncode, r.stderr[-3000:])
        return r, [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]

    free, ref = run(1 << 50, "free")
    limit = 1050 * MiB
    assert free.returncode == 0 and free.peak_bytes > limit
    limited, got = run(limit, "limited")
    assert limited.peak_bytes <= limit and got
    if limited.returncode == 3:  # the partition planner found no split within what the limit leaves the ranks
        assert all("\n" not in g["refused"] and "fits 2 devices" in g["refused"] and "MiB" in g["refused"]
                   for g in got), got
    else:
        assert {g["rank"]: g["losses"] for g in got} == {g["rank"]: g["losses"] for g in ref}


def _cli(args: list[str], limit: int, name: str, tmp_path: Path) -> LimitedRun:
    env = {**os.environ, "TIGHTFIT_CACHE_DIR": os.environ.get("TIGHTFIT_CACHE_DIR", str(tmp_path / "cache"))}
    return run_limited([sys.executable, "-m", "tightfit.cli", *args], limit, name=name, cwd=ROOT, env=env,
                       timeout=300)


def test_profile_device_and_doctor_show_the_limit_and_bound_memory_by_it(tmp_path):
    limit = 1 << 30
    run = _cli(["profile", "device", "--quick"], limit, "test-profile-device", tmp_path)
    assert run.enforced and not run.oom_killed and run.returncode == 0, run.stderr[-3000:]
    memory = next(ln for ln in run.stdout.splitlines() if ln.startswith("memory "))
    assert memory.split()[1:3] == ["1.00", "GiB"], memory  # the limit, not the machine's memory
    assert "memory limit" in run.stdout and "memory.limit_in_bytes" in run.stdout
    doctor = _cli(["doctor", "--json"], limit, "test-doctor", tmp_path)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    reading = json.loads(doctor.stdout)["memory"]
    assert reading["limit_bytes"] == limit and reading["capacity_bytes"] == limit and reading["free_bytes"] < limit


def test_plan_elixir_on_this_machine_refuses_under_a_small_limit_with_exit_code_3(tmp_path):
    run = _cli(["plan", "elixir", "--model", "gpt2", "--batch", "1", "--seq", "64", "--precision", "32-true"],
               700 * MiB, "test-plan-elixir", tmp_path)
    assert run.enforced and not run.oom_killed and run.returncode == 3, (run.returncode, run.stderr[-3000:])
    line = next(ln for ln in run.stderr.splitlines() if ln.startswith("tightfit plan elixir:"))
    assert "under the memory limit of 700.00 MiB" in line and "least-memory plan" in line
    assert "disk_dir" in line  # on a CPU only the disk tier takes state out of the one memory
