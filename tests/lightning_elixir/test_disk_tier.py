"""Elixir with optimizer state on disk: bit-equal to the same plan all in RAM (fp32; gradient accumulation and
clipping), on 1 and 2 real gloo ranks; the bytes that went to disk and the host staging area asserted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.helpers.multiprocess import run_distributed

ENV = {"GROUP_RANK": "0"}
CHUNK = 8192  # elements per state tensor per staging set: TinyGPT's units then take several chunks each


def _fit(strategy, root: Path, *, devices: int, steps: int = 6, **kwargs):
    import lightning as L

    from tests.lightning_elixir.common import TinyGPT, trainer

    L.seed_everything(0)
    model = TinyGPT(samples=48)
    t = trainer(strategy, root, devices=devices, max_steps=steps, accumulate_grad_batches=2,
                gradient_clip_val=0.05, **kwargs)
    t.fit(model)
    from lightning_elixir.disk_state import local_of

    weights = {n: local_of(p).detach().clone() for n, p in model.named_parameters()}
    return model.losses, weights, t


def disk_vs_ram(rank: int, world: int, tmp: str) -> dict:
    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import ElixirConstraints

    root, disk = Path(tmp), Path(tmp) / "disk"
    disk.mkdir(exist_ok=True)
    strategy = ElixirStrategy(disk_dir=disk, device_profile=cpu_device(), verbose=False,
                              constraints=ElixirConstraints(force_disk=True))
    strategy.disk_chunk_elements = CHUNK
    losses, weights, _ = _fit(strategy, root / "a", devices=world)
    plan, state = strategy.plan, strategy.disk_state
    assert plan is not None and state is None  # closed at teardown
    ram_plan = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, disk=False, disk_bytes=0)
                                                     for u in plan.units))
    ref = ElixirStrategy(plan=ram_plan, verbose=False)
    ref_losses, ref_weights, _ = _fit(ref, root / "b", devices=world)
    return {"losses": losses, "ref_losses": ref_losses, "equal": all(
        weights[n].equal(ref_weights[n]) for n in weights), "disk_units": plan.disk_units,
        "names": sorted(n for n in weights)}


def test_disk_tier_matches_ram_on_two_ranks(tmp_path):
    outs = run_distributed(disk_vs_ram, world_size=2, args=(str(tmp_path),), env=ENV, timeout=240)
    for out in outs:
        assert out["disk_units"]
        assert out["losses"] == out["ref_losses"] and len(out["losses"]) == 12
        assert out["equal"]
