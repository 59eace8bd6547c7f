"""The default paths that tests/test_memory_limits.py runs under a hard memory limit, one per child process.

``python -m tests.helpers.memory_limit_children KIND WORK_DIR``: runs ``KIND``'s default path (no budget beyond the
disk directory) and prints one JSON line last: ``{"losses": [...], ...}`` where it fits, ``{"refused": "..."}`` with
exit code 3 where it refuses before any step. An OOM kill prints nothing (the parent reads the group's counter).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# A GPT whose fp32 AdamW state (parameters, gradients, two moments: 16 bytes a parameter) is about 1.3 GB, while the
# interpreter with torch and Lightning holds a few hundred MiB: larger than a limit of a few hundred MiB above it. Its
# head is tied to a large token embedding, as GPT-2's: the least-memory step peaks in the embedding's backward, where
# the head's and the lookup's gradients of the table are summed.
ELIXIR_GPT = {"vocab_size": 32768, "n_positions": 32, "hidden": 768, "layers": 8, "heads": 8, "tie_embeddings": True}
STEPS, BATCH, SEQ = 2, 1, 32


def _threads() -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def elixir(work: Path, **given: object) -> dict:
    """``Trainer(strategy=ElixirStrategy(disk_dir=D))``, nothing else given (or the budgets ``given``), the model
    built in configure_model."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_elixir import ElixirStrategy
    from tightfit.models import GPTConfig, build_gpt

    cfg = GPTConfig(**ELIXIR_GPT)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (STEPS * BATCH, SEQ + 1), generator=g)
    losses: list[float] = []

    class GPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)
                self.model = build_gpt(cfg)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x).reshape(-1, cfg.vocab_size), y.reshape(-1))

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"].item()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, shuffle=False)

    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    strategy = ElixirStrategy(disk_dir=disk, verbose=False, **given)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=str(work))
    trainer.fit(GPT())
    plan = strategy.plan
    return {"losses": losses, "disk_units": len(plan.disk_units), "peak_bytes": plan.peak_bytes,
            "budget_bytes": plan.budget_bytes, "explain": plan.explain()}


# The cached DLRM: two tables of 1.35 M rows x 32 (about 330 MiB of fp32 rows) on disk, 0.1% of their rows cached.
DLRM_ROWS, DLRM_DIM, DLRM_STEPS, DLRM_BATCH = 1_350_000, 32, 4, 512


def dlrm(work: Path, on_disk: bool = True) -> dict:
    """TorchRec's DLRM over a ``CachedEmbeddingBagCollection(cache=CacheConfig(optimizer=..., disk_dir=D))``,
    nothing else given: the tables live on disk, the host level and the device slots take the defaults
    (``on_disk=False``: no ``disk_dir``, the full tables in host memory)."""
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM

    from torchrec_cache import CacheConfig, CachedEmbeddingBagCollection, RowOptimizer

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DLRM_DIM, num_embeddings=DLRM_ROWS,
                                 feature_names=[f"f{i}"], init_fn=lambda w: w.data.fill_(0.01)) for i in range(2)]
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    ebc = CachedEmbeddingBagCollection(tables=tables, cache=CacheConfig(
        capacity=0.001, optimizer=RowOptimizer(kind="rowwise_adagrad", lr=0.05),
        disk_dir=str(disk) if on_disk else None))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[64, DLRM_DIM],
                 over_arch_layer_sizes=[64, 1])
    dense_opt = torch.optim.Adagrad([p for n, p in model.named_parameters() if "embedding" not in n], lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(DLRM_STEPS):
        ids = torch.randint(0, DLRM_ROWS, (2 * DLRM_BATCH,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, torch.ones(2 * DLRM_BATCH, dtype=torch.int64))
        dense = torch.randn(DLRM_BATCH, 13, generator=g)
        labels = (torch.rand(DLRM_BATCH, generator=g) > 0.5).float()
        dense_opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), labels)
        loss.backward()
        dense_opt.step()
        losses.append(float(loss.item()))
    return {"losses": losses}


SKY_WIDTH, SKY_LAYERS = 1024, 32


def sky(work: Path) -> dict:
    """``Trainer(strategy=SkyStrategy(), devices=2)``, nothing else given: two CPU ranks that Lightning starts (both
    in the parent's memory group), the planner's memory per stage read from the limit."""
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import sky_strategy

    losses: list[float] = []

    class Net(L.LightningModule):
        pipeline_layers = ("layers",)

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(nn.Linear(16, SKY_WIDTH), nn.ReLU(),
                                        *[nn.Linear(SKY_WIDTH, SKY_WIDTH) for _ in range(SKY_LAYERS)],
                                        nn.Linear(SKY_WIDTH, 10))

        def forward(self, x):
            return self.layers(x)

        def loss_fn(self, output, target):
            return F.cross_entropy(output, target)

        def training_step(self, batch, batch_idx):
            return self.loss_fn(self(batch[0]), batch[1])

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if outputs is not None:
                losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.linspace(-1, 1, 1024).view(64, 16), torch.arange(64) % 10), batch_size=16)
    trainer = L.Trainer(strategy=sky_strategy.SkyStrategy(verbose=False), accelerator="cpu", devices=2, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(work))
    trainer.fit(Net(), data)
    return {"rank": trainer.global_rank, "losses": losses}


KINDS = {"sky": sky, "elixir": elixir, "elixir-budget-2GiB": lambda work: elixir(work, memory_budget="2GiB"), "dlrm": dlrm, "dlrm-in-ram": lambda work: dlrm(work, on_disk=False)}


def main() -> int:
    from tightfit.planner.errors import PlanInfeasibleError

    kind, work = sys.argv[1], Path(sys.argv[2])
    _threads()
    try:
        out = KINDS[kind](work)
    except PlanInfeasibleError as exc:
        _say(json.dumps({"refused": str(exc), "type": type(exc).__name__}))
        return 3
    _say(json.dumps(out))
    return 0


def _say(line: str) -> None:
    """One write of one line: ranks sharing the parent's stdout never interleave their lines."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
