"""The glue's seams, each without a strategy: planning takes what it needs and returns the plan, the
re-planner works on a plan state and returns what changed, norm clipping is a method of the precision
plugin's class (not an attribute patched onto an instance). In one process, no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.runif import RunIf
from tests.lightning_elixir.common import BATCH, TinyGPT, cpu_device, mixed_budget_for, token_data
from tightfit.profiler.types import ClusterSpec


def _batch():
    return next(iter(DataLoader(token_data(8), batch_size=BATCH)))


@RunIf(lightning=True)
def test_decide_plan_needs_no_strategy_and_returns_what_it_planned_from():
    from lightning_elixir.options import ElixirOptions
    from lightning_elixir.planning import PlanDecision, decide_plan, make_plan, profile_module

    budget = mixed_budget_for(1)
    options = ElixirOptions(memory_budget=budget, device_profile=cpu_device(), verbose=False, owner="ElixirStrategy")
    reads: list[int] = []

    def first_batch():
        reads.append(1)
        return _batch()

    module = TinyGPT()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    decision = decide_plan(options, module, first_batch=first_batch, precision="32-true",
                           device=torch.device("cpu"), world_size=1)
    assert isinstance(decision, PlanDecision) and reads == [1]  # the dataloader is read once, on rank 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # profiled, not changed
    assert decision.cluster == ClusterSpec.uniform(cpu_device(), 1)
    assert decision.profile is not None and decision.profile.param_numel == sum(p.numel() for p in module.parameters())
    # The same plan as core's search from the same inputs (as JSON: every rank decodes the broadcast text).
    expected = make_plan(profile_module(TinyGPT(), _batch()), decision.cluster, memory_budget=budget)
    def decided(plan):  # the JSON also carries how long the search took
        return plan.units, plan.checkpointed_blocks, plan.step_time_s, plan.peak_bytes

    assert decided(decision.plan) == decided(expected) and decision.plan.is_mixed

    # A given plan comes back checked, unchanged; a cluster of the wrong size is refused with both numbers.
    given = dataclasses.replace(options, plan=expected)
    assert decide_plan(given, TinyGPT(), first_batch=_batch, precision="32-true", device=torch.device("cpu"),
                       world_size=1).plan.to_json() == expected.to_json()
    two = ElixirOptions(cluster=ClusterSpec.uniform(cpu_device(), 2), verbose=False, owner="ElixirStrategy")
    with pytest.raises(ValueError, match=r"ElixirStrategy\(cluster=...\) describes 2 devices, this run has 1 ranks"):
        decide_plan(two, TinyGPT(), first_batch=_batch, precision="32-true", device=torch.device("cpu"), world_size=1)


@RunIf(lightning=True)
def test_replanner_decides_on_a_plan_state_and_every_rank_learns_the_same():
    from lightning_elixir.planning import make_plan, profile_module
    from lightning_elixir.replan import PlanState, Replanner
    from tightfit.planner.check import PredictionRecord
    from tightfit.planner.elixir import ElixirConstraints

    # test_replan.py's wrong calibration: predicted steps far below the measured ones, every block recomputed.
    wrong = dataclasses.replace(cpu_device(), matmul_flops={"float32": 5e15})
    profile = profile_module(TinyGPT(), _batch())
    cluster = ClusterSpec.uniform(wrong, 1)
    plan = make_plan(profile, cluster, activation_checkpointing=True)
    assert plan.checkpointed_blocks
    state = PlanState(plan=plan, units=())
    record = PredictionRecord(planner="elixir", cost_model="test", predicted_step_s=plan.step_time_s,
                              measured_step_s=plan.step_time_s * 1e3, predicted_peak_bytes=plan.peak_bytes,
                              measured_peak_bytes=0, steps=5, time_error=-0.999, peak_error=None, tolerance=0.25,
                              within_tolerance=False)
    sent: list = []

    def from_rank0(obj):  # the broadcast of a world of one, remembering what rank 0 sent
        sent.append(obj)
        return obj

    rank0 = Replanner(profile, cluster, None, ElixirConstraints())
    rec = rank0.decide(state, record, step=7, epoch=0, rank_zero=True, broadcast=from_rank0)
    assert rec is not None and rec.measured_at_step == 7 and rec.time_ratio == pytest.approx(1e3)
    assert sorted(rec.changes) == sorted(f"{b}: recompute off" for b in plan.checkpointed_blocks)
    assert state.plan is plan  # the state given is not touched: the switch returns a new one
    assert rank0.pending is not None and rank0.pending.checkpointed_blocks == ()
    assert rank0.records == [rec] and not rank0.due(0) and rank0.due(1)  # applied from the next epoch on
    # One re-plan per fit.
    assert rank0.decide(state, record, step=8, epoch=0, rank_zero=True, broadcast=from_rank0) is None
    # Another rank has no inputs; it learns rank 0's decision from the broadcast alone.
    other = Replanner(None, None, None, ElixirConstraints())
    assert other.decide(state, record, step=7, epoch=0, rank_zero=False, broadcast=lambda _: sent[0]) == rec
    assert other.pending is not None and other.pending.to_json() == rank0.pending.to_json()
    # Nothing pending: applying changes nothing and returns no state.
    assert Replanner(profile, cluster, None, ElixirConstraints()).apply(
        torch.nn.Linear(2, 2), state, step=10, boundary="epoch", rank_zero=True) is None


@RunIf(lightning=True)
def test_norm_clipping_is_a_method_of_every_elixir_precision_plugin():
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from lightning_elixir.precision import (
        ClipAcrossMeshes,
        ElixirHalfPrecision,
        ElixirMixedPrecision,
        ElixirPrecision,
        with_mesh_clipping,
    )

    # Lightning's plugins become the Elixir subclass with the same settings.
    full = with_mesh_clipping(Precision())
    half = with_mesh_clipping(HalfPrecision("bf16-true"))
    mixed = with_mesh_clipping(MixedPrecision("bf16-mixed", "cpu"))
    assert type(full) is ClipAcrossMeshes
    assert type(half) is ElixirHalfPrecision and half.precision == "bf16-true" and isinstance(half, HalfPrecision)
    assert type(mixed) is ElixirMixedPrecision and isinstance(mixed, MixedPrecision)
    assert (mixed.precision, mixed.device, mixed.scaler) == ("bf16-mixed", "cpu", None)
    fp16 = ElixirPrecision(device="cpu")
    assert with_mesh_clipping(fp16) is fp16 and with_mesh_clipping(half) is half

    class Mine(Precision):  # a user's own plugin is theirs: kept as it is
        pass

    mine = Mine()
    assert with_mesh_clipping(mine) is mine
    for plugin in (full, half, mixed, fp16):
        assert "clip_grad_by_norm" not in vars(plugin)  # an override on the class, not a patched attribute
        assert type(plugin).clip_grad_by_norm is ClipAcrossMeshes.clip_grad_by_norm

    # It clips like torch where torch can (one process, plain tensors): same gradients after.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model(torch.randn(4, 8)).pow(2).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in reference])) > 0.05  # the clip below binds
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    for p, g in zip(ref_model.parameters(), reference):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    full.clip_gradients(torch.optim.SGD(model.parameters(), lr=0.1), 0.05)  # Lightning's entry point
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
