"""The worker group: ``tp x pp`` processes, each holding one :class:`~energon_infer.worker.runtime.ModelRunner`.

The engine's controller (in the user's process) starts the group with ``torch.multiprocessing``
(spawn), and every worker joins one ``torch.distributed`` process group (gloo on CPUs, NCCL on
GPUs) and loads its slice of the model. From then on the workers are SPMD: each reads the same
commands in the same order from its own queue and calls the runner with them, so their KV caches
stay in step without talking about bookkeeping. Only the result rank (tp rank 0 of the last stage)
answers a step, with the sampled tokens, on the shared result queue.

Commands and replies are the typed messages of :mod:`energon_infer.protocol` (``Step``, ``Free``,
``Stats``, ``Stop``; ``Ready``, ``Tokens``, ``StatsReport``, ``WorkerError``).

A worker that fails reports a ``WorkerError`` and exits; a worker whose parent dies exits on its
own (it polls), so no orphan holds a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from energon_infer.errors import UnavailableError
from energon_infer.protocol import (
    Command,
    CompileGrammars,
    Free,
    GrammarReady,
    Ping,
    Pong,
    PoolInfo,
    Ready,
    Reply,
    Stats,
    StatsReport,
    Step,
    Stop,
    WorkerError,
    WorkerInfo,
)
from energon_infer.worker.late_steps import merge, poller, split, take_late
from energon_infer.worker.stage_timer import StageTimer
from energon_infer.worker.token_feedback import TokenFeedback

__all__ = ["ModelSource", "SpawnedWorkerGroup", "WorkerStartError", "build_runner", "load_worker", "serve_commands",
           "StageTimer"]


class WorkerStartError(UnavailableError, RuntimeError):
    """The worker group could not start (a worker failed to load, died, or took too long)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What each worker loads: a Hugging Face directory or a tightfit GPT training checkpoint.

    Args:
        kind: ``"pretrained"`` (:meth:`ModelRunner.from_pretrained`) or ``"tightfit_gpt"``
            (:func:`energon_infer.worker.gpt_checkpoint.load_tightfit_gpt`).
        path: the directory or checkpoint file.
        options: extra keyword arguments of the loader (``gpt_config``, ``heads``).
    """

    kind: str
    path: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("pretrained", "tightfit_gpt"):
            raise ValueError(f"ModelSource kind={self.kind!r} must be 'pretrained' or 'tightfit_gpt'")


def build_runner(source: ModelSource, runtime: Any) -> Any:
    """Load ``source`` on this rank with ``runtime`` (a :class:`~energon_infer.worker.runtime.RuntimeConfig`)."""
    if source.kind == "pretrained":
        from energon_infer.loading.backend import choose_backend

        if choose_backend(source.path, runtime.model_impl)[0] == "transformers":  # transformers' modeling code
            from energon_infer.worker.hf_runner import TransformersRunner

            return TransformersRunner.from_pretrained(source.path, runtime)
        from energon_infer.worker.runtime import ModelRunner

        return ModelRunner.from_pretrained(source.path, runtime)
    from energon_infer.worker.gpt_checkpoint import load_tightfit_gpt

    return load_tightfit_gpt(source.path, runtime, **source.options)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_WARMUP_SEQ = -(1 << 40)  # never a controller's id (those are positive) nor the runner's own (small negatives)


def _warm_up(runner: Any, *, decode: bool = True) -> None:
    """A 2-token step and a decode step (SPMD): the first request does not pay for lazy initialisation (seconds
    on a CPU). ``decode=False`` (a stage streams from disk: each step reads its disk layers) runs the first only."""
    from energon_infer.sampling import SamplingParams

    first = runner.step([(_WARMUP_SEQ, [0, 0])], SamplingParams(temperature=0, max_tokens=2)).tokens
    if decode:
        runner.step([(_WARMUP_SEQ, [first[0] if first else 0])])
    runner.free(_WARMUP_SEQ)
    if runner.decode_graphs is not None:  # every decode bucket captured now, not while a request waits
        runner.decode_graphs.capture_all()


def _load_tiered(source: ModelSource, runtime: Any, pool: Any) -> tuple[Any, Any, Any, bool]:
    """Plan the device/host/disk pool on rank 0 for every stage, load this rank's stage without its disk layers,
    and install the pool (:mod:`energon_infer.worker.disk_pool`); last: whether any stage streams from disk."""
    import torch.distributed as dist

    from energon_infer.loading.config import load_config
    from energon_infer.loading.quantization import QuantSpec
    from energon_infer.parallel import local_rank_device
    from energon_infer.worker.disk_pool import decode_plans, encode_plans, install_tiered_pool, plan_tiers
    from energon_infer.worker.runtime import ModelRunner
    from tightfit.distributed import decide_on_rank0

    if source.kind != "pretrained":
        raise ValueError(f"memory_budget streams layers from a Hugging Face safetensors directory; {source.path} is a "
                         "training checkpoint: export it with save_pretrained first, or use device_budget")
    cfg = load_config(source.path)
    device = torch.device(runtime.device) if runtime.device else local_rank_device()
    quant = QuantSpec.create(runtime.quantization, runtime.group_size)
    plans = decide_on_rank0(lambda: plan_tiers(source.path, cfg, tp=runtime.tp, pp=runtime.pp, dtype=runtime.dtype,
                                               device_type=device.type, config=pool, quant=quant),
                            encode=encode_plans, decode=decode_plans)
    stage = dist.get_rank() // runtime.tp if dist.is_initialized() else 0
    plan = plans[stage]
    experts: list[str] = []
    if pool.experts is not None:  # an MoE model's experts placed one by one (worker.expert_pool)
        from energon_infer.worker.disk_pool import _meta_stage
        from energon_infer.worker.expert_pool import expert_names
        from tightfit.planner.experts import ExpertPlan

        meta = _meta_stage(cfg, runtime.tp, runtime.pp, stage, torch.float32)  # for the names: any dtype
        experts = expert_names(meta, ExpertPlan.from_json(pool.experts))
    runner = ModelRunner.from_pretrained(source.path, runtime, offload=[*plan.disk_layers, *pool.disk_vocab, *experts])
    streams = any(p.disk_layers for p in plans) or bool(pool.disk_vocab) or bool(experts)
    layer_pool = install_tiered_pool(runner, plan, pool, source.path)
    if experts:  # an MoE model's disk experts, read when routed (quantized: from the quantized store)
        from energon_infer.worker.expert_pool import install_expert_pool

        layer_pool.experts = install_expert_pool(runner, ExpertPlan.from_json(pool.experts), pool, source.path)
        runner.decode_graphs = None  # experts move between steps
    return runner, layer_pool, plan, streams


def load_worker(source: ModelSource, runtime: Any, pool: Any, rank: int) -> tuple[Any, StageTimer, WorkerInfo]:
    """Load this rank's runner (and its memory pool), warm it up; returns it, its stage timer and what to report."""
    pool_info = report = None
    streams = False
    if pool is not None and pool.tiered:
        from energon_infer.worker.disk_pool import pool_snapshot

        runner, layer_pool, plan, streams = _load_tiered(source, runtime, pool)
        report = functools.partial(pool_snapshot, layer_pool, plan)
        if layer_pool.experts is not None and rank == 0:  # what serving routed, for the next plan
            runner.on_stop = functools.partial(layer_pool.experts.save_popularity, source.path)
    else:
        runner = build_runner(source, runtime)
    if pool is not None:
        if not pool.tiered:
            from energon_infer.worker.memory_pool import apply_memory_pool
            from energon_infer.worker.quantized_pool import apply_quantized_pool

            layer_pool, plan = (apply_memory_pool if runner.quant is None else apply_quantized_pool)(runner, pool)
        pool_info = PoolInfo(pooled=tuple(plan.pooled), layers=plan.n_layers, pool_bytes=layer_pool.pool_bytes,
                             slot_bytes=layer_pool.slot_bytes, device_bytes=plan.device_bytes,
                             layer_bytes=plan.slot_bytes, plan=plan.to_json(),
                             first_layer=runner.stage.layer_range.start)
    weights = sum(p.numel() * p.element_size() for p in runner.stage.parameters() if p.device.type != "meta")
    info = WorkerInfo(rank=rank, pid=os.getpid(), kv_blocks=runner.cache.num_blocks,
                      block_size=runner.cache.block_size, config=runner.config.to_dict(),
                      eos_token_ids=tuple(runner.eos_token_ids), device=str(runner.device),
                      weight_bytes=weights, pool=pool_info, layer_bytes=runner.layer_bytes(),
                      weights_format=runner.weights_format, first_layer=runner.stage.layer_range.start,
                      kv_window=runner.kv_window, kv_groups=runner.cache.group_windows)
    _warm_up(runner, decode=not streams)
    host_blocks = runner.cache.host_k.shape[1]
    if host_blocks:  # what the scheduler weighs a swap against a recompute with (SPMD: every rank runs it)
        from energon_infer.scheduling.swap import measure_costs

        swap_s, prefill_s = measure_costs(runner)
        info = dataclasses.replace(info, host_blocks=host_blocks, swap_s_per_block=swap_s,
                                   recompute_s_per_token=prefill_s)
    # The decode graphs' module when there is one: a replayed step never calls the stage's own hooks.
    return runner, StageTimer(runner.decode_graphs or runner.stage, runner.device, report=report), info


