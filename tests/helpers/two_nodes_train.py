"""Run under `torchrun --nnodes 2` (one process per node): train with Trainer(num_nodes=2) and record the losses.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID tests/helpers/two_nodes_train.py --strategy elixir --out DIR

Each rank writes ``DIR/<strategy>-rank<r>.json``: its node rank, world size, the strategy Lightning built and
the loss of every step on its own batch. tests/test_two_nodes.py compares them with one process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS, BATCH, SAMPLES = 3, 8, 64


class Net(L.LightningModule):
    """An MLP that both strategies accept: named pipeline layers for Sky, plain blocks for Elixir."""

    pipeline_layers = ("embed", "blocks", "head")

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 16, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g))


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss.detach()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategy", choices=("elixir", "sky"), required=True, help="the strategy to train with")
    p.add_argument("--out", type=Path, required=True, help="folder for the per-rank JSON")
    args = p.parse_args()
    import lightning_elixir  # noqa: F401  registers strategy="elixir"
    import sky_strategy  # noqa: F401  registers strategy="sky"

    torch.set_num_threads(1)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=args.strategy, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[losses], default_root_dir=str(args.out))
    trainer.fit(Net(), DataLoader(dataset(), batch_size=BATCH))
    record = {"node_rank": trainer.node_rank, "global_rank": trainer.global_rank, "world_size": trainer.world_size,
              "num_nodes": trainer.num_nodes, "strategy": type(trainer.strategy).__name__,
              "group_rank_env": os.environ.get("GROUP_RANK"), "losses": losses.values}
    (args.out / f"{args.strategy}-rank{trainer.global_rank}.json").write_text(json.dumps(record))
    # Leave together: a rank that exited while its peer still tore gloo down aborted in its own teardown
    # ("terminate called without an active exception", SIGABRT) with its results already written.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
