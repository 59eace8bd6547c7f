"""The Sky part of ``tightfit demo``, and the 2-process training comparison ``benchmarks/sky_train.py`` reuses.

1. Plan a simulated heterogeneous cluster (no processes): even split vs Sky Computing's allocator vs ours.
2. Train 2 real gloo processes with Lightning, rank 1 playing a 3x slower device: even vs balanced.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp
from torch import nn

from tightfit.console import drop_framework_tips, fit_text
from tightfit.planner.pipeline import DeviceSpec, LayerMemory, PipelineProblem, balance, even, sky_allocator
from tightfit.units import format_ratio

__all__ = ["run_demo", "simulated_cluster_plans", "train_side_by_side", "launch", "demo_module"]


def simulated_cluster_plans() -> str:
    """A 24-layer model on 4 devices of unequal speed and memory; returns the printed comparison."""
    costs = [1.5] + [1.0] * 22 + [0.8]  # embedding, blocks, head: seconds per microbatch on a speed-1 device
    mems = [LayerMemory(param_bytes=200 * 2**20, activation_bytes=50 * 2**20, output_bytes=8 * 2**20)] * 24
    devices = [DeviceSpec(name="A100", speed=1.0, memory_bytes=40 * 2**30),
               DeviceSpec(name="T4", speed=0.25, memory_bytes=16 * 2**30),
               DeviceSpec(name="V100", speed=0.5, memory_bytes=16 * 2**30),
               DeviceSpec(name="A10", speed=0.4, memory_bytes=6 * 2**30)]
    problem = PipelineProblem(layer_costs=costs, layer_memory=mems, devices=devices, microbatches=8,
                              schedule="1f1b", links=10e9)
    plans = [even(problem), sky_allocator(problem), balance(problem)]
    lines = [plans[-1].explain(), ""]
    for p in plans:
        lines.append(f"{p.method:>9}: layers per device {dict(zip(p.devices, p.layer_counts()))}, "
                     f"step {p.step_time_s:.1f} s{'' if p.feasible else ' (exceeds a memory cap)'}")
    return "\n".join(lines)


def demo_module(width: int, depth: int, *, vocab: int | None = None):
    """Wide MLP blocks: enough compute per layer that a slowed rank shows on 1 CPU thread per rank.

    The first layer reads 64 features, or, with ``vocab``, token ids through a ``vocab x width`` embedding
    (most of the parameters and almost no compute: what the cost-model benchmark uses so that layer
    counts and parameter bytes disagree)."""
    import lightning as L
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x):
            return x + torch.relu(self.fc(x))

    class Net(L.LightningModule):
        pipeline_layers = ("embed", "blocks", "head")

        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(64, width) if vocab is None else nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            x = self.embed(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

        def loss_fn(self, out, y):
            return F.cross_entropy(out, y)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.loss_fn(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Net()


def _train_rank(rank: int, world: int, contenders: list[dict], speed_factors: list[float], steps: int,
                repeats: int, width: int, depth: int, batch: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from sky_strategy.strategy import SkyStrategy

    class StepTimer(L.Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_batch_start(self, *args):
            self._t = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self._t)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(batch * steps, 64, generator=g), torch.randint(0, 10, (batch * steps,), generator=g))
    results: dict = {c["name"]: {"step_s": [], "counts": None} for c in contenders}
    for _ in range(repeats):
        for c in contenders:  # interleaved: A B A B ...
            timer = StepTimer()
            strategy = SkyStrategy(verbose=False, speed_factors=speed_factors, **c["kwargs"])
            trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, callbacks=[timer], use_distributed_sampler=False)
            torch.manual_seed(0)
            trainer.fit(demo_module(width, depth), DataLoader(data, batch_size=batch))
            warm = timer.times[2:] or timer.times  # the first steps build schedules and profile
            results[c["name"]]["step_s"].append(sorted(warm)[len(warm) // 2])
            plan = strategy.plan
            assert plan is not None  # planned on the first batch
            results[c["name"]]["counts"] = plan.layer_counts()
            results[c["name"]]["predicted_step_s"] = plan.step_time_s
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, out):
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    drop_framework_tips()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world: int, args: tuple, timeout: float = 600.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo processes; return rank results."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, ok, payload = out.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"sky training ranks stopped (exit codes {[p.exitcode for p in procs]})") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def train_side_by_side(*, slowdown: float = 3.0, steps: int = 8, repeats: int = 1, width: int = 768,
                       depth: int = 6, batch: int = 64, microbatches: int = 4,
                       partitions: tuple[str, ...] = ("even", "balanced")) -> dict:
    """Partitions side by side (default even vs balanced), 2 processes, rank 1 playing a ``slowdown``-times
    slower device."""
    contenders = [{"name": name, "kwargs": dict(partition=name, microbatches=microbatches)} for name in partitions]
    res = launch(_train_rank, 2, (contenders, [1.0, 1.0 / slowdown], steps, repeats, width, depth, batch))
    return res[0]


def run_demo(quick: bool) -> str:
    print("1) planning for a simulated cluster (A100, T4, V100, A10), 1F1B, 8 microbatches:")
    print(fit_text(simulated_cluster_plans()))
    print("\n2) training on 2 gloo processes with Lightning, rank 1 playing a 3x slower device:", flush=True)
    # Repeats interleave even and balanced (A B A B ...); the headline is the median of the per-repeat
    # ratios, and a spread crossing 1.0 is reported as inconclusive rather than as a speed-up or a loss.
    res = train_side_by_side(steps=5 if quick else 12, repeats=3 if quick else 5, width=512 if quick else 768)
    for name, r in res.items():
        med = sorted(r["step_s"])[len(r["step_s"]) // 2]
        print(f"   {name:>8}: layers per rank {r['counts']}, {med * 1e3:.0f} ms/step ({64 / med:.0f} samples/s)")
    ratios = [e / b for e, b in zip(res["even"]["step_s"], res["balanced"]["step_s"])]
    return (f"balanced {res['balanced']['counts']} vs even {res['even']['counts']} layers, rank 1 slowed 3x: "
            f"{format_ratio(ratios, 'the samples/s')}")
