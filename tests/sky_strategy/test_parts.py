"""The Sky plugin's parts on their own, without a Trainer or a process group: the layout, the injected
speeds, the planning path and the re-planner over its plan state, and the step's stand-in swap."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sky_strategy.config import SkyConfig
from sky_strategy.mesh import Layout
from tests.helpers.runif import RunIf

pytestmark = RunIf(lightning=True)


def _inputs(speeds=(1.0, 1.0), layers: int = 8, **config):
    from sky_strategy.planning import PlanInputs
    from tightfit.planner.pipeline import DeviceSpec, LayerMemory

    cfg = SkyConfig(**{"schedule": "1f1b", "microbatches": 4, **config})
    devices = tuple(DeviceSpec(name=f"rank{i}", speed=s, memory_bytes=1 << 30,
                               layer_seconds=tuple(1e-3 / s for _ in range(layers))) for i, s in enumerate(speeds))
    return PlanInputs(layer_costs=(1e-3,) * layers, layer_memory=(LayerMemory(param_bytes=1 << 16),) * layers,
                      devices=devices, links=None, link_latency=None, allreduce=None, step_overhead_s=0.0,
                      pipeline_overhead_s=0.0, optimizer_state_factor=2.0, replicas=1, config=cfg)


@settings(deadline=None)  # a loaded 2-core host
@given(replicas=st.integers(1, 4), ranks=st.integers(1, 4), data=st.data())
def test_layout_places_each_pipeline_on_consecutive_ranks(replicas, ranks, data):
    rank = data.draw(st.integers(0, replicas * ranks - 1))
    layout = Layout.of(SkyConfig(data_parallel=replicas), world=replicas * ranks, rank=rank)
    assert (layout.replicas, layout.pipeline_ranks, layout.world) == (replicas, ranks, replicas * ranks)
    assert layout.replica_rank * ranks + layout.pipeline_rank == rank
    assert 0 <= layout.pipeline_rank < ranks


def test_layout_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"rank=4\): the rank must lie in 0..3"):
        Layout(replicas=2, pipeline_ranks=2, rank=4)


def test_injected_speeds_change_mid_run_and_reach_a_running_slowdown():
    from sky_strategy.profiling import InjectedSpeeds

    speeds = InjectedSpeeds(None, throttle=True)
    slowdown = speeds.slowdown_of(1)  # what a stage holds
    assert (speeds.factor(1), slowdown()) == (1.0, 1.0)
    speeds.set([1.0, 0.25], world=2)
    assert slowdown() == 4.0
    assert InjectedSpeeds((1.0, 0.25), throttle=False).slowdown(1) == 1.0  # the planner sees it, nothing sleeps
    with pytest.raises(ValueError, match=r"set_speed_factors\(\[1.0, 0.0\]\): give 2 factors > 0"):
        speeds.set([1.0, 0.0], world=2)


def test_plans_follow_the_speeds_and_need_no_strategy():
    from sky_strategy.planning import decide_plan, make_plan, pipeline_problem

    inputs = _inputs()
    problem = pipeline_problem(inputs, (1.0, 0.25))
    assert problem.microbatches == 4 and problem.gradient_copies == 2
    even = make_plan(inputs, inputs.speeds, say=print)
    slow = decide_plan(inputs, (1.0, 0.25), say=print)  # no process group: rank 0 is this process
    assert even.layer_counts() == (4, 4)
    assert slow.layer_counts()[1] < slow.layer_counts()[0]


def test_replanner_measures_a_baseline_then_replans_on_drift_only():
    from sky_strategy.planning import Replanner, make_plan

    inputs = _inputs()
    first = make_plan(inputs, inputs.speeds, say=print)
    replanner = Replanner(inputs, first, every=2, threshold=0.5, say=print)
    assert [replanner.due(s) for s in range(5)] == [False, False, True, False, True]
    assert replanner.observe(2, [1.0, 1.0]) is None and replanner.state.baseline == (1.0, 1.0)
    assert replanner.observe(4, [1.1, 1.2]) is None  # within 50%: keep the plan and the baseline
    assert replanner.state.baseline == (1.0, 1.0) and replanner.plan is first
    replan = replanner.observe(6, [1.0, 4.0])  # rank 1 became 4x slower
    assert replan is not None and replan.step == 6 and replan.before == (4, 4)
    assert replan.after[1] < replan.after[0] and replanner.plan is replan.plan
    assert replanner.state.speeds == (1.0, 0.25) and replanner.state.baseline is None
    assert replanner.records == [replan]
    assert "re-planned (4, 4) ->" in replan.describe()
    assert not Replanner(inputs, first, every=None, threshold=0.5, say=print).due(2)


def test_stand_in_swaps_forward_and_log_for_the_block_only_even_on_error():
    import lightning as L

    from sky_strategy.step import StandIn

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x)

    net, out = Net(), torch.full((4, 2), 7.0)
    with StandIn(net, out, torch.Size([4, 3])) as stand_in:
        assert net(torch.zeros(4, 3)) is out
        net.log("loss", 1.5, prog_bar=True)
    assert stand_in.calls == [("loss", 1.5, (), {"prog_bar": True})]
    assert "forward" not in vars(net) and "log" not in vars(net)
    with pytest.raises(Exception, match=r"called the model on inputs of shape \(2, 3\) but the pipeline ran"):
        with StandIn(net, out, torch.Size([4, 3])):
            net(torch.zeros(2, 3))
    assert "forward" not in vars(net) and net(torch.zeros(4, 3)).shape == (4, 2)
    own = lambda x: x  # noqa: E731 - an instance's own forward survives the swap
    net.forward = own
    with pytest.raises(ZeroDivisionError), StandIn(net, out, torch.Size([4, 3])):
        raise ZeroDivisionError("the step failed")
    assert vars(net)["forward"] is own and "log" not in vars(net)


def test_backward_without_a_training_step_is_refused():
    from sky_strategy.step import PipelineStep

    step = PipelineStep(torch.nn.Linear(1, 1), runtime=None, device=torch.device("cpu"), group=None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="backward without a training step before it"):
        step.backward(lambda: None, 1.0)
