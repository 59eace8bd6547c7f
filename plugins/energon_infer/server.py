"""An OpenAI-compatible HTTP server for an :class:`~energon_infer.engine.Engine`, on FastAPI + uvicorn.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true`` answers
with server-sent events, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (200
while serving, ``ready`` or ``degraded``; 503 otherwise) and ``GET /metrics`` (Prometheus, see
:mod:`energon_infer.metrics`). Request bodies are the pydantic models of :mod:`energon_infer.api_schema`,
so ``/docs`` shows them.

No client can break it: every field is validated before anything reaches a worker (400 naming the
field, in OpenAI's error shape), bodies over ``max_request_bytes`` get 413 and JSON nested too deep
400; a request with more prompts x ``n`` than the engine's queue holds gets 400 (it could never run)
and one that does not fit now 429 with ``Retry-After``, with none of its prompts left running; no
workers gives 503. A client that goes away (streaming or not) has its requests aborted, which frees
their KV blocks. On SIGINT/SIGTERM uvicorn stops accepting connections and in-flight requests get
``drain_timeout_s`` to finish; a stream still running then ends with an error event and ``[DONE]``
rather than a cut connection; then the engine drains and stops its workers.

Safe defaults: it binds 127.0.0.1; with an API key every ``/v1`` call needs ``Authorization:
Bearer <key>``.

Example:
    >>> engine = Engine.from_pretrained(model_dir)                          # doctest: +SKIP
    >>> serve(engine, ServerConfig(port=8000))                              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Imported at module level: FastAPI resolves the endpoints' (string) annotations in this module's globals.
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from energon_infer import openai_format as fmt
from energon_infer.api_schema import ChatCompletionRequest, CompletionRequest, describe_errors
from energon_infer.engine import Completion, Engine
from energon_infer.hf_files import ChatTemplate, generation_defaults
from energon_infer.http_guard import ApiError, ClientGone, SafeJSONResponse, engine_error, guarded_route
from energon_infer.metrics import CONTENT_TYPE
from energon_infer.sampling import SamplingParams

__all__ = ["ServerConfig", "ApiError", "build_app", "serve", "BackgroundServer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """How the server listens and what it accepts.

    Args:
        host: address to bind (127.0.0.1: this machine only; ``0.0.0.0`` exposes it, use an API key).
        port: TCP port (0: any free port).
        api_key: when set, ``/v1`` requests need ``Authorization: Bearer <api_key>``.
        max_request_bytes: larger request bodies get 413.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for (also caps chat's default, the
            rest of the context).
        default_max_tokens: ``max_tokens`` of a completion that gives none (``generation_config.json``'s
            ``max_new_tokens`` wins when the model has one).
        max_prompts: prompts in one ``/v1/completions`` request at most.
        max_n: ``n`` (choices per prompt) at most.
        drain_timeout_s: on shutdown, how long in-flight requests may take to finish.
        max_concurrency: open connections at most (uvicorn answers 503 beyond); ``None``: unlimited.
        disconnect_poll_s: how often a non-streaming request checks whether its client is still there.
        log_level: uvicorn's log level.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    default_max_tokens: int = 16
    max_prompts: int = 64
    max_n: int = 16
    drain_timeout_s: float = 30.0
    max_concurrency: int | None = None
    disconnect_poll_s: float = 0.25
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        for name in ("max_request_bytes", "max_tokens_limit", "default_max_tokens", "max_prompts", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds max_tokens_limit="
                             f"{self.max_tokens_limit}")
        if not self.drain_timeout_s >= 0 or not self.disconnect_poll_s > 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0 and disconnect_poll_s="
                             f"{self.disconnect_poll_s} > 0")


# ---------------------------------------------------------------------- the app


