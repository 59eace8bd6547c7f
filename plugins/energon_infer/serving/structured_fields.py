"""The request fields of structured outputs: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its
older ``guided_*`` fields, turned into one :class:`~energon_infer.structured.StructuredOutput` (checked: a bad
schema, regex or grammar is a 400 naming the field, the schema path and the rule, before anything runs; the check's
outcome kept by constraint); the rank that samples compiles the grammar."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from energon_infer.serving.http_guard import ApiError
from energon_infer.structured import CHECKS, StructuredOutput, StructuredOutputError, prepare

__all__ = ["JsonSchemaFormat", "ResponseFormat", "StructuredOutputsParams", "request_structured", "compiled_jobs"]


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``{name, description, schema, strict}``."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: Annotated[StrictStr, Field(min_length=1, max_length=64)] = Field(description="the schema's name")
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="a JSON schema")
    strict: StrictBool | None = Field(None, description="true: no properties beyond those the schema allows")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(f"response_format type {self.type!r} " + ("needs 'json_schema': {'name': ..., "
                             "'schema': {...}}" if self.type == "json_schema" else "takes no 'json_schema'"))
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: Annotated[StrictStr, Field(min_length=1)] | None = Field(None, description="an EBNF grammar (root ::= ...)")
    json_object: StrictBool | None = None

    def to_structured(self) -> StructuredOutput:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"'structured_outputs' sets {', '.join(g.rstrip('_') for g in given) or 'nothing'}; "
                             "set exactly one of json, regex, choice, grammar, json_object")
        if self.json_ is not None:
            return StructuredOutput(json_schema=_schema_object(self.json_, "structured_outputs.json"))
        if self.choice is not None:
            return StructuredOutput(choice=tuple(self.choice))
        if self.json_object:
            return StructuredOutput(json_object=True)
        return StructuredOutput(regex=self.regex, grammar=self.grammar)


def _schema_object(value: dict[str, Any] | str, name: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"'{name}' is not valid JSON ({exc}); send a JSON schema object") from None
    if not isinstance(value, dict):
        raise ValueError(f"'{name}'={value!r} must be a JSON schema object")
    return value


def request_structured(req: Any) -> StructuredOutput | None:
    """The constraint a request's fields ask for (``None``: free text); raises ValueError naming the field."""
    given: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", StructuredOutput(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        given.append(("response_format", StructuredOutput(json_schema=rf.json_schema.schema_,
                                                          strict=bool(rf.json_schema.strict))))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs.to_structured()))
    if req.guided_json is not None:
        given.append(("guided_json", StructuredOutput(json_schema=_schema_object(req.guided_json, "guided_json"))))
    for name, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given.append((name, StructuredOutput(**{kind: getattr(req, name)})))
    if req.guided_choice is not None:
        given.append(("guided_choice", StructuredOutput(choice=tuple(req.guided_choice))))
    if len(given) > 1:
        raise ValueError(f"{', '.join(repr(n) for n, _ in given)} each constrain the output; send one of them")
    if not given:
        return None
    name, out = given[0]
    try:
        CHECKS.check(out)  # built once per constraint: a schema sent again is a lookup
    except StructuredOutputError as exc:
        raise ValueError(f"'{name}': {exc}") from None
    return out


async def compiled_jobs(engine: Any, jobs: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """``(prompt, params)`` jobs whose structured output is checked and marked for the rank to compile
    (:func:`~energon_infer.structured.prepare`, off the event loop); a grammar that cannot be built is a 400."""
    if not jobs or jobs[0][1].structured is None:
        return list(jobs)
    try:
        compiled = await asyncio.to_thread(prepare, engine, jobs[0][1])
    except StructuredOutputError as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    return [(ids, dataclasses.replace(p, structured=compiled.structured)) for ids, p in jobs]
