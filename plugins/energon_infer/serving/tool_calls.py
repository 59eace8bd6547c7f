"""Tool calls in a model's output: one parser per format, chosen from the chat template, and OpenAI's shapes.

A model asked to call a tool writes the call in its own format, the one its chat template renders an
assistant's ``tool_calls`` in:

* ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call, anywhere in the text;
* ``llama3`` (Llama 3.1-3.3 JSON tool calling): the whole output is ``{"name": ..., "parameters": {...}}``,
  possibly after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (a JSON array of calls at the start of
  the output counts too), and from tokenizer v11 on (Mistral Small 3.x, Devstral) ``[TOOL_CALLS]name[ARGS]{...}``,
  one marker per call; both are read, and the template's ``[ARGS]`` picks the one :meth:`~ToolCallParser.render`
  writes.

:func:`parser_for_template` picks the parser whose markers the template writes (``tightfit serve
--tool-call-parser`` overrides it). Text that does not parse as a call stays the message's ``content``: nothing
the model wrote is lost. With calls, the whitespace between and around them is dropped. A call is a call from
its head on (``{"name": "f", "arguments":``, see :mod:`~energon_infer.serving.tool_scan`): one cut by
``max_tokens`` keeps the arguments written.

:class:`ToolOutput` is what one chat request asked for (``tool_choice``): ``auto`` parses the output with the
parser; a named function and ``required`` constrain decoding to JSON (:func:`required_schema`, the function's
``parameters``), so their arguments always validate; ``none`` (and a model without a parser) keeps the text.
:class:`~energon_infer.serving.tool_stream.ToolCallStream` turns one choice's text deltas into OpenAI's streamed
deltas.

Example:
    >>> content, calls = HermesParser().parse('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    >>> content, calls
    ('ok ', [ToolCall(name='f', arguments='{"x": 1}')])
"""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from energon_infer.serving.tool_scan import (
    MAYBE,
    OpenCall,
    ToolCall,
    as_call,
    match_head,
    read_call,
    read_tail,
    skip_ws,
    to_marker,
    visible,
)
from energon_infer.serving.tool_stream import ToolCallStream, special_markers

__all__ = ["ToolCall", "ToolCallParser", "HermesParser", "Llama3Parser", "MistralParser", "PARSERS",
           "parser_for_template", "make_parser", "bind_tokenizer", "required_schema", "ToolOutput", "ToolCallStream"]

_DECODER = json.JSONDecoder()


