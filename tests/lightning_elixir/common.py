"""Shared pieces of the Elixir strategy tests: a tiny GPT LightningModule, fixed data, a loss recorder,
a fixed CPU device profile (plans must not depend on how loaded the test machine is) and the
mixed-plan budget for the model."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tightfit.models import GPT, GPTConfig
from tightfit.profiler.types import ClusterSpec, DeviceProfile

GiB = 2**30
CONFIG = GPTConfig(vocab_size=256, n_positions=64, hidden=64, layers=4, heads=4)
BATCH, SEQ = 4, 32


def cpu_device() -> DeviceProfile:
    """A fixed CPU profile (gloo collectives ~1 GB/s, 50 GFLOP/s fp32, host AdamW 3e8 elements/s)."""
    return DeviceProfile(name="cpu", kind="cpu", memory_bytes=24 * GiB, free_bytes=24 * GiB,
                         matmul_flops={"float32": 5e10}, host_adam_elems_per_s=3e8, device_adam_elems_per_s=3e8,
                         collective_bytes_per_s={"all_gather": {1 << 20: 1e9}, "reduce_scatter": {1 << 20: 1e9}})


def token_data(samples: int = 80, seed: int = 1) -> TensorDataset:
    """Learnable sequences: each one counts up from a random start (next token = this token + 1)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, CONFIG.vocab_size, (samples, 1), generator=g)
    seqs = (start + torch.arange(SEQ + 1)) % CONFIG.vocab_size
    return TensorDataset(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())


class TinyGPT(L.LightningModule):
    """The tightfit GPT as a LightningModule; ``meta=True`` builds it in ``configure_model`` instead of ``__init__``."""

    def __init__(self, meta: bool = False, lr: float = 3e-3, samples: int = 80, batch_size: int = BATCH) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: GPT | None = None if meta else GPT(CONFIG)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(CONFIG)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("loss", loss, prog_bar=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Here, not in training_step: ``.item()`` is data-dependent, which the meta-device profile cannot run.
        self.losses.append(outputs["loss"].item())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("val_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(token_data(self.hparams.samples), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(token_data(16, seed=2), batch_size=BATCH)

    def predict_dataloader(self):
        return DataLoader(token_data(8, seed=3), batch_size=BATCH)


def mixed_budget_for(world_size: int, precision: str = "32-true", batch_size: int = BATCH) -> int:
    """The budget under which the planner picks a mixed plan for TinyGPT on ``world_size`` fixed CPUs."""
    from lightning_elixir.planning import profile_module
    from tightfit.planner.elixir import mixed_budget

    module = TinyGPT()
    batch = next(iter(DataLoader(token_data(8), batch_size=batch_size)))
    profile = profile_module(module, batch)
    return mixed_budget(profile, ClusterSpec.uniform(cpu_device(), world_size), precision=precision)


def trainer(strategy, tmp_path, *, devices: int, max_steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps,
                     default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                     logger=kwargs.pop("logger", False), enable_checkpointing=kwargs.pop("enable_checkpointing", False),
                     num_sanity_val_steps=0, limit_val_batches=kwargs.pop("limit_val_batches", 0), **kwargs)
