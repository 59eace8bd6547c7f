"""The Elixir package's problem and forced choices: ``ElixirProblem`` validates once, ``solve`` equals
``search``, and ``force_offload`` / ``force_checkpointing`` are decided by core (the Lightning plugin
only passes them through)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.test_planner_elixir import cpu_device, gpt_like
from tightfit.planner.elixir import ElixirConstraints, ElixirProblem, search, solve
from tightfit.profiler.types import ClusterSpec


@pytest.fixture(scope="module")
def case():
    return gpt_like(layers=4, hidden=128, batch=2, seq=64, vocab=1024), ClusterSpec.uniform(cpu_device(), 2)


def test_solve_equals_search_and_problem_validates(case):
    prof, cluster = case
    problem = ElixirProblem(model=prof, cluster=cluster, precision="32-true")
    assert solve(problem).units == search(prof, cluster, precision="32-true").units
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        ElixirProblem(model=prof, cluster=cluster, optimizer="lion")
    with pytest.raises(ValueError, match="precision 'fp8' is not one the planner models"):
        ElixirProblem(model=prof, cluster=cluster, precision="fp8")
    with pytest.raises(ValueError, match="force_offload=True, allow_offload=False"):
        ElixirConstraints(force_offload=True, allow_offload=False)


def test_forced_offload_and_checkpointing_are_planned_in_core(case):
    prof, cluster = case
    free = search(prof, cluster, precision="32-true", memory_budget=10**15)
    assert not free.offloaded_units and not free.checkpointed_blocks
    forced = search(prof, cluster, precision="32-true", memory_budget=10**15,
                    constraints=ElixirConstraints(force_offload=True, force_checkpointing=True))
    assert all(u.offload for u in forced.units)
    assert set(forced.checkpointed_blocks) == {b.name for b in prof.blocks if b.checkpointable}
    assert forced.step_time_s > free.step_time_s and forced.fits
    assert "forced" in forced.search_method


def test_package_files_stay_small():
    root = Path(__file__).resolve().parents[2] / "core" / "planner" / "elixir"
    sizes = {p.name: len(p.read_text().splitlines()) for p in root.glob("*.py")}
    assert sizes and max(sizes.values()) < 500, sizes
