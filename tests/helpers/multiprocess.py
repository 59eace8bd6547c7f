"""Run a function on N real gloo ranks and collect what each returns.

    from tests.helpers.multiprocess import run_distributed
    outs = run_distributed(my_fn, world_size=2, args=(3,))   # my_fn(rank, world_size, 3) on each rank

``my_fn`` must be a module-level function (ranks are spawned). The process group is initialised
(gloo, a free port on 127.0.0.1) before it runs and destroyed after. The first rank that fails
raises :class:`DistributedTestError` in the caller with that rank's traceback, the other ranks are
killed, and a run longer than ``timeout`` seconds fails instead of blocking CI.

The free port is found by binding port 0 and closing it, so another process can take it before rank 0's store
listens on it (CI saw ``EADDRINUSE`` from ``init_process_group``). Such a run, which failed before ``fn`` ran
on any rank, is started again on a new port, up to ``PORT_TRIES`` times; a failure inside ``fn`` never is.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "PORT_TRIES", "free_port", "run_distributed", "unlaunched_env"]

PORT_TRIES = 4
_PORT_TAKEN = "port taken"  # a rank's status: its store could not listen on the port, nothing of fn ran


class DistributedTestError(AssertionError):
    """A rank failed, exited abnormally, or the group timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launcher (Lightning, torchrun) leaves in a process's environment. Lightning's script launcher sets some of
# them in its own process, so after an in-process Trainer a child that inherits them believes it is one rank of a
# group already launched and waits for peers that never come.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_",
                  "TORCHELASTIC_", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")


def unlaunched_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's rank variables, plus ``extra``: for a child that must start
    its own ranks (a Lightning script, ``torchrun``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(extra)
    return env


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, env: dict,
            threads: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
    })
    torch.set_num_threads(threads)
    ok = False
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except Exception as exc:
            if "EADDRINUSE" not in str(exc):
                raise
            results.put((rank, _PORT_TAKEN, traceback.format_exc()))
            raise
        out = fn(rank, world_size, *args)
        # Plain pickle to bytes: tensors then travel by value. Through the queue's own pickler they
        # would travel as shared-memory handles that close when this rank exits.
        try:
            payload = pickle.dumps(out)
        except Exception:
            payload = pickle.dumps(repr(out))
        results.put((rank, True, payload))
        ok = True
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        # Report before tearing the group down, so the root cause arrives before the peers'
        # "connection reset" errors that the teardown causes.
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is delivered and the group destroyed: leave without interpreter finalization. A spawned
    # rank otherwise ends in sys.exit, whose teardown of torch's C++ state (gloo pairs, store threads) took
    # 17 s on a loaded 2-core machine and can abort ("terminate called without an active exception":
    # a still-joinable std::thread destroyed), failing a test whose ranks had all reported success.
    results.close()
    results.join_thread()  # the queue's feeder thread has written everything
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, *, args: Sequence[Any] = (), timeout: float = 300.0,
    env: dict[str, str] | None = None, threads: int = 1,
) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return their results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return _run_once(fn, world_size, tuple(args), timeout, dict(env or {}), threads)
        except _PortTaken as taken:
            if attempt == PORT_TRIES:
                raise DistributedTestError(
                    f"{fn.__name__}: the rendezvous port was taken {PORT_TRIES} times in a row:\n{taken}") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """Rank 0's store could not listen on the chosen port; no rank ran ``fn``."""


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, env: dict[str, str],
              threads: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, env, threads, results),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedTestError(
                    f"{fn.__name__} timed out after {timeout:.0f} s on {world_size} ranks; "
                    f"ranks that finished: {sorted(outputs)}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    # Give a dying rank a moment to deliver its traceback first.
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        raise DistributedTestError(
                            f"{fn.__name__}: rank {dead[0][0]} exited with code {dead[0][1]} without reporting "
                            "(killed, or crashed in native code)"
                        ) from None
                else:
                    continue
            if ok == _PORT_TAKEN:
                raise _PortTaken(payload)
            if not ok:
                others = []
                try:  # collect what the other ranks said for context, briefly
                    while len(others) < world_size - 1:
                        r2, ok2, p2 = results.get(timeout=1.0)
                        if not ok2:
                            others.append(f"--- rank {r2} also failed:\n{p2}")
                except queue.Empty:
                    pass
                raise DistributedTestError(
                    f"{fn.__name__} failed on rank {rank} of {world_size}:\n{payload}" + "".join("\n" + o for o in others)
                )
            outputs[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            raise DistributedTestError(f"{fn.__name__}: exit codes {codes}; every rank must exit with 0")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    return [outputs[r] for r in range(world_size)]
