"""Train a small GPT on the text bundled here with ``Trainer(strategy="elixir")``.

    python examples/lightning_elixir/train_gpt.py                      # 2 CPU processes (or every GPU)
    python examples/lightning_elixir/train_gpt.py --budget mixed       # a budget that forces a mixed plan
    python examples/lightning_elixir/train_gpt.py --hidden 256 --layers 8 --budget 200MiB --steps 500
    python examples/lightning_elixir/train_gpt.py --steps 4 --hidden 32 --layers 2 --seq 32 --batch 4   # seconds

The model reads raw UTF-8 bytes (a 256-token vocabulary, no tokenizer to download) from
``data/corpus.txt``. It is built in ``configure_model``, so it starts on the meta device: Elixir
profiles one training step there, searches the plan, prints it, writes ``plan.json`` and only then
allocates each unit where the plan puts it.

Outputs in ``--out`` (default ``runs/elixir_demo``): ``last.ckpt`` (a sharded checkpoint directory;
resume with ``--resume``), ``model.safetensors`` + ``config.json`` (the consolidated weights, loadable
into ``tightfit.models.GPT`` without tightfit's runtime, and what the energon_infer demo serves),
``plan.json`` and ``summary.json`` (losses and the plan's shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

# Importing torch and Lightning takes seconds (10 s on 2 busy cores), in rank 0 and again in the rank Lightning
# spawns (LOCAL_RANK=1): say so rather than start silent.
_WHO = "[train_gpt]" + ("" if os.environ.get("LOCAL_RANK", "0") == "0" else f" rank {os.environ['LOCAL_RANK']}:")
print(f"{_WHO} importing PyTorch ...", flush=True)
import torch

print(f"{_WHO} importing Lightning ...", flush=True)
import lightning as L
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_elixir  # noqa: F401  (registers strategy="elixir")
from lightning_elixir import ElixirStrategy
from tightfit.console import drop_framework_tips, fit_text, heartbeat
from tightfit.models import GPT, GPTConfig

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


class ByteWindows(Dataset):
    """Windows of ``seq + 1`` bytes of the corpus: input = the first ``seq``, target = the next byte of each."""

    def __init__(self, path: Path, seq: int, samples: int, seed: int = 0) -> None:
        self.data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        if len(self.data) <= seq + 1:
            raise ValueError(f"{path} has {len(self.data)} bytes; --seq {seq} needs more (use a shorter --seq)")
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.data) - seq - 1, (samples,), generator=g)
        self.seq = seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[self.starts[i]: self.starts[i] + self.seq + 1]
        return w[:-1], w[1:]


class ByteGPT(L.LightningModule):
    def __init__(self, config: dict, lr: float = 3e-3, seq: int = 64, batch: int = 8, samples: int = 4096) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain values: the export and energon_infer read the config back
        self.model: GPT | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:  # Lightning may call this again (validate after fit)
            self.model = GPT(GPTConfig(**self.hparams.config))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())
        step, now = self.global_step, time.perf_counter()
        # The first step, every 10 steps, and at least every 3 s on a slow machine, so the run never goes quiet.
        if self.global_rank == 0 and (step in (1, self.trainer.max_steps) or step % 10 == 0
                                      or now - getattr(self, "_last_print", now) >= 3.0):
            print(f"step {step:5d}  loss {self.losses[-1]:.3f}", flush=True)
            self._last_print = now
        elif not hasattr(self, "_last_print"):
            self._last_print = now

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)

    def train_dataloader(self):
        data = ByteWindows(CORPUS, self.hparams.seq, self.hparams.samples)
        return DataLoader(data, batch_size=self.hparams.batch, shuffle=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in bytes (default 64)")
    p.add_argument("--batch", type=int, default=8, help="per-process batch (default 8)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--budget", default=None,
                   help="memory per device: '200MiB', a fraction like 0.5, 'mixed' (a budget that forces some "
                        "units offloaded, some resharded, some recomputed), or none for all of it")
    p.add_argument("--devices", type=int, default=None, help="processes (default: every GPU, else 2 CPU processes)")
    p.add_argument("--precision", default=None, help="default bf16-mixed on GPU, 32-true on CPU")
    p.add_argument("--out", default="runs/elixir_demo", help="checkpoints, plan and exported weights")
    p.add_argument("--resume", action="store_true", help="continue from <out>/last.ckpt")
    return p.parse_args(argv)


def mixed_budget_for(module: ByteGPT, args: argparse.Namespace, devices: int, precision: str):
    """The budget (and device profile) under which the planner picks a mixed plan for this model."""
    from lightning_elixir.planning import local_device, profile_module
    from tightfit.planner.elixir import mixed_budget
    from tightfit.profiler.types import ClusterSpec

    with torch.device("meta"):  # profiling needs no real weights
        module.configure_model()
    batch = next(iter(DataLoader(ByteWindows(CORPUS, args.seq, 8), batch_size=args.batch)))
    profile = profile_module(module, batch)
    device = local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return mixed_budget(profile, ClusterSpec.uniform(device, devices), precision=precision), device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    drop_framework_tips()  # Lightning's "try installing litlogger" line, printed once per rank
    gpu = torch.cuda.is_available()
    devices = args.devices or (torch.cuda.device_count() if gpu else 2)
    precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    config = dataclasses.asdict(GPTConfig(vocab_size=256, n_positions=max(args.seq, 64), hidden=args.hidden,
                                          layers=args.layers, heads=args.heads, name="byte-gpt"))
    L.seed_everything(0, verbose=False)
    module = ByteGPT(config, lr=args.lr, seq=args.seq, batch=args.batch)
    budget, device_profile = args.budget, None
    if budget == "mixed":
        probe = ByteGPT(config, seq=args.seq, batch=args.batch)
        budget, device_profile = mixed_budget_for(probe, args, devices, precision)
    elif budget is not None:
        try:
            budget = float(budget) if 0 < float(budget) <= 1 else budget
        except ValueError:
            pass
    out = Path(args.out)
    strategy = ElixirStrategy(memory_budget=budget, device_profile=device_profile)
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if gpu else "cpu", devices=devices, precision=precision,
        max_steps=args.steps, default_root_dir=str(out), logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[heartbeat("train_gpt"), ModelCheckpoint(dirpath=out, save_last=True, save_top_k=0,
                                                               every_n_train_steps=max(1, args.steps // 2))])
    start = time.perf_counter()
    trainer.fit(module, ckpt_path=str(out / "last.ckpt") if args.resume else None)
    seconds = time.perf_counter() - start
    if trainer.is_global_zero:
        from lightning_elixir.export import export_checkpoint

        weights = export_checkpoint(out / "last.ckpt", out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(config, indent=2))
        plan = strategy.plan
        summary = {
            "losses": module.losses, "seconds": seconds, "devices": devices, "precision": precision,
            "units": len(plan.units), "offloaded_units": len(plan.offloaded_units),
            "checkpointed_blocks": len(plan.checkpointed_blocks),
            "resharded_units": sum(u.mode == "reshard" for u in plan.units),
            "predicted_step_s": plan.step_time_s, "peak_bytes": plan.peak_bytes, "budget_bytes": plan.budget_bytes,
            "checkpoint": str(out / "last.ckpt"), "weights": str(weights),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        first, last = module.losses[0], module.losses[-1]
        print(fit_text(f"\ntrained {args.steps} steps on {devices} x {'GPU' if gpu else 'CPU'} in {seconds:.1f} s: "
                       f"loss {first:.2f} -> {last:.2f}; plan: {summary['units']} units, {summary['offloaded_units']} "
                       f"offloaded, {summary['resharded_units']} resharded, {summary['checkpointed_blocks']} blocks "
                       "recomputed"))
        print(fit_text(f"artifacts in {out}/: last.ckpt (checkpoint), {Path(weights).name} + config.json "
                       "(weights), plan.json, summary.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
