"""Train a small transformer-ish model on 2 processes that play devices of unequal speed.

    python examples/sky_strategy/train_hetero.py                     # rank 1 plays a 3x slower device
                                                     # checkpoint: runs/sky_hetero/last.ckpt
    python examples/sky_strategy/train_hetero.py --partition even    # the even split, for comparison
    torchrun --nproc-per-node 2 examples/sky_strategy/train_hetero.py --slowdown 1   # launched by torchrun
    python examples/sky_strategy/train_hetero.py --steps 4            # seconds (the tests)

Lightning starts the second process itself (``devices=2``). On GPUs use ``--accelerator gpu`` and drop
``--slowdown``: real devices of unequal speed are measured, not injected. The module follows the
SkyStrategy convention: ``pipeline_layers`` names the layers in forward order, ``loss_fn`` is the
per-microbatch loss, and ``training_step``/``validation_step`` are ordinary Lightning code.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# Importing torch and Lightning takes seconds (10 s on 2 busy cores), in rank 0 and again in the rank Lightning
# spawns (LOCAL_RANK=1): say so rather than start silent.
_WHO = "[train_hetero]" + ("" if os.environ.get("LOCAL_RANK", "0") == "0" else f" rank {os.environ['LOCAL_RANK']}:")
print(f"{_WHO} importing PyTorch ...", flush=True)
import torch

print(f"{_WHO} importing Lightning ...", flush=True)
import lightning as L
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sky_strategy  # registers strategy="sky"
from tightfit.console import heartbeat


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Head(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        return self.out(self.norm(x)).mean(dim=1)  # pooling lives in a layer: forward == layers in order


class TokenClassifier(L.LightningModule):
    pipeline_layers = ("embed", "blocks", "head")  # each block is one layer the planner places

    def __init__(self, vocab: int = 512, width: int = 256, depth: int = 8, classes: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = Head(width, classes)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss_fn(self, logits, target):
        return F.cross_entropy(logits, target)

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        loss = self.loss_fn(self(tokens), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, target = batch
        logits = self(tokens)
        self.log("val_loss", self.loss_fn(logits, target))
        self.log("val_acc", (logits.argmax(-1) == target).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def data(n: int, seq: int = 32, vocab: int = 512, classes: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    return TensorDataset(tokens, tokens[:, 0] % classes)  # learnable: the class is in the first token


class Throughput(L.Callback):
    """Step times, and a progress line from rank 0 at most every ``every_s`` seconds (and at the last step)."""

    def __init__(self, every_s: float = 3.0):
        self.times: list[float] = []
        self.every_s, self.last = every_s, 0.0

    def on_train_batch_start(self, *args):
        self.t = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.times.append(now - self.t)
        if trainer.is_global_zero and (now - self.last >= self.every_s or trainer.global_step >= trainer.max_steps):
            self.last = now
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            print(f"[train_hetero] step {trainer.global_step}/{trainer.max_steps}: loss {float(loss):.3f}, "
                  f"{self.times[-1] * 1e3:.0f} ms/step", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slowdown", type=float, default=3.0, help="rank 1 plays a device this many times slower")
    p.add_argument("--partition", default="balanced", help="balanced (default), even, parameter-balanced, sky")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--out", default="runs/sky_hetero", help="folder for the checkpoint (default runs/sky_hetero)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "last.ckpt"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # Lightning starts rank 1 with LOCAL_RANK=1: one banner
        print(f"[train_hetero] 2 processes, rank 1 slowed {args.slowdown:g}x, partition {args.partition}: the "
              "first batch profiles every layer on every rank, then rank 0 plans (about 20 s on 2 CPU cores)",
              flush=True)
    strategy = sky_strategy.SkyStrategy(schedule=args.schedule, microbatches=4, partition=args.partition,
                                        speed_factors=[1.0, 1.0 / args.slowdown])
    timer = Throughput()
    trainer = L.Trainer(accelerator=args.accelerator, devices=2, strategy=strategy, max_steps=args.steps,
                        val_check_interval=10, limit_val_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[heartbeat("train_hetero"), timer])
    trainer.fit(TokenClassifier(), DataLoader(data(2048), batch_size=32), DataLoader(data(256), batch_size=32))
    # Every rank takes part (the full model is gathered on rank 0); weights_only=False keeps the optimizer
    # and loop state so the run can resume, and says so instead of letting Lightning warn about the default.
    trainer.save_checkpoint(ckpt, weights_only=False)
    if trainer.is_global_zero:
        steady = sorted(timer.times[3:] or timer.times)
        med = steady[len(steady) // 2]
        acc = trainer.callback_metrics.get("val_acc")  # none before the first validation (step 10)
        print(f"\n[train_hetero] {args.partition}: layers per rank {strategy.plan.layer_counts()}, "
              f"{med * 1e3:.1f} ms/step, {32 / med:.0f} samples/s; val_acc "
              f"{'not measured yet' if acc is None else f'{float(acc):.2f}'}\n[train_hetero] checkpoint: "
              f"{ckpt.resolve()} (loads into TokenClassifier() in one process)", flush=True)


if __name__ == "__main__":
    main()
