"""``Fabric(strategy="elixir")`` beside the loop: the predicted-vs-measured step check the Trainer runs (each
``fabric.backward`` starts a step; after warm-up a record, and a warning beyond ``CHECK_TOLERANCE``), and the refusal,
with its fix, of ``setup_module`` alone for a model on meta whose plan keeps parameters on disk (Fabric refuses an
optimizer over meta parameters, so only ``fabric.setup(model, optimizer)`` can allocate it into the disk tier)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.runif import RunIf
from tightfit.planner.elixir import Tier


def _plan(**constraints):
    import torch

    from lightning_elixir.planning import FORWARD, profile_module
    from tests.lightning_elixir.common import CONFIG, cpu_device
    from tightfit.models import GPT
    from tightfit.planner.elixir import ElixirConstraints, search
    from tightfit.profiler.types import ClusterSpec, DiskProfile

    with torch.device("meta"):
        model = GPT(CONFIG)
    profile = profile_module(model, torch.zeros(4, 32, dtype=torch.long), stage_method=FORWARD)
    disk = DiskProfile(path="/tmp", free_bytes=2**34, read_fit=(1e-4, 1e9), write_fit=(1e-4, 1e9))
    cluster = ClusterSpec.uniform(dataclasses.replace(cpu_device(), disk=disk), 1)
    return search(profile, cluster, precision="32-true", optimizer="adamw",
                  constraints=ElixirConstraints(**constraints))


@RunIf(lightning=True)
def test_fabric_steps_off_the_prediction_leave_a_record_and_warn(recwarn):
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_elixir import ElixirFabricStrategy
    from tests.lightning_elixir.common import CONFIG, token_data
    from tightfit.models import GPT

    plan = _plan()
    plan = dataclasses.replace(plan, step_time_s=plan.step_time_s * 1e-4)  # a prediction no step can meet
    strategy = ElixirFabricStrategy(plan=plan, example_input=torch.zeros(4, 32, dtype=torch.long), verbose=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(GPT(CONFIG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = token_data(4).tensors
    monitor = None
    for step in range(9):  # two warm-up steps, five timed, and the start of the next closes the last
        if step == 7:
            assert strategy.prediction is None
        fabric.backward(F.cross_entropy(model(x).reshape(-1, CONFIG.vocab_size), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
        monitor = strategy.monitor
    record = strategy.prediction
    assert record is not None and monitor is not None and monitor.done and record.steps == 5
    assert not record.within_tolerance and record.predicted_step_s == pytest.approx(plan.step_time_s)
    assert record.measured_step_s > record.predicted_step_s
    assert any("prediction off by more than 25%" in str(w.message) for w in recwarn.list)


@RunIf(lightning=True)
def test_setup_module_alone_refuses_a_meta_model_whose_plan_keeps_parameters_on_disk(tmp_path):
    import lightning as L
    import torch

    from lightning_elixir import ElixirFabricStrategy
    from tests.lightning_elixir.common import CONFIG
    from tightfit.models import GPT

    plan = _plan(force_disk=True)
    plan = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=max(u.tier, Tier.DISK_PARAMS) if u.tier >= Tier.DISK else u.tier) for u in plan.units))
    assert plan.param_disk_units
    strategy = ElixirFabricStrategy(plan=plan, disk_dir=tmp_path, example_input=torch.zeros(4, 32, dtype=torch.long),
                                    verbose=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(CONFIG)
    with pytest.raises(ValueError, match=r"setup_module\(GPT\): the plan keeps the parameters of units .* on disk.*"
                                         r"model, optimizer = fabric.setup\(model, optimizer\)") as info:
        fabric.setup_module(model)
    assert "\n" not in str(info.value)
