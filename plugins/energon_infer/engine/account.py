"""The time account of the serving path: where a request's and a step's wall time goes, from the server's own stamps.

Every stamp is ``time.monotonic_ns()`` (one clock for the HTTP thread, the controller and the workers: on Linux
``CLOCK_MONOTONIC`` is shared by the processes of a machine), kept as plain ints: a request carries one
:class:`RequestStamps` and each step a handful of ints, so the account is always on.

A request's parts are consecutive intervals of its own timeline, so they add up to its wall time by construction
(:func:`request_parts`):

============  ==================================================================================================
part          from -> to
============  ==================================================================================================
http          the request reached the server (before its body was read) -> tokenizing began
tokenize      the prompt's encode
submit        encoded -> in the scheduler's queue (the engine's checks, the controller's lock)
queue         queued -> its first step was sent to the workers
prepare       its steps' time on the worker before the forward (block tables, swaps, placeholders filled)
forward       its steps' forwards (the result rank's stage)
sample        its steps' time on the worker after the forward (the head's tail and sampling)
wait_worker   its steps queued on the worker behind steps ahead of them (a step planned ahead, a late step)
loop          the rest of its run: each token back from the worker, through the controller, to its listener
stream_out    its last token handed out -> the answer written (the last SSE chunk, or the JSON reply)
============  ==================================================================================================

``detokenize`` (the time the frontend spent turning its tokens into text, on the controller's thread but outside
its lock) is reported beside them: it is part of ``loop``. A request with stop strings is decoded by the scheduler
instead (under the lock: a step's ``complete``), and its ``detokenize`` is 0.

A step's parts (:func:`step_parts`) are the same kind of chain, from the controller starting to plan it to its
tokens handed to every listener: ``schedule``, ``send``, ``worker_wait``, ``prepare``, ``forward``, ``sample``,
``reply`` (the result queue), ``complete`` (the scheduler's bookkeeping, under the controller's lock) and
``hand_off`` (delivery to futures and listeners). ``worker_idle``, beside them, is the worker's gap between the
end of the previous step and the start of this one: the loop on the critical path.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUEST_PARTS", "STEP_PARTS", "RequestStamps", "StepStamps", "ServingAccount", "request_parts",
           "step_parts", "now_ns", "explain_account"]

now_ns: Callable[[], int] = time.monotonic_ns

REQUEST_PARTS = ("http", "tokenize", "submit", "queue", "prepare", "forward", "sample", "wait_worker", "loop",
                 "stream_out")
STEP_PARTS = ("schedule", "send", "worker_wait", "prepare", "forward", "sample", "reply", "complete", "hand_off")


@dataclass(eq=False, slots=True)
class RequestStamps:
    """One request's stamps (ns) and its sums over the steps it ran in; 0: not yet.

    The server (or :meth:`Engine.submit_all <energon_infer.engine.engine.Engine.submit_all>` without one) writes
    ``received``, ``tokenize_start``, ``tokenized`` and ``done``; the frontend
    (:mod:`energon_infer.engine.delivery`) everything in between, in order.
    """

    received: int = 0
    tokenize_start: int = 0
    tokenized: int = 0
    queued: int = 0
    admitted: int = 0  # its first step sent to the workers
    last_token: int = 0  # its last token handed to the listener / future
    done: int = 0
    prepare: int = 0
    forward: int = 0
    sample: int = 0
    wait_worker: int = 0
    worker_end: int = 0  # the end of its latest step on the worker (its next step's wait starts no earlier)
    detokenize: int = 0

    def ran(self, sent: int, timing: tuple[int, int, int, int]) -> None:
        """Add one of its steps: sent at ``sent``, run on the worker over ``timing`` (start, forward start,
        forward end, end)."""
        start, f0, f1, end = timing
        self.wait_worker += max(0, start - max(sent, self.worker_end))
        self.prepare += f0 - start
        self.forward += f1 - f0
        self.sample += end - f1
        self.worker_end = end


def request_parts(s: RequestStamps) -> dict[str, int]:
    """The parts (ns) of a finished request's wall time ``s.done - s.received`` (:data:`REQUEST_PARTS`, in order).

    Stamps a path did not set (a request without HTTP has no ``received``) give their part 0; the worker's sums
    are scaled down, in the rare case the stamps of two processes disagree by more than the run, so no part is
    negative and they still add up.

        >>> s = RequestStamps(received=0, tokenize_start=2, tokenized=5, queued=6, admitted=10, last_token=40, done=41)
        >>> s.ran(10, (11, 12, 30, 33))
        >>> p = request_parts(s); p["forward"], p["loop"], sum(p.values()) == s.done - s.received
        (18, 7, True)
    """
    tok0 = s.tokenize_start or s.received
    tok1 = s.tokenized or tok0
    queued = s.queued or tok1
    admitted = s.admitted or queued
    last = s.last_token or admitted
    done = s.done or last
    run = last - admitted
    worker = [s.prepare, s.forward, s.sample, s.wait_worker]
    total = sum(worker)
    if total > run > 0:
        worker = [w * run // total for w in worker]
    elif run <= 0:
        worker = [0, 0, 0, 0]
    prepare, forward, sample, wait = worker
    return {"http": tok0 - s.received, "tokenize": tok1 - tok0, "submit": queued - tok1, "queue": admitted - queued,
            "prepare": prepare, "forward": forward, "sample": sample, "wait_worker": wait,
            "loop": run - sum(worker), "stream_out": done - last}


@dataclass(eq=False, slots=True)
class StepStamps:
    """One step's stamps (ns), written by the controller in order; ``timing``: the worker's (start, forward start,
    forward end, end), ``()`` when it reported none."""

    plan_start: int = 0
    planned: int = 0
    sent: int = 0
    timing: tuple[int, ...] = ()
    received: int = 0
    completed: int = 0
    handed: int = 0


def step_parts(s: StepStamps) -> dict[str, int]:
    """The parts (ns) of a step, from the controller starting to plan it to its tokens handed out
    (:data:`STEP_PARTS`; they add up to ``handed - plan_start``). Without the worker's timing, the worker's time is
    all ``forward``.

        >>> step_parts(StepStamps(0, 3, 4, (6, 7, 17, 19), 20, 22, 25))["forward"]
        10
    """
    if len(s.timing) == 4:
        start, f0, f1, end = (min(max(t, s.sent), s.received) for t in s.timing)
    else:
        start, f0, f1, end = s.sent, s.sent, s.received, s.received
    return {"schedule": s.planned - s.plan_start, "send": s.sent - s.planned, "worker_wait": start - s.sent,
            "prepare": f0 - start, "forward": f1 - f0, "sample": end - f1, "reply": s.received - end,
            "complete": s.completed - s.received, "hand_off": s.handed - s.completed}


class _Sums:
    """Running sums (ns) and a count, per part, for the mean of each since the last reset."""

    __slots__ = ("count", "sums", "extra")

    def __init__(self, parts: tuple[str, ...], extra: tuple[str, ...]):
        self.count = 0
        self.sums = dict.fromkeys(parts + extra, 0)
        self.extra = extra

    def add(self, parts: dict[str, int]) -> None:
        self.count += 1
        for k, v in parts.items():
            self.sums[k] += v

    def view(self, parts: tuple[str, ...]) -> dict[str, Any]:
        n = max(self.count, 1)
        wall = sum(self.sums[p] for p in parts)
        return {"count": self.count,
                "mean_s": {k: v / n / 1e9 for k, v in self.sums.items()},
                "share": {p: (self.sums[p] / wall if wall else 0.0) for p in parts},
                "wall_mean_s": wall / n / 1e9}


class ServingAccount:
    """The engine's account: sums per part since the last reset, the last finished requests' parts, and (with
    ``observe``) one histogram observation per part (``energon_request_part_seconds`` /
    ``energon_step_part_seconds``, labelled by part). Thread-safe: the controller adds steps, the frontend and the
    server add requests.

    Args:
        observe: ``(kind, part, seconds)`` -> None, called for every part of every request and step (the metrics).
        keep: finished requests kept with their parts (:meth:`recent`).
    """

    def __init__(self, observe: Callable[[str, str, float], None] | None = None, *, keep: int = 256):
        self._lock = threading.Lock()
        self.observe = observe
        self._requests = _Sums(REQUEST_PARTS, ("detokenize", "wall"))
        self._steps = _Sums(STEP_PARTS, ("worker_idle", "tokens", "wall"))
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._worker_end = 0  # the previous step's end on the worker (worker_idle)
        self._last_timing: tuple[int, ...] = ()
        self.merged = 0  # late steps the worker ran together with the step before them (one worker interval)

    def add_request(self, request_id: str, s: RequestStamps) -> dict[str, int]:
        """A request is done (``s.done`` set): its parts go into the sums; returns them."""
        parts = request_parts(s)
        with self._lock:
            self._requests.add({**parts, "detokenize": s.detokenize, "wall": s.done - s.received})
            self._recent.append({"request_id": request_id, "wall_ns": s.done - s.received, "received_ns": s.received,
                                 "detokenize_ns": s.detokenize, "parts_ns": parts})
        if self.observe is not None:
            for k, v in parts.items():
                self.observe("request", k, v / 1e9)
        return parts

    def add_step(self, s: StepStamps, n_tokens: int) -> dict[str, int]:
        """A step's tokens are handed out: its parts go into the sums; returns them. A late step the worker merged
        with the one before it reports that step's worker interval again: it counts once."""
        idle = 0
        if s.timing and s.timing == self._last_timing:
            self.merged += 1
            s.timing = (s.received,) * 4  # it waited for the step before it, which holds the worker's time
        elif len(s.timing) == 4:
            idle = max(0, s.timing[0] - self._worker_end) if self._worker_end else 0
            self._worker_end, self._last_timing = s.timing[3], s.timing
        parts = step_parts(s)
        with self._lock:
            self._steps.add({**parts, "worker_idle": idle, "tokens": n_tokens, "wall": s.handed - s.plan_start})
        if self.observe is not None:
            for k, v in parts.items():
                self.observe("step", k, v / 1e9)
        return parts

    def recent(self) -> list[dict[str, Any]]:
        """The last finished requests (oldest first): id, wall time and parts, in ns."""
        with self._lock:
            return list(self._recent)

    def view(self, *, reset: bool = False) -> dict[str, Any]:
        """Means and shares per part since the last reset (``reset``: start again after this read)."""
        with self._lock:
            sums = self._steps.sums
            steps = {**self._steps.view(STEP_PARTS), "tokens_mean": sums["tokens"] / max(self._steps.count, 1),
                     "worker_idle_share": sums["worker_idle"] / sums["wall"] if sums["wall"] else 0.0}
            out: dict[str, Any] = {"requests": self._requests.view(REQUEST_PARTS), "steps": steps,
                                   "merged_late_steps": self.merged}
            if reset:
                self._requests = _Sums(REQUEST_PARTS, ("detokenize", "wall"))
                self._steps = _Sums(STEP_PARTS, ("worker_idle", "tokens", "wall"))
                self._recent.clear()
                self.merged = 0
        return out


def explain_account(view: dict[str, Any]) -> str:
    """:meth:`ServingAccount.view` as lines: each part's mean and share of the wall time, requests then steps."""
    lines = []
    for kind, parts in (("requests", REQUEST_PARTS), ("steps", STEP_PARTS)):
        v = view[kind]
        lines.append(f"{kind}: {v['count']} since the last reset, mean wall {v['wall_mean_s'] * 1e3:.3f} ms")
        for p in parts:
            lines.append(f"  {p:<12} {v['mean_s'][p] * 1e3:9.3f} ms  {v['share'][p] * 100:5.1f}%")
        if kind == "requests":
            lines.append(f"  (detokenize {v['mean_s']['detokenize'] * 1e3:.3f} ms, within loop)")
        else:
            lines.append(f"  (worker idle between steps {v['mean_s']['worker_idle'] * 1e3:.3f} ms, "
                         f"{view['steps']['tokens_mean']:.1f} tokens a step)")
    return "\n".join(lines)
