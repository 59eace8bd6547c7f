"""One contender of ``benchmarks/elixir_disk.py`` in its own process (run under the memory limit by the parent).

    python -m benchmarks._elixir_disk_child SPEC.json

``SPEC.json`` names the role (``elixir``: ``ElixirStrategy`` with the disk tier; ``ram``: the same plan with
every unit's state in RAM; ``deepspeed``: ZeRO-3 with both offloads on NVMe, driven directly), the model, the
data seed and the steps. The child prints its numbers as one JSON line last: per step the wall time, the time
from the end of backward to the end of the step (the optimizer phase), the bytes this process read from and
wrote to the disk in the step and in its optimizer phase (``/proc/self/io``: what reached the block layer or,
for buffered writes, the page cache), the losses, and a SHA-256 per final parameter (bit-for-bit checks).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._child_sources import tag


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has moved to and from storage so far."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def rss() -> int:
    """This process's resident size now (VmRSS), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


class PhaseRSS:
    """The highest resident size seen in each phase of a step (a thread reads VmRSS every 10 ms): where host
    memory goes, beside the group's single peak."""

    def __init__(self) -> None:
        import threading

        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss())

    def enter(self, phase: str) -> dict[str, int]:
        """Start ``phase``; the peaks so far (a copy) are returned and the new phase starts from the current RSS."""
        now = rss()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), now)
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), now)
        return dict(self.peaks)

    def take(self) -> dict[str, int]:
        out, self.peaks = dict(self.peaks), {}
        return out


