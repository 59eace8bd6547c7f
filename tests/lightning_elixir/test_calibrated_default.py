"""What a user gets by default is the measured path (issue 32): ``Trainer(strategy="elixir")`` on a Hugging Face
causal LM in a plain LightningModule, no options, prices its plan from this machine's measurements (blocks
timed one at a time, collectives and FSDP2's overheads fitted), caches them so the second run measures
nothing, trains equal to DDP, and ``calibrate=False`` restores FLOPs / rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

pytestmark = RunIf(lightning=True)
LOSS_ATOL = 1e-5  # as test_distributed.py: FSDP2's reduce-scatter and DDP's all-reduce add the same gradients


def _llama_module():
    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class CausalLM(L.LightningModule):
        """What a user writes: a transformers model, its own loss, AdamW."""

        def __init__(self) -> None:
            super().__init__()
            cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
            self.model = LlamaForCausalLM(cfg)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("loss", loss)  # a Trainer-managed call: timing the step's blocks must not trip on it
            self.losses.append(float(loss.detach()))  # a value-dependent call: the step cannot run on meta
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return torch.utils.data.DataLoader(torch.randint(0, 256, (32, 32), generator=g), batch_size=4)

    return CausalLM


def _runs(rank: int, world: int, tmp: str) -> dict:
    import lightning as L

    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import trainer
    from tightfit.profiler.device import cache_dir

    CausalLM = _llama_module()
    out: dict = {}
    L.seed_everything(0)
    ref = CausalLM()
    trainer("ddp", Path(tmp) / "ddp", devices=world, max_steps=3).fit(ref)
    out["ddp"] = ref.losses
    for run in ("first", "second"):
        L.seed_everything(0)
        model = CausalLM()
        strategy = ElixirStrategy(verbose=False)
        trainer(strategy, Path(tmp) / run, devices=world, max_steps=3).fit(model)
        files = sorted(p.name for p in cache_dir().glob("*.json"))
        out[run] = {"losses": model.losses, "cost_model": strategy.plan.cost_model,
                    "notes": list(strategy.plan.notes), "cache": files,
                    "mtimes": {p.name: p.stat().st_mtime_ns for p in cache_dir().glob("*.json")}}
    L.seed_everything(0)
    model = CausalLM()
    strategy = ElixirStrategy(verbose=False, calibrate=False)
    trainer(strategy, Path(tmp) / "flops", devices=world, max_steps=3).fit(model)
    out["flops"] = {"losses": model.losses, "cost_model": strategy.plan.cost_model}
    return out


def test_default_elixir_on_a_hugging_face_llama_is_priced_from_measurements(tmp_path):
    env = {"GROUP_RANK": "0", "TIGHTFIT_CACHE_DIR": str(tmp_path / "cache")}
    r = run_distributed(_runs, 2, args=(str(tmp_path),), timeout=600, env=env)[0]
    first, second = r["first"], r["second"]
    # Priced from measurements: timed blocks, and the calibration's cost stated in the plan.
    assert first["cost_model"].startswith("measured block timings"), first["cost_model"]
    assert any(n.startswith("calibrated on this hardware in") for n in first["notes"]), first["notes"]
    assert any(name.startswith("blocks-") for name in first["cache"]), first["cache"]
    # The second run found everything cached: no cache file written again.
    assert second["cache"] == first["cache"]
    assert second["mtimes"] == first["mtimes"], "the second run re-measured something"
    # The plan changes what is priced, never what is trained.
    for run in (first, second, r["flops"]):
        assert max(abs(a - b) for a, b in zip(run["losses"], r["ddp"])) <= LOSS_ATOL, (run["losses"], r["ddp"])
    assert r["flops"]["cost_model"].startswith("FLOPs / rate"), r["flops"]["cost_model"]


def test_calibrate_must_be_a_bool():
    from lightning_elixir import ElixirStrategy

    with pytest.raises(ValueError, match=r"ElixirStrategy\(calibrate='yes'\): use True"):
        ElixirStrategy(calibrate="yes")  # type: ignore[arg-type]
