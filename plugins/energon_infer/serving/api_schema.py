"""The request bodies of the OpenAI-compatible server as pydantic models (FastAPI validates them; ``/docs``
shows them).

Everything a client sends is checked here, before anything reaches the engine or a worker: types are
strict (``"9"`` is not a number, ``true`` is not a token id), every number is finite and bounded,
strings with lone UTF-16 surrogates are refused (no tokenizer can encode them), and OpenAI fields this
server does not implement (``logit_bias``, ``suffix``...) get a 400 that names the field instead of being
ignored. Tools (:class:`Tool`, ``tool_choice``) are checked against each other here: a named function must be
one of ``tools``, a ``tool_choice`` needs ``tools``. Limits that depend on the server (``max_tokens``, prompts per request,
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

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from energon_infer.sampling import MAX_LOGPROBS, MAX_TEMPERATURE, MIN_TEMPERATURE, SEED_MAX, SEED_MIN
from energon_infer.serving.structured_fields import (
    ResponseFormat,
    StructuredOutputsParams,
    request_structured,
)
from energon_infer.structured import StructuredOutput

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "Tool", "NamedToolChoice", "StreamOptions", "TokenizeRequest",
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
    "logit_bias": (None, {}), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,),
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

    # Structured outputs (grammar-constrained decoding): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; at most one of them (see structured()).
    response_format: ResponseFormat | None = Field(
        None, description="{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
                          "{'name': ..., 'schema': {...}, 'strict': true}}: the output always parses (and validates)")
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar, json_object")
    guided_json: dict[str, Any] | Text | None = Field(None, description="vLLM's older form of structured_outputs.json")
    guided_regex: Text | None = Field(None, description="vLLM's older form of structured_outputs.regex")
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = Field(
        None, description="vLLM's older form of structured_outputs.choice")
    guided_grammar: Text | None = Field(None, description="vLLM's older form of structured_outputs.grammar")
    # Present in the schema so /docs shows it, refused unless neutral (see UNSUPPORTED).
    logit_bias: Any = Field(None, description="not supported (400) except {}")
    _structured: StructuredOutput | None = PrivateAttr(None)
    _structured_checked: bool = PrivateAttr(False)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature={v:g} is below the minimum {MIN_TEMPERATURE:g} for sampling; use 0 for "
                             "greedy decoding")
        return v

    @field_validator(*[k for k in UNSUPPORTED if k in ("response_format", "logit_bias")],
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
        self.structured()  # a bad schema, regex or grammar is a 400 before anything runs
        return self

    def structured(self) -> StructuredOutput | None:
        """The request's output constraint (``None``: free text); raises ValueError naming the field and the rule."""
        if not self._structured_checked:  # checked once, at validation
            self._structured, self._structured_checked = request_structured(self), True
        return self._structured


# Where a refused field's feature lives instead.
_INSTEAD = {"tools": "tools are served by /v1/chat/completions", "tool_choice": "tools are served by "
            "/v1/chat/completions", "functions": "send them as 'tools' (OpenAI's current form)",
            "function_call": "send 'tool_choice' (OpenAI's current form)"}


def _refuse(name: str, value: Any) -> Any:
    if value not in UNSUPPORTED[name] and name in _INSTEAD:
        raise ValueError(f"'{name}' is not supported here: {_INSTEAD[name]}")
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
    tools: Any = Field(None, description="not on completions (400): send tools to /v1/chat/completions")
    tool_choice: Any = Field(None, description="not on completions (400): send tools to /v1/chat/completions")

    @field_validator("suffix", "tools", "tool_choice", mode="before")
    @classmethod
    def _suffix(cls, v: Any, info: Any) -> Any:
        return _refuse(info.field_name, v)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"]
    text: Text


def _function_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError(f"function name {name!r} must be 1 to 64 letters, digits, '_' or '-' (OpenAI's rule); "
                         "rename it")
    return name


FunctionName = Annotated[Text, AfterValidator(_function_name)]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of an object: the arguments")
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"'parameters' has type {v.get('type')!r}: it must be the JSON schema of an object "
                             "({'type': 'object', 'properties': {...}}), since arguments are an object")
        return v


class Tool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {name, description, parameters}}``."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: Text


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    function: FunctionRef


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: Text
    arguments: Text = Field(description="the arguments as JSON text (an object)")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            value = json.loads(v)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"'arguments'={v[:60]!r} is not the JSON text of an object; send the arguments the "
                             "server returned (e.g. '{\"city\": \"Paris\"}')")
        return v


class AssistantToolCall(BaseModel):
    """A call in an earlier assistant message (``messages[i].tool_calls``), rendered back by the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = Field(None, description="text, or a list of text parts")
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, description="an assistant's calls")
    tool_call_id: Text | None = Field(None, description="a tool result's call (role 'tool')")

    @model_validator(mode="after")
    def _tool_calls_of_assistant(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"'tool_calls' is on a message of role {self.role!r}; only an assistant's message "
                             "carries tool calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (a call's arguments as an object, as transformers documents)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


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
    tools: list[Tool] | None = Field(None, description="functions the model may call, rendered by its chat template")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'auto' (the default with tools): the model chooses; 'required': at least one call; a "
                          "named function: that call; 'none': no calls parsed. required and named are "
                          "grammar-constrained, so their arguments validate against the function's parameters")
    parallel_tool_calls: StrictBool | None = Field(
        None, description="false: at most one call (with 'required'); default true")

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"'top_logprobs'={self.top_logprobs} needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"'tools' defines {', '.join(map(repr, twice))} more than once; give each function a "
                             "distinct name")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            shown = choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
            raise ValueError(f"'tool_choice'={shown!r} needs 'tools'; send the functions in 'tools' or leave "
                             "tool_choice out")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"'tool_choice' names the function {choice.function.name!r}, which is not in 'tools' "
                             f"({', '.join(names)}); name one of them")
        return self


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered with the chat template first."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = Field(None, description="the served model's id (see /v1/models); omitted: that one")
    prompt: Text | None = Field(None, description="the text to tokenize (or give messages)")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="chat messages, rendered with the chat template (or give prompt)")
    add_generation_prompt: StrictBool = Field(True, description="with messages: end with the assistant's turn")
    tools: list[Tool] | None = Field(None, description="with messages: the tools, rendered by the chat template")
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

_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "TextPart", "NamedToolChoice"}
_SHAPES = {
    "prompt": "'prompt' must be a non-empty string, a non-empty list of token ids (integers, not booleans, in "
              "[0, 2^31)), or a list of either",
    "stop": "'stop' must be a string or a list of at most 4 non-empty strings",
    "seed": "'seed' must be an integer that fits in 64 bits, in [-2^63, 2^64)",
    "tokens": "'tokens' must be a list of token ids (integers, not booleans, in [0, 2^31))",
    "messages": None,
    "tools": "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., \"description\": ..., "
             "\"parameters\": {JSON schema of an object}}}",
    "tool_choice": "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}",
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
