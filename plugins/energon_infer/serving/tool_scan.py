"""The pieces the tool-call parsers are built from: a call's head, its arguments as they are written, and the
content around calls.

A parser reads the whole text decoded so far, every time (:meth:`ToolCallParser.scan`), and says what is decided:
text that is content whatever follows, calls that are complete, and at most one call still being written
(:class:`OpenCall`: its name, and the arguments written so far). Every answer is a function of the text alone, and
what one prefix of an output decides, a longer prefix decides too (the open call's arguments only grow), so a
stream that sends the difference between two answers sends, put together, exactly the answer for the whole output,
however the output was cut into deltas.

A call is decided from its head: ``{"name": "<name>", "arguments":`` (or ``"parameters"``), in that order. From
there on it is a call, and the arguments are the JSON value's text as the model writes it (an object or array is
sent as it grows; a string, JSON text of the arguments, once it is complete, decoded). A block whose head reads
otherwise (keys in another order, not JSON) is decided once it is complete: a call if it parses as one, else
content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "OpenCall", "MAYBE", "skip_ws", "partial_suffix", "to_marker", "as_call", "match_head", "read_call",
           "read_tail", "visible"]

MAYBE = -1  # the text ends before it can be told
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_SCALAR_END = re.compile(r"[\s,}\]]")
_KEYS = ('"arguments"', '"parameters"')


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class OpenCall:
    """A call whose head is written and whose arguments are not finished: ``arguments`` is what is decided of
    them so far (a prefix of the arguments the finished call will have)."""

    name: str
    arguments: str


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def partial_suffix(text: str, pos: int, marker: str) -> int:
    """How many characters at the end of ``text[pos:]`` could be the beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def to_marker(text: str, pos: int, marker: str, final: bool, pieces: list[Any]) -> tuple[int, int]:
    """Content from ``pos`` up to the next ``marker`` appended to ``pieces``: ``(where the marker starts, -1 if
    none, where the text read ends)``; without a marker, a tail that could begin one is held back unless ``final``."""
    start = text.find(marker, pos)
    if start < 0:
        end = len(text) if final else len(text) - partial_suffix(text, pos, marker)
        if end > pos:
            pieces.append(text[pos:end])
        return -1, max(pos, end)
    if start > pos:
        pieces.append(text[pos:start])
    return start, start


def as_call(obj: Any) -> ToolCall | None:
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


def _expect(text: str, pos: int, options: Sequence[str]) -> int | None:
    """After whitespace, the end of whichever of ``options`` is at ``pos``; ``MAYBE``; ``None``: none of them."""
    pos = skip_ws(text, pos)
    if pos == len(text):
        return MAYBE
    for o in options:
        if text.startswith(o, pos):
            return pos + len(o)
    rest = text[pos:]
    return MAYBE if any(len(rest) < len(o) and o.startswith(rest) for o in options) else None


def match_head(text: str, pos: int) -> tuple[str, int] | int | None:
    """``{"name": "<name>", "arguments":`` at ``pos`` (whitespace allowed between): ``(name, where the value
    starts)``; ``MAYBE`` while the text may still become one; ``None`` when it cannot."""
    p = pos
    for options in (("{",), ('"name"',), (":",)):
        got = _expect(text, p, options)
        if got is None or got == MAYBE:
            return got
        p = got
    p = skip_ws(text, p)
    if p == len(text):
        return MAYBE
    if text[p] != '"':
        return None
    m = _STRING.match(text, p)
    if m is None:
        return MAYBE
    try:
        name = json.loads(m.group())
    except ValueError:
        return None
    if not name:
        return None
    p = m.end()
    for after_name in ((",",), _KEYS, (":",)):
        got = _expect(text, p, after_name)
        if got is None or got == MAYBE:
            return got
        p = got
    return name, p


def _scan_value(text: str, start: int, stop: str | None) -> tuple[int | None, int]:
    """The JSON value at ``start``: ``(end, sendable)``; ``end`` is ``None`` while it is not finished, and
    ``sendable`` how far its text can go out now (an object or array as it grows; a string or number only whole).
    ``stop`` (the format's next marker) ends a value that the model did not close before writing it."""
    if start >= len(text):
        return None, start
    c = text[start]
    if c == '"':
        m = _STRING.match(text, start)
        return (m.end(), m.end()) if m else (None, start)
    if c not in "{[":
        m = _SCALAR_END.search(text, start)
        if stop is not None:
            cut = text.find(stop[0], start)
            if cut >= 0 and (m is None or cut < m.start()):
                return cut, cut
        return (m.start(), m.start()) if m else (None, start)
    interesting = re.compile('["{}\\[\\]' + (re.escape(stop[0]) if stop else "") + "]")
    depth, i = 0, start
    while True:
        m = interesting.search(text, i)
        if m is None:
            return None, len(text)
        i, ch = m.start(), m.group()
        if stop is not None and ch == stop[0]:
            if text.startswith(stop, i):
                return i, i
            if len(text) - i < len(stop) and stop.startswith(text[i:]):
                return None, i  # maybe the marker: held back until the next text tells
        if ch == '"':
            s = _STRING.match(text, i)
            if s is None:
                return None, len(text)
            i = s.end()
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, i + 1
        i += 1


def read_call(text: str, name: str, pos: int, stop: str | None, final: bool
              ) -> tuple[ToolCall | OpenCall, int | None]:
    """The call named ``name`` whose arguments start at ``pos``, and where they end (``None``: not yet).
    A finished output's unfinished arguments are what was written (as OpenAI returns a call cut by its limit)."""
    start = skip_ws(text, pos)
    end, sendable = _scan_value(text, start, stop)
    if end is not None:
        raw = text[start:end]
        if raw.startswith('"'):  # the arguments as JSON text in a string
            try:
                raw = json.loads(raw)
            except ValueError:
                pass
        return ToolCall(name, raw), end
    if final:
        return ToolCall(name, text[start:]), len(text)
    return OpenCall(name, text[start:sendable] if sendable > start else ""), None


def read_tail(text: str, pos: int, closers: Sequence[str], final: bool) -> int | None:
    """After a call's arguments: the end of the object around them (``}``) and of a closing marker, if there;
    ``None`` while the text may still be writing them."""
    pos = skip_ws(text, pos)
    if pos < len(text) and text[pos] == "}":
        pos = skip_ws(text, pos + 1)
    for closer in closers:
        if text.startswith(closer, pos):
            return pos + len(closer)
    if not final and any(closer.startswith(text[pos:]) for closer in closers):
        return None
    if not final and not closers and pos == len(text):
        return None
    return pos


def visible(pieces: Sequence[str | ToolCall | OpenCall], final: bool
            ) -> tuple[str, list[ToolCall | OpenCall]]:
    """The content and calls of scanned pieces. With calls, whitespace-only text between and around them is
    dropped; text at the end that is only whitespace is held back until the end (a call may follow)."""
    out: list[str] = []
    calls: list[ToolCall | OpenCall] = []
    buf = ""
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
