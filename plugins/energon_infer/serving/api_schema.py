"""The request bodies of the OpenAI-compatible server as pydantic models (FastAPI validates them; ``/docs``
shows them).

Everything a client sends is checked here, before anything reaches the engine or a worker: types are
strict (``"9"`` is not a number, ``true`` is not a token id), every number is finite and bounded,
strings with lone UTF-16 surrogates are refused (no tokenizer can encode them), and OpenAI fields this
server does not implement (``tools``, ``response_format``, ``logit_bias``...) get a 400 that names the
field instead of being ignored. Limits that depend on the server (``max_tokens``, prompts per request,
``n``) are checked by the server with its :class:`~energon_infer.serving.server.ServerConfig`.

Example:
    >>> CompletionRequest.model_validate({"prompt": "hi", "temperature": 0.7}).temperature
    0.7
    >>> from pydantic import ValidationError
    >>> try:
    ...     CompletionRequest.model_validate({"prompt": "hi", "temperature": 1e-40})
    ... except ValidationError as exc:
    ...     print(describe_errors(exc.errors()))
    ('temperature=1e-40 is below the minimum 0.01 for sampling; use 0 for greedy decoding', 'temperature')
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from energon_infer.sampling import MAX_LOGPROBS, MAX_TEMPERATURE, MIN_TEMPERATURE, SEED_MAX, SEED_MIN

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions", "TokenizeRequest",
           "DetokenizeRequest", "UNSUPPORTED",
           "describe_error", "describe_errors"]


def _no_surrogates(text: str) -> str:
    # A lone surrogate ("\ud800") survives json.loads but no UTF-8 tokenizer can encode it.
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            raise ValueError(f"the text has a lone UTF-16 surrogate (U+{ord(ch):04X}) at character {i}, which is "
                             "not valid Unicode; send valid UTF-8 text")
    return text


Text = Annotated[StrictStr, AfterValidator(_no_surrogates)]
TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 31) - 1)]
Finite = Annotated[float, Field(allow_inf_nan=False)]

# OpenAI fields this server does not implement, with the values that mean "not used" (those are accepted).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,),
}


class _Request(BaseModel):
    # strict: no coercion ("9" is not 9, true is not 1); extra fields (user, store, metadata...) are ignored
    # unless they are in UNSUPPORTED.
    model_config = ConfigDict(strict=True, extra="allow")

    model: Text | None = Field(None, description="the served model's id (see /v1/models); omitted: that one")
    temperature: Finite | None = Field(
        None, ge=0, le=MAX_TEMPERATURE,
        description=f"0: greedy; otherwise between {MIN_TEMPERATURE} and {MAX_TEMPERATURE:g} (smaller positive "
                    "values would turn the probabilities into NaN); default: generation_config.json's, else 1")
    top_p: Finite | None = Field(None, gt=0, le=1, description="nucleus sampling mass in (0, 1]")
    top_k: Annotated[StrictInt, Field(ge=-1, le=(1 << 31) - 1)] | None = Field(
        None, description="keep the k most likely tokens (0 or -1: all)")
    n: Annotated[StrictInt, Field(ge=1, le=128)] = Field(1, description="completions per prompt")
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = Field(None, description="must equal n if given")
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = Field(
        None, description="a 64-bit signed integer: the same seed gives the same tokens")
    stop: Text | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=4)] | None = Field(
        None, description="up to 4 strings; the output is cut before the first one")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Finite | None = Field(None, ge=-2, le=2)
    frequency_penalty: Finite | None = Field(None, ge=-2, le=2)
    repetition_penalty: Finite | None = Field(None, gt=0, le=10,
                                              description="Hugging Face/vLLM style: > 1 discourages repeats")
    ignore_eos: StrictBool = Field(False, description="keep generating past the model's end-of-sequence token")
    min_tokens: Annotated[StrictInt, Field(ge=0)] = Field(
        0, description="tokens to generate at least (vLLM's): the end-of-sequence and stop tokens cannot be drawn "
                       "and stop strings are not looked for before; at most max_tokens")
    user: Text | None = None

    # Present in the schema so /docs shows them, refused unless neutral (see UNSUPPORTED).
    tools: Any = Field(None, description="not supported (400)")
    tool_choice: Any = Field(None, description="not supported (400)")
    response_format: Any = Field(None, description="not supported (400) except {'type': 'text'}")
    logit_bias: Any = Field(None, description="not supported (400) except {}")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature={v:g} is below the minimum {MIN_TEMPERATURE:g} for sampling; use 0 for "
                             "greedy decoding")
        return v

    @field_validator(*[k for k in UNSUPPORTED if k in ("tools", "tool_choice", "response_format", "logit_bias")],
                     mode="before")
    @classmethod
    def _unsupported_declared(cls, v: Any, info: Any) -> Any:
        return _refuse(info.field_name, v)

    @model_validator(mode="after")
    def _whole(self) -> _Request:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED:
                _refuse(name, value)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"'best_of'={self.best_of} differs from n={self.n}; this server returns every sample "
                             "(best_of == n); leave best_of out")
        return self


def _refuse(name: str, value: Any) -> Any:
    if value not in UNSUPPORTED[name]:
        raise ValueError(f"'{name}' is not supported by this server; leave it out"
                         + (f" (or send {UNSUPPORTED[name][1]!r})" if len(UNSUPPORTED[name]) > 1 else ""))
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: StrictBool = Field(False, description="a last chunk with the token counts")


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: (Annotated[Text, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]) = Field(
        description="a string, a list of token ids, or a list of either")
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = Field(None, description="tokens to generate at most")
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description=f"log-probabilities of the sampled token and of the {MAX_LOGPROBS} most likely at most")
    echo: StrictBool = Field(False, description="return the prompt before the completion")
    suffix: Any = Field(None, description="not supported (400)")

    @field_validator("suffix", mode="before")
    @classmethod
    def _suffix(cls, v: Any) -> Any:
        return _refuse("suffix", v)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = Field(None, description="text, or a list of text parts")
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="deprecated name of max_completion_tokens")
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="tokens to generate at most; default: what is left of the model's context")
    logprobs: StrictBool = Field(False, description="return the log-probability of each sampled token")
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="also the most likely alternatives at each position (needs logprobs=true)")
    add_generation_prompt: StrictBool = Field(True, description="end the prompt with the assistant's turn")

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"'top_logprobs'={self.top_logprobs} needs logprobs=true")
        return self


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered with the chat template first."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = Field(None, description="the served model's id (see /v1/models); omitted: that one")
    prompt: Text | None = Field(None, description="the text to tokenize (or give messages)")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="chat messages, rendered with the chat template (or give prompt)")
    add_generation_prompt: StrictBool = Field(True, description="with messages: end with the assistant's turn")
    add_special_tokens: StrictBool = Field(True, description="with prompt: the tokenizer's special tokens "
                                                             "(e.g. BOS) as for a completion")
    return_token_strs: StrictBool = Field(False, description="also each token's text")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("'prompt' or 'messages' is required (exactly one of them)")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = Field(None, description="the served model's id (see /v1/models); omitted: that one")
    tokens: list[TokenId] = Field(description="token ids to turn into text")


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
TokenizeRequest.model_rebuild()

_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "TextPart"}
_SHAPES = {
    "prompt": "'prompt' must be a non-empty string, a non-empty list of token ids (integers, not booleans, in "
              "[0, 2^31)), or a list of either",
    "stop": "'stop' must be a string or a list of at most 4 non-empty strings",
    "seed": "'seed' must be an integer that fits in 64 bits, in [-2^63, 2^64)",
    "tokens": "'tokens' must be a list of token ids (integers, not booleans, in [0, 2^31))",
    "messages": None,
}


def describe_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first problem of a request as ``(message, param)``: a rule's own message (a lone surrogate, a
    temperature below the minimum) before a union's generic "none of the shapes matched"."""
    if not errors:
        return "invalid request", None
    own = [e for e in errors if e.get("type") == "value_error"]
    return describe_error(own[0] if own else errors[0])


def describe_error(error: dict[str, Any]) -> tuple[str, str | None]:
    """A pydantic error (one of ``ValidationError.errors()``) as ``(message, param)`` in OpenAI's style."""
    # Union branches and validators show up in a location ("str", "function-after[...]"): keep names and indices.
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    loc = [x for x in loc if re.fullmatch(r"\d+|[A-Za-z_]\w*", x) and x not in _BRANCHES]
    field = loc[0] if loc else None
    if error.get("type") == "missing":
        return f"'{'.'.join(loc)}' is required", field
    shape = _SHAPES.get(field or "")
    if shape is not None and error.get("type") != "value_error":
        return shape, field
    where = "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc).lstrip(".")
    msg = str(error.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if error.get("type") == "model_attributes_type" and not loc:
        return "the request body must be a JSON object (send it with Content-Type: application/json)", None
    if error.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error', msg)})", None
    if not where:
        named = re.match(r"'([a-z_]+)'", msg)  # a whole-request rule names its field first
        return msg, named.group(1) if named else None
    if not msg.startswith(f"'{where}'") and not msg.startswith(where.split("[")[0]):
        msg = f"'{where}': {msg}"
    return msg, field