def serve_commands(runner: Any, timer: StageTimer, rank: int, next_command: Callable[[], Command | None],
                   reply: Callable[[Reply], None], poll: Callable[[], Command | None] | None = None) -> None:
    """The worker loop (SPMD): obey commands in order until :class:`Stop` or ``next_command()`` gives ``None``.

    ``poll`` (a single worker only): the next command if one is queued, else ``None`` without waiting; with it,
    late steps queued behind a step run together with it (:mod:`energon_infer.worker.late_steps`).
    :class:`~energon_infer.protocol.CompileGrammars`: the result rank's grammar thread compiles and answers
    :class:`~energon_infer.protocol.GrammarReady` itself, so every reply goes out under one lock (a torchrun reply
    is two sends)."""
    result_rank = runner.grid.result_rank
    reply = _one_at_a_time(reply)
    feedback = TokenFeedback(runner.grid, runner.device)
    held: deque[Command] = deque()
    while True:
        cmd = held.popleft() if held else next_command()
        if cmd is None or isinstance(cmd, Stop):
            return
        if isinstance(cmd, Step):
            parts = [cmd, *take_late(cmd, poll, held)] if poll is not None and not cmd.late else [cmd]
            run = merge(parts)
            # take_back: the placeholders' tokens arrive from the last stage (received before anything runs).
            began = time.monotonic_ns()
            result = runner.run_step(run, feedback.take(run) if run.take_back else None, broadcast=False)
            if run.send_back:
                feedback.give(run, result.tokens)
            if rank == result_rank:
                ended = time.monotonic_ns()
                f0, f1 = timer.forward_ns
                timing = (began, f0, f1, ended) if began <= f0 <= f1 <= ended else (began, began, ended, ended)
                for msg in split(parts, result.tokens, result.logprobs, result.errors, result.accepted):
                    reply(dataclasses.replace(msg, timing=timing))
        elif isinstance(cmd, Free):
            for seq_id in cmd.seq_ids:
                runner.free(seq_id)
        elif isinstance(cmd, Stats):
            stats = timer.snapshot(reset=cmd.reset)
            if rank == result_rank:  # the only rank that compiles structured outputs' grammars
                stats["grammar_compiles"] = float(runner.sampler.grammars.compiles)
            reply(StatsReport(rank, stats))
        elif isinstance(cmd, Ping):
            reply(Pong(rank, cmd.seq))
        elif isinstance(cmd, CompileGrammars):
            if rank == result_rank:
                runner.sampler.grammars.compile(cmd.structured, lambda key, why: reply(GrammarReady(key, why)))
        else:
            raise TypeError(f"unknown command {cmd!r}; the protocol's commands are Step, Free, Stats, Ping, "
                            "CompileGrammars and Stop")


