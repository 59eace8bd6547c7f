"""The controller: the loop that drives the worker group, watches it and restarts it.

One thread per engine. Each turn it plans a step for every idle group of requests
(:mod:`energon_infer.scheduling.scheduler`), sends it to the workers (:mod:`energon_infer.protocol`
messages), takes one reply from the result queue, and checks the workers: a worker that died, or
a step without an answer after ``step_timeout_s`` (the watchdog; while idle, a :class:`Ping` that not every
rank answers within it), fails the running requests with
:class:`WorkerFailedError` and restarts the group (up to ``max_restarts`` within any
``restart_window_s``, a :class:`~energon_infer.engine.restart_budget.RestartBudget`); waiting requests
are kept. A request that fails alone in a worker (its row could not be sampled) fails with
:class:`~energon_infer.engine.delivery.RequestFailedError` and nothing else is touched. Results go out
through :mod:`energon_infer.engine.delivery`. The grammars the scheduler holds requests for
(:mod:`energon_infer.scheduling.grammar_wait`) go to the workers as :class:`CompileGrammars` before the turn's steps;
each :class:`GrammarReady` answer releases its requests into the queue (or fails them, a 400), and a restarted
group is asked again for every grammar still awaited.

Data moves one way: the controller calls the scheduler, the worker group and delivery, and none of
them calls it back. A restart is the controller's own job: it is given the factory that starts a
group (:func:`start_group` with the engine's source and layout bound) and calls it again, with its own
``cancelled`` test, after a failure.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from energon_infer.engine.account import ServingAccount, StepStamps, now_ns
from energon_infer.engine.delivery import Delivery
from energon_infer.engine.engine_config import EngineConfig
from energon_infer.engine.metrics import EngineMetrics
from energon_infer.engine.restart_budget import RestartBudget
from energon_infer.errors import UnavailableError
from energon_infer.protocol import (
    CompileGrammars,
    Free,
    GrammarReady,
    Ping,
    Pong,
    Stats,
    StatsReport,
    Tokens,
    Wake,
    WorkerError,
    WorkerGroup,
    WorkerInfo,
)
from energon_infer.scheduling.scheduler import (
    QueueFullError,
    Request,
    Scheduler,
    StepPlan,
)
from energon_infer.worker.workers import ModelSource, SpawnedWorkerGroup

__all__ = ["Controller", "EngineConfig", "WorkerFailedError", "EngineClosedError", "start_group"]

log = logging.getLogger("energon_infer")


class WorkerFailedError(UnavailableError, RuntimeError):
    """The worker group failed while this request ran (a worker died or a step hung)."""


class EngineClosedError(UnavailableError, RuntimeError):
    """The engine is shut down (or has no workers left) and takes no more requests."""


def start_group(source: ModelSource, runtime: Any, config: EngineConfig, pool: Any,
                cancelled: Callable[[], bool] = lambda: False) -> WorkerGroup:
    """Start the worker group ``config.launch.launcher`` names and wait until every worker has loaded."""
    if config.launch.launcher == "torchrun":
        from energon_infer.worker.torchrun import TorchrunWorkerGroup

        tgroup = TorchrunWorkerGroup(source, runtime, pool=pool)
        tgroup.start(config.faults.start_timeout_s)
        return tgroup
    group = SpawnedWorkerGroup(source, runtime, pool=pool, threads=config.launch.threads_per_worker,
                               backend=config.launch.backend)
    if runtime.progress:
        print(f"energon: starting {group.world} worker(s) ({group.backend}, tp={runtime.tp} x pp={runtime.pp}) for "
              f"{source.path}", file=sys.stderr, flush=True)
    group.start(config.faults.start_timeout_s, cancelled=cancelled)
    return group


class Controller:
    """Owns the worker group, the scheduler's lock and the requests in flight (see the module docstring).

    Args:
        group: a started worker group (``start()`` once).
        scheduler: plans the steps.
        start: the factory of a fresh group (``start(cancelled=...)``, e.g. :func:`start_group` with the
            engine's source, layout and pool bound), called to restart after a failure.
        config: batching and fault handling.
        metrics: counters the engine reports.
        groups: steps in flight at most.
        tp, pp: the layout (for per-stage statistics).
        account: where each step's time account goes (:mod:`energon_infer.engine.account`).
    """

    def __init__(self, group: WorkerGroup, scheduler: Scheduler, start: Callable[..., WorkerGroup],
                 config: EngineConfig, metrics: EngineMetrics, delivery: Delivery, *, groups: int, tp: int, pp: int,
                 account: ServingAccount | None = None):
        self.group, self.scheduler, self.start_group, self.config = group, scheduler, start, config
        self.metrics, self.delivery, self.groups, self.tp, self.pp = metrics, delivery, groups, tp, pp
        self.account = account or ServingAccount()
        self.step_stamps: dict[int, StepStamps] = {}  # by step id, while in flight
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)
        self.stats_ready = threading.Condition(self.lock)
        self.live: dict[str, Request] = {}
        self.inflight: dict[int, StepPlan] = {}
        self.stats: dict[int, dict[str, float]] = {}
        self.closing = self.stop_now = False
        self.status = "ready"
        self.last_error = ""
        self.budget = RestartBudget(config.faults.max_restarts, config.faults.restart_window_s)
        # Heartbeat while idle: a Ping every heartbeat_s without a step in flight; every rank must answer
        # within step_timeout_s, so a frozen worker is found before the next request waits on it.
        self.heartbeat_s = min(1.0, config.faults.step_timeout_s / 4)
        self.ping_seq = 0
        self.ping_sent: float | None = None
        self.pongs: set[int] = set()
        self.last_alive = time.monotonic()
        self.thread = threading.Thread(target=self.run, name="energon-controller", daemon=True)

    @property
    def worker_info(self) -> list[WorkerInfo]:
        return list(self.group.info)

    # ------------------------------------------------------------------ requests

    def check_open(self) -> None:
        if self.closing:
            raise EngineClosedError("the engine is shut down; start a new one to serve more requests")
        if self.status == "failed":
            raise EngineClosedError(f"the engine has no workers ({self.last_error}); start a new engine")

    def add(self, req: Request, *, block: bool, deadline: float | None) -> None:
        """Queue ``req``; a full queue raises :class:`QueueFullError` or, with ``block``, waits until ``deadline``."""
        with self.lock:
            self.check_open()
            if req.request_id in self.live:
                raise ValueError(f"request id {req.request_id!r} is already running; use a unique id")
            while True:
                try:
                    self.scheduler.add(req)
                    break
                except QueueFullError:
                    self._wait_for_room(block, deadline)
            self.live[req.request_id] = req
            self.delivery.queued([req])
            wake = (self.scheduler.in_flight < self.scheduler.capacity or self.scheduler.config.late_admission
                    or self.scheduler.grammars.asking)  # a grammar to ask for: now, not after the steps in flight
        if wake:
            self.wake()

    def _wait_for_room(self, block: bool, deadline: float | None, asked: int = 1) -> None:
        """The queue is full for ``asked`` more (lock held): wait a while for room with ``block``, else record a
        rejection and raise :class:`QueueFullError` (also once ``deadline`` has passed)."""
        left = None if deadline is None else deadline - time.monotonic()
        if not block or (left is not None and left <= 0):
            self.metrics.record_rejected()
            raise QueueFullError(self.scheduler.num_waiting, self.scheduler.config.max_queue, asked=asked)
        self.space.wait(0.5 if left is None else min(left, 0.5))
        self.check_open()

    def add_all(self, reqs: list[Request], *, block: bool = False, deadline: float | None = None) -> None:
        """Queue every request or none: validated first, then queued together once the queue has room for all
        (without ``block`` a full queue raises :class:`QueueFullError`; with it, waits until ``deadline``)."""
        with self.lock:
            self.check_open()
            ids = [r.request_id for r in reqs]
            dup = [i for i in ids if i in self.live] or [i for i in ids if ids.count(i) > 1]
            if dup:
                raise ValueError(f"request id {dup[0]!r} is already running; use unique ids")
            for req in reqs:
                self.scheduler.check(req.prompt, req.params)  # raises ValueError before anything is queued
            limit = self.scheduler.config.max_queue
            while self.scheduler.num_waiting + len(reqs) > limit:  # more than max_queue never fit: no wait
                self._wait_for_room(block and len(reqs) <= limit, deadline, asked=len(reqs))
            for req in reqs:
                self.scheduler.add(req)
                self.live[req.request_id] = req
            self.delivery.queued(reqs)
            wake = (self.scheduler.in_flight < self.scheduler.capacity or self.scheduler.config.late_admission
                    or self.scheduler.grammars.asking)
        if wake:
            self.wake()

    def abort(self, request_id: str) -> bool:
        with self.lock:
            if request_id not in self.live:
                return False
            req = self.scheduler.abort(request_id)
            if req is not None:  # finished now (else when its step in flight answers)
                self.live.pop(request_id, None)
            wake = self.scheduler.in_flight < self.scheduler.capacity
        if req is not None:
            self.delivery.notify([(req, None, True)])
        if wake:
            self.wake()
        return True

    # ------------------------------------------------------------------ the loop

    def wake(self) -> None:
        try:
            self.group.results.put(Wake())
        except (OSError, ValueError):
            pass

    def run(self) -> None:
        try:
            while True:
                frees: list[int] = []
                with self.lock:
                    if self.stop_now or (self.closing and not self.scheduler.has_work() and not self.inflight):
                        break
                    plans: list[StepPlan] = []
                    stamps: list[StepStamps] = []
                    more = self.status == "ready"
                    asks = self.scheduler.grammars.take_asks() if more else []
                    while more:  # with depth > 1 a group can take several steps ahead
                        more = False
                        for g in self.scheduler.idle_groups():
                            t0 = now_ns()
                            plan = self.scheduler.schedule(g)
                            if plan is not None:
                                plans.append(plan)
                                stamps.append(StepStamps(t0, now_ns()))
                                self.inflight[plan.step_id] = plan
                                more = True
                        frees = [] if plans or self.inflight else self.scheduler.take_frees()
                    # Arrivals while every step is in flight (none planned this turn): a late step each.
                    for g in range(self.groups) if self.status == "ready" and not plans else ():
                        t0 = now_ns()
                        late = self.scheduler.schedule_late(g)
                        if late is not None:
                            plans.append(late)
                            stamps.append(StepStamps(t0, now_ns()))
                            self.inflight[late.step_id] = late
                    if plans:
                        self.space.notify_all()  # admissions made room in the queue
                if asks:  # compiled on the rank's grammar thread: no step waits for them
                    self.group.send(CompileGrammars(tuple(asks)))
                for plan, st in zip(plans, stamps):
                    self.group.send(plan.step)
                    st.sent = now_ns()
                    self.step_stamps[plan.step_id] = st
                if self.status == "ready" and not plans and frees:
                    self.group.send(Free(frees))
                try:
                    msg = self.group.results.get(timeout=0.25)
                except queue.Empty:
                    msg = None
                if msg is not None:
                    self.handle(msg, now_ns())
                self.watch()
                self.heartbeat()
        except BaseException as exc:  # the controller must never die silently
            self.last_error = f"controller crashed: {exc!r}\n{traceback.format_exc()}"
            self.status = "failed"
        finally:
            self.close_down()

    def handle(self, msg: Any, received: int = 0) -> None:
        if isinstance(msg, Tokens):
            st = self.step_stamps.pop(msg.step_id, None) or StepStamps()
            st.received, st.timing = received or now_ns(), msg.timing
            with self.lock:
                plan = self.inflight.pop(msg.step_id, None)
                if plan is None:
                    return  # a step of a group that has since failed
                if len(msg.timing) == 4 and not plan.step.late:  # the step's measured cost (token_budget)
                    self.scheduler.budget.observe(plan.n_tokens, (msg.timing[3] - msg.timing[0]) / 1e9)
                events = self.scheduler.complete(plan, msg.tokens, msg.logprobs, msg.errors, msg.accepted)
                for req, _, done in events:
                    if done:
                        self.live.pop(req.request_id, None)
            st.completed = now_ns()
            self.last_alive = time.monotonic()
            self.metrics.record_step(plan.n_tokens, sum(1 for _, tok, _ in events if tok is not None))
            self.delivery.ran(plan.requests, st.sent, msg.timing)
            if plan.step.proposals:
                self.metrics.record_speculation(sum(plan.step.proposals.values()),
                                                sum(len(v) - 1 for v in msg.accepted.values()))
            self.delivery.notify(events)
            st.handed = now_ns()
            self.account.add_step(st, plan.n_tokens)
        elif isinstance(msg, WorkerError):
            # A peer's death usually reaches the survivors as a collective error ("connection reset")
            # before the controller sees the exit: name the dead worker first when there is one.
            deadline = time.monotonic() + 1.0
            while not self.group.dead() and time.monotonic() < deadline:
                time.sleep(0.02)
            tb = msg.traceback.strip()
            last = tb.splitlines()[-1] if tb else "no traceback"
            failed = [r for r, _ in self.group.dead()]
            reason = self.group.describe_death().strip() if [r for r in failed if r != msg.rank] else ""
            reason = (f"{reason}; worker {msg.rank} then failed: {last}" if reason
                      else f"worker {msg.rank} failed: {last}")
            log.error("energon: worker %d traceback:\n%s", msg.rank, msg.traceback)
            self.group_failed(last if msg.fatal else reason, restart=not msg.fatal)
        elif isinstance(msg, GrammarReady):
            self.grammar_ready(msg)
        elif isinstance(msg, Pong):
            if msg.seq == self.ping_seq:
                self.pongs.add(msg.rank)
        elif isinstance(msg, StatsReport):
            with self.lock:
                self.stats[msg.rank] = msg.stats
                self.stats_ready.notify_all()

    def grammar_ready(self, msg: GrammarReady) -> None:
        """The rank holds a grammar (its requests join the queue) or could not compile it (they fail alone)."""
        with self.lock:
            released = self.scheduler.grammar_ready(msg.key, msg.error)
            if msg.error is not None:
                for req, _ in released:
                    self.live.pop(req.request_id, None)
                self.space.notify_all()
        for _, waited in released:
            self.metrics.record_grammar_wait(waited)
        if msg.error is not None:
            self.delivery.notify([(req, None, True) for req, _ in released])

    def watch(self) -> None:
        if self.status != "ready":
            return
        if self.group.dead():
            self.group_failed(self.group.describe_death().strip())
            return
        now = time.monotonic()
        hung = [p for p in self.inflight.values() if now - p.started > self.config.faults.step_timeout_s]
        if hung:
            self.group_failed(f"step {hung[0].step_id} got no answer within step_timeout_s="
                              f"{self.config.faults.step_timeout_s:g} s (a worker hangs)")

    def heartbeat(self) -> None:
        if self.status != "ready":
            return
        now = time.monotonic()
        if self.ping_sent is not None:
            if len(self.pongs) >= self.group.world:
                self.ping_sent, self.last_alive = None, now
            elif now - self.ping_sent > self.config.faults.step_timeout_s:
                missing = sorted(set(range(self.group.world)) - self.pongs)
                self.group_failed(f"worker(s) {missing} did not answer a heartbeat within step_timeout_s="
                                  f"{self.config.faults.step_timeout_s:g} s (a worker hangs)")
        elif not self.inflight and now - self.last_alive >= self.heartbeat_s:
            self.ping_seq += 1
            self.ping_sent, self.pongs = now, set()
            self.group.send(Ping(self.ping_seq))

    def group_failed(self, reason: str, *, restart: bool = True) -> None:
        """The group is lost: fail its running requests, then restart it (``restart`` and the budget allowing)."""
        self.metrics.worker_failures += 1
        can_restart = (restart and self.config.faults.restart_workers and self.config.launch.launcher == "spawn"  # torchrun owns its world
                       and self.budget.take())
        if restart and self.config.faults.restart_workers and not can_restart and self.config.launch.launcher == "spawn":
            reason = f"{reason}; no restart left ({self.budget.describe()})"
        with self.lock:
            lost = self.scheduler.fail_running()
            self.scheduler.grammars.restart()  # the next group holds no grammar: asked again
            self.inflight.clear()
            self.step_stamps.clear()
            self.status = "restarting" if can_restart else "failed"
            self.last_error = reason
            for req in lost:
                self.live.pop(req.request_id, None)
        after = "the worker group is restarting" if can_restart else "the engine has no workers left"
        log.error("energon: worker group failed: %s; %d running request(s) failed; %s", reason, len(lost), after)
        self.delivery.fail(lost, WorkerFailedError(f"the worker group failed while this request ran ({reason}); "
                                                   f"{after}; resubmit the request"))
        self.group.kill()
        if can_restart:
            self.metrics.restarts += 1
            try:
                self.group = self.start_group(cancelled=lambda: self.stop_now)
                with self.lock:
                    self.ping_sent, self.last_alive = None, time.monotonic()
                    self.status = "ready"
                return
            except Exception as exc:
                with self.lock:
                    self.status = "failed"
                    self.last_error = f"{reason}; the restart failed too: {exc}"
        with self.lock:
            waiting = self.scheduler.drain_waiting()
            for req in waiting:
                self.live.pop(req.request_id, None)
            self.space.notify_all()
        self.delivery.fail(waiting, EngineClosedError(f"the engine has no workers left ({self.last_error}); start a "
                                                      "new one"))

    def close_down(self) -> None:
        with self.lock:
            leftovers = self.scheduler.fail_running() + self.scheduler.drain_waiting()
            self.live.clear()
            self.inflight.clear()
            self.closing = True
            self.space.notify_all()
            if self.status != "failed":
                self.status = "stopped"
        self.delivery.fail(leftovers, EngineClosedError("the engine shut down before this request finished; resubmit "
                                                        "it to a running engine"))
        self.group.stop()

    # ------------------------------------------------------------------ status and shutdown

    def pipeline_stats(self, *, reset: bool, timeout: float) -> dict[str, Any]:
        with self.lock:
            self.stats.clear()
        self.group.send(Stats(reset))
        deadline = time.monotonic() + timeout
        with self.lock:
            while len(self.stats) < self.group.world:
                left = deadline - time.monotonic()
                if left <= 0 or self.status not in ("ready",):
                    raise TimeoutError(f"the workers did not report stage times within {timeout:g} s "
                                       f"(status {self.status})")
                self.stats_ready.wait(min(left, 0.5))
            ranks = [self.stats[r] for r in range(self.group.world)]
        tp = self.tp
        stages = [max(ranks[s * tp: (s + 1) * tp], key=lambda r: r["busy_s"]) for s in range(self.pp)]
        return {"ranks": ranks, "stages": [s["utilisation"] for s in stages], "groups": self.groups}

    def shutdown(self, *, wait: bool, timeout: float | None, cancel: bool) -> None:
        with self.lock:
            self.closing = True
            self.space.notify_all()
            if cancel:
                self.stop_now = True
        self.wake()
        if not wait:
            return
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.stop_now = True
            self.wake()
            self.thread.join(timeout)
        if self.thread.is_alive():  # wedged (it never should be): do not leave workers behind
            self.group.kill()
