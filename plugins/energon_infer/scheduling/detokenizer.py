"""One request's text, decoded a few tokens at a time.

The scheduler keeps one :class:`IncrementalDetokenizer` per request (its stop-string rule reads the
text) and the frontend (:mod:`energon_infer.engine.delivery`) streams from the same text, so each token is
decoded once, over a window of a few tokens, instead of the whole output twice per token (the cost
was quadratic in the output length). A leaf module: both sides import it, neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """The text of one request's tokens, decoded incrementally.

    Each :meth:`add` decodes a short window: the tokens since the last settled point plus the ones
    before it (``prefix``), so tokenizers that drop a leading space or merge bytes across tokens
    still yield the text a full decode would. Text that ends in an incomplete UTF-8 character
    (``U+FFFD``) waits for the next token.

        >>> d = IncrementalDetokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
        >>> [d.add(t) for t in "h\u00e9".encode()], d.text
        (['h', '', 'é'], 'hé')
    """

    __slots__ = ("decode", "tokens", "text", "prefix", "read")

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""  # every settled character so far
        self.prefix = 0  # the window starts here; tokens before it are never decoded again
        self.read = 0  # tokens whose text is in ``text``

    def add(self, token: int) -> str:
        """Append a token; returns the text it settled (possibly empty)."""
        self.tokens.append(int(token))
        before = self.decode(self.tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self.decode(self.tokens[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return ""  # an incomplete character, or nothing new yet: wait for the next token
        new = after[len(before):]
        self.text += new
        self.prefix, self.read = self.read, len(self.tokens)
        return new

    def finish(self) -> str:
        """Settle what is left (an incomplete character becomes ``U+FFFD``); returns the whole text."""
        if self.read < len(self.tokens):
            before = self.decode(self.tokens[self.prefix:self.read]) if self.read > self.prefix else ""
            after = self.decode(self.tokens[self.prefix:])
            # A tokenizer that revised earlier text: fall back to one full decode.
            self.text = self.text + after[len(before):] if after.startswith(before) else self.decode(self.tokens)
            self.prefix = self.read = len(self.tokens)
        return self.text
