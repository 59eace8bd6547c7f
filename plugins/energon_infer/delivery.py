"""Delivery: what the controller hands back per request (completions, token events) and its text.

:class:`IncrementalDetokenizer` turns one request's tokens into text a few tokens at a time. The
scheduler owns one per request (it checks stop strings on its text) and delivery reads the same
text for streaming, so each token is decoded once, over a window of a few tokens, instead of the
whole output twice per token (the cost was quadratic in the output length).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from energon_infer.errors import EnergonError

if TYPE_CHECKING:
    from energon_infer.scheduler import Request

__all__ = ["Completion", "TokenEvent", "IncrementalDetokenizer", "Delivery", "completion_of", "RequestFailedError"]

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


class IncrementalDetokenizer:
    """The text of one request's tokens, decoded incrementally.

    Each :meth:`add` decodes a short window: the tokens since the last settled point plus the ones
    before it (``prefix``), so tokenizers that drop a leading space or merge bytes across tokens
    still yield the text a full decode would. Text that ends in an incomplete UTF-8 character
    (``U+FFFD``) waits for the next token.

        >>> d = IncrementalDetokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
        >>> [d.add(t) for t in "h\u00e9".encode()], d.text
        (['h', '', 'é'], 'hé')
    """

    __slots__ = ("decode", "tokens", "text", "prefix", "read")

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""  # every settled character so far
        self.prefix = 0  # the window starts here; tokens before it are never decoded again
        self.read = 0  # tokens whose text is in ``text``

    def add(self, token: int) -> str:
        """Append a token; returns the text it settled (possibly empty)."""
        self.tokens.append(int(token))
        before = self.decode(self.tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self.decode(self.tokens[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return ""  # an incomplete character, or nothing new yet: wait for the next token
        new = after[len(before):]
        self.text += new
        self.prefix, self.read = self.read, len(self.tokens)
        return new

    def finish(self) -> str:
        """Settle what is left (an incomplete character becomes ``U+FFFD``); returns the whole text."""
        if self.read < len(self.tokens):
            before = self.decode(self.tokens[self.prefix:self.read]) if self.read > self.prefix else ""
            after = self.decode(self.tokens[self.prefix:])
            # A tokenizer that revised earlier text: fall back to one full decode.
            self.text = self.text + after[len(before):] if after.startswith(before) else self.decode(self.tokens)
            self.prefix = self.read = len(self.tokens)
        return self.text


def completion_of(req: Request) -> Completion:
    """The :class:`Completion` of a finished request."""
    return Completion(req.request_id, list(req.prompt), list(req.generated), req.text, req.finish_reason or "abort",
                      req.arrival, req.first_token, req.finished,
                      list(req.logprobs) if req.params.logprobs is not None else None)


class Delivery:
    """Hands results to futures and listeners, and counts them in ``metrics``.

    Args:
        metrics: the engine's :class:`~energon_infer.metrics.EngineMetrics`.
        has_text: whether requests carry text (the engine has a tokenizer).
    """

    def __init__(self, metrics: Any, *, has_text: bool):
        self.metrics = metrics
        self.has_text = has_text

    def delta(self, req: Request, done: bool) -> str:
        """New text since the last event; holds back what may still become a stop string."""
        if not self.has_text:
            return ""
        if done and req.text is not None:
            full = req.text
        else:
            full = req.detok.text if req.detok is not None else ""
        if not done:
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            full = full[: len(full) - hold] if hold else full
        if not full.startswith(req.sent_text):
            return ""  # a stop string cut earlier text (rare); the completion carries the final text
        delta = full[len(req.sent_text):]
        req.sent_text = full
        return delta

    def notify(self, events: list[tuple[Request, int | None, bool]]) -> None:
        """Per ``(request, token, finished)``: a token event to its listener; the completion when finished."""
        for req, tok, done in events:
            if done and req.error is not None:  # failed alone in a worker: an error, not a completion
                self.fail([req], RequestFailedError(f"this request failed in a worker ({req.error}); the other requests "
                                                    "were not affected; resubmit it with other sampling settings"))
                continue
            if tok is not None:
                self._timing(req)
            completion = completion_of(req) if done else None
            if req.listener is not None:
                lp = req.logprobs[-1] if tok is not None and req.params.logprobs is not None and req.logprobs else None
                event = TokenEvent(req.request_id, tok, self.delta(req, done), req.finish_reason if done else None,
                                   completion, logprobs=lp)
                try:
                    req.listener(event)
                except Exception:  # a listener's bug must not stop the controller
                    traceback.print_exc()
            if done:
                assert completion is not None
                status = "aborted" if completion.finish_reason == "abort" else "ok"
                self.metrics.record_finished(latency_s=completion.latency_s, ttft_s=completion.ttft_s,
                                             tokens=len(completion.token_ids), status=status, first_token_recorded=True)
                if not req.future.done():
                    try:
                        req.future.set_result(completion)
                    except Exception:  # cancelled meanwhile
                        pass

    def _timing(self, req: Request) -> None:
        # Time to first token from the scheduler's own stamps; then each gap as the controller hands tokens out.
        now = time.monotonic()
        if req.last_token_at:
            self.metrics.record_token_gap(now - req.last_token_at)
        elif req.first_token:
            self.metrics.record_first_token(req.first_token - req.arrival)
        req.last_token_at = now

    def fail(self, requests: list[Request], error: BaseException) -> None:
        """Each request's listener gets an error event and its future the exception."""
        for req in requests:
            self.metrics.record_finished(latency_s=0.0, ttft_s=None, tokens=len(req.generated), status="error")
            if req.listener is not None:
                try:
                    req.listener(TokenEvent(req.request_id, None, "", "error", None, error))
                except Exception:
                    traceback.print_exc()
            if not req.future.done():
                try:
                    req.future.set_exception(error)
                except Exception:
                    pass
