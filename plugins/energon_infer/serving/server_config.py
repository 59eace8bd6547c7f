"""How the HTTP server listens and what it accepts (:class:`ServerConfig`); a light module, so ``tightfit serve
--help`` reads its defaults without starting FastAPI."""

from __future__ import annotations

from dataclasses import dataclass

from energon_infer.errors import OptionError

__all__ = ["ServerConfig", "TOOL_CALL_PARSERS"]

# The formats of energon_infer.serving.tool_calls (named here so --help needs no import of it).
TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral", "none")


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
        tool_call_parser: the format tool calls are parsed in (``hermes``, ``llama3``, ``mistral``, ``none``);
            ``None``: the one the chat template writes.
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
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise OptionError(f"port={self.port} must be in [0, 65535]")
        for name in ("max_request_bytes", "max_tokens_limit", "default_max_tokens", "max_prompts", "max_n"):
            if getattr(self, name) < 1:
                raise OptionError(f"{name}={getattr(self, name)} must be >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise OptionError(f"default_max_tokens={self.default_max_tokens} exceeds max_tokens_limit="
                              f"{self.max_tokens_limit}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise OptionError(f"tool_call_parser={self.tool_call_parser!r} is not one of "
                              f"{', '.join(TOOL_CALL_PARSERS)}; pick one (or leave it out: the chat template's)")
        if not self.drain_timeout_s >= 0 or not self.disconnect_poll_s > 0:
            raise OptionError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0 and disconnect_poll_s="
                              f"{self.disconnect_poll_s} > 0")
