"""Structured outputs: what a request's output must match, enforced by grammar-constrained decoding (xgrammar).

A :class:`StructuredOutput` on :class:`~energon_infer.sampling.SamplingParams` (``structured=``) names one
constraint: a JSON schema, any JSON object, a regular expression, a choice among strings, or an EBNF grammar (as
xgrammar takes it). The engine checks it before admitting the request (:func:`prepare`: its grammar built without
the vocabulary, once per ``(kind, canonical text)``: :class:`CheckCache`), so a constraint that cannot be built is a
400 naming its schema path; the rank that samples compiles it for the model's vocabulary (:data:`ON_RANK`: the only
compile), on its grammar thread while the engine holds the request out of the batch
(:mod:`energon_infer.scheduling.grammar_wait`), and keeps one
matcher per request (:class:`energon_infer.worker.grammar.GrammarMasks`): before each draw the tokens the grammar cannot take next are set to
``-inf``, each sampled token advances the matcher, the EOS is allowed only where the grammar may end, and a
grammar that has ended ends the request (``finish_reason="stop"``).

Example:
    >>> StructuredOutput(choice=("yes", "no")).kind
    'choice'
    >>> StructuredOutput(json_schema={"type": "object"}, regex="a+")
    Traceback (most recent call last):
    ...
    ValueError: StructuredOutput sets json_schema, regex: set exactly one of json_schema, json_object, regex, choice, grammar
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from energon_infer.errors import BadInputError

__all__ = ["StructuredOutput", "StructuredOutputError", "KINDS", "ON_RANK", "REFUSED", "CHECKS", "CheckCache", "check",
           "compile_grammar", "compiles", "prepare", "tokenizer_info"]

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
#: :attr:`StructuredOutput.compiled` of a constraint the engine checked, which the rank that samples compiles (the
#: engine compiles nothing: xgrammar's JSON of a compiled grammar serialises and deserialises several times slower
#: than the grammar compiles, so the request carries the constraint only).
ON_RANK = "<rank>"
#: How the error of a request whose constraint the rank could not compile begins (the server answers it with a 400).
REFUSED = "structured output refused: "


class StructuredOutputError(BadInputError, ValueError):
    """A constraint that cannot be compiled (an invalid or unsupported schema, regex or grammar)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutput:
    """One constraint on a request's output; exactly one field is set.

    Args:
        json_schema: the output is JSON valid against this JSON schema (a dict).
        json_object: the output is any JSON object.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar (xgrammar's GBNF dialect, ``root ::= ...``).
        strict: with ``json_schema``: properties not listed are refused unless the schema allows them
            (``additionalProperties``); ``False`` lets the model add any (OpenAI's ``strict``).
        compiled: set by the engine: :data:`ON_RANK` once it checked (the rank that samples compiles it); or the
            grammar compiled for the model's vocabulary (xgrammar's JSON), which the request carries to the rank that
            samples; not part of the constraint's identity.

    The constraint is immutable (its ``json_schema`` dict is not to be changed once given): its :attr:`key` is
    computed once and travels with it.
    """

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool = True
    compiled: str | None = field(default=None, repr=False)
    _key: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput sets {', '.join(given) or 'nothing'}: set exactly one of "
                             f"{', '.join(KINDS)}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema={self.json_schema!r} must be a JSON schema object (a dict)")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"regex={self.regex!r} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"choice={self.choice!r} must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"grammar={self.grammar!r} must be a non-empty EBNF grammar (root ::= ...)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: equal constraints have equal keys (the compile cache's key). Computed once
        (a large schema's canonical text takes milliseconds; the server, the scheduler and the rank each look it up)."""
        if self._key is None:
            object.__setattr__(self, "_key", self._canonical_key())
        return self._key  # type: ignore[return-value]

    def _canonical_key(self) -> tuple[str, str]:
        kind = self.kind
        if kind == "json_schema":
            return kind, json.dumps({"schema": _canonical(self.json_schema), "strict": self.strict},
                                    separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()))
        return kind, str(self.regex if kind == "regex" else self.grammar)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutput) and self.key == other.key

    def __hash__(self) -> int:  # json_schema is a dict: hash the canonical text
        return hash(self.key)

    def to_json(self) -> str:
        """The constraint as JSON text (how it travels; :meth:`from_json` reads it back)."""
        kind, _ = self.key
        value: Any = {"json_schema": self.json_schema, "json_object": True, "regex": self.regex,
                      "choice": list(self.choice or ()), "grammar": self.grammar}[kind]
        return json.dumps({kind: value, "strict": self.strict})

    @classmethod
    def from_json(cls, text: str) -> StructuredOutput:
        d = json.loads(text)
        if "choice" in d:
            d["choice"] = tuple(d["choice"])
        return cls(**d)

    def as_grammar_source(self) -> tuple[str, str]:
        """``(kind, text)`` for the compiler: a choice becomes an EBNF grammar of its literal alternatives."""
        kind, text = self.key
        if kind == "choice":
            return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in (self.choice or ()))
        return kind, text


