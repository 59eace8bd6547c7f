"""OpenAI's response shapes for the server: choices, chunks, usage and the two logprobs formats.

Completions report logprobs as four parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``
as ``{token: logprob}``, ``text_offset``); chat as ``content: [{token, logprob, bytes, top_logprobs}]``.
A token's text is its decoded string (``"token_id:N"`` when the model has no tokenizer, as vLLM writes it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from energon_infer.engine.delivery import Completion
from energon_infer.scheduling.detokenizer import IncrementalDetokenizer
from energon_infer.serving.tool_calls import ToolCallStream, ToolOutput
from energon_infer.serving.tool_stream import MarkerText

__all__ = ["Reply", "CompletionReply", "ChatReply", "Choice", "completion_logprobs", "chat_logprobs", "usage", "metrics", "sse", "error_event", "completion_choice",
           "chat_choice", "completion_chunk", "chat_chunk"]

TokenLogprobs = tuple[float, list[tuple[int, float]]]  # (logprob of the token, [(token, logprob), ...])


class Choice:
    """One choice being streamed: its index, what it has sent, and its tokens' logprobs so far."""

    __slots__ = ("index", "prompt_tokens", "completion_tokens", "finish_reason", "text_offset")

    def __init__(self, index: int, prompt_tokens: int, text_offset: int = 0):
        self.index, self.prompt_tokens, self.completion_tokens = index, prompt_tokens, 0
        self.finish_reason: str | None = None
        self.text_offset = text_offset


def _lp(value: float) -> float:
    # JSON has no -inf; OpenAI writes an impossible token's logprob as -9999.0.
    return value if math.isfinite(value) else -9999.0


def _token_text(decode: Callable[[list[int]], str] | None, token: int) -> str:
    return decode([token]) if decode is not None else f"token_id:{token}"


def completion_logprobs(tokens: Sequence[int], logprobs: Sequence[TokenLogprobs] | None,
                        decode: Callable[[list[int]], str] | None, offset: int = 0) -> dict[str, Any] | None:
    """The completions ``logprobs`` object of ``tokens`` (``offset``: characters before the first one)."""
    if logprobs is None:
        return None
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, (lp, top) in zip(tokens, logprobs):
        text = _token_text(decode, tok)
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp))
        alternatives: dict[str, float] = {}
        for t, v in top:  # most likely first; two tokens with the same text keep the likelier one's value
            alternatives.setdefault(_token_text(decode, t), _lp(v))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokens: Sequence[int], logprobs: Sequence[TokenLogprobs] | None,
                  decode: Callable[[list[int]], str] | None) -> dict[str, Any] | None:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if logprobs is None:
        return None

    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = _token_text(decode, tok)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                        for tok, (lp, top) in zip(tokens, logprobs)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def metrics(done: Sequence[Completion]) -> dict[str, Any]:
    """A response's ``metrics``, as vLLM's ``--per-request-spec-decode-metrics summary`` writes them: the speculative
    decoding counts of a single-sequence request that verified proposals (``{}`` otherwise, as vLLM leaves ``n > 1``
    out). ``acceptance_histogram[j]``: verifying steps that accepted ``j`` proposals (the bonus token not counted)."""
    if len(done) != 1 or not sum(done[0].spec_histogram):
        return {}
    c, hist = done[0], done[0].spec_histogram
    steps, accepted = sum(hist), sum(j * n for j, n in enumerate(hist))
    return {"metrics": {"speculative_decoding": {
        "mean_acceptance_length": 1.0 + accepted / steps,
        "draft_acceptance_rate": accepted / c.spec_proposed if c.spec_proposed else 0.0,
        "acceptance_histogram": list(hist), "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": c.spec_proposed, "num_spec_tokens": len(hist) - 1}}}


def sse(payload: dict[str, Any] | str) -> bytes:
    # ensure_ascii: a model may emit text that is not valid UTF-8 on its own; escapes always encode.
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def error_event(message: str, *, type: str = "server_error", code: int = 500) -> bytes:
    """The last data event of a stream that could not finish (before ``[DONE]``)."""
    return sse({"error": {"message": message, "type": type, "param": None, "code": code}})


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: Any,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _tool_finish(reason: str | None, called: bool) -> str | None:
    # A generation that ended by itself after calls ends in them (OpenAI's "tool_calls"); "length" stays.
    return "tool_calls" if called and reason == "stop" else reason


def completion_chunk(rid: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}


def chat_chunk(rid: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices}


# ---------------------------------------------------------------------- one reply, two shapes


