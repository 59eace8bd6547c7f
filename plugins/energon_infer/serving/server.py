"""An OpenAI-compatible HTTP server for an :class:`~energon_infer.engine.engine.Engine`, on FastAPI + uvicorn.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true`` answers
with server-sent events, ending with ``data: [DONE]``), ``GET /v1/models`` (with vLLM's fields), vLLM's
``POST /tokenize`` and ``POST /detokenize``, ``GET /health`` (200
while serving, ``ready`` or ``degraded``; 503 otherwise), ``GET /metrics`` (Prometheus, see
:mod:`energon_infer.engine.metrics`) and ``GET /v1/account`` (the time account, :mod:`energon_infer.engine.account`). Request bodies are the pydantic models of :mod:`energon_infer.serving.api_schema`,
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

:class:`EnergonServer` owns the state (the engine, its limits, the model's defaults, whether it is
shutting down) and its methods are the endpoints; completions and chat differ only in how they read
their body and write their answer (:mod:`energon_infer.serving.openai_format`'s replies) and share one
submit / stream / wait path (:mod:`energon_infer.serving.streaming`). Errors are answered by class
(:func:`~energon_infer.serving.http_guard.engine_error`): an :class:`~energon_infer.errors.EnergonError` with its
status, anything else with 500, logged with its traceback.

Example:
    >>> engine = Engine.from_pretrained(model_dir)                          # doctest: +SKIP
    >>> serve(engine, ServerConfig(port=8000))                              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

# Imported at module level: FastAPI resolves the endpoints' (string) annotations in this module's globals.
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from energon_infer.engine.account import RequestStamps, now_ns
from energon_infer.engine.engine import Engine
from energon_infer.engine.metrics import CONTENT_TYPE
from energon_infer.errors import EnergonError, InvalidRequestError
from energon_infer.loading.hf_files import ChatTemplate, generation_defaults
from energon_infer.sampling import SamplingParams
from energon_infer.serving.api_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    describe_errors,
)
from energon_infer.serving.http_guard import (
    ARRIVAL,
    ApiError,
    ClientGone,
    SafeJSONResponse,
    StampArrival,
    engine_error,
    guarded_route,
)
from energon_infer.serving.openai_format import ChatReply, CompletionReply, Reply
from energon_infer.serving.server_config import ServerConfig
from energon_infer.serving.streaming import TokenStream, wait_all
from energon_infer.serving.structured_fields import compiled_jobs
from energon_infer.serving.tool_calls import bind_tokenizer, make_parser, parser_for_template
from energon_infer.serving.tool_requests import compile_tool_grammar, tool_output_of

__all__ = ["ServerConfig", "ApiError", "EnergonServer", "build_app", "serve", "BackgroundServer"]

Jobs = list[tuple[list[int], SamplingParams]]


class EnergonServer:
    """The server's state (the engine, its limits, the model's defaults, whether it is shutting down) and its
    endpoints as methods; :attr:`app` is the FastAPI application that routes to them.

    Args:
        engine: what serves the requests.
        config: limits and listening address.
        owns_engine: shut the engine down with the server.
        chat_template: how chat messages become a prompt (default: :meth:`ChatTemplate.for_engine`).
    """

    def __init__(self, engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = False,
                 chat_template: ChatTemplate | None = None):
        self.engine, self.config, self.owns_engine = engine, config or ServerConfig(), owns_engine
        self.created = int(time.time())
        self.template = chat_template or ChatTemplate.for_engine(engine)
        # The format tool calls are parsed in: the configured one, else the one the chat template writes.
        named = self.config.tool_call_parser
        self.tool_parser = bind_tokenizer(make_parser(named) if named else parser_for_template(self.template.text), engine)
        self.tool_parser_source = "--tool-call-parser" if named else "the chat template"
        self.defaults = generation_defaults(engine.source.path) if Path(engine.source.path).is_dir() else {}
        self.closing_since: float | None = None  # set when uvicorn begins its graceful shutdown
        self.signals: list[int] = []  # the signals that stopped the server (serve() turns them into its exit status)
        self.cut_short = False  # requests failed or were aborted after the shutdown began: the drain did not finish
        self._failed_at_close = 0
        engine.metrics.bind(model_name=engine.model_name, state=lambda: _engine_state(engine))
        self.app = self._build_app()

    def begin_shutdown(self) -> None:
        """Streams still running ``drain_timeout_s`` from now end with an error event."""
        self.closing_since = time.monotonic()
        self._failed_at_close = self._failed()

    def _failed(self) -> int:
        done = self.engine.metrics.requests
        return done.get("error", 0) + done.get("aborted", 0)

    def exit_status(self, forced: bool = False) -> int:
        """The serving process's exit status once stopped: 0 after a clean drain (or without a signal); 128 + the
        signal (143 for SIGTERM, 130 for Ctrl-C) where the drain was cut short (``forced``: a second Ctrl-C)."""
        if not self.signals or not (self.cut_short or forced):
            return 0
        return 128 + self.signals[-1]

    # ------------------------------------------------------------------ the app

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="energon_infer", summary=f"OpenAI-compatible server for {self.engine.model_name}",
                      lifespan=self._lifespan, default_response_class=SafeJSONResponse, strict_content_type=False)
        app.router.route_class = guarded_route(self.config.max_request_bytes)
        app.add_middleware(StampArrival)
        app.add_exception_handler(RequestValidationError, self._invalid)
        app.add_exception_handler(EnergonError, self._error)  # ApiError included: its own status
        app.add_exception_handler(Exception, self._error)  # a bug: 500, logged with its traceback
        auth = [Depends(self.authorize)]
        app.add_api_route("/health", self.health, methods=["GET"], tags=["operations"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"], tags=["operations"])
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/account", self.account, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=auth)
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], dependencies=auth)
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"], dependencies=auth)
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"], dependencies=auth)
        return app

    @asynccontextmanager
    async def _lifespan(self, _app: Any) -> AsyncIterator[None]:
        yield
        if self.owns_engine:  # uvicorn has already let in-flight requests finish (timeout_graceful_shutdown)
            await asyncio.to_thread(self.engine.shutdown, timeout=self.config.drain_timeout_s)
            self.cut_short = self.closing_since is not None and self._failed() > self._failed_at_close
            served = self.engine.metrics.requests
            print(f"energon: stopped; {served.get('ok', 0)} request(s) served, {served.get('error', 0)} failed, "
                  f"{served.get('rejected', 0)} rejected; workers stopped", file=sys.stderr, flush=True)

    async def _error(self, _request: Request, exc: Exception) -> Response:
        err = engine_error(exc)
        return SafeJSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def _invalid(self, _request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = describe_errors(list(exc.errors()))
        return SafeJSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    # ------------------------------------------------------------------ checks of a request

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error")

    def _check_model(self, model: str | None) -> None:
        name = self.engine.model_name
        if model is not None and model != name:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {name!r} (see /v1/models)",
                           param="model", type="model_not_found")

    def _max_tokens(self, value: int | None, key: str, default: int) -> int:
        if value is None:
            return default
        if value > self.config.max_tokens_limit:
            raise ApiError(400, f"'{key}'={value} must be between 1 and {self.config.max_tokens_limit} (this "
                                "server's limit)", param=key)
        return value

    def _sampling(self, body: Any, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(body, name)
            return value if value is not None else self.defaults.get(name, fallback)

        stop = body.stop if body.stop is not None else ()
        try:
            return SamplingParams(
                temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                top_k=max(0, int(pick("top_k", 0))), seed=body.seed, max_tokens=max_tokens,
                stop=(stop,) if isinstance(stop, str) else tuple(stop), ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                presence_penalty=float(body.presence_penalty or 0.0),
                frequency_penalty=float(body.frequency_penalty or 0.0),
                repetition_penalty=float(pick("repetition_penalty", 1.0)), logprobs=logprobs,
                structured=body.structured())
        except ValueError as exc:  # SamplingParams' own checks of the client's values
            named = str(exc).split("=", 1)[0]
            raise ApiError(400, str(exc), param=named if named.isidentifier() else None) from None

    def _jobs(self, prompt_ids: list[list[int]], params: SamplingParams, n: int) -> Jobs:
        if n > self.config.max_n:
            raise ApiError(400, f"n={n} is more than this server's max_n={self.config.max_n}", param="n")
        total, limit = len(prompt_ids) * n, self.engine.config.scheduler.max_queue
        if total > limit:
            raise ApiError(400, f"this request asks for {total} completions ({len(prompt_ids)} prompt(s) x n={n}) but "
                                f"the engine's queue holds max_queue={limit}, so it could never be admitted; split it "
                                "into smaller requests", param="n" if n > 1 else "prompt")
        out = []
        for ids in prompt_ids:
            for k in range(n):
                # Each choice its own stream of random numbers; reproducible when the request has a seed.
                seed = None if params.seed is None else (params.seed + k) % (1 << 64)
                out.append((ids, params if k == 0 or seed is None else dataclasses.replace(params, seed=seed)))
        return out

    def _encode(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.engine.encode(prompt)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="prompt") from None

    # ------------------------------------------------------------------ the one path of both generating endpoints

    async def _generate(self, request: Request, reply: Reply, jobs: Jobs, *, prompt_tokens: int, stream: bool,
                        include_usage: bool, tokenized: tuple[int, int]) -> Any:
        """Submit every job (all admitted or none), then stream their tokens or wait for all of them.
        ``tokenized``: when the prompts' encode began and ended (the time account's stamps)."""
        received = request.scope.get(ARRIVAL, tokenized[0])
        stamps = [RequestStamps(received=received, tokenize_start=tokenized[0], tokenized=tokenized[1]) for _ in jobs]
        jobs = await compiled_jobs(self.engine, jobs)  # a structured output's grammar: on the engine's pool
        if stream:
            events = TokenStream(reply, include_usage=include_usage, prompt_tokens=prompt_tokens,
                                 closing_since=lambda: self.closing_since, drain_timeout_s=self.config.drain_timeout_s,
                                 account=self.engine.time_account)
            # Submitted before the response starts, so queue-full and validation errors are real HTTP statuses.
            futures = self.engine.submit_all(jobs, listeners=[events.listener(i) for i in range(len(jobs))],
                                             stamps=stamps)
            return StreamingResponse(events.body(futures, stamps), media_type="text/event-stream")
        futures = self.engine.submit_all(jobs, stamps=stamps)
        try:
            done = await wait_all(request, futures, self.config.disconnect_poll_s)
        except ClientGone:
            return Response(status_code=499)  # nobody to answer; the requests are aborted
        answer = reply.response(done, prompt_tokens)
        end = now_ns()
        for c, st in zip(done, stamps):
            st.done = end
            self.engine.time_account.add_request(c.request_id, st)
        return answer

    # ------------------------------------------------------------------ endpoints

    async def health(self) -> Response:
        h = self.engine.health()
        return SafeJSONResponse(h, status_code=200 if h["status"] in ("ready", "degraded") else 503)

    async def metrics(self) -> Response:
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

    async def account(self, reset: bool = False) -> dict[str, Any]:
        """The time account (:meth:`Engine.account <energon_infer.engine.engine.Engine.account>`); ``?reset=true``
        starts it again after this read."""
        return self.engine.account(reset=reset)

    async def models(self) -> dict[str, Any]:
        e = self.engine
        # vLLM's fields: clients (its benchmark among them) read id, root and max_model_len.
        return {"object": "list", "data": [{"id": e.model_name, "object": "model", "created": self.created,
                                            "owned_by": "tightfit", "root": e.model_name, "parent": None,
                                            "max_model_len": e.max_context, "permission": []}]}

    def _tokenizer(self, endpoint: str) -> Any:
        if self.engine.tokenizer is None:
            raise ApiError(400, f"{endpoint} needs a tokenizer and this model has none; put tokenizer.json in the "
                                "model directory")
        return self.engine.tokenizer

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``{count, max_model_len, tokens, token_strs}``."""
        self._check_model(body.model)
        tok = self._tokenizer("/tokenize")
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            try:
                text = self.template.render([m.for_template() for m in body.messages],
                                            add_generation_prompt=body.add_generation_prompt, tools=tools)
            except Exception as exc:  # noqa: BLE001 - the template's own checks speak to the client
                raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
            ids = self._encode(text)
        elif body.add_special_tokens:
            ids = self._encode(body.prompt or "")
        else:
            hf = getattr(tok, "hf", None)
            try:
                ids = (list(hf.encode(body.prompt, add_special_tokens=False)) if hf is not None
                       else list(tok.encode(body.prompt, add_special_tokens=False).ids))
            except TypeError:
                raise ApiError(400, "add_special_tokens=false: this model's tokenizer cannot leave out special "
                                    "tokens; send true", param="add_special_tokens") from None
        strs = [self.engine.decode([t]) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_context, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/detokenize``: ``{prompt}``."""
        self._check_model(body.model)
        self._tokenizer("/detokenize")
        try:
            ids = self.engine.encode(body.tokens)  # ids outside the vocabulary: 400 naming them
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="tokens") from None
        return {"prompt": self.engine.decode(ids)}

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        raw, cfg = body.prompt, self.config
        prompts: list[str | list[int]] = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else list(raw)
        if len(prompts) > cfg.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts in one request; this server takes at most {cfg.max_prompts}",
                           param="prompt")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "'echo' with 'logprobs' would need the prompt's logprobs, which this server does not "
                                "compute; drop one of them", param="echo")
        t0 = now_ns()
        ids = [self._encode(p) for p in prompts]
        tokenized = (t0, now_ns())
        default = min(int(self.defaults.get("max_tokens", cfg.default_max_tokens)), cfg.max_tokens_limit)
        max_tokens = self._max_tokens(body.max_tokens, "max_tokens", default)
        jobs = self._jobs(ids, self._sampling(body, max_tokens=max_tokens, logprobs=body.logprobs), body.n)
        decode = self.engine.decode if self.engine.tokenizer is not None else None
        echo = [(p if isinstance(p, str) else (decode(p) if decode else "")) if body.echo else "" for p in prompts]
        reply = CompletionReply(f"cmpl-{uuid.uuid4().hex}", self.engine.model_name, echo, body.n, decode)
        return await self._generate(request, reply, jobs, prompt_tokens=sum(len(x) for x in ids), stream=body.stream,
                                    include_usage=bool(body.stream_options and body.stream_options.include_usage),
                                    tokenized=tokenized)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        engine = self.engine
        if engine.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer and this model has none; use /v1/completions with token ids")
        # Tools are rendered whatever tool_choice says (as vLLM does): with "none" the model still knows them.
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            prompt = self.template.render([m.for_template() for m in body.messages],
                                          add_generation_prompt=body.add_generation_prompt, tools=tools)
        except Exception as exc:  # noqa: BLE001 - the template's own checks (raise_exception) speak to the client
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        t0 = now_ns()
        ids = self._encode(prompt)
        tokenized = (t0, now_ns())
        room = engine.max_context - len(ids)
        if room < 1:
            raise ApiError(400, f"the messages take {len(ids)} tokens, the whole context of {engine.max_context}; "
                                "shorten them", param="messages")
        key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        # Like vLLM: without a limit a chat answer may use the rest of the context (capped by this server's limit).
        default = min(room, self.config.max_tokens_limit, int(self.defaults.get("max_tokens", room)))
        max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens, key, default)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling(body, max_tokens=max_tokens, logprobs=logprobs)
        tool_output, params = tool_output_of(body, params, self.tool_parser)
        if tool_output.kind in ("named", "required"):
            params = await compile_tool_grammar(self.engine, body, tool_output, params)
        jobs = self._jobs([ids], params, body.n)
        reply = ChatReply(f"chatcmpl-{uuid.uuid4().hex}", engine.model_name, engine.decode, tool_output)
        return await self._generate(request, reply, jobs, prompt_tokens=len(ids), stream=body.stream,
                                    include_usage=bool(body.stream_options and body.stream_options.include_usage),
                                    tokenized=tokenized)


def build_app(engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = False,
              chat_template: ChatTemplate | None = None) -> Any:
    """The FastAPI application serving ``engine`` (an :class:`EnergonServer`'s); ``owns_engine`` shuts the
    engine down with the server. ``chat_template``: how chat messages become a prompt."""
    return EnergonServer(engine, config, owns_engine=owns_engine, chat_template=chat_template).app


def _engine_state(engine: Engine) -> dict[str, float]:
    s = engine.scheduler
    return {"waiting": s.num_waiting, "grammar_waiting": s.grammars.num_held, "running": s.num_running,
            "kv_blocks_used": s.reserved, "kv_blocks_total": s.config.kv_blocks, "up": float(engine.status == "ready"),
            "step_token_budget": s.budget.last.tokens, "step_prefill_budget": s.budget.last.prefill_tokens}


# ---------------------------------------------------------------------- running it


def _uvicorn_server(server: EnergonServer) -> Any:
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            server.begin_shutdown()  # streams past the drain timeout end with an error event
            await super().shutdown(sockets)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the signals it caught once it has stopped, so the process died by SIGTERM (-15,
            # before multiprocessing's exit handlers ran: a leaked-semaphore warning) or KeyboardInterrupt (130)
            # after a clean drain. The drain is done and the workers are stopped by then: keep the signals for
            # serve()'s exit status instead.
            with super().capture_signals():
                try:
                    yield
                finally:
                    caught = getattr(self, "_captured_signals", None)
                    if isinstance(caught, list):
                        server.signals.extend(caught)
                        caught.clear()

    cfg = server.config

    # uvicorn cancels what is still running 2 s after the streams' own deadline, so they end cleanly first.
    return _Server(uvicorn.Config(server.app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                  timeout_graceful_shutdown=int(cfg.drain_timeout_s) + 2,
                                  limit_concurrency=cfg.max_concurrency, lifespan="on"))


def serve(engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = True,
          sock: socket.socket | None = None) -> int:
    """Serve until SIGINT/SIGTERM (blocking); then drain in-flight requests and stop the engine's workers.

    ``sock``: a socket bound beforehand (``tightfit serve`` binds before it loads the model). Returns the exit
    status: 0 after a clean drain, 128 + the signal (143 for SIGTERM, 130 for Ctrl-C) where in-flight requests
    had to be failed or aborted (the drain timeout passed, or a second Ctrl-C).
    """
    energon = EnergonServer(engine, config, owns_engine=owns_engine)
    parser = energon.tool_parser.name if energon.tool_parser is not None else "none (tool_choice 'auto' returns text)"
    print(f"energon: chat template: {energon.template.source}; tool calls: {parser} (from "
          f"{energon.tool_parser_source}; --tool-call-parser hermes|llama3|mistral|none to change)",
          file=sys.stderr, flush=True)
    server = _uvicorn_server(energon)
    server.run(sockets=[sock] if sock is not None else None)
    return energon.exit_status(forced=bool(server.force_exit))


class BackgroundServer:
    """Serve ``engine`` from a thread of this process (tests, notebooks, the demo); a context manager.

    Example:
        >>> with BackgroundServer(engine, ServerConfig(port=0)) as srv:      # doctest: +SKIP
        ...     httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"})
    """

    def __init__(self, engine: Engine, config: ServerConfig | None = None, *, owns_engine: bool = False,
                 chat_template: ChatTemplate | None = None):
        self.config = config or ServerConfig(port=0)
        self.energon = EnergonServer(engine, self.config, owns_engine=owns_engine, chat_template=chat_template)
        self.app = self.energon.app
        self.server = _uvicorn_server(self.energon)
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
