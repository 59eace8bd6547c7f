"""Iteration-level (continuous) batching: which requests run in the next step, and what their tokens mean.

The controller asks :meth:`Scheduler.schedule` for a step whenever a group of the pipeline is idle.
A step is the decode token of every running request of that group plus, first come first served,
the prompts of waiting requests while three limits hold: the step's token budget
(``max_batch_tokens``: one token per running request, the whole prompt of a new one), the number
of running sequences (``max_running``), and the KV cache: a request is admitted only when the
blocks for its prompt plus ``max_tokens`` are free, so a running request is never evicted and the
workers never run out of cache. Finished requests leave after the step that finished them, and
their blocks are freed on the workers at the start of the next step (frees travel with it).

Fairness is strict FIFO: when the head of the queue does not fit, nothing behind it jumps ahead,
so a long prompt cannot starve. Backpressure: the queue holds at most ``max_queue`` waiting
requests; :meth:`Scheduler.add` raises :class:`QueueFullError` beyond that.

With ``groups > 1`` (the engine uses one group per pipeline stage) running requests are split
into groups whose steps are in flight at the same time: while the last stage samples group A's
tokens, the first stage already runs group B (EnergonAI's non-blocking pipeline). New requests
are spread so that no group holds more than its share of the work.

``policy="static"`` is the baseline continuous batching replaces: a group takes new requests only
when all of its previous batch has finished.

Example:
    >>> from energon_infer.sampling import SamplingParams
    >>> s = Scheduler(SchedulerConfig(kv_blocks=8, block_size=4, max_context=32, max_batch_tokens=16))
    >>> r = s.add(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2)))
    >>> plan = s.schedule(0)
    >>> plan.items
    [(1, [1, 2, 3])]
    >>> [(req.request_id, tok, done) for req, tok, done in s.complete(plan, [7])]
    [('a', 7, False)]
    >>> s.schedule(0).items
    [(1, [7])]
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from energon_infer.delivery import IncrementalDetokenizer
from energon_infer.sampling import SamplingParams, stop_reason

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "POLICIES", "QueueFullError", "SchedulerConfig", "Request", "StepPlan", "Scheduler"]

POLICIES = ("continuous", "static")


#: Tokens per step unless told otherwise: the one default of ``SchedulerConfig``, ``EngineConfig``,
#: ``RuntimeConfig`` and the engine's factories (4096 was the engine's and the CLI's default; the
#: runtime and the scheduler had 8192 before they shared this one).
DEFAULT_MAX_BATCH_TOKENS = 4096


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP: 429)."""

    def __init__(self, waiting: int, limit: int):
        self.waiting, self.limit = waiting, limit
        super().__init__(
            f"the request queue is full ({waiting} waiting, max_queue={limit}); retry later, or start the engine "
            "with a larger max_queue if the workers keep up"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Limits of one step and of the queue.

    Args:
        kv_blocks: blocks in each worker's KV cache (all ranks have the same number).
        block_size: tokens per block.
        max_context: the model's context (tokens); a request stops with ``"length"`` there.
        max_batch_tokens: tokens per step: one per running request plus each admitted prompt.
        max_running: sequences running at once (all groups together).
        max_queue: waiting requests at most; more raise :class:`QueueFullError`.
        groups: steps in flight at once (1: each step waits for the previous one's tokens).
        policy: ``"continuous"`` (requests join at the next step) or ``"static"`` (a group admits
            only when its whole batch has finished).
    """

    kv_blocks: int
    block_size: int
    max_context: int
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_running: int = 256
    max_queue: int = 1024
    groups: int = 1
    policy: str = "continuous"

    def __post_init__(self) -> None:
        for name in ("kv_blocks", "block_size", "max_context", "max_batch_tokens", "max_running", "groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue} must be >= 0 (0 accepts no waiting request)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}")


@dataclass(eq=False, slots=True)
class Request:
    """One request's state as it moves from waiting to running to finished.

    Args:
        request_id: the caller's id (unique among live requests).
        prompt: prompt token ids.
        params: how it samples and stops.
        listener: called from the controller thread with each new token (see the engine).
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    listener: Callable[..., None] | None = None
    seq_id: int = 0
    reserve: int = 0
    generated: list[int] = field(default_factory=list)
    group: int = -1
    state: str = "new"  # new -> waiting -> running -> finished
    in_flight: bool = False
    aborted: bool = False
    finish_reason: str | None = None
    text: str | None = None
    arrival: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    sent_text: str = ""  # streamed so far
    detok: IncrementalDetokenizer | None = None  # its text, decoded once per token (with a tokenizer)
    future: Any = None


@dataclass(slots=True)
class StepPlan:
    """One step for the workers: frees first, then the packed items (``(seq_id, new_tokens)``)."""

    step_id: int
    group: int
    frees: list[int]
    items: list[tuple[int, list[int]]]
    new_params: dict[int, SamplingParams]
    requests: list[Request]
    started: float = 0.0

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for _, t in self.items)


class Scheduler:
    """Continuous batching over a paged KV cache (see the module docstring). Not thread-safe: the engine locks.

    Args:
        config: limits.
        eos_token_ids: the model's end tokens (requests stop there unless ``ignore_eos``).
        decode: token ids -> text, for stop strings and each request's text (``None``: token ids only, stop
            strings are not checked). Each request gets one :class:`~energon_infer.delivery.IncrementalDetokenizer`
            (``request.detok``) that delivery streams from too.
        clock: time source for request timings.
        seq_ids: the sequence ids to give requests (default 1, 2, ...; ``ModelRunner.generate`` gives its own
            negative ones, which never collide with a caller's).
    """

    def __init__(self, config: SchedulerConfig, *, eos_token_ids: Sequence[int] = (),
                 decode: Callable[[Sequence[int]], str] | None = None, clock: Callable[[], float] = time.monotonic,
                 seq_ids: Iterator[int] | None = None):
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.decode = decode
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.reserved = 0
        self._frees: list[int] = []
        self._busy = [False] * config.groups
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count(1)
        self._step_ids = itertools.count(1)

    # ------------------------------------------------------------------ admission

    def blocks_for(self, prompt_len: int, params: SamplingParams) -> int:
        """KV blocks a request reserves: its prompt plus ``max_tokens``, capped at the context."""
        return -(-min(prompt_len + params.max_tokens, self.config.max_context) // self.config.block_size)

    def check(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Raise ``ValueError`` if the request can never run here; return the blocks it reserves."""
        cfg = self.config
        n = len(prompt)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if n > cfg.max_context:
            raise ValueError(f"the prompt has {n} tokens but the model's context is {cfg.max_context}; shorten it")
        if n > cfg.max_batch_tokens:
            raise ValueError(
                f"the prompt has {n} tokens, more than max_batch_tokens={cfg.max_batch_tokens} (the tokens one step "
                "runs); shorten it or start the engine with a larger max_batch_tokens"
            )
        blocks = self.blocks_for(n, params)
        if blocks > cfg.kv_blocks:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens={params.max_tokens} needs {blocks} KV blocks of {cfg.block_size} "
                f"tokens but the cache has {cfg.kv_blocks}; lower max_tokens or load with a larger kv_cache_tokens"
            )
        return blocks

    def add(self, request: Request) -> Request:
        """Queue ``request`` (validated); raises :class:`QueueFullError` when ``max_queue`` are waiting."""
        reserve = self.check(request.prompt, request.params)
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(len(self.waiting), self.config.max_queue)
        request.reserve = reserve
        request.seq_id = next(self._seq_ids)
        request.state = "waiting"
        request.arrival = request.arrival or self.clock()
        if self.decode is not None and request.detok is None:
            request.detok = IncrementalDetokenizer(self.decode)
        self.waiting.append(request)
        return request

    # ------------------------------------------------------------------ steps

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def in_flight(self) -> int:
        return sum(self._busy)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._frees)

    def idle_groups(self) -> list[int]:
        return [g for g, busy in enumerate(self._busy) if not busy]

    def _fits(self, req: Request, budget: int, running: int) -> bool:
        return (len(req.prompt) <= budget and running < self.config.max_running
                and self.reserved + req.reserve <= self.config.kv_blocks)

    def schedule(self, group: int) -> StepPlan | None:
        """The next step of ``group`` (``None`` if it is busy or has nothing to run)."""
        if self._busy[group]:
            return None
        mine = [r for r in self.running.values() if r.group == group]
        items: list[tuple[int, list[int]]] = [(r.seq_id, [r.generated[-1]]) for r in mine]
        reqs = list(mine)
        new_params: dict[int, SamplingParams] = {}
        admit = self.config.policy == "continuous" or not mine
        if admit and self.waiting:
            # Spread requests over the groups: a group takes at most its share of all live requests.
            share = math.ceil((len(self.running) + len(self.waiting)) / self.config.groups)
            budget = self.config.max_batch_tokens - len(items)
            while self.waiting and len(reqs) < share and self._fits(self.waiting[0], budget, len(self.running)):
                req = self.waiting.popleft()
                req.state, req.group = "running", group
                self.running[req.seq_id] = req
                self.reserved += req.reserve
                budget -= len(req.prompt)
                items.append((req.seq_id, list(req.prompt)))
                new_params[req.seq_id] = req.params
                reqs.append(req)
        if not items:
            return None
        frees, self._frees = self._frees, []
        for r in reqs:
            r.in_flight = True
        self._busy[group] = True
        return StepPlan(next(self._step_ids), group, frees, items, new_params, reqs, self.clock())

    def take_frees(self) -> list[int]:
        """Frees not yet sent with a step (the engine sends them alone when nothing else runs)."""
        frees, self._frees = self._frees, []
        return frees

    def _finish(self, req: Request, reason: str, text: str | None = None) -> None:
        req.state, req.finish_reason, req.finished = "finished", reason, self.clock()
        req.in_flight = False
        if text is not None:
            req.text = text
        elif req.detok is not None:
            req.text = req.detok.finish()
        if self.running.pop(req.seq_id, None) is not None:
            self.reserved -= req.reserve
            self._frees.append(req.seq_id)

    def complete(self, plan: StepPlan, tokens: Sequence[int]) -> list[tuple[Request, int | None, bool]]:
        """Apply a step's sampled tokens; returns ``(request, token or None, finished)`` per request of the step."""
        if len(tokens) != len(plan.items):
            raise RuntimeError(f"step {plan.step_id} ran {len(plan.items)} sequences but returned {len(tokens)} tokens")
        self._busy[plan.group] = False
        out: list[tuple[Request, int | None, bool]] = []
        now = self.clock()
        for req, tok in zip(plan.requests, tokens):
            req.in_flight = False
            if req.state == "finished":  # failed or aborted while the step ran
                continue
            if req.aborted:
                self._finish(req, "abort")
                out.append((req, None, True))
                continue
            req.generated.append(int(tok))
            if len(req.generated) == 1:
                req.first_token = now
            if req.detok is not None:
                req.detok.add(int(tok))
            reason, text = stop_reason(req.generated, req.params, self.eos_token_ids,
                                       text=req.detok.text if req.detok is not None else None)
            if reason is None and len(req.prompt) + len(req.generated) > self.config.max_context:
                reason = "length"  # the next step would feed a token past the context
            if reason is not None:
                self._finish(req, reason, text)
            out.append((req, int(tok), reason is not None))
        return out

    def abort(self, request_id: str) -> Request | None:
        """Stop a request: a waiting one leaves the queue; a running one leaves now or after its step in flight."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.state, req.finish_reason, req.finished = "finished", "abort", self.clock()
                return req
        for req in self.running.values():
            if req.request_id == request_id:
                if req.in_flight:
                    req.aborted = True  # finished when its step's tokens arrive
                    return None
                self._finish(req, "abort")
                return req
        return None

    def fail_running(self) -> list[Request]:
        """The workers are gone: every running request (in flight or not) is lost; reset the step state."""
        lost = list(self.running.values())
        for req in lost:
            req.state, req.in_flight, req.finished = "finished", False, self.clock()
            req.finish_reason = "error"
        self.running.clear()
        self.reserved = 0
        self._frees = []
        self._busy = [False] * self.config.groups
        return lost

    def drain_waiting(self) -> list[Request]:
        """Remove and return every waiting request (shutdown, or no workers left)."""
        out = list(self.waiting)
        self.waiting.clear()
        for req in out:
            req.state, req.finished = "finished", self.clock()
        return out
