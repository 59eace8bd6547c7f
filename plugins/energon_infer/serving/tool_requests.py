"""A chat request's ``tool_choice`` turned into what the engine runs: how the answer's text becomes content and tool
calls (:class:`~energon_infer.serving.tool_calls.ToolOutput`) and, for ``required`` or a named function, the JSON
schema the output is constrained to (through :class:`~energon_infer.structured.StructuredOutput`), checked off the
event loop so that a function's ``parameters`` that cannot compile get a 400 naming that function (the rank that
samples compiles it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import TYPE_CHECKING, Any

from energon_infer.sampling import SamplingParams
from energon_infer.serving.http_guard import ApiError
from energon_infer.serving.tool_calls import ToolCallParser, ToolOutput, required_schema
from energon_infer.structured import StructuredOutput, StructuredOutputError, prepare

if TYPE_CHECKING:
    from energon_infer.engine.engine import Engine
    from energon_infer.serving.api_schema import ChatCompletionRequest

__all__ = ["tool_output_of", "compile_tool_grammar"]


def tool_output_of(body: ChatCompletionRequest, params: SamplingParams,
                   parser: ToolCallParser | None) -> tuple[ToolOutput, SamplingParams]:
    """How the answer's text becomes content and tool calls, and for ``required`` / a named function the
    grammar that makes it a valid call (the request's checks already tied tool_choice to tools)."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if choice == "none":
        return ToolOutput("text", parser), params
    if choice == "auto":
        return ToolOutput("auto", parser), params
    functions: dict[str, Any] = {t.function.name: t.function.parameters for t in body.tools or ()}
    if isinstance(choice, str):  # "required": an array of calls, each one of the functions with its arguments
        output = ToolOutput("required", parser)
        schema = required_schema(list(functions.items()), parallel=body.parallel_tool_calls is not False)
    else:
        name = choice.function.name
        output = ToolOutput("named", parser, name)
        schema = functions[name] or {"type": "object", "properties": {}}
    if params.structured is not None:
        raise ApiError(400, f"tool_choice={choice if isinstance(choice, str) else 'a named function'!r} "
                            "constrains the output to tool calls, and the request also constrains it "
                            "(response_format or structured outputs); send one of them", param="tool_choice")
    return output, dataclasses.replace(params, structured=StructuredOutput(json_schema=schema))


async def compile_tool_grammar(engine: Engine, body: ChatCompletionRequest, output: ToolOutput,
                               params: SamplingParams) -> SamplingParams:
    """The grammar of ``required`` / a named function checked (off the loop: :func:`~energon_infer.structured.prepare`),
    so a function's ``parameters`` that cannot compile get a 400 naming that function's schema rather than the schema made from it."""
    try:
        return await asyncio.to_thread(prepare, engine, params)
    except StructuredOutputError as exc:
        names = [t.function.name for t in body.tools or ()]
        msg = str(exc)
        made = (re.search(r"json_schema at #/items(?:/anyOf/(\d+))?/properties/arguments", msg)
                if output.kind == "required" else re.search(r"json_schema at #", msg))
        if made is not None:
            index = int(made.group(1) or 0) if output.kind == "required" else names.index(str(output.function))
            msg = msg.replace(made.group(0), f"tools[{index}].function.parameters at #", 1)
        raise ApiError(400, msg, param="tools") from None
