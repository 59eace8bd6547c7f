"""Tool calls in a model's output: one parser per format, chosen from the chat template, and OpenAI's shapes.

A model asked to call a tool writes the call in its own format, the one its chat template renders an
assistant's ``tool_calls`` in:

* ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call, anywhere in the text;
* ``llama3`` (Llama 3.1-3.3 JSON tool calling): the whole output is ``{"name": ..., "parameters": {...}}``,
  possibly after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker is a special token that
  decoding drops, so a JSON array of calls at the start of the output counts too).

:func:`parser_for_template` picks the parser whose markers the template writes (``tightfit serve
--tool-call-parser`` overrides it). Text that does not parse as a call stays the message's ``content``: nothing
the model wrote is lost. With calls, the whitespace between and around them is dropped.

:class:`ToolOutput` is what one chat request asked for (``tool_choice``): ``auto`` parses the output with the
parser; a named function and ``required`` constrain decoding to JSON (:func:`required_schema`, the function's
``parameters``), so their arguments always validate; ``none`` (and a model without a parser) keeps the text.
:class:`ToolCallStream` turns one choice's text deltas into OpenAI's streamed deltas: a call is sent once it is
complete (a first delta with ``index``, ``id``, ``type`` and ``function.name``, then ``function.arguments``),
a named function's arguments as they come, and content is held back while a call may be starting, so the
deltas put together equal the answer of the same request without streaming.

Example:
    >>> content, calls = HermesParser().parse('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    >>> content, calls
    ('ok ', [ToolCall(name='f', arguments='{"x": 1}')])
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

__all__ = ["ToolCall", "ToolCallParser", "HermesParser", "Llama3Parser", "MistralParser", "PARSERS",
           "parser_for_template", "make_parser", "required_schema", "ToolOutput", "ToolCallStream"]

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _as_call(obj: Any) -> ToolCall | None:
    """``{"name": str, "arguments" | "parameters": object or its JSON text}`` as a call; anything else ``None``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _partial_suffix(text: str, pos: int, marker: str) -> int:
    """How many characters at the end of ``text[pos:]`` could be the beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _visible(pieces: Sequence[str | ToolCall], final: bool) -> tuple[str, list[ToolCall]]:
    """The content and calls of scanned pieces. With calls, whitespace-only text between and around them is
    dropped; text at the end that is only whitespace is held back until the end (a call may follow)."""
    out, calls, buf = [], [], ""
    for p in pieces:
        if isinstance(p, str):
            buf += p
            continue
        if buf and not buf.isspace():
            out.append(buf)
        buf = ""
        calls.append(p)
    if buf and (not buf.isspace() or (final and not calls)):
        out.append(buf)
    return "".join(out), calls


class ToolCallParser(ABC):
    """One tool-call format. :meth:`scan` is the one method a format writes; :meth:`render` its inverse."""

    name: ClassVar[str]

    @abstractmethod
    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        """``(pieces, decided)``: ``text[:decided]`` as text and calls, each piece final whatever text follows;
        ``final``: the output is complete, so everything is decided."""

    @abstractmethod
    def render(self, calls: Sequence[ToolCall]) -> str:
        """``calls`` as the model writes them (what :meth:`parse` reads back)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished output as ``(content, calls)``; content is ``""`` when only calls were written."""
        return _visible(self.scan(text, True)[0], final=True)

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)


def _scan_markers(text: str, final: bool, pos: int, pieces: list[str | ToolCall], opener: str,
                  read: Callable[[str, int, bool], tuple[list[ToolCall] | None, int] | None]
                  ) -> tuple[list[str | ToolCall], int]:
    """Text with calls that start at ``opener``; ``read(text, after_opener, final)`` gives the calls (``None``:
    not calls, the text stays content) and where they end, or ``None`` while they may still be incomplete."""
    while True:
        start = text.find(opener, pos)
        if start < 0:
            end = len(text) if final else len(text) - _partial_suffix(text, pos, opener)
            if end > pos:
                pieces.append(text[pos:end])
            return pieces, max(pos, end)
        if start > pos:
            pieces.append(text[pos:start])
        got = read(text, start + len(opener), final)
        if got is None:
            return pieces, start
        calls, end = got
        if calls is None:
            pieces.append(text[start:end])
        else:
            pieces.extend(calls)
        pos = end


def _json_list(text: str, pos: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
    """A JSON array (or one object) of calls at ``pos``."""
    pos = _skip_ws(text, pos)
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return (None, len(text)) if final else None
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(x) for x in items]
    if not items or any(c is None for c in calls):
        return None, end
    return [c for c in calls if c is not None], end


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _read(self, text: str, pos: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
        close = text.find(self.CLOSE, pos)
        if close < 0 and not final:
            return None
        body, end = (text[pos:], len(text)) if close < 0 else (text[pos:close], close + len(self.CLOSE))
        try:
            call = _as_call(json.loads(body))
        except ValueError:
            call = None
        return ([call] if call is not None else None), end

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        return _scan_markers(text, final, 0, [], self.OPEN, self._read)

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(f"{self.OPEN}\n" + json.dumps({"name": c.name, "arguments": json.loads(c.arguments)},
                                                        ensure_ascii=False) + f"\n{self.CLOSE}" for c in calls)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``; a bare array of calls at the start counts too."""

    name = "mistral"
    OPEN = "[TOOL_CALLS]"

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        lead = _skip_ws(text, 0)
        pieces: list[str | ToolCall] = [text[:lead]] if lead else []
        pos = 0
        if text.startswith("[", lead) and not text.startswith(self.OPEN, lead):
            got = _json_list(text, lead, final)
            if got is None:
                return pieces, lead
            calls, end = got
            if calls is not None:
                pieces.extend(calls)
                pos = end
        return _scan_markers(text, final, pos, pieces if pos else [], self.OPEN, _json_list)

    def render(self, calls: Sequence[ToolCall]) -> str:
        return self.OPEN + json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls],
                                      ensure_ascii=False)

    def new_id(self) -> str:
        # Mistral's templates refuse any id but 9 letters and digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class Llama3Parser(ToolCallParser):
    """The whole output is ``{"name": ..., "parameters": {...}}`` (``;``-separated for several), possibly after
    ``<|python_tag|>``; otherwise it is all content."""

    name = "llama3"
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        lead = _skip_ws(text, 0)
        rest = text[lead:]
        pieces: list[str | ToolCall] = [text[:lead]] if lead else []
        if rest.startswith(self.TAG):
            pos = lead + len(self.TAG)
        elif rest.startswith("{"):
            pos = lead
        elif not final and self.TAG.startswith(rest):  # nothing yet, or the beginning of the tag
            return pieces, lead
        else:
            return ([text] if text else []), len(text)
        if not final:
            return pieces, lead  # a call, or not, is known only from the whole output
        calls: list[ToolCall] = []
        while True:
            pos = _skip_ws(text, pos)
            try:
                value, pos = _DECODER.raw_decode(text, pos)
            except ValueError:
                return [text], len(text)
            call = _as_call(value)
            if call is None:
                return [text], len(text)
            calls.append(call)
            pos = _skip_ws(text, pos)
            if pos == len(text):
                return [*pieces, *calls], len(text)
            if text[pos] != ";":
                return [text], len(text)
            pos += 1

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": json.loads(c.arguments)}, ensure_ascii=False)
                         for c in calls)


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3Parser, MistralParser)}


