"""The frontend: each request's output state, and what the controller hands back per step (vLLM's OutputProcessor).

The scheduler's :class:`~energon_infer.scheduling.scheduler.Request` holds what batching needs (tokens, blocks,
why it stopped); everything the caller of the engine sees lives here, in one :class:`Output` per
request, written only by this module: its future, its listener, the text streamed so far and its
timings (arrival, first token, last token, finish). The data moves one way: the engine opens an
output and queues the request; the controller passes each step's ``(request, token, finished)``
events to :meth:`Delivery.notify`, which reads the scheduler's request (never writes it) and
answers the listener and the future. The scheduler never imports this module.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from energon_infer.errors import EnergonError

if TYPE_CHECKING:
    from energon_infer.scheduling.scheduler import Request

__all__ = ["Completion", "TokenEvent", "Output", "Delivery", "completion_of", "RequestFailedError"]

# (logprob of the sampled token, [(token, logprob), ...] the most likely first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class RequestFailedError(EnergonError, RuntimeError):
    """This request failed inside a worker (e.g. its sampling probabilities were not finite); the other
    requests of the batch and the worker group were not affected."""


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


def completion_of(req: Request, out: Output, finished: float) -> Completion:
    """The :class:`Completion` of a finished request: the scheduler's tokens and text, the frontend's timings."""
    return Completion(req.request_id, list(req.prompt), list(req.generated), req.text, req.finish_reason or "abort",
                      out.arrival, out.first_token, finished,
                      list(req.logprobs) if req.params.logprobs is not None else None)


class Delivery:
    """Opens each request's :class:`Output`, hands results to futures and listeners, counts them in ``metrics``.

    Args:
        metrics: the engine's :class:`~energon_infer.engine.metrics.EngineMetrics`.
        has_text: whether requests carry text (the engine has a tokenizer).
        clock: the time source of the timings.
    """

    def __init__(self, metrics: Any, *, has_text: bool, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.has_text = has_text
        self.clock = clock
        self.outputs: dict[str, Output] = {}  # by request id, from open to the last event

    def open(self, request_id: str, listener: Callable[[TokenEvent], None] | None = None) -> Future[Completion]:
        """Start a request's output (before it is queued); returns its future. A live id raises ``ValueError``."""
        out = Output(request_id, Future(), listener, self.clock())
        if self.outputs.setdefault(request_id, out) is not out:  # atomic: two threads cannot both open one id
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        return out.future

    def close(self, request_id: str) -> None:
        """Forget an output whose request was never queued (the queue refused it)."""
        self.outputs.pop(request_id, None)

    def delta(self, req: Request, out: Output, done: bool) -> str:
        """New text since the last event; holds back what may still become a stop string."""
        if not self.has_text:
            return ""
        if req.text is not None:  # finished (a speculative step's earlier tokens too): the text cut at a stop string
            full = req.text
        else:
            full = req.detok.text if req.detok is not None else ""
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
                self._fail_one(req, out, RequestFailedError(
                    f"this request failed in a worker ({req.error}); the other requests were not affected; resubmit "
                    "it with other sampling settings"))
                continue
            if tok is not None:
                self._timing(out, now)
                out.sent_tokens += 1
            completion = completion_of(req, out, now) if done else None
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