class ToolCallParser(ABC):
    """One tool-call format. :meth:`scan` is the one method a format writes; :meth:`render` its inverse.

    ``special``: the format's markers that are special tokens of the served tokenizer (token id -> marker), which
    decoding drops; the server decodes the output keeping them (:func:`bind_tokenizer`)."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]

    def __init__(self) -> None:
        self.special: dict[int, str] = {}

    @abstractmethod
    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall | OpenCall], int]:
        """``(pieces, decided)``: the content and calls of ``text`` that are decided (``tool_scan``'s module
        docstring), the last call possibly still open, and how far the text is decided; ``final``: the output is
        complete, so everything is decided."""

    @abstractmethod
    def render(self, calls: Sequence[ToolCall]) -> str:
        """``calls`` as the model writes them (what :meth:`parse` reads back)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished output as ``(content, calls)``; content is ``""`` when only calls were written."""
        content, calls = visible(self.scan(text, True)[0], final=True)
        return content, [c for c in calls if isinstance(c, ToolCall)]  # a finished output has no open call

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)


Pieces = list[str | ToolCall | OpenCall]


def _json_list(text: str, pos: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
    """A whole JSON array (or one object) of calls at ``pos`` (``None`` in the list: not calls)."""
    pos = skip_ws(text, pos)
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return (None, len(text)) if final else None
    items = value if isinstance(value, list) else [value]
    calls = [as_call(x) for x in items]
    if not items or any(c is None for c in calls):
        return None, end
    return [c for c in calls if c is not None], end


def _read_array(text: str, mark: int, pos: int, final: bool, pieces: Pieces) -> int | None:
    """The calls of a JSON array whose ``[`` ends at ``pos``, appended to ``pieces``; where the text goes on after
    them (``None``: the array is not finished). An array whose first item does not open as a call is read whole:
    calls if it parses as calls, else content from ``mark`` (its marker) on; one that stops being calls leaves the
    rest to content."""
    first = True
    while True:
        p = skip_ws(text, pos)
        head = match_head(text, p)
        if head == MAYBE and not final:
            return None
        if not isinstance(head, tuple):
            if not first:
                return p
            got = _json_list(text, pos - 1, final)
            if got is None:
                return None
            calls, end = got
            pieces.extend(calls if calls is not None else [text[mark:end]])
            return end
        call, last = read_call(text, head[0], head[1], None, final)
        pieces.append(call)
        if last is None:
            return None
        q = skip_ws(text, last)
        q = skip_ws(text, q + 1) if text.startswith("}", q) else q
        if q == len(text):
            return q if final else None
        if text[q] != ",":
            return q + 1 if text[q] == "]" else q
        pos, first = q + 1, False


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def _whole(self, text: str, pos: int, final: bool) -> tuple[ToolCall | None, int] | None:
        """A block read whole once it is closed (or the output ended): a call if it parses as one."""
        close = text.find(self.CLOSE, pos)
        if close < 0 and not final:
            return None
        body, end = (text[pos:], len(text)) if close < 0 else (text[pos:close], close + len(self.CLOSE))
        try:
            return as_call(json.loads(body)), end
        except ValueError:
            return None, end

    def scan(self, text: str, final: bool) -> tuple[Pieces, int]:
        pieces: Pieces = []
        pos = 0
        while True:
            start, end = to_marker(text, pos, self.OPEN, final, pieces)
            if start < 0:
                return pieces, end
            body = start + len(self.OPEN)
            head = match_head(text, body)
            if head == MAYBE and not final:
                return pieces, start
            if isinstance(head, tuple):
                call, last = read_call(text, head[0], head[1], self.CLOSE, final)
                pieces.append(call)
                after = None if last is None else read_tail(text, last, (self.CLOSE,), final)
                if after is None:
                    return pieces, start
                pos = after
                continue
            got = self._whole(text, body, final)
            if got is None:
                return pieces, start
            whole, pos = got
            pieces.append(whole if whole is not None else text[start:pos])

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(f"{self.OPEN}\n" + json.dumps({"name": c.name, "arguments": json.loads(c.arguments)},
                                                        ensure_ascii=False) + f"\n{self.CLOSE}" for c in calls)


class MistralParser(ToolCallParser):
    """Mistral's two formats, both read whatever the template: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``
    (tokenizers before v11; a bare array of calls at the start counts too) and ``[TOOL_CALLS]name[ARGS]{...}``,
    one marker per call (v11 on: Mistral Small 3.x, Devstral; ``[CALL_ID]id`` before ``[ARGS]`` is skipped).

    Args:
        args_format: :meth:`render` writes the v11 format (the template writes ``[ARGS]``).
    """

    name = "mistral"
    OPEN, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (OPEN, ARGS, CALL_ID)
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def __init__(self, args_format: bool = False) -> None:
        super().__init__()
        self.args_format = args_format

    def _named(self, text: str, pos: int, final: bool) -> tuple[str, int] | int | None:
        """``name[ARGS]`` (or ``name[CALL_ID]id[ARGS]``) at ``pos``: ``(name, where the arguments start)``,
        ``MAYBE`` or ``None``."""
        m = self._NAME.match(text, pos)
        q = m.end() if m else pos
        rest = text[q:]
        if rest.startswith(self.CALL_ID):
            args = text.find(self.ARGS, q)
            if args < 0:
                return None if final else MAYBE
            rest, q = self.ARGS, args
        if m and rest.startswith(self.ARGS):
            return m.group(), q + len(self.ARGS)
        if not final and (self.ARGS.startswith(rest) or self.CALL_ID.startswith(rest)):
            return MAYBE
        return None

    def scan(self, text: str, final: bool) -> tuple[Pieces, int]:
        lead = skip_ws(text, 0)
        pieces: Pieces = [text[:lead]] if lead else []
        rest = text[lead:]
        if not final and len(rest) < len(self.OPEN) and self.OPEN.startswith(rest):
            return pieces, lead
        pos = 0
        if rest.startswith("[") and not rest.startswith(self.OPEN):  # the array, its marker dropped by decoding
            after = _read_array(text, lead, lead + 1, final, pieces)
            if after is None:
                return pieces, lead
            pos = after
        else:
            pieces = []
        while True:
            start, end = to_marker(text, pos, self.OPEN, final, pieces)
            if start < 0:
                return pieces, end
            body = skip_ws(text, start + len(self.OPEN))
            if body == len(text) and not final:
                return pieces, start
            if text.startswith("[", body):
                after = _read_array(text, start, body + 1, final, pieces)
            else:
                head = self._named(text, body, final)
                if head == MAYBE:
                    return pieces, start
                if head is None:  # not a call: the marker and what follows stay content
                    pieces.append(text[start:body])
                    pos = body
                    continue
                assert isinstance(head, tuple)
                call, after = read_call(text, head[0], head[1], self.OPEN, final)
                pieces.append(call)
            if after is None:
                return pieces, start
            pos = after

    def render(self, calls: Sequence[ToolCall]) -> str:
        if self.args_format:
            return "".join(f"{self.OPEN}{c.name}{self.ARGS}{c.arguments}" for c in calls)
        return self.OPEN + json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls],
                                      ensure_ascii=False)

    def new_id(self) -> str:
        # Mistral's templates refuse any id but 9 letters and digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class Llama3Parser(ToolCallParser):
    """The output is ``{"name": ..., "parameters": {...}}`` (``;``-separated for several), possibly after
    ``<|python_tag|>``; text after the calls stays content. An output that does not open with a call's head is
    read whole at the end: calls if it all parses as calls (keys in any order), else content."""

    name = "llama3"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def scan(self, text: str, final: bool) -> tuple[Pieces, int]:
        lead = skip_ws(text, 0)
        rest = text[lead:]
        pieces: Pieces = [text[:lead]] if lead else []
        if rest.startswith(self.TAG):
            pos = lead + len(self.TAG)
        elif rest.startswith("{"):
            pos = lead
        elif not final and self.TAG.startswith(rest):  # nothing yet, or the beginning of the tag
            return pieces, lead
        else:
            return ([text] if text else []), len(text)
        first = True
        while True:
            p = skip_ws(text, pos)
            head = match_head(text, p)
            if head == MAYBE and not final:
                return pieces, p
            if not isinstance(head, tuple):
                if not first:  # what follows the calls is content, from the separator on
                    pieces.append(text[pos - 1:])
                    return pieces, len(text)
                return (self._whole(text, pos, pieces) if final else pieces), (len(text) if final else lead)
            call, end = read_call(text, head[0], head[1], None, final)
            pieces.append(call)
            after = None if end is None else read_tail(text, end, (), final)
            if after is None:
                return pieces, p
            if after == len(text):
                return pieces, after
            if text[after] != ";":
                pieces.append(text[after:])
                return pieces, len(text)
            pos, first = after + 1, False

    def _whole(self, text: str, pos: int, lead: Pieces) -> Pieces:
        """A finished output that did not open with a head: calls if all of it parses as calls, else content."""
        calls: Pieces = []
        while True:
            pos = skip_ws(text, pos)
            try:
                value, pos = _DECODER.raw_decode(text, pos)
            except ValueError:
                return [text]
            call = as_call(value)
            if call is None:
                return [text]
            calls.append(call)
            pos = skip_ws(text, pos)
            if pos == len(text):
                return [*lead, *calls]
            if text[pos] != ";":
                return [text]
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
        return MistralParser(args_format=MistralParser.ARGS in template)
    if Llama3Parser.TAG in template or ('"parameters"' in template and "ipython" in template):
        return Llama3Parser()
    return None


def required_schema(functions: Sequence[tuple[str, dict[str, Any] | None]], *, parallel: bool = True
                    ) -> dict[str, Any]:
    """The JSON schema of ``tool_choice="required"``: an array of ``{"name", "arguments"}`` objects, each one of
    ``functions`` (``(name, parameters schema)``) with its own arguments; at most one item unless ``parallel``.
    The grammar writes ``name`` first (properties in the schema's order), so a call opens before its arguments."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "arguments": params or {"type": "object", "properties": {}}},
              "required": ["name", "arguments"], "additionalProperties": False} for name, params in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _scan_required(text: str, final: bool) -> tuple[Pieces, int]:
    """The output of ``tool_choice="required"``: a JSON array of ``{"name", "arguments"}`` objects. As in the
    formats' parsers, a call is a call from its head on and its arguments are sent as they are written (one cut by
    ``max_tokens`` keeps what was written); an item whose keys come in another order is a call once it is
    complete. Text that is not an array of calls (the output was cut before a call's head) stays content."""
    lead = skip_ws(text, 0)
    if lead == len(text):
        return ([text] if final and text else []), (len(text) if final else 0)
    if text[lead] != "[":
        return [text], len(text)
    pieces: Pieces = []
    pos = lead + 1
    while True:
        item = skip_ws(text, pos)
        if item < len(text) and text[item] == "]" and not pieces:
            return [text], len(text)  # no calls: all of it is content
        head = match_head(text, item)
        if head == MAYBE and not final:
            return pieces, item
        if isinstance(head, tuple):
            call, last = read_call(text, head[0], head[1], None, final)
            pieces.append(call)
            end = None if last is None else read_tail(text, last, (), final)
        else:
            try:
                value, end = _DECODER.raw_decode(text, item)
                whole = as_call(value)
            except ValueError:
                whole, end = None, None
            if whole is None:
                if not final:
                    return pieces, item
                return [*pieces, text[item if pieces else 0:]], len(text)
            pieces.append(whole)
        if end is None:
            return pieces, item
        pos = skip_ws(text, end)
        if pos == len(text) and not final:
            return pieces, pos
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos < len(text) or final:
            return [*pieces, text[pos + 1 if text.startswith("]", pos) else pos:]], len(text)


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
            content, calls = visible(_scan_required(text, True)[0], final=True)
            return content, [c for c in calls if isinstance(c, ToolCall)]
        if self.kind == "auto" and self.parser is not None:
            return self.parser.parse(text)
        return text, []

    def scan(self, text: str, final: bool) -> tuple[Pieces, int]:
        if self.kind == "required":
            return _scan_required(text, final)
        if self.kind == "auto" and self.parser is not None:
            return self.parser.scan(text, final)
        return [text], len(text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def bind_tokenizer(parser: ToolCallParser | None, engine: Any) -> ToolCallParser | None:
    """``parser``, told which of its markers are special tokens of ``engine``'s tokenizer (Qwen 2.5/3 mark
    ``<tool_call>`` so): the server then parses a decode of the output that keeps them."""
    if parser is not None and getattr(engine, "tokenizer", None) is not None:
        parser.special = special_markers(engine.tokenizer, engine.decode, parser.markers)
    return parser