def make_parser(name: str) -> ToolCallParser | None:
    """The parser called ``name`` (``"none"``: ``None``); an unknown name raises listing the known ones."""
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r} is not one of {', '.join([*PARSERS, 'none'])}; pick one of them")
    return PARSERS[name]()


def parser_for_template(template: str | None) -> ToolCallParser | None:
    """The parser of the format a chat template writes tool calls in (``None``: it writes none we know)."""
    if not template:
        return None
    if HermesParser.OPEN in template:
        return HermesParser()
    if MistralParser.OPEN in template:
        return MistralParser()
    if Llama3Parser.TAG in template or ('"parameters"' in template and "ipython" in template):
        return Llama3Parser()
    return None


def required_schema(functions: Sequence[tuple[str, dict[str, Any] | None]], *, parallel: bool = True
                    ) -> dict[str, Any]:
    """The JSON schema of ``tool_choice="required"``: an array of ``{"name", "arguments"}`` objects, each one of
    ``functions`` (``(name, parameters schema)``) with its own arguments; at most one item unless ``parallel``."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "arguments": params or {"type": "object", "properties": {}}},
              "required": ["name", "arguments"], "additionalProperties": False} for name, params in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _scan_required(text: str, final: bool) -> tuple[list[str | ToolCall], int]:
    """The output of ``tool_choice="required"``: a JSON array of calls; each call is decided once its object is
    complete; text that is not one (an output cut by ``max_tokens``) stays content."""
    lead = _skip_ws(text, 0)
    if lead == len(text):
        return ([text] if final and text else []), (len(text) if final else 0)
    if text[lead] != "[":
        return [text], len(text)
    pieces: list[str | ToolCall] = []
    pos = lead + 1
    while True:
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == "]":
            return ([*pieces, text[pos + 1:]] if pieces else [text]), len(text)  # no calls: all of it is content
        try:
            value, end = _DECODER.raw_decode(text, pos)
            call = _as_call(value)
        except ValueError:
            call = None
        if call is None:
            if not final:
                return pieces, pos if pieces else 0
            return [*pieces, text[pos if pieces else 0:]], len(text)
        pieces.append(call)
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos += 1


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """How one chat request's output becomes a message (from its ``tool_choice``).

    Args:
        kind: ``"text"``: all content; ``"auto"``: ``parser`` finds the calls; ``"named"``: the whole output is
            the arguments of ``function``; ``"required"``: the whole output is a JSON array of calls.
        parser: the model's format: finds the calls of ``"auto"``, and makes every kind's call ids (Mistral's
            templates take only their own).
        function: the function called (``"named"``).
    """

    kind: Literal["text", "auto", "named", "required"] = "text"
    parser: ToolCallParser | None = None
    function: str | None = None

    def new_id(self) -> str:
        return self.parser.new_id() if self.parser is not None else "call_" + secrets.token_hex(12)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished output as ``(content, calls)``."""
        if self.kind == "named":
            assert self.function is not None
            return "", [ToolCall(self.function, text)]
        if self.kind == "required":
            return _visible(_scan_required(text, True)[0], final=True)
        if self.kind == "auto" and self.parser is not None:
            return self.parser.parse(text)
        return text, []

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        if self.kind == "required":
            return _scan_required(text, final)
        if self.kind == "auto" and self.parser is not None:
            return self.parser.scan(text, final)
        return [text], len(text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One choice's text deltas as OpenAI's chat deltas (see the module docstring).

    Example:
        >>> s = ToolOutput("auto", HermesParser()).stream()
        >>> s.feed("hi <tool_")
        [{'content': 'hi '}]
        >>> [d["tool_calls"][0]["function"] for d in s.feed('call>{"name": "f", "arguments": {}}</tool_call>')]
        [{'name': 'f', 'arguments': ''}, {'arguments': '{}'}]
    """

    def __init__(self, output: ToolOutput):
        self.output = output
        self.text = ""
        self._content_sent = 0
        self.calls: list[ToolCall] = []
        self._ids: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def _call_deltas(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self._ids)
        self._ids.append(self.output.new_id())
        self.calls.append(call)
        head = {"tool_calls": [{"index": index, "id": self._ids[-1], "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}
        return [head] + ([{"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
                         if call.arguments else [])

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas ``delta`` (the next text) lets out; ``final``: it is the last."""
        self.text += delta
        if self.output.kind == "named":
            assert self.output.function is not None
            head = [] if self.called else self._call_deltas(ToolCall(self.output.function, ""))
            return head + ([{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else [])
        if self.output.kind == "text" or (self.output.kind == "auto" and self.output.parser is None):
            return [{"content": delta}] if delta else []
        content, calls = _visible(self.output.scan(self.text, final)[0], final)
        out: list[dict[str, Any]] = []
        # Content is sent as it is decided, in order with the calls around it: what was decided before a call is
        # a prefix of the content (the text between calls is whitespace, dropped, or part of the content).
        if len(content) > self._content_sent:
            out.append({"content": content[self._content_sent:]})
            self._content_sent = len(content)
        for call in calls[len(self.calls):]:
            out.extend(self._call_deltas(call))
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back at the end of the output."""
        if self.output.kind == "named" and not self.called:
            return self.feed("")
        return self.feed("", final=True) if self.output.kind in ("auto", "required") else []