class Reply(Protocol):
    """How one endpoint writes its answer; the server's one submit / stream / wait path calls these."""

    def chunk(self, index: int, text: str, reason: str | None, lps: tuple[list[int], list[TokenLogprobs]] | None
              ) -> dict[str, Any]:
        """The stream chunk of choice ``index``'s new ``text`` (and its tokens' logprobs, when asked)."""

    def chunks(self, index: int, text: str, reason: str | None,
               lps: tuple[list[int], list[TokenLogprobs]] | None, token: int | None = None) -> list[dict[str, Any]]:
        """The stream chunks of choice ``index``'s new ``text`` (of its new ``token``): :meth:`chunk`'s, or more or
        none where the text holds tool calls."""

    def first(self, choices: int) -> list[dict[str, Any]]:
        """The chunks a stream starts with, before any token."""

    def response(self, done: list[Completion], prompt_tokens: int) -> dict[str, Any]:
        """The whole answer of a request that did not stream."""


class CompletionReply:
    """``/v1/completions``: ``echo[i]`` (the prompt's text, or ``""``) before each choice of prompt ``i``."""

    def __init__(self, rid: str, model: str, echo: list[str], n: int, decode: Callable[[list[int]], str] | None):
        self.rid, self.model, self.echo, self.n, self.decode = rid, model, echo, n, decode

    def chunk(self, index: int, text: str, reason: str | None, lps: Any) -> dict[str, Any]:
        logprobs = None if lps is None else completion_logprobs(lps[0], lps[1], self.decode)
        return completion_chunk(self.rid, self.model, [completion_choice(index, text, reason, logprobs)])

    def chunks(self, index: int, text: str, reason: str | None, lps: Any, token: int | None = None
               ) -> list[dict[str, Any]]:
        return [self.chunk(index, text, reason, lps)]

    def first(self, choices: int) -> list[dict[str, Any]]:
        return [completion_chunk(self.rid, self.model, [completion_choice(i, self.echo[i // self.n], None, None)])
                for i in range(choices) if self.echo[i // self.n]]

    def response(self, done: list[Completion], prompt_tokens: int) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(done):
            echo = self.echo[i // self.n]
            choices.append(completion_choice(i, echo + (c.text or ""), c.finish_reason,
                                             completion_logprobs(c.token_ids, c.logprobs, self.decode, len(echo))))
        return {"id": self.rid, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in done)), **metrics(done)}


class ChatReply:
    """``/v1/chat/completions``: a stream opens each choice with the assistant's role; ``tools``: how the output
    becomes content and tool calls (default: all content). Where the parser's markers are special tokens, it reads
    the output decoded from its tokens with the markers kept."""

    def __init__(self, rid: str, model: str, decode: Callable[[list[int]], str] | None,
                 tools: ToolOutput | None = None):
        self.rid, self.model, self.decode = rid, model, decode
        self.tools = tools or ToolOutput()
        self._streams: dict[int, ToolCallStream] = {}
        parser = self.tools.parser
        self._keep = (MarkerText(decode, parser.special) if self.tools.kind == "auto" and parser is not None
                      and parser.special and decode is not None else None)
        self._texts: dict[int, IncrementalDetokenizer] = {}

    def chunk(self, index: int, text: str, reason: str | None, lps: Any) -> dict[str, Any]:
        delta = {"content": text} if text or reason is None else {}
        logprobs = None if lps is None else chat_logprobs(lps[0], lps[1], self.decode)
        return chat_chunk(self.rid, self.model, [{"index": index, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": reason}])

    def chunks(self, index: int, text: str, reason: str | None, lps: Any, token: int | None = None
               ) -> list[dict[str, Any]]:
        if self.tools.kind == "text":
            return [self.chunk(index, text, reason, lps)]
        stream = self._streams.setdefault(index, self.tools.stream())
        if self._keep is not None:  # the same text, from the tokens, with the markers in it
            keep = self._texts.setdefault(index, self._keep.incremental())
            text = keep.add(token) if token is not None else ""
            if reason is not None:
                settled = len(keep.text)
                text += keep.finish()[settled:]
        deltas = stream.feed(text)
        if reason is not None:
            deltas += stream.finish()
            deltas.append({})
        logprobs = None if lps is None else chat_logprobs(lps[0], lps[1], self.decode)
        if not deltas and logprobs is not None:
            deltas.append({})  # the text is held back, its tokens' logprobs are not
        out = [chat_chunk(self.rid, self.model, [{"index": index, "delta": d, "logprobs": None,
                                                  "finish_reason": None}]) for d in deltas]
        if out:
            out[0]["choices"][0]["logprobs"] = logprobs
        if reason is not None:
            out[-1]["choices"][0]["finish_reason"] = _tool_finish(reason, stream.called)
        return out

    def first(self, choices: int) -> list[dict[str, Any]]:
        return [chat_chunk(self.rid, self.model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])
                for i in range(choices)]

    def response(self, done: list[Completion], prompt_tokens: int) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(done):
            content, calls = self.tools.extract(self._keep(c.token_ids) if self._keep is not None else c.text or "")
            choices.append(chat_choice(i, content or (None if calls else ""), _tool_finish(c.finish_reason, bool(calls)),
                                       chat_logprobs(c.token_ids, c.logprobs, self.decode),
                                       [call.to_openai(self.tools.new_id()) for call in calls]))
        return {"id": self.rid, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in done)), **metrics(done)}
