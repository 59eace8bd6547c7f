"""Elixir's whole-process budget from core's reading of memory: the defaults on a CPU (what the limit leaves this
rank, the interpreter as the reserve, the host budget the same memory), budgets a user gives checked against the
limit in one line, and the plan's explanation of the whole process."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lightning_elixir.memory_budget import (
    LIMIT_HEADROOM,
    MemoryLimitError,
    check_given_budgets,
    module_bytes,
    process_budget,
)
from tightfit.memory_limit import MemoryReading
from tightfit.planner.errors import PlanInfeasibleError

MiB, GiB = 1 << 20, 1 << 30
LIMITED = MemoryReading(total=24 * GiB, available=20 * GiB, limit=GiB + 256 * MiB, usage=500 * MiB,
                        reclaimable=50 * MiB, limit_file="/sys/fs/cgroup/memory/job/memory.limit_in_bytes",
                        resident=450 * MiB)
FREE_MACHINE = MemoryReading(total=24 * GiB, available=20 * GiB, resident=450 * MiB)


def test_cpu_default_is_what_the_limit_leaves_with_the_interpreter_as_reserve():
    b = process_budget(None, None, device_type="cpu", ranks_per_node=1, held_by_model=100 * MiB, reading=LIMITED,
                       reserved_given=False)
    headroom = int(LIMITED.capacity * LIMIT_HEADROOM)  # a hard limit kills: the default plan aims below it
    assert b.memory_budget == min(LIMITED.capacity, LIMITED.resident + LIMITED.free) - headroom
    assert b.memory_budget == GiB + 256 * MiB - headroom
    assert b.reserved_bytes == 350 * MiB  # resident less the model's own tensors (the plan counts those)
    assert b.host_budget == b.memory_budget  # one memory
    assert "memory limit" in b.source and LIMITED.limit_file in b.source


def test_a_given_cpu_budget_is_the_plan_s_own_and_adds_no_reserve():
    b = process_budget("600MiB", None, device_type="cpu", ranks_per_node=1, held_by_model=0, reading=LIMITED,
                       reserved_given=False)
    assert (b.memory_budget, b.host_budget, b.reserved_bytes, b.source) == ("600MiB", None, None, "")


def test_two_ranks_split_the_limit_and_a_given_reserve_is_kept():
    b = process_budget(None, None, device_type="cpu", ranks_per_node=2, held_by_model=0, reading=LIMITED,
                       reserved_given=True)
    assert b.memory_budget == min(LIMITED.capacity // 2, LIMITED.resident + LIMITED.free // 2) - int(
        LIMITED.capacity // 2 * LIMIT_HEADROOM)
    assert b.reserved_bytes is None


def test_without_a_limit_a_cpu_plans_for_what_the_machine_leaves():
    b = process_budget(None, None, device_type="cpu", ranks_per_node=1, held_by_model=0, reading=FREE_MACHINE,
                       reserved_given=False)
    assert b.memory_budget == min(24 * GiB, 450 * MiB + 20 * GiB) and "machine" in b.source


def test_a_gpu_keeps_its_device_budget_and_takes_the_host_budget_from_the_limit():
    b = process_budget("40GiB", None, device_type="cuda", ranks_per_node=2, held_by_model=0, reading=LIMITED,
                       reserved_given=False)
    assert (b.memory_budget, b.host_budget, b.reserved_bytes) == ("40GiB", LIMITED.free // 2, None)
    b = process_budget(None, None, device_type="cuda", ranks_per_node=1, held_by_model=0, reading=FREE_MACHINE,
                       reserved_given=False)
    assert (b.memory_budget, b.host_budget) == (None, None)


def test_a_budget_above_the_limit_is_refused_in_one_line_naming_value_rule_and_fix():
    with pytest.raises(MemoryLimitError, match=r"memory_budget='2GiB'.*memory limit of 1.25 GiB.*give at most") as e:
        check_given_budgets("ElixirStrategy", "2GiB", None, device_type="cpu", ranks_per_node=1, reading=LIMITED)
    assert "\n" not in str(e.value) and isinstance(e.value, PlanInfeasibleError)
    assert e.value.needed_bytes == 2 * GiB and e.value.budget_bytes == LIMITED.capacity
    with pytest.raises(MemoryLimitError, match=r"host_budget='900MiB'.*for each of 2 ranks"):
        check_given_budgets("ElixirStrategy", None, "900MiB", device_type="cuda", ranks_per_node=2, reading=LIMITED)
    # within the limit, a fraction, a GPU's device budget, or no limit at all: accepted
    check_given_budgets("ElixirStrategy", "1GiB", "900MiB", device_type="cpu", ranks_per_node=1, reading=LIMITED)
    check_given_budgets("ElixirStrategy", 0.9, None, device_type="cpu", ranks_per_node=1, reading=LIMITED)
    check_given_budgets("ElixirStrategy", "80GiB", None, device_type="cuda", ranks_per_node=1, reading=LIMITED)
    check_given_budgets("ElixirStrategy", "80GiB", "80GiB", device_type="cpu", ranks_per_node=1, reading=FREE_MACHINE)


@given(budget=st.integers(1, 4 * GiB), ranks=st.integers(1, 8))
def test_any_budget_is_accepted_exactly_when_it_fits_the_rank_s_share(budget, ranks):
    try:
        check_given_budgets("ElixirStrategy", budget, None, device_type="cpu", ranks_per_node=ranks, reading=LIMITED)
        accepted = True
    except MemoryLimitError as exc:
        accepted = False
        assert "\n" not in str(exc) and str(budget) in str(exc)
    assert accepted == (budget <= LIMITED.capacity // ranks)


def test_module_bytes_counts_materialised_tensors_once_and_meta_ones_not_at_all():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, shared, nn.BatchNorm1d(4))
    assert module_bytes(model) == (16 + 4 + 4 + 4 + 4 + 4) * 4 + 8  # weights, bias, norm + running stats + count
    assert module_bytes(nn.Linear(1000, 1000, device="meta")) == 0


def test_the_plan_explains_the_whole_process_line_by_line():
    import dataclasses

    import torch

    from tightfit.models import GPTConfig, build_gpt
    from tightfit.planner.elixir import ElixirConstraints, search
    from tightfit.profiler import profile_model
    from tightfit.profiler.types import ClusterSpec, DeviceProfile

    cfg = GPTConfig(vocab_size=256, n_positions=32, hidden=64, layers=2, heads=4)
    profile = profile_model(lambda: build_gpt(cfg), torch.zeros(2, 16, dtype=torch.long, device="meta"), name="tiny")
    cpu = DeviceProfile(name="cpu", kind="cpu", memory_bytes=GiB, free_bytes=GiB, matmul_flops={"float32": 5e10},
                        host_adam_elems_per_s=3e8, device_adam_elems_per_s=3e8, unified_memory=True)
    plan = search(profile, ClusterSpec.uniform(cpu, 1), precision="32-true", memory_budget=GiB,
                  constraints=ElixirConstraints(reserved_bytes=300 * MiB))
    plan = dataclasses.replace(plan, budget_source="the memory limit of 1.00 GiB (memory.max)")
    text = plan.explain()
    block = text[text.index("whole process per device"):].splitlines()
    assert "budget 1.00 GiB (the memory limit of 1.00 GiB (memory.max))" in block[0]
    assert "reserve" in block[1] and "300.00 MiB" in block[1]
    assert block[6].strip().startswith("= predicted peak") and "left of the budget" in block[6]
    m = plan.memory
    assert m.reserved_bytes == 300 * MiB and m.margin_bytes >= m.reserved_bytes
    assert m.state_bytes + m.params_bytes + m.activation_bytes + m.margin_bytes == pytest.approx(plan.peak_bytes, abs=2)
    assert type(plan).from_json(plan.to_json()) == plan  # the new fields round-trip
