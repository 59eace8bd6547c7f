"""``ElixirDeepSpeedStrategy``: the plan's DeepSpeed ZeRO translation trains through Lightning's DeepSpeedStrategy.

On this CPU-only machine the adapter lifts Lightning's CUDA-only check knowingly and DeepSpeed runs on
its CPU accelerator over gloo (deepspeed_backend.py says why); two real processes, against DDP.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

# ZeRO-3 keeps fp32 partitions of flattened parameters and reduces in buckets, so sums run in another
# order than DDP's; 1e-4 on losses ~5 over 8 steps is still far below a one-step change (~0.05).
LOSS_ATOL = 1e-4
ENV = {"GROUP_RANK": "0", "DS_ACCELERATOR": "cpu"}


def _both(rank: int, world: int, tmp: str) -> dict:
    """Both tests' runs on one process group (each spawned rank imports Lightning and DeepSpeed anew, which costs
    more than a run). ZeRO-3 replaces ``torch.nn.functional.linear`` process-wide; the strategy's teardown puts it
    back, which each rank checks after each run so that the second run computes with torch's own linear."""
    import torch.nn.functional as F

    linear = F.linear
    out = {"translated": _deepspeed_vs_ddp(rank, world, str(Path(tmp) / "translated"))}
    out["linear_kept"] = [F.linear is linear]
    out["zero_init"] = _zero_init_vs_ddp(rank, world, str(Path(tmp) / "zero_init"))
    out["linear_kept"].append(F.linear is linear)
    return out


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> list[dict]:
    """What each of two ranks returned from both runs (``_both``)."""
    tmp = tmp_path_factory.mktemp("deepspeed_two_ranks")
    results = run_distributed(_both, 2, args=(str(tmp),), timeout=600, env=ENV)
    assert all(r["linear_kept"] == [True, True] for r in results), [r["linear_kept"] for r in results]
    return results


def _deepspeed_vs_ddp(rank: int, world: int, tmp: str) -> dict:
    import lightning as L

    from lightning_elixir import ElixirDeepSpeedStrategy
    from tests.lightning_elixir.common import TinyGPT, cpu_device, mixed_budget_for, trainer

    budget = mixed_budget_for(world)
    L.seed_everything(0)
    ref = TinyGPT()
    trainer("ddp", Path(tmp) / "ddp", devices=world, max_steps=8).fit(ref)
    L.seed_everything(0)
    model = TinyGPT()
    strategy = ElixirDeepSpeedStrategy(memory_budget=budget, device_profile=cpu_device(),
                                       verbose=rank == 0, config={"zero_optimization": {"reduce_bucket_size": 1 << 20}})
    trainer(strategy, Path(tmp) / "ds", devices=world, max_steps=8).fit(model)
    zero = strategy.config["zero_optimization"]
    return {"ddp": ref.losses, "ds": model.losses, "stage": zero["stage"],
            "offload": "offload_optimizer" in zero, "engine": type(strategy.model).__name__,
            "mixed": strategy.plan.is_mixed}


@RunIf(lightning=True, deepspeed=True, min_world=2)
def test_deepspeed_backend_runs_the_translated_plan(on_two_ranks):
    for r in (both["translated"] for both in on_two_ranks):
        assert r["mixed"] and r["stage"] == 3 and r["offload"], r
        assert r["engine"] == "DeepSpeedEngine"
        assert len(r["ds"]) == len(r["ddp"]) == 8
        assert max(abs(a - b) for a, b in zip(r["ddp"], r["ds"])) <= LOSS_ATOL, (r["ddp"], r["ds"])


def _zero_init_vs_ddp(rank: int, world: int, tmp: str) -> dict:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_elixir import ElixirDeepSpeedStrategy
    from tests.lightning_elixir.common import cpu_device, trainer
    from tightfit.planner.elixir import ElixirConstraints

    class Wide(L.LightningModule):
        """An MLP built in ``configure_model`` (initialised by its layers' constructors only)."""

        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module | None = None
            self.losses: list[float] = []
            self.built: dict = {}

        def configure_model(self) -> None:
            if self.net is None:
                self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                         nn.Linear(256, 8))
                params = list(self.net.parameters())
                # Right after construction: what this rank really holds (ZeRO-3 keeps ds_tensor, a partition).
                self.built = {"held": sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() for p in params),
                              "total": sum(getattr(p, "ds_numel", p.numel()) for p in params)}

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.losses.append(outputs["loss"].item())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(3)
            return DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 8, (64,), generator=g)),
                              batch_size=4)

    L.seed_everything(0)
    ref = Wide()
    trainer("ddp", Path(tmp) / "ddp", devices=world, max_steps=6).fit(ref)
    L.seed_everything(0)
    model = Wide()
    strategy = ElixirDeepSpeedStrategy(device_profile=cpu_device(), optimizer="sgd", offload="none", verbose=False,
                                       constraints=ElixirConstraints(modes=("reshard",)))
    trainer(strategy, Path(tmp) / "ds", devices=world, max_steps=6).fit(model)
    return {"ddp": ref.losses, "ds": model.losses, "stage": strategy.config["zero_optimization"]["stage"],
            "ref_built": ref.built, "built": model.built}


@RunIf(lightning=True, deepspeed=True, min_world=2)
def test_deepspeed_backend_builds_under_zero_init(on_two_ranks):
    for r in (both["zero_init"] for both in on_two_ranks):
        assert r["stage"] == 3, r
        total = r["built"]["total"]
        assert r["ref_built"]["held"] == r["ref_built"]["total"] == total  # DDP: every rank holds everything
        # ZeRO-3 from construction: each rank holds its half (partitions are padded to equal size).
        assert total / 2 <= r["built"]["held"] <= total / 2 + 8, r["built"]
        assert len(r["ds"]) == len(r["ddp"]) == 6
        assert max(abs(a - b) for a, b in zip(r["ddp"], r["ds"])) <= LOSS_ATOL, (r["ddp"], r["ds"])
