"""The frontend: each request's output state, and what the controller hands back per step (vLLM's OutputProcessor).

The scheduler's :class:`~energon_infer.scheduling.scheduler.Request` holds what batching needs (tokens, blocks,
why it stopped); everything the caller of the engine sees lives here, in one :class:`Output` per
request, written only by this module: its future, its listener, the text streamed so far and its
timings (arrival, first token, last token, finish, and the time account's stamps:
:mod:`energon_infer.engine.account`). The data moves one way: the engine opens an
output and queues the request; the controller passes each step's ``(request, token, finished)``
events to :meth:`Delivery.notify`, which reads the scheduler's request (never writes it) and
answers the listener and the future. The scheduler never imports this module.

Text: a request with stop strings is decoded by the scheduler (its stop rule reads the text, under the
controller's lock); every other request's text is decoded here, outside that lock, into the output's own
:class:`~energon_infer.scheduling.detokenizer.IncrementalDetokenizer`.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from energon_infer.engine.account import RequestStamps, ServingAccount, now_ns
from energon_infer.errors import EnergonError
from energon_infer.scheduling.detokenizer import IncrementalDetokenizer
from energon_infer.structured import REFUSED

if TYPE_CHECKING:
    from energon_infer.scheduling.scheduler import Request

__all__ = ["Completion", "TokenEvent", "Output", "Delivery", "completion_of", "RequestFailedError",
           "RequestRefusedError"]

# (logprob of the sampled token, [(token, logprob), ...] the most likely first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class RequestFailedError(EnergonError, RuntimeError):
    """This request failed inside a worker (e.g. its sampling probabilities were not finite); the other
    requests of the batch and the worker group were not affected."""


class RequestRefusedError(RequestFailedError):
    """This request's structured output could not be compiled on the rank that samples (it passed the engine's
    check): the request is at fault (a 400), and it failed alone."""

    http_status = 400


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request: tokens, text, why it stopped, and its timings (``time.monotonic`` seconds)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop", "length" or "abort"
    arrival: float
    first_token: float
    finished: float
    logprobs: list[TokenLogprobs] | None = None  # one per token, when SamplingParams.logprobs was set
    spec_proposed: int = 0  # speculative decoding: tokens proposed for it (0: none)
    spec_histogram: tuple[int, ...] = ()  # its verifying steps by proposals accepted: index 0..num_speculative_tokens

    @property
    def latency_s(self) -> float:
        return self.finished - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return self.first_token - self.arrival if self.first_token else None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One token of a request as it is generated (``text``: the new text since the previous event).

    The last event of a request has ``finish_reason`` set and carries the :class:`Completion`
    (or ``error``, when the request failed).
    """

    request_id: str
    token_id: int | None
    text: str
    finish_reason: str | None = None
    completion: Completion | None = None
    error: BaseException | None = None
    logprobs: TokenLogprobs | None = None  # this token's, when SamplingParams.logprobs was set


@dataclass(eq=False, slots=True)
class Output:
    """The frontend's state of one request (``time.monotonic`` seconds; 0: not yet)."""

    request_id: str
    future: Future[Completion]
    listener: Callable[[TokenEvent], None] | None
    arrival: float
    first_token: float = 0.0
    last_token_at: float = 0.0  # the previous token's delivery (inter-token latency)
    sent_text: str = ""  # streamed so far
    sent_tokens: int = 0  # token events so far (a speculative step gives several at once: each its own logprobs)
    stamps: RequestStamps | None = None  # the time account's (energon_infer.engine.account)
    closes: bool = True  # its account is closed here at its last token (else by whoever gave the stamps)
    detok: IncrementalDetokenizer | None = None  # its text, where the scheduler does not decode it


def _text(req: Request, out: Output) -> str | None:
    """The final text of a finished request: the scheduler's (cut at a stop string), else the frontend's."""
    if req.text is not None:
        return req.text
    return out.detok.finish() if out.detok is not None else None


def completion_of(req: Request, out: Output, finished: float) -> Completion:
    """The :class:`Completion` of a finished request: the scheduler's tokens and text, the frontend's timings."""
    return Completion(req.request_id, list(req.prompt), list(req.generated), _text(req, out), req.finish_reason or "abort",
                      out.arrival, out.first_token, finished,
                      list(req.logprobs) if req.params.logprobs is not None else None, req.proposed,
                      tuple(req.spec_histogram))


