"""The disk tier's knobs on the Elixir strategy: ``host_budget`` and ``disk_dir`` validated once (one-line
errors), passed to core's search (``profile_disk`` of ``disk_dir``), and a given plan that keeps state on disk
refused without a directory to keep it in."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_elixir import ElixirStrategy
from lightning_elixir.options import ElixirOptions
from lightning_elixir.planning import decide_plan
from tests.lightning_elixir.common import TinyGPT, cpu_device, token_data
from tightfit.planner.elixir import ElixirConstraints, Tier


def test_host_budget_is_a_positive_size_or_none():
    assert ElixirOptions(host_budget="4GiB").host_budget_bytes == 4 * 2**30
    assert ElixirOptions().host_budget_bytes is None
    for bad in ("lots", -1, 0, True):
        with pytest.raises(ValueError, match=r"ElixirStrategy\(host_budget=.*give bytes > 0"):
            ElixirStrategy(host_budget=bad)


def test_disk_dir_must_be_a_writable_directory(tmp_path):
    with pytest.raises(ValueError, match=r"ElixirStrategy\(disk_dir=\.\.\.\): disk directory .*missing does not "
                                         r"exist.*mkdir -p"):
        ElixirStrategy(disk_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match=r"disk_dir=3\): give the path"):
        ElixirOptions(disk_dir=3, owner="ElixirStrategy")  # type: ignore[arg-type]
    assert ElixirStrategy(disk_dir=str(tmp_path)).options.disk_dir == tmp_path
    with pytest.raises(ValueError, match=r"replan=True, disk_dir=\.\.\.\): re-planning does not move"):
        ElixirStrategy(disk_dir=tmp_path, replan=True)


def test_no_disk_dir_means_no_disk_tier_in_the_search(tmp_path):
    # A given cluster may carry disk profiles; without disk_dir the run has nowhere to put state.
    assert not ElixirOptions().planner_constraints().allow_disk
    assert ElixirOptions(disk_dir=tmp_path).planner_constraints().allow_disk
    with pytest.raises(ValueError, match=r"force_disk=True\)\) needs a disk tier: give disk_dir="):
        ElixirOptions(constraints=ElixirConstraints(force_disk=True), owner="ElixirStrategy")


def _decide(options: ElixirOptions):
    batch = next(iter(DataLoader(token_data(8), batch_size=4)))
    return decide_plan(options, TinyGPT(), first_batch=lambda: batch, precision="32-true",
                       device=torch.device("cpu"), world_size=1).plan


def test_the_budgets_and_the_disk_dir_reach_the_search(tmp_path):
    # TinyGPT's offloaded state is ~3.4 MB: a 1 MB host budget is short, and the disk cannot help a model this
    # small (the disk tier's host staging area alone is 128 MiB, DISK_STAGING_BYTES), which the error says.
    opts = dict(device_profile=cpu_device(), verbose=False, owner="ElixirStrategy")
    with pytest.raises(Exception, match=r"host memory budget is 976.56 KiB.*give a disk directory \(disk_dir\)"):
        _decide(ElixirOptions(host_budget=1_000_000, offload="all", **opts))
    with pytest.raises(Exception, match=r"host memory budget is 976.56 KiB, the least-memory plan \(every "
                                        r"offloaded unit's optimizer state and master weights on disk, gradients too\)"):
        _decide(ElixirOptions(host_budget=1_000_000, offload="all", disk_dir=tmp_path, **opts))
    # Forced onto the disk, the plan is priced from profile_disk(tmp_path) (quick, cached per filesystem).
    plan = _decide(ElixirOptions(disk_dir=tmp_path, constraints=ElixirConstraints(force_disk=True), **opts))
    assert plan.disk_units == tuple(range(len(plan.units))) and plan.disk_path == str(tmp_path)
    assert plan.disk_bytes_per_rank > 0 and plan.breakdown.disk_io_s > 0
    assert all(u.tier.state_on == "disk" for u in plan.units)
    assert " disk " in plan.explain()
    # The same plan given back to a run without disk_dir is refused, naming the units and the fix.
    with pytest.raises(ValueError, match=r"keeps the optimizer state of units \[0, .*\] on disk, but no disk_dir"):
        _decide(ElixirOptions(plan=plan, verbose=False, owner="ElixirStrategy"))
    ram = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0) for u in plan.units))
    assert not _decide(ElixirOptions(plan=ram, verbose=False)).disk_units
