"""What the server does before and after an endpoint: the error shape, reading bodies safely, JSON that always encodes.

* :class:`ApiError`: OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with its status;
  :func:`engine_error` maps an :class:`~energon_infer.errors.EnergonError` to its class's status (queue full: 429,
  no workers: 503, bad input: 400) and anything else to 500, logged with its traceback.
* :func:`guarded_route`: endpoints read their body through :class:`GuardedRequest`: at most ``limit`` bytes
  (413), JSON that nests too deep or is not an object gets 400 instead of a recursion error (500).
* :class:`SafeJSONResponse`: ASCII escapes and no NaN, so no text can make a response unencodable.
* :class:`StampArrival`: each request's arrival time in its ASGI scope (where the time account begins).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from energon_infer.engine.account import now_ns
from energon_infer.errors import EnergonError

log = logging.getLogger("energon_infer")

__all__ = ["ApiError", "engine_error", "ClientGone", "SafeJSONResponse", "GuardedRequest", "guarded_route", "ARRIVAL",
           "StampArrival"]


class ApiError(EnergonError, HTTPException):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.http_status = status  # this instance's, unlike the other EnergonErrors' class-wide one
        self.status, self.message, self.type, self.param = status, message, type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


# OpenAI's error "type" and the Retry-After (seconds) a client gets for each status energon answers.
_TYPES = {400: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}
_RETRY_AFTER = {429: "1", 503: "5"}  # a full queue drains in about a second; a restart takes several


def engine_error(exc: BaseException) -> ApiError:
    """The answer to ``exc``: an :class:`EnergonError` gets its class's ``http_status``; anything else is a
    bug in energon (even a ``ValueError``), answered 500 and logged with its traceback."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EnergonError):
        status = exc.http_status
        retry = _RETRY_AFTER.get(status)
        return ApiError(status, str(exc), type=_TYPES.get(status, "server_error"),
                        headers={"Retry-After": retry} if retry else None)
    log.error("energon: unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
    return ApiError(500, f"internal error: {exc!r}", type="server_error")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its requests are aborted)."""


class SafeJSONResponse(JSONResponse):
    # ASCII escapes: a text can never make the response unencodable (what a lone surrogate did before).
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class GuardedRequest(Request):
    """A request whose body is read with a size limit and parsed without recursion errors or non-objects."""

    limit = 1 << 20

    async def body(self) -> bytes:
        cached = getattr(self, "tf_body", None)
        if cached is not None:
            return cached
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            raise ApiError(413, f"the request body has {declared} bytes; this server accepts at most {self.limit}")
        buf = bytearray()
        async for chunk in self.stream():
            buf += chunk
            if len(buf) > self.limit:
                raise ApiError(413, f"the request body is over {self.limit} bytes, the most this server accepts")
        self.tf_body = bytes(buf)
        return self.tf_body

    async def json(self) -> Any:
        cached = getattr(self, "tf_json", None)
        if cached is not None:
            return cached
        raw = await self.body()
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "the request body nests JSON arrays/objects too deeply to be a valid request") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        self.tf_json = data
        return data


def guarded_route(limit: int) -> type[APIRoute]:
    class GuardedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Any]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Any:
                req = GuardedRequest(request.scope, request.receive)
                req.limit = limit
                return await handler(req)

            return guarded

    return GuardedRoute


ARRIVAL = "energon_received_ns"  # the ASGI scope's key: when the request reached the server (the time account)


class StampArrival:
    """ASGI middleware: stamps each HTTP request's arrival (``time.monotonic_ns()``) in its scope, before the body is
    read, routed and validated: where the time account's ``http`` part begins."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[ARRIVAL] = now_ns()
        await self.app(scope, receive, send)