def _one_at_a_time(reply: Callable[[Reply], None]) -> Callable[[Reply], None]:
    lock = threading.Lock()

    def locked(msg: Reply) -> None:
        with lock:
            reply(msg)

    return locked


#: OpenMP's spin before a waiting worker thread sleeps (libgomp's ``GOMP_SPINCOUNT``; see :func:`_worker_environment`).
SPIN_COUNT = 3000


@contextlib.contextmanager
def _worker_environment(cpu: bool) -> Iterator[None]:
    """The environment the workers are spawned with: on CPUs, OpenMP threads that spin briefly at a barrier, then
    sleep (``GOMP_SPINCOUNT=3000``), unless the user chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set:
    ``OMP_WAIT_POLICY=PASSIVE`` sleeps at once). OpenMP reads it once, when the worker's torch loads, so it is set
    around the spawn. On the serving benchmark's model with 2 threads, the short spin beats sleeping at once on a
    batch with the machine to itself and is on a par beside busy processes, where libgomp's own default spin
    (300000) falls far behind: a long spin holds the core its partner needs to reach the barrier
    (docs/architecture.md, "Threads on a shared CPU")."""
    if not cpu or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    try:
        yield
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)


def _worker_main(rank: int, world: int, port: int, source: ModelSource, runtime: Any, pool: Any, threads: int,
                 backend: str, timeout_s: float, in_q: Any, out_q: Any, parent: int) -> None:
    import torch.distributed as dist

    # Ctrl-C (SIGINT to the terminal's group) and SIGTERM to the whole group (systemd's KillMode=control-group) go to
    # the controller too, which drains and stops us in order; a worker left alone notices its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        if world > 1:
            kwargs: dict[str, Any] = {}
            if backend == "nccl":
                kwargs["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                    **kwargs)
        runner, timer, info = load_worker(source, runtime, pool, rank)
        out_q.put(Ready(rank, info))

        def next_command() -> Command | None:
            while True:
                try:
                    return in_q.get(timeout=1.0)
                except queue.Empty:
                    if os.getppid() != parent:  # the controller is gone: nobody will read our answers
                        return None

        serve_commands(runner, timer, rank, next_command, out_q.put, poller(in_q) if world == 1 else None)
        if (stop := getattr(runner, "on_stop", None)) is not None:
            stop()
    except BaseException as exc:
        from energon_infer.loading.safetensors_files import CheckpointChangedError

        out_q.put(WorkerError(rank, traceback.format_exc(), fatal=isinstance(exc, CheckpointChangedError)))
        out_q.close()
        out_q.join_thread()  # make sure the report leaves before we exit
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class SpawnedWorkerGroup:
    """Start, command, watch and stop the ``tp x pp`` worker processes (see the module docstring); a
    :class:`~energon_infer.protocol.WorkerGroup`.

    Args:
        source: what to load.
        runtime: the :class:`~energon_infer.worker.runtime.RuntimeConfig` every worker loads with.
        pool: a :class:`~energon_infer.worker.memory_pool.MemoryPoolConfig`, or ``None``.
        threads: intra-op threads per worker (0: the CPU cores divided among the workers).
        backend: ``"gloo"`` or ``"nccl"`` (``None``: NCCL when CUDA is available, else gloo).
        collective_timeout_s: how long a collective may wait for a peer before the worker fails.
    """

    def __init__(self, source: ModelSource, runtime: Any, *, pool: Any = None, threads: int = 0,
                 backend: str | None = None, collective_timeout_s: float = 120.0):
        self.source, self.runtime, self.pool = source, runtime, pool
        self.world = runtime.tp * runtime.pp
        cuda = torch.cuda.is_available() and (runtime.device is None or str(runtime.device).startswith("cuda"))
        self.backend = backend or ("nccl" if cuda else "gloo")
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.world)
        self.collective_timeout_s = collective_timeout_s
        self._ctx = torch.multiprocessing.get_context("spawn")
        self.results: Any = self._ctx.Queue()
        self._inputs: list[Any] = []
        self.procs: list[Any] = []
        self.info: list[WorkerInfo] = []

    def start(self, timeout_s: float = 600.0, cancelled: Any = None) -> list[WorkerInfo]:
        """Spawn the workers and wait until each has loaded its slice; returns what each reported.

        ``cancelled()`` (optional) is polled while waiting: when it returns true the start is abandoned
        (the engine shuts down during a restart).
        """
        port = _free_port()
        with _worker_environment(self.backend == "gloo"):
            for rank in range(self.world):
                q = self._ctx.Queue()
                p = self._ctx.Process(
                    target=_worker_main, name=f"energon-worker-{rank}", daemon=True,
                    args=(rank, self.world, port, self.source, self.runtime, self.pool, self.threads, self.backend,
                          self.collective_timeout_s, q, self.results, os.getpid()))
                p.start()
                self._inputs.append(q)
                self.procs.append(p)
        ready: dict[int, WorkerInfo] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(ready) < self.world:
                try:
                    msg = self.results.get(timeout=0.5)
                except queue.Empty:
                    dead = self.dead()
                    if dead:
                        raise WorkerStartError(
                            self._dead_message(dead, "while loading") + "; its error is printed above. If your script "
                            "creates the Engine at module level, put that code under `if __name__ == \"__main__\":` "
                            "(workers are spawned, and spawning imports your script)") from None
                    if cancelled is not None and cancelled():
                        raise WorkerStartError("the worker group start was cancelled (the engine is shutting down)") from None
                    if time.monotonic() > deadline:
                        raise WorkerStartError(
                            f"the {self.world} workers did not finish loading within {timeout_s:.0f} s (ready: "
                            f"{sorted(ready)}); raise start_timeout_s for a large model") from None
                    continue
                if isinstance(msg, WorkerError):
                    raise WorkerStartError(f"worker {msg.rank} failed while loading the model:\n{msg.traceback}")
                if isinstance(msg, Ready):
                    ready[msg.rank] = msg.info
        except BaseException:
            self.kill()
            raise
        self.info = [ready[r] for r in range(self.world)]
        return self.info

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, cmd: Command) -> None:
        for q in self._inputs:
            q.put(cmd)

    def dead(self) -> list[tuple[int, int]]:
        """``(rank, exit code)`` of every worker that has exited."""
        return [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]

    @staticmethod
    def _dead_message(dead: list[tuple[int, int]], when: str) -> str:
        what = ", ".join(f"worker {r} exited with code {c}" + (f" (signal {-c})" if c < 0 else "") for r, c in dead)
        return f"{what} {when}"

    def describe_death(self) -> str:
        return self._dead_message(self.dead(), "")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to leave its loop, wait, then kill any that did not."""
        if any(p.is_alive() for p in self.procs):
            try:
                self.send(Stop())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        # Never let interpreter exit wait on a queue's feeder thread for a reader that is gone.
        for q in [*self._inputs, self.results]:
            q.cancel_join_thread()
        for q in self._inputs:
            q.close()
        self._inputs = []
