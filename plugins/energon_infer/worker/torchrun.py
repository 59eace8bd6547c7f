"""Join an existing ``torchrun`` world (one or many nodes): rank 0 holds the controller, every rank is a worker.

    # on every node: torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 serve_it.py
    if int(os.environ["RANK"]) == 0:
        engine = Engine.from_pretrained(path, tp=4, pp=2, launcher="torchrun")   # controller + grid rank 0
        serve(engine, ServerConfig(port=8000))
    else:
        run_worker()                                                            # until the controller stops

(``tightfit serve PATH --tp 4 --pp 2 --launcher torchrun`` does exactly that.)

Instead of spawning processes, :class:`TorchrunWorkerGroup` uses the world torchrun started. Two
extra gloo groups carry the control traffic, so it never mixes with the model's own collectives
(NCCL on GPUs): rank 0 broadcasts each command on the *command* group from a sender thread (so the
controller never blocks on a busy rank), and the ranks that answer (the result rank, and every rank
for stage statistics) send to rank 0 on the *result* group, where a receiver thread takes messages
from whichever rank sends first. Rank 0 runs its own share of the model in a worker thread that
reads the same command sequence. A remote worker that dies cannot be restarted from here (torchrun
owns the processes): the engine fails the running requests and closes; an ``--max-restarts``-style
elastic restart is torchrun's job.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from energon_infer.protocol import Bye, Command, Reply, Stop, WorkerError, WorkerInfo
from energon_infer.worker.late_steps import poller
from energon_infer.worker.workers import ModelSource, load_worker, serve_commands

__all__ = ["TorchrunWorkerGroup", "run_worker", "in_torchrun"]


def in_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets ``RANK``/``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_world(timeout_s: float) -> None:
    if dist.is_initialized():
        return
    if not in_torchrun():
        raise RuntimeError("launcher='torchrun' needs a torchrun world: start every rank with `torchrun "
                           "--nproc-per-node N ...` (RANK and WORLD_SIZE are not set), or use launcher='spawn'")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def _control_groups(timeout_s: float) -> tuple[Any, Any]:
    # Every rank creates them in the same order; gloo whatever the model uses (objects travel on the CPU).
    timeout = timedelta(seconds=timeout_s)
    return dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout)


def _send(msg: Reply, group: Any) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.long), dst=0, group=group)
    dist.send(data, dst=0, group=group)


def _recv_any(group: Any) -> Reply:
    size = torch.zeros(1, dtype=torch.long)
    src = dist.recv(size, src=None, group=group)  # whichever rank sends first...
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)  # ...then that rank's payload (messages of a pair stay ordered)
    return pickle.loads(data.numpy().tobytes())  # the world's own ranks: trusted peers, like *_object_list


def run_worker(timeout_s: float = 600.0) -> None:
    """The worker side of a torchrun world (ranks other than 0): load, obey commands, return when stopped."""
    _init_world(timeout_s)
    rank = dist.get_rank()
    if rank == 0:
        raise RuntimeError("rank 0 is the controller: create the Engine with launcher='torchrun' there, and call "
                           "run_worker() on the other ranks")
    cmd_group, res_group = _control_groups(timeout_s)
    setup: list[Any] = [None, None, None]
    dist.broadcast_object_list(setup, src=0, group=cmd_group)
    source, runtime, pool = setup
    try:
        runner, timer, info = load_worker(source, runtime, pool, rank)
        dist.gather_object(info, None, dst=0, group=res_group)

        def next_command() -> Command:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=cmd_group)
            return box[0]

        serve_commands(runner, timer, rank, next_command, lambda msg: _send(msg, res_group))
    except BaseException:
        try:
            _send(WorkerError(rank, traceback.format_exc()), res_group)
        except Exception:
            pass
        raise
    _send(Bye(rank), res_group)
    dist.destroy_process_group()


class TorchrunWorkerGroup:
    """A :class:`~energon_infer.protocol.WorkerGroup` over a torchrun world (see the module docstring).

    Args:
        source: what every rank loads (broadcast from rank 0).
        runtime: the layout; ``tp * pp`` must equal the world size.
        pool: a :class:`~energon_infer.worker.memory_pool.MemoryPoolConfig` or ``None``.
        collective_timeout_s: timeout of the world's and the control groups' collectives.
    """

    def __init__(self, source: ModelSource, runtime: Any, *, pool: Any = None, collective_timeout_s: float = 600.0):
        self.source, self.runtime, self.pool = source, runtime, pool
        self.world = runtime.tp * runtime.pp
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.timeout_s = collective_timeout_s
        self.results: queue.Queue[Reply] = queue.Queue()
        self._outbox: queue.Queue[Command] = queue.Queue()
        self._local: queue.Queue[Command] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self.procs: list[Any] = []  # remote processes are torchrun's, not ours
        self.info: list[WorkerInfo] = []
        self._failed: list[tuple[int, int]] = []

    def start(self, timeout_s: float = 600.0, cancelled: Any = None) -> list[WorkerInfo]:
        _init_world(self.timeout_s)
        world, rank = dist.get_world_size(), dist.get_rank()
        if rank != 0:
            raise RuntimeError(f"the controller must run on rank 0, not rank {rank}; call run_worker() there")
        if world != self.world:
            raise ValueError(f"tp={self.runtime.tp} x pp={self.runtime.pp} = {self.world} ranks, but the torchrun "
                             f"world has {world}; launch {self.world} processes in all or change tp/pp")
        self.cmd_group, self.res_group = _control_groups(self.timeout_s)
        dist.broadcast_object_list([self.source, self.runtime, self.pool], src=0, group=self.cmd_group)
        runner, timer, info = load_worker(self.source, self.runtime, self.pool, 0)
        infos: list[Any] = [None] * world
        dist.gather_object(info, infos, dst=0, group=self.res_group)
        self.info = infos
        self._spawn(self._local_worker, runner, timer)
        self._spawn(self._sender)
        if world > 1:
            self._spawn(self._receiver)
        return self.info

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=f"energon-{target.__name__.strip('_')}", daemon=True)
        t.start()
        self._threads.append(t)

    def _local_worker(self, runner: Any, timer: Any) -> None:
        try:
            # One rank alone may merge late steps into the step before them (it polls its queue).
            poll = poller(self._local) if self.world == 1 else None
            serve_commands(runner, timer, 0, self._local.get, self.results.put, poll)
        except BaseException:
            self._failed.append((0, 1))
            self.results.put(WorkerError(0, traceback.format_exc()))

    def _sender(self) -> None:
        while True:
            cmd = self._outbox.get()
            self._local.put(cmd)
            if self.world > 1:
                dist.broadcast_object_list([cmd], src=0, group=self.cmd_group)
            if isinstance(cmd, Stop):
                return

    def _receiver(self) -> None:
        left = self.world - 1
        while left:
            try:
                msg = _recv_any(self.res_group)
            except Exception as exc:  # a peer vanished: report it as that worker's failure
                self.results.put(WorkerError(-1, f"the result channel failed: {exc!r}"))
                return
            if isinstance(msg, Bye):
                left -= 1
                continue
            if isinstance(msg, WorkerError):
                self._failed.append((msg.rank, 1))
            self.results.put(msg)

    @property
    def pids(self) -> list[int]:
        return [i.pid for i in self.info]

    def send(self, cmd: Command) -> None:
        self._outbox.put(cmd)

    def dead(self) -> list[tuple[int, int]]:
        return list(self._failed)

    def describe_death(self) -> str:
        return ", ".join(f"worker {r} failed" for r, _ in self._failed)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.send(Stop())
        for t in self._threads:
            t.join(timeout_s)

    def kill(self) -> None:
        # Processes of a torchrun world are not ours to kill; ask them to leave and stop waiting for them.
        self.send(Stop())
