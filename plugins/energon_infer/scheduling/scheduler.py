"""Iteration-level (continuous) batching: which requests run in the next step, and what their tokens mean.

The controller asks :meth:`Scheduler.schedule` for a step whenever a group of the pipeline can take one. A step is the
next tokens of every running request of that group (a decode token, or the next chunk of a prompt; with a
``speculator``, a decode and its proposed tokens) plus, first come first served, waiting requests while the step's
token budget (``max_batch_tokens``), ``max_running`` and the KV cache allow. The scheduler owns the KV blocks
(:mod:`energon_infer.scheduling.blocks`): on demand, a sequence takes blocks as it grows and, when none is free,
the newest idle running request is preempted (its blocks freed, recomputed from prompt + generated tokens when it is
readmitted, at the head of the queue); ``kv_admission="reserve"`` instead admits only when prompt + ``max_tokens``
fit. Block decisions and frees travel with the step. With a sliding window (``kv_window``, or the windowed KV groups
of ``kv_groups``: :mod:`energon_infer.scheduling.kv_groups`), a running sequence's blocks before its window are
released as it grows (``Step.trims``), so it holds about ``kv_window / block_size + 2`` blocks in each windowed group
however long it runs. A sequence about to pass a longrope model's switch (``rope_switch``) is recomputed whole with
the long factors, once (:mod:`energon_infer.scheduling.rope_switch`).

Fairness is strict FIFO: when the head of the queue does not fit, nothing behind it jumps ahead.
Backpressure: :meth:`Scheduler.add` raises :class:`QueueFullError` beyond ``max_queue`` waiting.
With ``groups > 1`` (one per pipeline stage) the groups' steps are in flight at the same time
(EnergonAI's non-blocking pipeline); ``depth > 1`` keeps more than one step of a group in flight.
``policy="static"`` is the baseline: a group admits only when all of its previous batch has finished.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from energon_infer.protocol import Step
from energon_infer.sampling import SamplingParams, stop_reason
from energon_infer.scheduling.budget import TokenBudget
from energon_infer.scheduling.detokenizer import IncrementalDetokenizer
from energon_infer.scheduling.grammar_wait import GrammarWait
from energon_infer.scheduling.kv_groups import KVGroups
from energon_infer.scheduling.requests import Request, StepPlan
from energon_infer.scheduling.rope_switch import chain_root, is_long
from energon_infer.scheduling.scheduler_config import (
    DEFAULT_MAX_BATCH_TOKENS,
    KV_ADMISSION,
    PLACEHOLDER,
    POLICIES,
    QueueFullError,
    SchedulerConfig,
    check_request,
    most_tokens,
    request_blocks,
)
from energon_infer.scheduling.speculation import NoSpeculation, Speculator
from energon_infer.scheduling.swap import SwapSpace

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "KV_ADMISSION", "PLACEHOLDER", "POLICIES", "QueueFullError", "SchedulerConfig", "Request", "StepPlan", "Scheduler"]

class Scheduler:
    """Continuous batching over a paged KV cache (see the module docstring). Not thread-safe: the engine locks.

    Args:
        config: limits.
        eos_token_ids: the model's end tokens (requests stop there unless ``ignore_eos``).
        decode: token ids -> text, for stop strings and each request's text (``None``: token ids only, stop
            strings are not checked), in one :class:`~energon_infer.scheduling.detokenizer.IncrementalDetokenizer`
            per request (``request.detok``); ``stop_text_only``: only requests with stop strings (the others' text is
            the caller's: the engine's frontend decodes it outside the controller's lock; their ``text`` is None).
        clock: time source of when each step was planned (the controller's watchdog).
        seq_ids: the sequence ids to give requests (default 1, 2, ...; ``ModelRunner.generate`` gives its own
            negative ones, which never collide with a caller's).
        speculator: proposes tokens for decodes (:mod:`energon_infer.scheduling.speculation`; ``None``: off).
        hold_grammars: a structured-output request waits for its grammar (the engine's: :mod:`.grammar_wait`).
    """

    def __init__(self, config: SchedulerConfig, *, eos_token_ids: Sequence[int] = (),
                 decode: Callable[[Sequence[int]], str] | None = None, clock: Callable[[], float] = time.monotonic,
                 seq_ids: Iterator[int] | None = None, block_ids: Iterable[int] | None = None,
                 stop_text_only: bool = False, speculator: Speculator | NoSpeculation | None = None,
                 hold_grammars: bool = False):
        self.config, self.speculator, self.clock = config, speculator or NoSpeculation(), clock
        self.grammars = GrammarWait(hold=hold_grammars)
        self.eos_token_ids, self.decode, self.stop_text_only = tuple(eos_token_ids), decode, stop_text_only
        self.budget = TokenBudget(config.token_budget, config.max_batch_tokens, tpot_target_s=config.tpot_target_s)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.blocks = KVGroups(config.kv_blocks, config.block_size, config.kv_groups or (config.kv_window,),
                               prefix_caching=config.prefix_caching, blocks=block_ids)
        self.preemptions = 0
        self.rope_recomputes = self.late_steps = 0  # sequences recomputed at the rope switch; late steps planned
        self.swap = SwapSpace(config.host_blocks, mode=config.preemption, swap_s_per_block=config.swap_s_per_block,
                              recompute_s_per_token=config.recompute_s_per_token)
        self._swap_out: list[tuple[int, int]] = []
        self._reserved = 0
        self._frees: list[int] = []
        self._trims: dict[int, int] = {}  # seq -> holes at the front of its table, not yet sent with a step
        self._busy, self._last_step = [0] * config.groups, [0] * config.groups
        self._owed = [False] * config.groups  # a step's tokens were sent back and not yet taken
        self._last_tokens = [0] * config.groups  # tokens of its last planned step and the late ones since
        self._seq_ids, self._step_ids = seq_ids if seq_ids is not None else itertools.count(1), itertools.count(1)

    @property
    def reserved(self) -> int:  # KV blocks held for running requests (reserved up front, or those they hold)
        return self._reserved if self.config.kv_admission == "reserve" else self.blocks.used

    def blocks_for(self, prompt_len: int, params: SamplingParams) -> int:
        """KV blocks a request needs at most (:func:`~energon_infer.scheduling.scheduler_config.request_blocks`)."""
        return request_blocks(self.config, self.blocks.peak, prompt_len, params.max_tokens)

    def check(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Raise :class:`InvalidRequestError` if the request can never run here; return the blocks it needs at most
        (:func:`~energon_infer.scheduling.scheduler_config.check_request`)."""
        return check_request(self.config, self.blocks.peak, len(prompt), params.max_tokens)

    def add(self, request: Request) -> Request:
        """Queue ``request`` (validated); raises :class:`QueueFullError` when ``max_queue`` are waiting."""
        reserve = self.check(request.prompt, request.params)
        if self.num_waiting >= self.config.max_queue:
            raise QueueFullError(self.num_waiting, self.config.max_queue)
        request.reserve, request.seq_id, request.state = reserve, next(self._seq_ids), "waiting"
        if self.decode is not None and request.detok is None and (request.params.stop or not self.stop_text_only):
            request.detok = IncrementalDetokenizer(self.decode)
        self.grammars.queue(request, self.waiting)  # or held until its grammar is ready (scheduling.grammar_wait)
        return request

    def grammar_ready(self, key: tuple[str, str], error: str | None) -> list[tuple[Request, float]]:  # into the queue
        return self.grammars.release(key, error, self.waiting)  # the rank answered (GrammarWait.release)

    @property
    def num_waiting(self) -> int:  # queued, or held for a grammar (both count against max_queue)
        return len(self.waiting) + self.grammars.num_held

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def in_flight(self) -> int:
        return sum(self._busy)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._frees or self.grammars.num_held)

    @property
    def capacity(self) -> int:  # steps in flight at most
        return self.config.groups * self.config.depth

    def idle_groups(self) -> list[int]:
        return [g for g, busy in enumerate(self._busy) if busy < self.config.depth]

    @staticmethod
    def _tokens(req: Request) -> list[int]:
        return req.prompt + req.generated if req.generated else req.prompt

    def _trim(self, plan: StepPlan, req: Request) -> None:
        """Release ``req``'s blocks before the window of its next token; a sequence the workers hold is told."""
        if not self.blocks.window:
            return
        before = self.blocks.holes(req.seq_id)
        holes = self.blocks.trim(req.seq_id, req.computed)
        if holes > before and req.seq_id not in plan.step.starts:  # a new one gets its table with the holes
            plan.step.trims[req.seq_id] = holes

    def _feed(self, plan: StepPlan, req: Request, n: int) -> None:
        """``req``'s next ``n`` tokens into ``plan`` (blocks grown first); a token still sampled: a placeholder."""
        tokens, step = self._tokens(req), plan.step
        self._trim(plan, req)
        new = self.blocks.grow(req.seq_id, req.computed + n)
        if req.seq_id in step.starts or new:  # new on the workers: its whole table
            step.blocks[req.seq_id] = self.blocks.table(req.seq_id) if req.seq_id in step.starts else new
        known = req.computed - req.fed_unknown
        if known < len(tokens):
            step.items.append((req.seq_id, tokens[known:known + n]))
            if known + n < len(tokens) and self.config.rope_switch:  # a chunk: longrope takes the whole's length
                step.prefill_lengths[req.seq_id] = len(tokens)
        else:
            step.items.append((req.seq_id, [PLACEHOLDER]))  # the step's take_back fills it in on the first stage
            req.fed_unknown += 1
        req.computed += n
        sampled = req.computed == len(tokens) + req.fed_unknown
        plan.samples.append(sampled)
        req.pending += sampled
        plan.requests.append(req)

    def _preempt(self, req: Request, *, switch: bool = False) -> None:
        """Free a running request's blocks; at the head of the queue, it is recomputed or (where swapping its blocks
        to host memory is cheaper) swapped back in. ``switch``: about to pass ``rope_switch``: recomputed, uncounted."""
        del self.running[req.seq_id]
        groups = self.blocks.held_groups(req.seq_id)  # the blocks before its window were released already
        table = [b for held in groups for b in held]
        if switch:
            self.rope_recomputes += 1
        elif self.swap.choose(blocks=len(table), tokens=req.computed):
            req.swapped, req.swap_counts = self.swap.take(len(table)), tuple(map(len, groups))
            self._swap_out.extend(zip(table, req.swapped))
            self.swap.swaps += 1
        else:
            self.swap.recomputes += 1
        self.blocks.free(req.seq_id)
        self._reserved -= req.reserve if self.config.kv_admission == "reserve" else 0
        self._frees.append(req.seq_id)
        req.state, req.group = "waiting", -1
        req.computed = req.computed if req.swapped else 0
        if not switch:
            req.preemptions += 1
            self.preemptions += 1
        self.waiting.appendleft(req)  # victims go newest first, so the queue keeps their age order

    def _make_room(self, req: Request, n: int, plan: StepPlan) -> bool:
        """Preempt the newest idle running requests until ``req`` can grow by ``n``; False if ``req`` itself went."""
        while self.blocks.grow_cost(req.seq_id, req.computed + n) > self.blocks.num_free:
            victims = [r for r in self.running.values()
                       if r is not req and not r.in_flight and r not in plan.requests]
            if not victims and req.in_flight:
                return False  # a step in flight holds it: it waits for that step's tokens
            victim = victims[-1] if victims else req
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _admit(self, plan: StepPlan, req: Request, budget: int,
               found: tuple[list[int], tuple[list[Any], int, tuple[int, int] | None]] | None = None) -> int:
        """Start the head of the queue in ``plan`` if it fits; returns the tokens it took (0: it did not fit).
        ``found``: the request's tokens and what ``blocks.lookup`` gave for them, where the caller asked already."""
        cfg, mgr = self.config, self.blocks
        if cfg.kv_admission == "reserve" and self._reserved + req.reserve > cfg.kv_blocks:
            return 0
        tokens, looked = found if found is not None else (self._tokens(req), None)
        long = req.rope_long if req.swapped else is_long(cfg.rope_switch, len(tokens))
        if looked is None:
            looked = mgr.lookup(tokens, chain_root(long)) if not req.swapped else ([], 0, None)
        shared, _, cow = looked
        cached = req.computed if req.swapped else len(shared) * cfg.block_size + (cow[1] if cow else 0)
        n = len(tokens) - cached
        if cfg.chunked_prefill or mgr.window or req.generated:  # a recompute in chunks: it may pass the budget
            n = min(n, most_tokens(cfg, mgr.window, len(req.prompt), budget))
        if n < 1 or n > budget:
            return 0
        cost = (mgr.resume_cost(cached, cached + n, req.swap_counts) if req.swapped
                else mgr.start_cost(shared, cow, cached + n))
        # On demand, leave ~1% of the cache free for the running requests' next blocks (fewer preemptions).
        watermark = max(1, cfg.kv_blocks // 100) if self.running and cfg.kv_admission == "on_demand" else 0
        if cost > mgr.num_free and not self.running and (shared or cow):  # the prefix (its copy's source held too)
            return self._admit(plan, req, budget, (tokens, ([], 0, None)))  # costs more than the pool: start afresh
        if cost + watermark > mgr.num_free:
            return 0
        self.waiting.popleft()
        step = plan.step
        if req.swapped:  # its keys/values come back from host memory into fresh blocks (those its window reaches)
            step.swap_in.extend(mgr.resume(req.seq_id, req.computed, req.swapped, req.swap_counts, chain_root(long)))
            self.swap.give(req.swapped)
            req.swapped = []
            step.starts[req.seq_id] = req.computed
        else:
            hit = mgr.start(req.seq_id, tokens, share=bool(shared or cow), root=chain_root(long))
            req.computed = hit.start
            step.starts[req.seq_id] = hit.start
            step.copies.extend(hit.copies)
        req.state, req.group, req.rope_long = "running", step.group, long
        self.running[req.seq_id] = req
        if cfg.kv_admission == "reserve":
            self._reserved += req.reserve
        step.new_params[req.seq_id] = req.params
        # min_tokens: the worker needs the prompt's length; structured: the outputs its grammar has taken already
        if req.params.penalised or req.params.min_tokens or req.params.structured is not None:
            step.history[req.seq_id] = (list(req.prompt), list(req.generated))
        self._feed(plan, req, n)
        return n

    def schedule(self, group: int) -> StepPlan | None:
        """The next step of ``group`` (``None`` if it is busy or has nothing to run)."""
        cfg = self.config
        if self._busy[group] >= cfg.depth:
            return None
        # The step is built once, here, and sent as it is: frees and swap-outs (preemptions below add to them)
        # go with it; planned ahead (depth > 1), the last stage sends its tokens back and the group's next step
        # takes them (a placeholder is only ever fed after such a step, so take_back covers it).
        ahead = cfg.depth > 1
        plan = StepPlan(Step(next(self._step_ids), self._frees, [], {}, group=group, send_back=ahead,
                             take_back=ahead and self._owed[group], swap_out=self._swap_out, trims=self._trims))
        mine = [r for r in self.running.values() if r.group == group]
        budget = self.budget.choose(len(mine), min(len(self.waiting[0].prompt), cfg.max_batch_tokens) if self.waiting else 0)
        before = self.preemptions
        for r in mine:  # the running requests first (oldest first): decode tokens, then prompt chunks
            if r.state != "running" or r.in_flight >= cfg.depth:
                continue  # preempted for an older one in this loop
            known = len(r.prompt) + len(r.generated)
            n = known - (r.computed - r.fed_unknown)
            if n == 0 and r.pending > r.fed_unknown:
                # Its token is still being sampled: feed it as a placeholder if the group's previous step samples it
                # (its tokens come back to the first stage), it cannot be the last, and it does not wait to speculate.
                if (r.last_sampled != self._last_step[group] or len(r.generated) + r.pending >= r.params.max_tokens
                        or known + r.pending >= cfg.max_context or self.speculator.waits(r)):
                    continue
                n = 1
            if cfg.chunked_prefill or self.blocks.window or r.generated:
                n = min(n, most_tokens(cfg, self.blocks.window, len(r.prompt), budget))
            if n < 1 or n > budget:
                continue
            if cfg.rope_switch and not r.rope_long and r.computed + n > cfg.rope_switch:
                if not (r.in_flight or r.pending):  # its keys are short-factor ones: recompute it whole, long
                    self._preempt(r, switch=True)
                    budget -= self._admit(plan, r, budget)  # at the queue's head: now, or when it fits
                continue  # else its latest token is still being sampled: recomputed once it is known
            self._trim(plan, r)  # its blocks before the window go first: fewer to find room for
            if not self._make_room(r, n, plan):
                continue
            self._feed(plan, r, n)
            budget -= n
        admit = cfg.policy == "continuous" or not mine
        if admit and self.waiting and self.preemptions == before:  # no readmitting what was just preempted
            # Spread requests over the groups: a group takes at most its share of all live requests.
            share = math.ceil((len(self.running) + len(self.waiting)) / cfg.groups)
            while (self.waiting and len(plan.requests) < share and len(self.running) < cfg.max_running
                   and budget > 0):
                took = self._admit(plan, self.waiting[0], budget)
                if not took:
                    break
                budget -= took
        if not plan.step.items:
            return None
        self.speculator.extend(plan, self.blocks, budget=budget, max_context=cfg.max_context, ahead=ahead)
        self._seal(plan, plan.step.step_id)
        if ahead:
            self._owed[group] = True
        self._busy[group], self._last_step[group] = self._busy[group] + 1, plan.step.step_id
        self._last_tokens[group] = plan.n_tokens
        return plan

    def _seal(self, plan: StepPlan, sampled_in: int) -> None:
        """``plan`` leaves: its requests are in flight, and each sampled one's token counts as ``sampled_in``'s."""
        # Name the blocks this step fills only now: a block is shared from the next step on, once written
        # (and only blocks of known tokens: a placeholder's value comes later).
        for r in plan.requests:  # (proposals are fed but not known: their blocks are named once accepted)
            self.blocks.commit(r.seq_id, self._tokens(r), min(r.computed - r.fed_unknown, len(self._tokens(r))))
        self._frees, self._swap_out, self._trims, plan.started = [], [], {}, self.clock()  # they left with the step
        for r, sampled in zip(plan.requests, plan.samples):
            r.in_flight += 1
            if sampled:
                r.last_sampled = sampled_in

    def schedule_late(self, group: int) -> StepPlan | None:
        """Admit waiting requests now, while every step of ``group`` is in flight (``late_admission``).

        Without it an arrival waits for the step planned ahead to run before its prompt can (one whole step of time to
        first token). The late step holds admissions only, so a worker that has not yet started the step planned ahead
        can run both as one; otherwise it runs right after it. Either way its tokens count as that step's: the group's
        next step feeds their placeholders. Arrivals while a late step is in flight get another one (a worker merges
        every late step queued behind the step planned ahead), all of them together within that step's
        ``max_batch_tokens``. It is planned only when that is safe in both orders: nothing freed or swapped out since
        the step planned ahead (so no block a step in flight still writes is handed out), no swapped-in request, and
        no shared prefix (whose blocks a step in flight may not have written yet). ``None``: no late step now.
        """
        cfg = self.config
        if (not cfg.late_admission or cfg.depth < 2 or cfg.policy != "continuous"
                or self._busy[group] < cfg.depth or not self.waiting or self._frees or self._swap_out or self._trims):
            return None
        plan: StepPlan | None = None  # made (and a step id taken) once a request can join it
        budget = cfg.max_batch_tokens - self._last_tokens[group]  # they all may run as one step
        share = math.ceil((len(self.running) + len(self.waiting)) / cfg.groups)
        while (self.waiting and (plan is None or len(plan.requests) < share) and len(self.running) < cfg.max_running
               and budget > 0):
            head = self.waiting[0]
            if head.swapped or head.computed:
                break
            tokens = self._tokens(head)
            found = self.blocks.lookup(tokens, chain_root(is_long(cfg.rope_switch, len(tokens))))
            if found[0] or found[2]:  # a shared prefix
                break
            if plan is None:
                plan = StepPlan(Step(next(self._step_ids), [], [], {}, group=group, send_back=True, late=True))
            took = self._admit(plan, head, budget, (tokens, found))
            if not took:
                break
            budget -= took
        if plan is None or not plan.step.items:
            return None
        self._seal(plan, self._last_step[group])
        self._last_tokens[group] += plan.n_tokens
        self.late_steps += 1
        return plan

    def take_frees(self) -> list[int]:
        """Frees not yet sent with a step (the engine sends them alone when nothing else runs)."""
        frees, self._frees = self._frees, []
        return frees

    def _finish(self, req: Request, reason: str, text: str | None = None) -> None:
        req.state, req.finish_reason = "finished", reason
        req.text = text if text is not None else req.detok.finish() if req.detok is not None else req.text
        if self.running.pop(req.seq_id, None) is not None:
            self.blocks.free(req.seq_id)
            self._reserved -= req.reserve if self.config.kv_admission == "reserve" else 0
            self._frees.append(req.seq_id)

    def complete(self, plan: StepPlan, tokens: Sequence[int], logprobs: dict[int, Any] | None = None,
                 errors: dict[int, str] | None = None, accepted: dict[int, list[tuple[int, Any]]] | None = None
                 ) -> list[tuple[Request, int | None, bool]]:
        """Apply a step's sampled tokens; returns ``(request, token or None, finished)`` per token of the step.

        ``logprobs`` / ``errors`` / ``accepted`` are by seq_id (see :class:`~energon_infer.protocol.Tokens`): a request
        in ``errors`` finishes with ``finish_reason="error"`` and ``request.error`` set, its placeholder token dropped;
        a speculating one takes its ``accepted`` tokens in order, up to the first that stops it.
        """
        step = plan.step
        if len(tokens) != len(step.items):
            raise RuntimeError(f"step {step.step_id} ran {len(step.items)} sequences but returned {len(tokens)} tokens")
        if not step.late:
            self._busy[step.group] -= 1
        self.speculator.observe_step(step, plan.n_tokens, started=plan.started, ended=self.clock())
        out: list[tuple[Request, int | None, bool]] = []
        samples = plan.samples or [True] * len(tokens)
        for req, tok, sampled in zip(plan.requests, tokens, samples):
            req.in_flight -= 1
            if sampled and req.pending:
                req.pending -= 1
                if req.fed_unknown:
                    req.fed_unknown -= 1  # it was fed as a placeholder: now known, and computed
            if req.state != "running":  # failed, aborted or stopped while the step ran
                continue
            if req.aborted or (errors and req.seq_id in errors):  # aborted meanwhile, or failed alone in a worker
                req.error = None if req.aborted else (errors or {})[req.seq_id]
                self._finish(req, "abort" if req.aborted else "error")
                out.append((req, None, True))
                continue
            if not sampled:  # a chunk of a longer prompt (or recompute): its token is not the next one
                continue
            emitted = (accepted or {}).get(req.seq_id) or [(tok, (logprobs or {}).get(req.seq_id))]
            if spec := step.proposals.get(req.seq_id, 0):  # the rejected proposals' slots: written over next
                req.computed -= spec + 1 - len(emitted)
                self.speculator.settle(req, spec, len(emitted) - 1)
            for t, lp in emitted:
                if lp is not None:
                    req.logprobs.append(lp)
                req.generated.append(int(t))
                if req.detok is not None:
                    req.detok.add(int(t))
                reason, text = stop_reason(req.generated, req.params, self.eos_token_ids,
                                           text=req.detok.text if req.detok is not None else None)
                if reason is None and len(req.prompt) + len(req.generated) > self.config.max_context:
                    reason = "length"  # the next step would feed a token past the context
                out.append((req, int(t), reason is not None))
                if reason is not None:
                    self._finish(req, reason, text)
                    break
            else:
                self.blocks.commit(req.seq_id, self._tokens(req), req.computed - req.fed_unknown)
        return out

    def abort(self, request_id: str) -> Request | None:
        """Stop a request: a waiting one leaves the queue; a running one leaves now or after its step in flight."""
        if (held := self.grammars.remove(request_id)) is not None:  # finished there
            return held
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.swap.give(req.swapped)
                req.state, req.finish_reason = "finished", "abort"
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
            req.state, req.in_flight, req.finish_reason = "finished", 0, "error"
        self.running.clear()
        self.blocks.reset()
        self.swap.reset()
        self._swap_out, self._trims = [], {}
        for req in self.waiting:  # swapped out to workers that are gone: recompute
            req.swapped, req.computed = [], 0
        self._reserved, self._frees = 0, []
        self._busy, self._owed = [0] * self.config.groups, [False] * self.config.groups
        return lost

    def drain_waiting(self) -> list[Request]:
        """Remove and return every waiting request (shutdown, or no workers left)."""
        out = list(self.waiting) + self.grammars.drain()
        self.waiting.clear()
        for req in out:
            req.state = "finished"
        return out
