"""A choice's output as OpenAI's streamed chat deltas, and its text decoded with the tool-call markers kept.

:class:`ToolCallStream` sends what OpenAI and vLLM send: content as it is decided, and for each call a first delta
with ``index``, ``id``, ``type`` and ``function.name`` (``arguments`` ``""``), then ``function.arguments`` in
fragments as the model writes them; parallel calls get increasing indexes. It re-reads the text decoded so far at
each delta and sends what became decided since the last one (the parsers' contract in
:mod:`~energon_infer.serving.tool_scan`), so the deltas put together equal the answer without streaming, however
the text was cut, and nothing of a call's markup reaches the content.

:class:`MarkerText` is for tokenizers whose markers are special tokens (Qwen 2.5/3's ``<tool_call>``, Mistral's
``[TOOL_CALLS]``): decoding drops special tokens, so the parser reads a decode that keeps those markers (and still
drops every other special token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from energon_infer.scheduling.detokenizer import IncrementalDetokenizer
from energon_infer.serving.tool_scan import OpenCall, ToolCall, visible

if TYPE_CHECKING:
    from energon_infer.serving.tool_calls import ToolOutput

__all__ = ["ToolCallStream", "MarkerText", "special_markers"]


class ToolCallStream:
    """One choice's text deltas as OpenAI's chat deltas (see the module docstring).

    Example:
        >>> from energon_infer.serving.tool_calls import HermesParser, ToolOutput
        >>> s = ToolOutput("auto", HermesParser()).stream()
        >>> s.feed("hi <tool_")
        [{'content': 'hi '}]
        >>> [d["tool_calls"][0]["function"] for d in s.feed('call>{"name": "f", "arguments": {"a"')]
        [{'name': 'f', 'arguments': ''}, {'arguments': '{"a"'}]
        >>> [d["tool_calls"][0]["function"] for d in s.feed(': 1}}</tool_call>')]
        [{'arguments': ': 1}'}]
    """

    def __init__(self, output: ToolOutput):
        self.output = output
        self.text = ""
        self._content_sent = 0
        self._args_sent: list[str] = []  # each call's arguments sent so far
        self._ids: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def _call_deltas(self, index: int, call: ToolCall | OpenCall) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if index == len(self._ids):
            self._ids.append(self.output.new_id())
            self._args_sent.append("")
            out.append({"tool_calls": [{"index": index, "id": self._ids[-1], "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        sent = self._args_sent[index]
        if len(call.arguments) > len(sent):  # the parsers only ever add to a call's arguments
            out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[len(sent):]}}]})
            self._args_sent[index] = call.arguments
        return out

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas ``delta`` (the next text) lets out; ``final``: it is the last."""
        self.text += delta
        if self.output.kind == "named":
            assert self.output.function is not None
            head = [] if self.called else self._call_deltas(0, OpenCall(self.output.function, ""))
            return head + ([{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else [])
        if self.output.kind == "text" or (self.output.kind == "auto" and self.output.parser is None):
            return [{"content": delta}] if delta else []
        content, calls = visible(self.output.scan(self.text, final)[0], final)
        out: list[dict[str, Any]] = []
        # Content is sent as it is decided: what was decided before a call is a prefix of the content (the text
        # between calls is whitespace, dropped, or part of the content).
        if len(content) > self._content_sent:
            out.append({"content": content[self._content_sent:]})
            self._content_sent = len(content)
        for index, call in enumerate(calls):
            out.extend(self._call_deltas(index, call))
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back at the end of the output."""
        if self.output.kind == "named" and not self.called:
            return self.feed("")
        return self.feed("", final=True) if self.output.kind in ("auto", "required") else []


def special_markers(tokenizer: Any, decode: Callable[[list[int]], str], markers: Iterable[str]
                    ) -> dict[int, str]:
    """The ``markers`` that are single tokens of ``tokenizer`` which ``decode`` drops (special tokens), by id."""
    vocab_of = getattr(getattr(tokenizer, "hf", tokenizer), "get_vocab", None)
    if vocab_of is None:
        return {}
    vocab = vocab_of()
    found = {vocab[m]: m for m in markers if m in vocab}
    return {i: m for i, m in found.items() if decode([i]) == ""}


class MarkerText:
    """``decode`` keeping the ``special`` marker tokens (id -> text): the runs between them are decoded as usual.

    Example:
        >>> keep = MarkerText(lambda ids: "".join(chr(i) for i in ids if i < 1000), {1000: "<m>"})
        >>> keep([104, 1000, 105, 1001])
        'h<m>i'
    """

    def __init__(self, decode: Callable[[list[int]], str], special: dict[int, str]):
        self.decode, self.special = decode, special

    def __call__(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special:
                out.append(self.decode(run) if run else "")
                out.append(self.special[i])
                run = []
            else:
                run.append(i)
        if run:
            out.append(self.decode(run))
        return "".join(out)

    def incremental(self) -> IncrementalDetokenizer:
        """A decoder of one output token by token (what a stream reads)."""
        return IncrementalDetokenizer(self)