def build_app(engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = False,
              chat_template: ChatTemplate | None = None) -> Any:
    """The FastAPI application serving ``engine``; ``owns_engine`` shuts the engine down with the server.

    ``chat_template``: how chat messages become a prompt (default: :meth:`ChatTemplate.for_engine`).
    """
    cfg = config or ServerConfig()
    created = int(time.time())
    template = chat_template or ChatTemplate.for_engine(engine)
    defaults = generation_defaults(engine.source.path) if Path(engine.source.path).is_dir() else {}
    closing: dict[str, float] = {}  # "at": when shutdown began (set by the uvicorn server, see _Server)
    engine.metrics.bind(model_name=engine.model_name, state=lambda: _engine_state(engine))

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        if owns_engine:  # uvicorn has already let in-flight requests finish (timeout_graceful_shutdown)
            await asyncio.to_thread(engine.shutdown, timeout=cfg.drain_timeout_s)
            served = engine.metrics.requests
            print(f"energon: stopped; {served.get('ok', 0)} request(s) served, {served.get('error', 0)} failed, "
                  f"{served.get('rejected', 0)} rejected; workers stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="energon_infer", summary=f"OpenAI-compatible server for {engine.model_name}",
                  lifespan=lifespan, default_response_class=SafeJSONResponse, strict_content_type=False)
    app.router.route_class = guarded_route(cfg.max_request_bytes)
    app.state.closing = closing

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> Response:
        return SafeJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_errors(list(exc.errors()))
        return SafeJSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    def authorize(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), cfg.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error")

    def check_model(model: str | None) -> None:
        if model is not None and model != engine.model_name:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {engine.model_name!r} "
                                "(see /v1/models)", param="model", type="model_not_found")

    def max_tokens_of(value: int | None, key: str, default: int) -> int:
        if value is None:
            return default
        if value > cfg.max_tokens_limit:
            raise ApiError(400, f"'{key}'={value} must be between 1 and {cfg.max_tokens_limit} (this server's "
                                "limit)", param=key)
        return value

    def sampling(body: Any, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(body, name)
            return value if value is not None else defaults.get(name, fallback)

        stop = body.stop if body.stop is not None else ()
        try:
            return SamplingParams(
                temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                top_k=max(0, int(pick("top_k", 0))), seed=body.seed, max_tokens=max_tokens,
                stop=(stop,) if isinstance(stop, str) else tuple(stop), ignore_eos=body.ignore_eos,
                presence_penalty=float(body.presence_penalty or 0.0),
                frequency_penalty=float(body.frequency_penalty or 0.0),
                repetition_penalty=float(pick("repetition_penalty", 1.0)), logprobs=logprobs)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def jobs_of(prompt_ids: list[list[int]], params: SamplingParams, n: int) -> list[tuple[list[int], SamplingParams]]:
        if n > cfg.max_n:
            raise ApiError(400, f"n={n} is more than this server's max_n={cfg.max_n}", param="n")
        total = len(prompt_ids) * n
        if total > engine.config.max_queue:
            raise ApiError(400, f"this request asks for {total} completions ({len(prompt_ids)} prompt(s) x n={n}) but "
                                f"the engine's queue holds max_queue={engine.config.max_queue}, so it could never be "
                                "admitted; split it into smaller requests", param="n" if n > 1 else "prompt")
        out = []
        for ids in prompt_ids:
            for k in range(n):
                # Each choice its own stream of random numbers; reproducible when the request has a seed.
                seed = None if params.seed is None else (params.seed + k) % (1 << 64)
                out.append((ids, params if k == 0 or seed is None else _with(params, seed=seed)))
        return out

    def encode(prompt: str | list[int]) -> list[int]:
        try:
            return engine.encode(prompt)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from None

    def submit_all(jobs: list[tuple[list[int], SamplingParams]], listeners: list[Any] | None = None) -> list[Any]:
        """Admit every job or none (the engine checks the queue's room for all of them at once)."""
        try:
            return engine.submit_all(jobs, listeners=listeners)
        except Exception as exc:
            raise engine_error(exc) from None

    async def wait_all(request: Request, futures: list[Any]) -> list[Completion]:
        """Every result, in order; the first failure fails them all; a client that leaves aborts them."""
        waiting = [asyncio.wrap_future(f) for f in futures]
        try:
            while True:
                done, pending = await asyncio.wait(waiting, timeout=cfg.disconnect_poll_s,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failed = next((exc for d in done if not d.cancelled() and (exc := d.exception()) is not None), None)
                if failed is not None:
                    raise engine_error(failed)
                if not pending:
                    return [w.result() for w in waiting]
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            for f in futures:
                if not f.done():
                    f.cancel()  # the client went away or another choice failed: free the workers

    def stream(request: Request, jobs: list[tuple[list[int], SamplingParams]], make_chunk: Callable[..., dict],
               first: list[dict[str, Any]], include_usage: bool, prompt_tokens: int, decode: Any) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        def listener_for(index: int) -> Callable[[Any], Any]:
            return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (index, ev))

        # Submitted before the response starts, so queue-full and validation errors are real HTTP statuses.
        futures = submit_all(jobs, [listener_for(i) for i in range(len(jobs))])

        async def body() -> AsyncIterator[bytes]:
            live, completion_tokens = set(range(len(jobs))), 0
            try:
                for chunk in first:
                    yield fmt.sse(chunk)
                while live:
                    at = closing.get("at")
                    if at is not None and time.monotonic() - at >= cfg.drain_timeout_s:
                        yield fmt.error_event(f"the server is shutting down and this stream did not finish within "
                                              f"drain_timeout_s={cfg.drain_timeout_s:g} s; it was aborted, resubmit "
                                              "it to a running server", type="service_unavailable", code=503)
                        break
                    try:
                        index, ev = await asyncio.wait_for(events.get(), timeout=0.25)
                    except asyncio.TimeoutError:
                        continue
                    if ev.error is not None:
                        err = engine_error(ev.error)
                        yield fmt.error_event(err.message, type=err.type, code=err.status)
                        break
                    if ev.token_id is not None:
                        completion_tokens += 1
                    lp = getattr(ev, "logprobs", None)
                    yield fmt.sse(make_chunk(index, ev.text, ev.finish_reason,
                                             None if lp is None or ev.token_id is None else ([ev.token_id], [lp])))
                    if ev.finish_reason is not None:
                        live.discard(index)
                if not live and include_usage:
                    yield fmt.sse({**make_chunk(0, "", None, None), "choices": [],
                                   "usage": fmt.usage(prompt_tokens, completion_tokens)})
                yield b"data: [DONE]\n\n"
            finally:
                for f in futures:
                    if not f.done():
                        f.cancel()  # the client left (or the stream was cut): abort, which frees the KV blocks

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/health", tags=["operations"])
    async def health() -> Response:
        h = engine.health()
        return SafeJSONResponse(h, status_code=200 if h["status"] in ("ready", "degraded") else 503)

    @app.get("/metrics", tags=["operations"])
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": created,
                                            "owned_by": "tightfit", "max_model_len": engine.max_context}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        raw = body.prompt
        prompts: list[str | list[int]] = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else list(raw)
        if len(prompts) > cfg.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts in one request; this server takes at most {cfg.max_prompts}",
                           param="prompt")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "'echo' with 'logprobs' would need the prompt's logprobs, which this server does not "
                                "compute; drop one of them", param="echo")
        ids = [encode(p) for p in prompts]
        max_tokens = max_tokens_of(body.max_tokens, "max_tokens",
                                   min(int(defaults.get("max_tokens", cfg.default_max_tokens)), cfg.max_tokens_limit))
        jobs = jobs_of(ids, sampling(body, max_tokens=max_tokens, logprobs=body.logprobs), body.n)
        decode = engine.decode if engine.tokenizer is not None else None
        echo = [(p if isinstance(p, str) else (decode(p) if decode else "")) if body.echo else "" for p in prompts]
        rid, model, n = f"cmpl-{uuid.uuid4().hex}", engine.model_name, body.n
        prompt_tokens = sum(len(x) for x in ids)

        def chunk(index: int, text: str, reason: str | None, lps: Any) -> dict[str, Any]:
            logprobs = None if lps is None else fmt.completion_logprobs(lps[0], lps[1], decode)
            return fmt.completion_chunk(rid, model, [fmt.completion_choice(index, text, reason, logprobs)])

        if body.stream:
            first = [fmt.completion_chunk(rid, model, [fmt.completion_choice(i, echo[i // n], None, None)])
                     for i in range(len(jobs)) if echo[i // n]]
            include = bool(body.stream_options and body.stream_options.include_usage)
            return stream(request, jobs, chunk, first, include, prompt_tokens, decode)
        done = await _answer(request, wait_all, submit_all(jobs))
        if done is None:
            return Response(status_code=499)
        choices = [fmt.completion_choice(i, echo[i // n] + (c.text or ""), c.finish_reason,
                                         fmt.completion_logprobs(c.token_ids, getattr(c, "logprobs", None), decode,
                                                                 len(echo[i // n])))
                   for i, c in enumerate(done)]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": fmt.usage(prompt_tokens, sum(len(c.token_ids) for c in done))}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        if engine.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer and this model has none; use /v1/completions with token ids")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            prompt = template.render(messages, add_generation_prompt=body.add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - the template's own checks (raise_exception) speak to the client
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        ids = encode(prompt)
        room = engine.max_context - len(ids)
        if room < 1:
            raise ApiError(400, f"the messages take {len(ids)} tokens, the whole context of {engine.max_context}; "
                                "shorten them", param="messages")
        key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        # Like vLLM: without a limit a chat answer may use the rest of the context (capped by this server's limit).
        max_tokens = max_tokens_of(body.max_completion_tokens or body.max_tokens, key,
                                   min(room, cfg.max_tokens_limit, int(defaults.get("max_tokens", room))))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        jobs = jobs_of([ids], sampling(body, max_tokens=max_tokens, logprobs=logprobs), body.n)
        decode = engine.decode
        rid, model = f"chatcmpl-{uuid.uuid4().hex}", engine.model_name

        def chunk(index: int, text: str, reason: str | None, lps: Any) -> dict[str, Any]:
            delta = {"content": text} if text or reason is None else {}
            logprobs = None if lps is None else fmt.chat_logprobs(lps[0], lps[1], decode)
            return fmt.chat_chunk(rid, model, [{"index": index, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": reason}])

        if body.stream:
            first = [fmt.chat_chunk(rid, model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}])
                     for i in range(len(jobs))]
            include = bool(body.stream_options and body.stream_options.include_usage)
            return stream(request, jobs, chunk, first, include, len(ids), decode)
        done = await _answer(request, wait_all, submit_all(jobs))
        if done is None:
            return Response(status_code=499)
        choices = [fmt.chat_choice(i, c.text or "", c.finish_reason,
                                   fmt.chat_logprobs(c.token_ids, getattr(c, "logprobs", None), decode))
                   for i, c in enumerate(done)]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": fmt.usage(len(ids), sum(len(c.token_ids) for c in done))}

    return app


async def _answer(request: Request, wait_all: Any, futures: list[Any]) -> list[Completion] | None:
    try:
        return await wait_all(request, futures)
    except ClientGone:
        return None  # nobody to answer; the requests are aborted


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


def _engine_state(engine: Engine) -> dict[str, float]:
    s = engine.scheduler
    return {"waiting": s.num_waiting, "running": s.num_running, "kv_blocks_used": s.reserved,
            "kv_blocks_total": s.config.kv_blocks, "up": float(engine.status == "ready")}


# ---------------------------------------------------------------------- running it


def _uvicorn_server(app: Any, cfg: ServerConfig) -> Any:
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            app.state.closing["at"] = time.monotonic()  # streams past the drain timeout end with an error event
            await super().shutdown(sockets)

    # uvicorn cancels what is still running 2 s after the streams' own deadline, so they end cleanly first.
    return _Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                  timeout_graceful_shutdown=int(cfg.drain_timeout_s) + 2,
                                  limit_concurrency=cfg.max_concurrency, lifespan="on"))


def serve(engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = True,
          sock: socket.socket | None = None) -> None:
    """Serve until SIGINT/SIGTERM (blocking); then drain in-flight requests and stop the engine's workers.

    ``sock``: a socket bound beforehand (``tightfit serve`` binds before it loads the model).
    """
    cfg = config or ServerConfig()
    server = _uvicorn_server(build_app(engine, cfg, owns_engine=owns_engine), cfg)
    server.run(sockets=[sock] if sock is not None else None)


class BackgroundServer:
    """Serve ``engine`` from a thread of this process (tests, notebooks, the demo); a context manager.

    Example:
        >>> with BackgroundServer(engine, ServerConfig(port=0)) as srv:      # doctest: +SKIP
        ...     httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"})
    """

    def __init__(self, engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = False,
                 chat_template: ChatTemplate | None = None):
        self.config = config or ServerConfig(port=0)
        self.app = build_app(engine, self.config, owns_engine=owns_engine, chat_template=chat_template)
        self.server = _uvicorn_server(self.app, self.config)
        self._thread = threading.Thread(target=self.server.run, name="energon-http", daemon=True)
        self._port = self.config.port

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.config.host}:{self.config.port} "
                                   f"within {timeout:g} s (port in use?)")
            time.sleep(0.02)
        self._port = int(self.server.servers[0].sockets[0].getsockname()[1])  # the real one when port=0
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def stop(self, timeout: float | None = None) -> None:
        """Graceful: stop accepting, let in-flight requests finish (up to ``drain_timeout_s``), then return."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
