"""The server's two ways of answering submitted requests: wait for all of them, or stream their tokens as events.

Both free the workers when the answer cannot be delivered: a client that goes away, a choice that
fails, or a stream cut by shutdown cancel every future still running (which aborts its request and
frees its KV blocks). Used by :class:`energon_infer.serving.server.EnergonServer` for completions and chat alike.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, ClassVar

from fastapi import Request

from energon_infer.engine.account import RequestStamps, ServingAccount, now_ns
from energon_infer.engine.delivery import Completion, TokenEvent
from energon_infer.serving.http_guard import ClientGone, engine_error
from energon_infer.serving.openai_format import Reply, error_event, metrics, sse, usage

__all__ = ["wait_all", "TokenStream", "LoopInbox"]


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


class LoopInbox:
    """Token events from the engine's controller thread to one event loop, a batch for one wake-up of the loop.

    The controller hands out a step's tokens together (one per running request); waking the loop once per token
    would cost a write to the loop's self-pipe each, from the controller thread, between the step's reply and the
    planning of the next step. Here the first event of a batch wakes the loop, and the events that come before it
    runs ride along. One inbox per loop (:meth:`of`), shared by every stream on it.
    """

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox]] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[TokenStream, tuple[int, TokenEvent]]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopInbox:
        """The inbox of ``loop`` (made on first use; call it on the loop's thread)."""
        inbox = cls._by_loop.get(loop)
        if inbox is None:
            inbox = cls._by_loop[loop] = cls(loop)
        return inbox

    def put(self, stream: TokenStream, item: tuple[int, TokenEvent]) -> None:
        """From any thread: ``item`` to ``stream`` on the loop; wakes the loop unless a wake-up is on its way."""
        with self._lock:
            self._pending.append((stream, item))
            if len(self._pending) > 1:
                return  # the loop has not run the batch yet: this one goes with it
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed (the server stopped): nobody is left to read it
            with self._lock:
                self._pending.clear()

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for stream, item in batch:
            stream.receive(item)


class TokenStream:
    """The token events of several requests (one per choice), as OpenAI's server-sent events.

    Make it on the event loop, pass :meth:`listener` ``(i)`` to the engine for choice ``i``, then send :meth:`body`.

    Args:
        reply: the endpoint's shapes (chunks, the first events).
        include_usage: end with a chunk carrying the usage (``stream_options.include_usage``).
        prompt_tokens: for that usage.
        closing_since: when the server began shutting down (``None``: it is not).
        drain_timeout_s: how long a stream may run after that before it ends with an error event.
        account: where each choice's time account goes once the stream has ended (``None``: nowhere).
    """

    def __init__(self, reply: Reply, *, include_usage: bool, prompt_tokens: int,
                 closing_since: Callable[[], float | None], drain_timeout_s: float,
                 account: ServingAccount | None = None):
        self.account = account
        self.reply, self.include_usage, self.prompt_tokens = reply, include_usage, prompt_tokens
        self.closing_since, self.drain_timeout_s = closing_since, drain_timeout_s
        self._loop = asyncio.get_running_loop()
        self._inbox = LoopInbox.of(self._loop)
        self._events: deque[tuple[int, TokenEvent]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def listener(self, index: int) -> Callable[[TokenEvent], Any]:
        """Called from the engine's controller thread for each token of choice ``index``."""
        return lambda ev: self._inbox.put(self, (index, ev))

    def receive(self, item: tuple[int, TokenEvent]) -> None:
        """On the loop: the next event (from :class:`LoopInbox`); wakes :meth:`body` if it waits."""
        self._events.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _next(self, timeout: float) -> tuple[int, TokenEvent] | None:
        """The next event, or ``None`` after ``timeout`` seconds without one."""
        if not self._events:
            self._waiter = self._loop.create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout)
            except asyncio.TimeoutError:
                return None
            finally:
                self._waiter = None
        return self._events.popleft()

    def _drain_expired(self) -> bool:
        at = self.closing_since()
        return at is not None and time.monotonic() - at >= self.drain_timeout_s

    async def body(self, futures: list[Future[Completion]], stamps: list[RequestStamps] | None = None
                   ) -> AsyncIterator[bytes]:
        """The events: the first chunks, one per token, the usage if asked, then ``[DONE]``. ``stamps``: each
        choice's time account, closed once ``[DONE]`` is out (a stream cut short is not accounted)."""
        live, completion_tokens = set(range(len(futures))), 0
        finished: dict[int, str] = {}  # choice -> its request id, once it completed
        try:
            for chunk in self.reply.first(len(futures)):
                yield sse(chunk)
            while live:
                if self._drain_expired():
                    yield error_event(f"the server is shutting down and this stream did not finish within "
                                          f"drain_timeout_s={self.drain_timeout_s:g} s; it was aborted, resubmit it "
                                          "to a running server", type="service_unavailable", code=503)
                    break
                got = await self._next(0.25)
                if got is None:
                    continue
                index, ev = got
                if ev.error is not None:
                    err = engine_error(ev.error)
                    yield error_event(err.message, type=err.type, code=err.status)
                    break
                if ev.token_id is not None:
                    completion_tokens += 1
                lps = None if ev.logprobs is None or ev.token_id is None else ([ev.token_id], [ev.logprobs])
                # none while text is held; the token: for a reply that decodes it itself
                chunks = self.reply.chunks(index, ev.text, ev.finish_reason, lps, ev.token_id)
                if chunks and ev.completion is not None and len(futures) == 1:  # the final chunk, as vLLM's
                    chunks[-1] = {**chunks[-1], **metrics([ev.completion])}  # speculative decoding's counts
                for chunk in chunks:
                    yield sse(chunk)
                if ev.finish_reason is not None:
                    live.discard(index)
                    if ev.completion is not None:
                        finished[index] = ev.completion.request_id
            if not live and self.include_usage:
                yield sse({**self.reply.chunk(0, "", None, None), "choices": [],
                               "usage": usage(self.prompt_tokens, completion_tokens)})
            yield b"data: [DONE]\n\n"
            if stamps is not None and self.account is not None:
                end = now_ns()
                for index, request_id in finished.items():
                    stamps[index].done = end
                    self.account.add_request(request_id, stamps[index])
        finally:
            _cancel_unfinished(futures)  # the client left (or the stream was cut): abort, which frees the KV blocks