def _canonical(node: Any, names: bool = False) -> Any:
    """A schema with its keys sorted except the property names of a ``properties`` map (``names``), whose order
    is the order the output writes them in."""
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    if not isinstance(node, dict):
        return node
    items = node.items() if names else sorted(node.items())
    return {k: _canonical(v, names=not names and k == "properties") for k, v in items}


# ---------------------------------------------------------------------- compiling (xgrammar, imported lazily)


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - xgrammar is in the serve extra
        raise ImportError("structured outputs need xgrammar: pip install 'xgrammar==0.2.9' (or tightfit[serve])") \
            from None
    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of ``tokenizer`` for a model whose logits are ``vocab_size`` wide (often more ids than the
    tokenizer has: the extra ids are never allowed) and which stops at ``stop_token_ids``.

    ``tokenizer``: a ``tokenizers.Tokenizer``, a transformers tokenizer, or the engine's wrapper of one."""
    xgr = import_xgrammar()
    hf = getattr(tokenizer, "hf", tokenizer)  # energon's HFTokenizer wraps a transformers tokenizer
    if not hasattr(hf, "convert_ids_to_tokens"):  # a bare tokenizers.Tokenizer
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=hf)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


def check(structured: StructuredOutput) -> None:
    """Raise :class:`StructuredOutputError` (the schema path and the rule) if ``structured`` cannot be compiled.

    Builds the grammar only (no vocabulary: milliseconds), so a server refuses a bad schema before any work."""
    xgr = import_xgrammar()
    kind, text = structured.as_grammar_source()
    try:
        if kind in ("json_schema", "json_object"):
            json_grammar(structured)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses with its own message
        where = ""
        if kind == "json_schema" and isinstance(structured.json_schema, dict):
            where = f" at {_failing_path(structured.json_schema, structured.strict)}"
        raise StructuredOutputError(f"{kind}{where} cannot be compiled: {_one_line(exc)}; fix or remove it "
                                    "(supported: docs/serving.md, Structured outputs)") from None


_SUB_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "additionalItems", "if", "then",
            "else", "unevaluatedProperties", "unevaluatedItems")
_SUB_MAP = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def _failing_path(schema: dict[str, Any], strict: bool) -> str:
    """The JSON pointer (``#/properties/a/items``) of the deepest subschema that fails to compile on its own
    (with the root's ``$defs`` / ``definitions`` beside it, so its ``$ref`` resolve); ``#`` for the root."""
    xgr = import_xgrammar()
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}

    def fails(sub: Any) -> bool:
        if not isinstance(sub, dict):
            return not isinstance(sub, bool)
        try:
            xgr.Grammar.from_json_schema(json.dumps({**defs, **sub}), any_whitespace=False, strict_mode=strict)
        except Exception:
            return True
        return False

    def children(node: dict[str, Any]) -> list[tuple[str, Any]]:
        out = [(k, node[k]) for k in _SUB_ONE if k in node]
        out += [(f"{k}/{_pointer(name)}", sub) for k in _SUB_MAP if isinstance(node.get(k), dict)
                for name, sub in node[k].items()]
        out += [(f"{k}/{i}", sub) for k in _SUB_LIST if isinstance(node.get(k), list) for i, sub in enumerate(node[k])]
        return out

    path, node = "#", schema
    for _ in range(64):  # deep enough for any schema a request carries
        bad = next(((p, sub) for p, sub in children(node) if fails(sub)), None)
        if bad is None or not isinstance(bad[1], dict):
            return path + (f"/{bad[0]}" if bad is not None else "")
        path, node = f"{path}/{bad[0]}", bad[1]
    return path


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def json_grammar(structured: StructuredOutput) -> str:
    """The EBNF grammar of a ``json_schema`` / ``json_object`` constraint: compact JSON (``", "`` and ``": "``
    between items, no other whitespace: a model cannot spend its tokens on whitespace), the properties in the
    schema's order (a tool call's ``name`` before its ``arguments``: the call is decided early), whose strings hold
    no raw control character (xgrammar 0.2.9's rule for a string with ``maxLength`` lets U+0000-U+001F through,
    which JSON forbids and strict parsers such as Pydantic's refuse), no surrogate's bytes (not UTF-8) and no
    ``\\u`` escape of a lone surrogate (U+D800-U+DFFF outside a high-low pair: Pydantic refuses it too)."""
    schema = structured.json_schema if structured.json_schema is not None else {"type": "object"}
    ebnf = str(import_xgrammar().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                          strict_mode=structured.strict))
    for plain, strict in _STRING_CHARACTERS:
        ebnf = ebnf.replace(plain, strict)
    return ebnf.replace(_ANY_ESCAPE, _PAIRED_ESCAPE)


