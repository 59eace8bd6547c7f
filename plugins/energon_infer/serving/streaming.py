"""The server's two ways of answering submitted requests: wait for all of them, or stream their tokens as events.

Both free the workers when the answer cannot be delivered: a client that goes away, a choice that
fails, or a stream cut by shutdown cancel every future still running (which aborts its request and
frees its KV blocks). Used by :class:`energon_infer.serving.server.EnergonServer` for completions and chat alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import Request

from energon_infer.engine.delivery import Completion, TokenEvent
from energon_infer.serving.http_guard import ClientGone, engine_error
from energon_infer.serving.openai_format import Reply, error_event, sse, usage

__all__ = ["wait_all", "TokenStream"]


def _cancel_unfinished(futures: list[Future[Completion]]) -> None:
    for f in futures:
        if not f.done():
            f.cancel()  # aborts the request: its KV blocks go back to the pool


async def wait_all(request: Request, futures: list[Future[Completion]], poll_s: float) -> list[Completion]:
    """Every result, in order; the first failure fails them all; a client that leaves (checked every ``poll_s``)
    raises :class:`ClientGone`. Whatever happens, nothing is left running."""
    waiting = [asyncio.wrap_future(f) for f in futures]
    try:
        while True:
            done, pending = await asyncio.wait(waiting, timeout=poll_s, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((exc for d in done if not d.cancelled() and (exc := d.exception()) is not None), None)
            if failed is not None:
                raise engine_error(failed)
            if not pending:
                return [w.result() for w in waiting]
            if await request.is_disconnected():
                raise ClientGone
    finally:
        _cancel_unfinished(futures)


class TokenStream:
    """The token events of several requests (one per choice), as OpenAI's server-sent events.

    Make it on the event loop, pass :meth:`listener` ``(i)`` to the engine for choice ``i``, then send :meth:`body`.

    Args:
        reply: the endpoint's shapes (chunks, the first events).
        include_usage: end with a chunk carrying the usage (``stream_options.include_usage``).
        prompt_tokens: for that usage.
        closing_since: when the server began shutting down (``None``: it is not).
        drain_timeout_s: how long a stream may run after that before it ends with an error event.
    """

    def __init__(self, reply: Reply, *, include_usage: bool, prompt_tokens: int,
                 closing_since: Callable[[], float | None], drain_timeout_s: float):
        self.reply, self.include_usage, self.prompt_tokens = reply, include_usage, prompt_tokens
        self.closing_since, self.drain_timeout_s = closing_since, drain_timeout_s
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

    def listener(self, index: int) -> Callable[[TokenEvent], Any]:
        """Called from the engine's controller thread for each token of choice ``index``."""
        return lambda ev: self._loop.call_soon_threadsafe(self._events.put_nowait, (index, ev))

    def _drain_expired(self) -> bool:
        at = self.closing_since()
        return at is not None and time.monotonic() - at >= self.drain_timeout_s

    async def body(self, futures: list[Future[Completion]]) -> AsyncIterator[bytes]:
        """The events: the first chunks, one per token, the usage if asked, then ``[DONE]``."""
        live, completion_tokens = set(range(len(futures))), 0
        try:
            for chunk in self.reply.first(len(futures)):
                yield sse(chunk)
            while live:
                if self._drain_expired():
                    yield error_event(f"the server is shutting down and this stream did not finish within "
                                          f"drain_timeout_s={self.drain_timeout_s:g} s; it was aborted, resubmit it "
                                          "to a running server", type="service_unavailable", code=503)
                    break
                try:
                    index, ev = await asyncio.wait_for(self._events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    continue
                if ev.error is not None:
                    err = engine_error(ev.error)
                    yield error_event(err.message, type=err.type, code=err.status)
                    break
                if ev.token_id is not None:
                    completion_tokens += 1
                lps = None if ev.logprobs is None or ev.token_id is None else ([ev.token_id], [ev.logprobs])
                yield sse(self.reply.chunk(index, ev.text, ev.finish_reason, lps))
                if ev.finish_reason is not None:
                    live.discard(index)
            if not live and self.include_usage:
                yield sse({**self.reply.chunk(0, "", None, None), "choices": [],
                               "usage": usage(self.prompt_tokens, completion_tokens)})
            yield b"data: [DONE]\n\n"
        finally:
            _cancel_unfinished(futures)  # the client left (or the stream was cut): abort, which frees the KV blocks
