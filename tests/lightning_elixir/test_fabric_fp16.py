"""``precision="16-mixed"`` under ``Fabric(strategy="elixir")``: ``plugins=[ElixirFabricPrecision()]`` (Fabric's connector
refuses the flag for any ``ModelParallelStrategy``).

On two gloo ranks: a plan that shards and offloads trains in fp16 with the losses of Fabric's own DDP with Fabric's
``MixedPrecision`` and torch's ``GradScaler`` (an independent reference: DDP's gradients are whole on every rank, so a
local inf/nan check is a global one) within fp16 rounding, skipping the same overflowing steps; an inf put into one
parameter's shard on rank 1 only makes both ranks skip that step, with the optimizer state on disk exactly as in RAM.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

ENV = {"GROUP_RANK": "0"}
MICRO, STEPS = 4, 6
INIT = 2.0**24  # gradients of ~1e-2 times this overflow fp16 (65504): the first steps are skipped, then it trains
INF_STEP = 4  # the step whose gradient gets an inf on rank 1's shard only
# fp16 keeps 11 bits of mantissa; measured Trainer fp16 vs fp32 differences are ~1e-3 (tests/lightning_elixir/test_fp16.py).
LOSS_ATOL = 0.01


def _example():
    from tests.lightning_elixir.common import token_data

    return token_data(MICRO).tensors[0]


def _loop(strategy, plugin, *, inf_on_rank1: bool = False) -> dict:
    """A Fabric loop recording losses and the loss scale after each step (a skipped step halves it)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from tests.lightning_elixir.common import CONFIG, token_data
    from tightfit.models import GPT

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(GPT(CONFIG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    x_all, y_all = token_data(STEPS * MICRO * fabric.world_size).tensors
    disk = getattr(fabric.strategy, "disk_state", None)
    name = "blocks.1.mlp.c_fc.weight"  # in a unit the disk plan keeps on disk
    losses, scales = [], []
    for step in range(STEPS):
        at = (step * fabric.world_size + fabric.global_rank) * MICRO
        logits = model(x_all[at:at + MICRO])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y_all[at:at + MICRO].reshape(-1))
        fabric.backward(loss)
        if inf_on_rank1 and step == INF_STEP and fabric.global_rank == 1:
            grad = dict(model.module.named_parameters())[name].grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(float(plugin.scaler.get_scale()))
    on_disk = disk is not None and id(dict(model.module.named_parameters())[name]) in disk.params
    return {"losses": losses, "scales": scales, "on_disk": on_disk, "strategy": fabric.strategy}


def _skipped(scales: list[float]) -> list[int]:
    return [i for i, s in enumerate(scales) if s < (scales[i - 1] if i else INIT)]


def _run(rank: int, world: int, tmp: str) -> dict:
    import dataclasses

    import torch
    from lightning.fabric.plugins.precision import MixedPrecision

    from lightning_elixir import ElixirFabricPrecision, ElixirFabricStrategy
    from lightning_elixir.planning import FORWARD, profile_module
    from tests.lightning_elixir.common import CONFIG, cpu_device
    from tightfit.models import GPT
    from tightfit.planner.elixir import ElixirConstraints, Tier, mixed_budget
    from tightfit.profiler.types import ClusterSpec

    profile = profile_module(GPT(CONFIG), _example(), stage_method=FORWARD)
    budget = mixed_budget(profile, ClusterSpec.uniform(cpu_device(), world), precision="16-mixed")
    out: dict = {}
    ddp = _loop("ddp", MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT)))
    strategy = ElixirFabricStrategy(memory_budget=budget, device_profile=cpu_device(), example_input=_example(),
                                    verbose=False)
    sharded = _loop(strategy, ElixirFabricPrecision(init_scale=INIT))
    out["ddp"], out["sharded"] = ddp, {k: v for k, v in sharded.items() if k != "strategy"}
    out["priced"], out["mixed"] = strategy.plan.precision, strategy.plan.is_mixed
    # Optimizer state on disk (units of blocks 1..), an inf on rank 1's shard of one of them at INF_STEP.
    disk_dir = Path(tmp) / "disk"
    disk_dir.mkdir(exist_ok=True)
    on_disk = ElixirFabricStrategy(disk_dir=disk_dir, device_profile=cpu_device(), example_input=_example(),
                                   constraints=ElixirConstraints(force_disk=True), verbose=False)
    disk = _loop(on_disk, ElixirFabricPrecision(init_scale=INIT), inf_on_rank1=True)
    plan = on_disk.plan
    on_disk.teardown()
    ram = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0)
                                                for u in plan.units))
    in_ram = _loop(ElixirFabricStrategy(plan=ram, example_input=_example(), verbose=False),
                   ElixirFabricPrecision(init_scale=INIT), inf_on_rank1=True)
    out["disk"] = {k: v for k, v in disk.items() if k != "strategy"}
    out["ram"] = {k: v for k, v in in_ram.items() if k != "strategy"}
    return out


@RunIf(lightning=True, min_world=2)
def test_fabric_fp16_skips_overflow_on_every_rank_and_tracks_ddp_fp16(tmp_path):
    results = run_distributed(_run, 2, args=(str(tmp_path),), timeout=420, env=ENV)
    r0 = results[0]
    for r in results:
        assert r["priced"] == "16-mixed" and r["mixed"]
        ddp, sharded = r["ddp"], r["sharded"]
        # The first steps overflow at this scale and are skipped, by DDP's GradScaler and by Elixir's alike.
        assert _skipped(ddp["scales"]) and _skipped(sharded["scales"]) == _skipped(ddp["scales"]), (sharded, ddp)
        assert sharded["scales"] == ddp["scales"]
        assert max(abs(a - b) for a, b in zip(sharded["losses"], ddp["losses"])) <= LOSS_ATOL, (sharded, ddp)
        # An inf on rank 1's shard of a unit whose optimizer state is on disk: every rank skips that step, and the
        # disk run is the RAM run's, losses and scales exactly.
        disk, ram = r["disk"], r["ram"]
        assert disk["on_disk"] and not ram["on_disk"]
        assert INF_STEP in _skipped(disk["scales"]) and disk["scales"] == ram["scales"], (disk, ram)
        assert disk["losses"] == ram["losses"], (disk["losses"], ram["losses"])
        assert r["disk"]["scales"] == r0["disk"]["scales"] and r["sharded"]["scales"] == r0["sharded"]["scales"]


@RunIf(lightning=True)
def test_fabric_refuses_the_fp16_flag_and_a_plain_scaler_names_the_plugin():
    import lightning as L

    from lightning_elixir import ElixirFabricPrecision, ElixirFabricStrategy

    # Lightning's connector refuses the flag for every ModelParallelStrategy (Elixir's base), before any work.
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='16-mixed'\)`"):
        L.Fabric(accelerator="cpu", devices=1, strategy=ElixirFabricStrategy(), precision="16-mixed")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ElixirFabricStrategy(),
                      plugins=[ElixirFabricPrecision(init_scale=8.0)])
    assert isinstance(fabric.strategy.precision, ElixirFabricPrecision)
    assert fabric.strategy.precision.scaler.get_scale() == 8.0
    import torch

    with pytest.raises(TypeError, match=r"ElixirFabricPrecision\(scaler=GradScaler\): use an ElixirGradScaler"):
        ElixirFabricPrecision(scaler=torch.amp.GradScaler("cpu"))