#: xgrammar's classes of a JSON string's characters, and what energon allows: no control character, and no
#: surrogate code point (U+D800-U+DFFF, which xgrammar reads from the 3 bytes that would encode one: not UTF-8, so
#: the text decodes to 3 replacement characters, breaking a ``maxLength`` and any strict parser).
_STRING_CHARACTERS = ((r"[^\"\\\r\n]", r"[^\"\\\0-\x1f\uD800-\uDFFF]"),
                      (r"[^\0-\x1f\"\\\r\n]", r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"))
_HEX = "[A-Fa-f0-9]"
_ANY_ESCAPE = f'("u" {_HEX} {_HEX} {_HEX} {_HEX})'
#: ``\\u`` escapes of a code point outside the surrogates, or of a high surrogate followed by a low one.
_PAIRED_ESCAPE = (f'("u" [0-9A-Ca-cE-Fe-f] {_HEX} {_HEX} {_HEX}) | ("u" [Dd] [0-7] {_HEX} {_HEX}) | '
                  f'("u" [Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] {_HEX} {_HEX})')


def compile_grammar(compiler: Any, structured: StructuredOutput) -> Any:
    """``structured`` compiled by an xgrammar ``GrammarCompiler`` (raises StructuredOutputError)."""
    kind, text = structured.as_grammar_source()
    with _COMPILES_LOCK:
        _COMPILES[0] += 1
    try:
        if kind in ("json_schema", "json_object"):
            return compiler.compile_grammar(json_grammar(structured))
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)
    except Exception as exc:
        check(structured)  # raises with the schema path where the grammar itself is wrong
        raise StructuredOutputError(f"{kind} cannot be compiled: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = re.sub(r"\[[0-9:]+\] \S+\.cc:\d+: ", "", str(exc))  # xgrammar's "[time] file.cc:line: " prefix
    return " ".join(text.split())[:500] or type(exc).__name__


class CheckCache:
    """The outcome of :func:`check` by ``(kind, canonical text)`` (the least recently used dropped past ``size``):
    a schema a server sees again is not built again, a bad one is refused again from its message.

    Args:
        size: outcomes kept.
    """

    def __init__(self, size: int = 1024):
        self._lru: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # None: it builds
        self._lock = threading.Lock()
        self.size = size
        self.checks = 0  # grammars built (a hit builds none)

    def check(self, structured: StructuredOutput) -> None:
        """:func:`check`, once per constraint (raises StructuredOutputError)."""
        key = structured.key
        with self._lock:
            known = key in self._lru
            why = self._lru.get(key)
            if known:
                self._lru.move_to_end(key)
        if not known:
            try:
                check(structured)
                why = None
            except StructuredOutputError as exc:
                why = str(exc)
            with self._lock:
                self.checks += 1
                self._lru[key] = why
                while len(self._lru) > self.size:
                    self._lru.popitem(last=False)
        if why is not None:
            raise StructuredOutputError(why)


CHECKS = CheckCache()  #: the process's :func:`check` outcomes (the server's and the engine's)


def compiles() -> int:
    """Grammars this process compiled for a vocabulary (:func:`compile_grammar`): none on the engine's side,
    which checks (:class:`CheckCache`) and leaves the compile to the rank that samples."""
    return _COMPILES[0]


def prepare(engine: Any, params: Any) -> Any:
    """``params`` (:class:`~energon_infer.sampling.SamplingParams`) ready to run on ``engine``: a structured output
    checked (:data:`CHECKS`: built once per constraint, without the vocabulary) and marked :data:`ON_RANK` (the
    rank that samples compiles it). Raises StructuredOutputError for a constraint that cannot be built, before the
    request is admitted."""
    so = params.structured
    if so is None or so.compiled is not None:
        return params
    if engine.tokenizer is None:
        raise StructuredOutputError("structured outputs need the model's tokenizer; put tokenizer.json in the model "
                                    "directory or pass tokenizer=...")
    CHECKS.check(so)
    marked = dataclasses.replace(so, compiled=ON_RANK)
    object.__setattr__(marked, "_key", so.key)  # the same constraint: its key is not computed again
    return dataclasses.replace(params, structured=marked)


_COMPILES = [0]
_COMPILES_LOCK = threading.Lock()
