"""An OpenAI-compatible HTTP server for an :class:`~energon_infer.engine.Engine`, on FastAPI + uvicorn.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true`` answers
with server-sent events, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503
unless the worker group is serving) and ``GET /metrics`` (Prometheus text: queue depth, tokens/s,
latency and time-to-first-token percentiles, failures, restarts).

Safe defaults: it binds 127.0.0.1; with an API key every ``/v1`` call needs ``Authorization:
Bearer <key>``; request bodies over ``max_request_bytes`` get 413; ``max_tokens`` over
``max_tokens_limit`` and malformed requests get 400 with the reason (OpenAI's error shape); a full
queue gets 429 with ``Retry-After``; no workers (restarting or failed) gets 503. On SIGINT/SIGTERM
uvicorn stops accepting connections and lets in-flight requests finish (up to
``drain_timeout_s``), then the engine drains and stops its workers.

Example:
    >>> engine = Engine.from_pretrained(model_dir)                          # doctest: +SKIP
    >>> serve(engine, ServerConfig(port=8000))                              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

# Imported at module level: FastAPI resolves the endpoints' (string) annotations in this module's globals.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from energon_infer.engine import Completion, Engine, EngineClosedError, WorkerFailedError
from energon_infer.sampling import SamplingParams
from energon_infer.scheduler import QueueFullError

__all__ = ["ServerConfig", "ApiError", "build_app", "serve", "BackgroundServer", "chat_prompt"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """How the server listens and what it accepts.

    Args:
        host: address to bind (127.0.0.1: this machine only; ``0.0.0.0`` exposes it, use an API key).
        port: TCP port (0: any free port).
        api_key: when set, ``/v1`` requests need ``Authorization: Bearer <api_key>``.
        max_request_bytes: larger request bodies get 413.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` when a request gives none.
        max_prompts: prompts in one ``/v1/completions`` request at most.
        drain_timeout_s: on shutdown, how long in-flight requests may take to finish.
        max_concurrency: open connections at most (uvicorn answers 503 beyond); ``None``: unlimited.
        log_level: uvicorn's log level.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    default_max_tokens: int = 16
    max_prompts: int = 64
    drain_timeout_s: float = 30.0
    max_concurrency: int | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        for name in ("max_request_bytes", "max_tokens_limit", "default_max_tokens", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds max_tokens_limit="
                             f"{self.max_tokens_limit}")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def _engine_error(exc: BaseException) -> ApiError:
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), type="rate_limit_error", headers={"Retry-After": "1"})
    if isinstance(exc, (EngineClosedError, WorkerFailedError)):
        return ApiError(503, str(exc), type="service_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal error: {exc!r}", type="server_error")


# ---------------------------------------------------------------------- request parsing


async def _read_json(request: Any, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; this server accepts at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes, the most this server accepts")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _field(data: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {names}, got {json.dumps(value)[:80]}", param=name)
    return value


def _sampling(data: dict[str, Any], cfg: ServerConfig, *, chat: bool) -> SamplingParams:
    # Options this server does not implement: accepted only at their neutral values, refused otherwise.
    neutral = {"n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "echo": (False,),
               "logprobs": (False, 0), "top_logprobs": (0,), "suffix": ("",), "logit_bias": ({},)}
    for name, ok in neutral.items():
        value = data.get(name)
        if value is not None and value not in ok:
            raise ApiError(400, f"'{name}'={json.dumps(value)[:40]} is not supported by this server; leave it out "
                                f"(or set it to {json.dumps(ok[0])})", param=name)
    key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(data, key, (int,), cfg.default_max_tokens)
    if not 1 <= max_tokens <= cfg.max_tokens_limit:
        raise ApiError(400, f"'{key}'={max_tokens} must be between 1 and {cfg.max_tokens_limit} (this server's "
                            "limit)", param=key)
    stop = data.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stop = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
    try:
        return SamplingParams(
            temperature=float(_field(data, "temperature", (int, float), 1.0)),
            top_p=float(_field(data, "top_p", (int, float), 1.0)),
            top_k=_field(data, "top_k", (int,), 0), seed=_field(data, "seed", (int,), None),
            max_tokens=max_tokens, stop=stop, ignore_eos=_field(data, "ignore_eos", (bool,), False))
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def _prompts(data: dict[str, Any], cfg: ServerConfig) -> list[str | list[int]]:
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            if len(prompt) > cfg.max_prompts:
                raise ApiError(400, f"{len(prompt)} prompts in one request; this server takes at most "
                                    f"{cfg.max_prompts}", param="prompt")
            return list(prompt)
    raise ApiError(400, "'prompt' must be a non-empty string, a list of token ids, or a list of those",
                   param="prompt")


def chat_prompt(messages: Any, tokenizer_config: dict[str, Any] | None = None) -> str:
    """The prompt text for chat ``messages``: the model's own Jinja ``chat_template`` (from
    ``tokenizer_config.json``, rendered in a sandbox) when it has one, else ``"role: content"`` lines
    ending with ``"assistant:"``."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(400, f"messages[{i}] needs a 'role' of system, user, assistant, developer or tool",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ApiError(400, f"messages[{i}].content parts must all be text parts; this model reads text only",
                               param="messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        norm.append({"role": m["role"], "content": content})
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, str):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        special = {k: v for k, v in (tokenizer_config or {}).items() if k in ("bos_token", "eos_token")
                   and isinstance(v, str)}
        return env.from_string(template).render(messages=norm, add_generation_prompt=True, **special)
    return "".join(f"{m['role']}: {m['content']}\n" for m in norm) + "assistant:"


# ---------------------------------------------------------------------- the app


def build_app(engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = False,
              tokenizer_config: dict[str, Any] | None = None) -> Any:
    """The FastAPI application serving ``engine``; ``owns_engine`` shuts the engine down with the server."""
    cfg = config or ServerConfig()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        if owns_engine:  # uvicorn has already let in-flight requests finish (timeout_graceful_shutdown)
            await asyncio.to_thread(engine.shutdown, timeout=cfg.drain_timeout_s)
            served = engine.metrics.requests
            print(f"energon: stopped; {served.get('ok', 0)} request(s) served, {served.get('error', 0)} failed, "
                  f"{served.get('rejected', 0)} rejected; workers stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="energon_infer", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def authorize(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), cfg.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error")

    def check_model(data: dict[str, Any]) -> None:
        model = data.get("model")
        if model is not None and model != engine.model_name:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {engine.model_name!r} "
                                "(see /v1/models)", param="model", type="model_not_found")

    def submit(prompt: str | list[int], params: SamplingParams) -> Any:
        try:
            return engine.submit(prompt, params)
        except Exception as exc:
            raise _engine_error(exc) from None

    def usage(done: list[Completion]) -> dict[str, int]:
        p, c = sum(len(x.prompt_token_ids) for x in done), sum(len(x.token_ids) for x in done)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def text_of(c: Completion) -> str:
        return c.text if c.text is not None else ""

    async def wait_all(futures: list[Any]) -> list[Completion]:
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except Exception as exc:
            raise _engine_error(exc) from None
        finally:
            for f in futures:
                if not f.done():
                    f.cancel()  # the client went away: free the workers from its requests

    async def sse(prompt: str | list[int], params: SamplingParams, make_chunk: Any, first: Any = None,
                  include_usage: bool = False) -> AsyncIterator[bytes]:
        events = engine.stream(prompt, params)
        try:
            # Submit before the response starts, so queue-full and validation errors are real HTTP statuses.
            head = await events.__anext__()
        except Exception as exc:
            raise _engine_error(exc) from None

        async def body() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield _sse(first)
                event: Any = head
                while True:
                    yield _sse(make_chunk(event.text, event.finish_reason))
                    if event.finish_reason is not None:
                        if include_usage and event.completion is not None:
                            yield _sse({**make_chunk("", None), "choices": [], "usage": usage([event.completion])})
                        break
                    event = await events.__anext__()
                yield b"data: [DONE]\n\n"
            except (WorkerFailedError, EngineClosedError, ValueError) as exc:
                yield _sse(_engine_error(exc).body())
            finally:
                await events.aclose()

        return body()

    @app.get("/health")
    async def health() -> JSONResponse:
        h = engine.health()
        return JSONResponse(h, status_code=200 if h["status"] == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": created,
                                            "owned_by": "tightfit", "max_model_len": engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        authorize(request)
        data = await _read_json(request, cfg.max_request_bytes)
        check_model(data)
        params = _sampling(data, cfg, chat=False)
        prompts = _prompts(data, cfg)
        rid, model = f"cmpl-{uuid.uuid4().hex}", engine.model_name
        if _field(data, "stream", (bool,), False):
            if len(prompts) != 1:
                raise ApiError(400, "streaming takes one prompt per request; send the prompts separately",
                               param="prompt")
            opts = data.get("stream_options") or {}

            def chunk(text: str, reason: str | None) -> dict[str, Any]:
                return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

            gen = await sse(prompts[0], params, chunk, include_usage=bool(opts.get("include_usage")))
            return StreamingResponse(gen, media_type="text/event-stream")
        done = await wait_all([submit(p, params) for p in prompts])
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [{"index": i, "text": text_of(c), "logprobs": None, "finish_reason": c.finish_reason}
                            for i, c in enumerate(done)],
                "usage": usage(done)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        authorize(request)
        data = await _read_json(request, cfg.max_request_bytes)
        check_model(data)
        params = _sampling(data, cfg, chat=True)
        prompt = chat_prompt(data.get("messages"), tokenizer_config)
        if engine.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer and this model has none; use /v1/completions with token ids")
        rid, model = f"chatcmpl-{uuid.uuid4().hex}", engine.model_name
        if _field(data, "stream", (bool,), False):
            opts = data.get("stream_options") or {}

            def chunk(text: str, reason: str | None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
                d = delta if delta is not None else ({"content": text} if text or reason is None else {})
                return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                        "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}]}

            gen = await sse(prompt, params, chunk, first=chunk("", None, {"role": "assistant", "content": ""}),
                            include_usage=bool(opts.get("include_usage")))
            return StreamingResponse(gen, media_type="text/event-stream")
        done = await wait_all([submit(prompt, params)])
        c = done[0]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text_of(c)}, "logprobs": None,
                             "finish_reason": c.finish_reason}],
                "usage": usage(done)}

    return app


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _uvicorn_server(app: Any, cfg: ServerConfig) -> Any:
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                         timeout_graceful_shutdown=int(max(1, cfg.drain_timeout_s)),
                                         limit_concurrency=cfg.max_concurrency, lifespan="on"))


def _tokenizer_config(engine: Engine) -> dict[str, Any] | None:
    from pathlib import Path

    file = Path(engine.source.path) / "tokenizer_config.json"
    if file.is_file():
        try:
            return json.loads(file.read_text())
        except ValueError:
            return None
    return None


def serve(engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = True) -> None:
    """Serve until SIGINT/SIGTERM (blocking); then drain in-flight requests and stop the engine's workers."""
    cfg = config or ServerConfig()
    server = _uvicorn_server(build_app(engine, cfg, owns_engine=owns_engine,
                                       tokenizer_config=_tokenizer_config(engine)), cfg)
    server.run()


class BackgroundServer:
    """Serve ``engine`` from a thread of this process (tests, notebooks, the demo); a context manager.

    Example:
        >>> with BackgroundServer(engine, ServerConfig(port=0)) as srv:      # doctest: +SKIP
        ...     httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"})
    """

    def __init__(self, engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = False):
        self.config = config or ServerConfig(port=0)
        self.server = _uvicorn_server(build_app(engine, self.config, owns_engine=owns_engine,
                                                tokenizer_config=_tokenizer_config(engine)), self.config)
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
        """Graceful: stop accepting, let in-flight requests finish, then return."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