def peak_rss() -> int:
    """This process's resident high-water mark (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def thread_cpu() -> tuple[float, float]:
    """(CPU seconds of the store's I/O threads, CPU seconds of every other thread) of this process so far: a
    diagnostic of how much of the cores the disk tier's reads, writes and checksums take from the compute."""
    import threading

    io = {str(t.native_id) for t in threading.enumerate() if t.name.startswith("tightfit-io")}
    hz = os.sysconf("SC_CLK_TCK")
    io_s = other_s = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / hz  # utime + stime
        if task.name in io:
            io_s += cpu
        else:
            other_s += cpu
    return io_s, other_s


class StepClock:
    """Marks of one step: start, end of backward, end; the disk bytes and the threads' CPU time at each."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._start: tuple[float, ...] = (0.0, 0, 0, 0.0, 0.0)
        self._mid: tuple[float, ...] = (0.0, 0, 0, 0.0, 0.0)

    def start(self) -> None:
        self._start = (time.perf_counter(), *proc_io(), *thread_cpu())

    def backward_done(self) -> None:
        self._mid = (time.perf_counter(), *proc_io(), *thread_cpu())

    def end(self, loss: float) -> None:
        t, r, w, io, other = time.perf_counter(), *proc_io(), *thread_cpu()
        (t0, r0, w0, io0, other0), (t1, r1, w1, io1, other1) = self._start, self._mid
        self.steps.append({"wall_s": t - t0, "opt_s": t - t1, "read_bytes": r - r0, "write_bytes": w - w0,
                           "opt_read_bytes": r - r1, "opt_write_bytes": w - w1, "loss": loss,
                           "io_cpu_fwd_bwd_s": io1 - io0, "other_cpu_fwd_bwd_s": other1 - other0,
                           "io_cpu_opt_s": io - io1, "other_cpu_opt_s": other - other1})


def digests(named: Any, master: Any = None, store_dir: Any = None) -> dict[str, str]:
    """SHA-256 of each parameter's full value (DTensors gathered), by name; a tier-3 parameter left in the store
    after fit (``master``: its ``DiskParameters``, ``store_dir``: the rank's store) is read from there, one at a
    time (one rank: a local shard is the whole parameter)."""
    from tightfit.storage import TensorStore

    where = {id(p): (u.index, start, n) for u in master.units for p, start, n in u.pieces} if master else {}
    out = {}
    with TensorStore(store_dir) if where else nullcontext() as store:
        for name, p in named:
            if id(p) in where:
                unit, start, n = where[id(p)]
                t = torch.empty(n, dtype=torch.float32)
                assert store is not None
                store.read_into(master.name(unit), t, start * 4).result()
            else:
                t = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu").contiguous()
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


PORT_TRIES = 4


def data(spec: dict) -> torch.Tensor:
    """This repeat's tokens (fresh per repeat, the same for every contender of the repeat)."""
    g = torch.Generator().manual_seed(1000 + spec["seed"])
    return torch.randint(0, spec["config"]["vocab_size"], (spec["steps"], spec["batch"], spec["seq"] + 1), generator=g)


def run_lightning(spec: dict) -> dict:
    """``elixir`` / ``ram``: Lightning's Trainer with ``ElixirStrategy`` on the given plan."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_elixir import ElixirStrategy
    from tightfit.models import GPTConfig, build_gpt

    cfg = GPTConfig(**spec["config"])
    tokens = data(spec).flatten(0, 1)
    clock = StepClock()
    phases = PhaseRSS()

    class Bench(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None

        def configure_model(self) -> None:
            # On meta under the strategy (tensor_init_context): allocated and initialised as the plan places it, a
            # tier-3 unit at a time into the store, never the whole fp32 model in RAM.
            if self.model is None:
                torch.manual_seed(0)
                self.model = build_gpt(cfg)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x).reshape(-1, cfg.vocab_size), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=spec["lr"])

        def train_dataloader(self):
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=spec["batch"], shuffle=False)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if batch_idx == 0:
                phases.enter("setup")
                setup_rss.update(phases.take())
            phases.enter("forward")
            clock.start()

        def on_before_backward(self, trainer, module, loss) -> None:
            phases.enter("backward")

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            phases.enter("optimizer")
            clock.backward_done()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            clock.end(float(outputs["loss"].item()))
            phases.enter("between")
            clock.steps[-1]["rss_peak_by_phase"] = phases.take()
            state = getattr(trainer.strategy, "disk_state", None)
            io = getattr(state, "last_step", None)
            if io is not None:  # the runtime's own account of the streamed step (DiskOptimizerState.last_step)
                clock.steps[-1].update(stream_s=io.seconds, stream_read_bytes=io.bytes_read,
                                       stream_write_bytes=io.bytes_written, stream_wait_s=io.wait_seconds,
                                       stream_sync_s=io.sync_seconds)
            grads = getattr(state, "grads", None)
            if grads is not None:  # tier 4: gradients written behind the backward so far (DiskGradients)
                clock.steps[-1]["grad_bytes_written_total"] = grads.bytes_written

    setup_rss: dict[str, int] = {}
    kwargs: dict[str, Any] = {"plan": spec["plan"], "verbose": False}
    if spec["role"] == "elixir":
        kwargs.update(host_budget=spec["host_budget"], disk_dir=spec["disk_dir"])
    module = Bench()
    left: list[Any] = []  # tier-3 weights the strategy left in the store after fit (they did not fit back in RAM)
    for attempt in range(1, PORT_TRIES + 1):
        strategy = ElixirStrategy(**kwargs)
        teardown = strategy.teardown

        def keep_master(strategy: Any = strategy, teardown: Any = teardown) -> None:
            state = strategy.disk_state
            teardown()
            if state is not None and state.master is not None and strategy._left_on_disk is not None:
                left.append((state.master, state.store.path))

        strategy.teardown = keep_master  # type: ignore[method-assign]
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1,
                            max_steps=spec["steps"], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=[Clock()], default_root_dir=spec["work_dir"])
        try:
            trainer.fit(module)
            break
        except Exception as exc:
            # Lightning finds its rendezvous port by binding port 0 and closing it; another process can take the
            # port before the store listens on it. Nothing has run then (no step, no disk state): start again.
            if "EADDRINUSE" not in str(exc) or clock.steps or attempt == PORT_TRIES:
                raise
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            os.environ.pop("MASTER_PORT", None)
    assert module.model is not None
    return {"steps": clock.steps, "setup_rss_peak": setup_rss.get("setup"),
            "digests": digests(module.model.named_parameters(), *(left[0] if left else (None, None)))}


def aio_unavailable() -> str | None:
    """Why DeepSpeed's async_io op (ZeRO-Infinity's NVMe path) cannot load here, or None."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as exc:
        return f"DeepSpeed is not installed ({exc})"
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's async_io op is not buildable here: libaio-dev is missing (apt-get install -y libaio-dev)"
    try:
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means the peer cannot run; say which
        return f"DeepSpeed's async_io op failed to build/load: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def run_deepspeed(spec: dict) -> dict:
    """ZeRO-3, ``offload_optimizer`` and ``offload_param`` on ``device: nvme``, one process over gloo."""
    import importlib
    import socket


    # import_module, not `import deepspeed.comm.torch as`: that binds deepspeed.comm's attribute `torch`, PyTorch
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    ds_torch.build_shm_op = lambda: None  # its CPU shared-memory op crashes on these machines (SETUP_NOTES.md)
    reason = aio_unavailable()
    if reason is not None:
        return {"unavailable": reason}
    import deepspeed

    from tightfit.models import GPTConfig, build_gpt

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    deepspeed.init_distributed("gloo")
    cfg = GPTConfig(**spec["config"])
    torch.manual_seed(0)
    # Built under zero.Init, as ZeRO-Infinity's docs say for a model larger than memory: each parameter goes to its
    # NVMe partition as it is made. (Also needed on a CPU: deepspeed.initialize partitioning an already built fp32
    # model passes dtype=float32 to zero.Init, which in DeepSpeed 0.19.8 then picks bfloat16 when the accelerator
    # has no fp16 - an operator-precedence slip in Init._set_dtype.)
    with deepspeed.zero.Init(config_dict_or_path=spec["ds_config"]):
        model = build_gpt(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=spec["ds_config"])
    clock = StepClock()
    for batch in data(spec):
        x, y = batch[:, :-1], batch[:, 1:]
        clock.start()
        loss = F.cross_entropy(engine(x).reshape(-1, cfg.vocab_size), y.reshape(-1))
        engine.backward(loss)
        clock.backward_done()
        engine.step()
        clock.end(float(loss.item()))
    swap = Path(spec["disk_dir"])
    swapped = sum(f.stat().st_size for f in swap.rglob("*.swp")) if swap.is_dir() else 0
    return {"steps": clock.steps, "swap_file_bytes": swapped}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    try:
        out = run_deepspeed(spec) if spec["role"] == "deepspeed" else run_lightning(spec)
        out["ok"] = "unavailable" not in out
    except Exception as exc:  # noqa: BLE001 - reported in the result JSON with its traceback, not swallowed
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    out["peak_rss_bytes"] = peak_rss()
    print(json.dumps(tag(out)), flush=True)
    return 0 if out["ok"] or "unavailable" in out else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