class Delivery:
    """Opens each request's :class:`Output`, hands results to futures and listeners, counts them in ``metrics``.

    Args:
        metrics: the engine's :class:`~energon_infer.engine.metrics.EngineMetrics`.
        has_text: whether requests carry text (the engine has a tokenizer).
        clock: the time source of the timings.
        decode: token ids -> text, for the requests the scheduler does not decode (``None``: it decodes them all).
        account: where each request's time account goes once it is done (``None``: nowhere).
    """

    def __init__(self, metrics: Any, *, has_text: bool, clock: Callable[[], float] = time.monotonic,
                 decode: Callable[[Any], str] | None = None, account: ServingAccount | None = None):
        self.metrics = metrics
        self.has_text = has_text
        self.clock = clock
        self.decode = decode
        self.account = account
        self.outputs: dict[str, Output] = {}  # by request id, from open to the last event

    def open(self, request_id: str, listener: Callable[[TokenEvent], None] | None = None,
             stamps: RequestStamps | None = None, *, closes: bool = True) -> Future[Completion]:
        """Start a request's output (before it is queued); returns its future. A live id raises ``ValueError``.

        ``stamps``: the request's time account so far (received, tokenized; default: it starts now); ``closes``: it
        goes to the account at the last token, else its giver closes it
        (:meth:`~energon_infer.engine.account.ServingAccount.add_request`) once the answer is written (the server)."""
        out = Output(request_id, Future(), listener, self.clock(), stamps=stamps or RequestStamps(received=now_ns()),
                     closes=closes)
        if self.outputs.setdefault(request_id, out) is not out:  # atomic: two threads cannot both open one id
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        return out.future

    def close(self, request_id: str) -> None:
        """Forget an output whose request was never queued (the queue refused it)."""
        self.outputs.pop(request_id, None)

    def queued(self, requests: list[Request]) -> None:
        """The requests are in the scheduler's queue (the controller calls, under its lock: before any step)."""
        t = now_ns()
        for req in requests:
            out = self.outputs.get(req.request_id)
            if out is not None and out.stamps is not None:
                out.stamps.queued = t

    def ran(self, requests: list[Request], sent: int, timing: tuple[int, ...]) -> None:
        """A step holding ``requests`` was sent at ``sent`` and ran on the worker over ``timing`` (the worker's
        start, forward start, forward end and end; ``()``: not reported): each live one's account adds it."""
        for req in requests:
            out = self.outputs.get(req.request_id)
            if out is None or out.stamps is None:
                continue
            if not out.stamps.admitted:
                out.stamps.admitted = sent
            if len(timing) == 4:
                out.stamps.ran(sent, (timing[0], timing[1], timing[2], timing[3]))

    def delta(self, req: Request, out: Output, done: bool) -> str:
        """New text since the last event; holds back what may still become a stop string."""
        if not self.has_text:
            return ""
        if req.text is not None:  # finished (a speculative step's earlier tokens too): the text cut at a stop string
            full = req.text
        elif done:
            full = _text(req, out) or ""
        else:
            detok = req.detok if req.detok is not None else out.detok
            full = detok.text if detok is not None else ""
        if not done:
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            full = full[: len(full) - hold] if hold else full
        if not full.startswith(out.sent_text):
            return ""  # a stop string cut earlier text (rare); the completion carries the final text
        delta = full[len(out.sent_text):]
        out.sent_text = full
        return delta

    def notify(self, events: list[tuple[Request, int | None, bool]]) -> None:
        """Per ``(request, token, finished)``: a token event to its listener; the completion when finished."""
        now = self.clock()
        for req, tok, done in events:
            out = self.outputs.get(req.request_id) if not done else self.outputs.pop(req.request_id, None)
            if out is None:
                continue  # never opened here (a scheduler driven without the engine) or already failed
            if done and req.error is not None:  # failed alone in a worker: an error, not a completion
                self._fail_one(req, out, RequestRefusedError(
                    f"{req.error}; fix or remove the constraint (supported: docs/serving.md, Structured outputs)")
                    if req.error.startswith(REFUSED) else RequestFailedError(
                    f"this request failed in a worker ({req.error}); the other requests were not affected; resubmit "
                    "it with other sampling settings"))
                continue
            if tok is not None:
                self._timing(out, now)
                out.sent_tokens += 1
            stamps = out.stamps
            if req.detok is None and self.decode is not None and (tok is not None or done):
                t0 = now_ns()
                if out.detok is None:
                    out.detok = IncrementalDetokenizer(self.decode)
                if tok is not None:
                    out.detok.add(tok)
                if stamps is not None:
                    stamps.detokenize += now_ns() - t0
            completion = completion_of(req, out, now) if done else None
            if stamps is not None:
                stamps.last_token = now_ns()  # before the listener: the answer may be written before it returns
            if out.listener is not None:
                at = out.sent_tokens - 1  # this token's place in the output
                lp = req.logprobs[at] if tok is not None and req.params.logprobs is not None and at < len(req.logprobs) \
                    else None
                event = TokenEvent(req.request_id, tok, self.delta(req, out, done), req.finish_reason if done else None,
                                   completion, logprobs=lp)
                try:
                    out.listener(event)
                except Exception:  # a listener's bug must not stop the controller
                    traceback.print_exc()
            if stamps is not None:
                if done and out.closes and self.account is not None:
                    stamps.done = stamps.last_token
                    self.account.add_request(req.request_id, stamps)
            if completion is not None:
                status = "aborted" if completion.finish_reason == "abort" else "ok"
                self.metrics.record_finished(latency_s=completion.latency_s, ttft_s=completion.ttft_s,
                                             tokens=len(completion.token_ids), status=status, first_token_recorded=True)
                if not out.future.done():
                    try:
                        out.future.set_result(completion)
                    except Exception:  # cancelled meanwhile
                        pass

    def _timing(self, out: Output, now: float) -> None:
        # Time to first token, then each gap, as the controller hands tokens out.
        if out.last_token_at:
            self.metrics.record_token_gap(now - out.last_token_at)
        else:
            out.first_token = now
            self.metrics.record_first_token(now - out.arrival)
        out.last_token_at = now

    def fail(self, requests: list[Request], error: BaseException) -> None:
        """Each request's listener gets an error event and its future the exception."""
        for req in requests:
            out = self.outputs.pop(req.request_id, None)
            if out is not None:
                self._fail_one(req, out, error)

    def _fail_one(self, req: Request, out: Output, error: BaseException) -> None:
        self.metrics.record_finished(latency_s=0.0, ttft_s=None, tokens=len(req.generated), status="error")
        if out.listener is not None:
            try:
                out.listener(TokenEvent(req.request_id, None, "", "error", None, error))
            except Exception:
                traceback.print_exc()
        if not out.future.done():
            try:
                out.future.set_exception(error)
            except Exception:
                pass
