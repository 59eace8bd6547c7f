"""Tool calling: the three tool-call formats parsed back (hand-written outputs, and any calls rendered in a format
parse back to themselves), streamed deltas equal to the whole answer, and the official ``openai`` client against a
served random-weight model whose chat template writes Hermes/Qwen ``<tool_call>`` blocks: ``tool_choice``
required and named (grammar-constrained, so the arguments validate), streaming, a tool result rendered back, and
400s for bad tools."""

from __future__ import annotations

import json
from typing import Literal

import pydantic_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from energon_infer.serving.tool_calls import (
    HermesParser,
    Llama3Parser,
    MistralParser,
    ToolCall,
    ToolOutput,
    make_parser,
    parser_for_template,
    required_schema,
)
from tests.helpers.runif import RunIf

PARSERS = [HermesParser(), Llama3Parser(), MistralParser()]


def _call(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args))


def _streamed(output: ToolOutput, pieces: list[str]) -> tuple[str, list[ToolCall], list[dict]]:
    """Feed ``pieces`` as one choice's text deltas; the content and calls the deltas put together, and the deltas."""
    s = output.stream()
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, calls, names = "", {}, {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", ()):
            i = tc["index"]
            if "id" in tc:  # the first delta of a call: index, id, type, name
                assert i == len(names) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                names[i], calls[i] = tc["function"]["name"], ""
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[i] += tc["function"]["arguments"]
    return content, [ToolCall(names[i], calls[i]) for i in sorted(names)], deltas


# ---------------------------------------------------------------------- parsers, hand-written outputs


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [_call("get_weather", city="Paris")]),
    ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>\n', "Let me look.\n", [_call("a"), _call("b", x=[1, 2])]),
    # arguments given as JSON text, and a last block whose closing tag the model left out
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call><tool_call>{"name": "b", "arguments": {}}', "",
     [_call("a", k=1), _call("b")]),
    # not a call: stays content, nothing lost
    ("<tool_call>{not json}</tool_call> and after", "<tool_call>{not json}</tool_call> and after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("plain answer with <tool_ in it", "plain answer with <tool_ in it", []),
    ("  \n", "  \n", []),
])
def test_hermes_parses_blocks_and_keeps_what_is_not_a_call(text, content, calls):
    assert HermesParser().parse(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [_call("get_weather", city="Oslo")]),
    ('<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}', "",
     [_call("a", n=1), _call("b")]),
    (' {"name": "a", "arguments": {}}\n', "", [_call("a")]),
    ('{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, not a call
    # a call from its head on (streamed as it is written): what follows it stays content
    ('{"name": "a", "parameters": {}} and then words', "and then words", [_call("a")]),
    ("It is sunny.", "It is sunny.", []),
])
def test_llama3_parses_a_whole_output_of_calls(text, content, calls):
    assert Llama3Parser().parse(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]', "",
     [_call("a", q="x"), _call("b")]),
    ('Checking. [TOOL_CALLS][{"name": "a", "arguments": {}}]', "Checking. ", [_call("a")]),
    ('[{"name": "a", "arguments": {}}]', "", [_call("a")]),  # the marker is a special token decoding drops
    ("[1, 2] are numbers", "[1, 2] are numbers", []),
    ("[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
])
def test_mistral_parses_the_marker_and_a_bare_array(text, content, calls):
    assert MistralParser().parse(text) == (content, calls)


def test_mistral_ids_are_nine_letters_and_digits():
    ids = {MistralParser().new_id() for _ in range(20)}
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(ids) == 20
    assert HermesParser().new_id().startswith("call_")


def test_parser_is_chosen_from_the_template_text():
    assert isinstance(parser_for_template("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}"), HermesParser)
    assert isinstance(parser_for_template("{{ '[TOOL_CALLS]' + (calls | tojson) }}"), MistralParser)
    assert isinstance(parser_for_template('{{- \'"parameters": \' }} ipython'), Llama3Parser)
    assert parser_for_template("{{ m.content }}") is None and parser_for_template(None) is None
    assert make_parser("none") is None
    with pytest.raises(ValueError, match=r"'qwen' is not one of hermes, llama3, mistral, none"):
        make_parser("qwen")


def test_required_schema_lists_each_function_with_its_arguments():
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema = required_schema([("a", params), ("b", None)], parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    a, b = schema["items"]["anyOf"]
    assert a["properties"]["name"] == {"type": "string", "enum": ["a"]} and a["properties"]["arguments"] == params
    assert b["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_schema([("a", params)])


# ---------------------------------------------------------------------- streaming


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_stream_one_character_at_a_time_equals_the_whole_answer(parser):
    calls = [_call("get_weather", city="Paris", days=3), _call("noop")]
    text = ("Sure. " if parser.name != "llama3" else "") + parser.render(calls)
    content, got, deltas = _streamed(ToolOutput("auto", parser), list(text))
    assert (content, got) == parser.parse(text) and got == calls
    # The content never showed a piece of the call markup: it was held back while a call could be starting.
    assert all("<tool" not in d.get("content", "") and "[TOOL" not in d.get("content", "") for d in deltas)


def test_stream_sends_content_before_the_call_completes():
    s = ToolOutput("auto", HermesParser()).stream()
    assert s.feed("The weather") == [{"content": "The weather"}]
    assert s.feed(" <tool") == [{"content": " "}]
    # The head is written: the call opens, and its arguments go out as they are written.
    first, args = s.feed('_call>{"name": "f", "arguments": {"a"')
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""} and first["tool_calls"][0]["id"]
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert s.feed(": 1}}</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": ': 1}'}}]}]
    assert s.feed("\n") == [] and s.finish() == []  # whitespace after a call is dropped


def test_named_function_streams_its_arguments_as_they_come():
    out = ToolOutput("named", HermesParser(), "get_weather")
    content, calls, deltas = _streamed(out, ['{"city"', ': "Oslo"', "}"])
    assert (content, calls) == out.extract('{"city": "Oslo"}') == ("", [ToolCall("get_weather", '{"city": "Oslo"}')])
    assert [d["tool_calls"][0]["function"].get("arguments") for d in deltas] == ["", '{"city"', ': "Oslo"', "}"]


def test_required_output_cut_short_keeps_its_text():
    out = ToolOutput("required", HermesParser())
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu'
    assert out.extract(text) == ('{"name": "b", "argu', [_call("a", x=1)])  # b's head is not written: content
    assert _streamed(out, list(text))[:2] == out.extract(text)
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": [1, "z'
    assert out.extract(text) == ("", [_call("a", x=1), ToolCall("b", '{"y": [1, "z')])  # the arguments written
    assert _streamed(out, list(text))[:2] == out.extract(text)
    assert out.extract('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}] ') == ("", [_call("a"),
                                                                                                  _call("b")])


# ---------------------------------------------------------------------- properties

_json = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=8)
_calls = st.lists(st.builds(lambda n, a: ToolCall(n, json.dumps(a)), st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,12}",
                                                                                     fullmatch=True),
                            st.dictionaries(st.text(max_size=6), _json, max_size=4)), min_size=1, max_size=4)


def _same(a: list[ToolCall], b: list[ToolCall]) -> bool:
    return [(c.name, json.loads(c.arguments)) for c in a] == [(c.name, json.loads(c.arguments)) for c in b]


@settings(max_examples=150, deadline=None)
@given(calls=_calls, which=st.sampled_from(PARSERS))
def test_any_calls_rendered_in_a_format_parse_back_to_themselves(calls, which):
    content, got = which.parse(which.render(calls))
    assert content == "" and _same(got, calls)


_fragments = st.sampled_from(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]",
                              '"name"', ": ", '"f"', ", ", '"arguments"', '{"x": 1}', "; ", "\n", " ", "hi", "<",
                              "<tool", '{"name": "g", "arguments": {}}'])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_fragments, max_size=14), cuts=st.lists(st.integers(0, 60), max_size=6),
       which=st.sampled_from(PARSERS), kind=st.sampled_from(["auto", "required"]))
def test_streamed_deltas_put_together_equal_the_whole_answer_for_any_text(parts, cuts, which, kind):
    text = "".join(parts)
    bounds = sorted({0, len(text), *[c for c in cuts if c < len(text)]})
    out = ToolOutput(kind, which)  # type: ignore[arg-type]
    content, calls, _ = _streamed(out, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert (content, calls) == out.extract(text)
    # Nothing is lost: every character of the output is in the content or inside a call's markup.
    assert calls or content == text


# ---------------------------------------------------------------------- the served model and the openai client

# A Qwen 2.5-style template: tools in a system block, calls as <tool_call> blocks, results as <tool_response>.
TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Weather(BaseModel):
    """The arguments of get_weather (an independent validator of what the server returns)."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)
    metric: bool


class Noop(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _tool(name: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                            "parameters": {**model.model_json_schema(), "additionalProperties": False}}}


TOOLS = [_tool("get_weather", Weather), _tool("noop", Noop)]
VALIDATORS = {"get_weather": Weather, "noop": Noop}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path_factory.mktemp("tools") / "tiny-tools", vocab=384, layers=2, hidden=32,
                              heads=4, kv_heads=2, intermediate=64, max_positions=1024)
    # Byte-level, so every character of JSON has tokens; <tool_call> tags are ordinary (kept by decoding), as in Qwen.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(t) for t in TOOLS] + ['{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=380, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    assert tok.get_vocab_size() <= 384
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(model_dir, max_queue=64, progress=False, threads_per_worker=1, block_size=4,
                                kv_cache_tokens=8192) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    with BackgroundServer(engine, ServerConfig(port=0, max_tokens_limit=256)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _validate(call) -> None:
    VALIDATORS[call.function.name].model_validate_json(call.function.arguments)  # raises if invalid


def _validate_prefix(call) -> None:
    """A call cut by ``max_tokens``: its arguments are valid arguments or the beginning of some (pydantic's partial
    JSON parser, each complete field validated on its own)."""
    if not call.function.arguments:
        return  # cut right after the call's head
    try:
        json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        assert e.msg != "Extra data", call.function.arguments  # not text after the object
    else:
        return _validate(call)
    model = VALIDATORS[call.function.name]
    partial = pydantic_core.from_json(call.function.arguments, allow_partial=True)  # raises if it is not a prefix
    assert isinstance(partial, dict) and call.function.arguments.lstrip().startswith("{")
    for key, value in partial.items():  # extra="forbid": an unknown key raises too
        model.__pydantic_validator__.validate_assignment(model.model_construct(), key, value)


@RunIf(serve=True)
def test_docs_tool_calls_snippet_runs(server, capsys):
    from tests.helpers.docs import python_block

    code = python_block("docs/serving.md", "Tool calls")
    exec(compile(code.replace("http://127.0.0.1:8000", server.url), "docs/serving.md", "exec"),
         {"API_KEY": "none", "MODEL": "tiny-tools"})
    first = capsys.readouterr().out.splitlines()[0]
    name, args = first.split(" ", 1)
    assert name == "get_weather" and json.loads(args)["city"] in ("Paris", "Oslo")


@RunIf(serve=True)
def test_server_picks_the_hermes_parser_from_the_template(server):
    assert isinstance(server.energon.tool_parser, HermesParser)
    assert server.energon.tool_parser_source == "the chat template"


@RunIf(serve=True)
@pytest.mark.parametrize("parallel", [False, True])
def test_required_returns_calls_whose_arguments_validate(client, parallel):
    for seed in (0, 4, 8):
        out = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, max_tokens=200, temperature=1.0, seed=seed)
        choice = out.choices[0]
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        assert len({c.id for c in calls}) == len(calls) and all(c.type == "function" for c in calls)
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None
            for call in calls:
                _validate(call)
            continue
        # A random model may go on calling until max_tokens (as OpenAI, the call it was writing keeps the arguments
        # written so far; one cut before its head stays content).
        assert parallel and choice.finish_reason == "length"
        for call in calls[:-1]:
            _validate(call)
        _validate_prefix(calls[-1])
        assert choice.message.content is None or choice.message.content.startswith("{")


@RunIf(serve=True)
def test_named_function_validates_and_parses_with_the_clients_helper(client):
    import openai

    out = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS, max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "tool_calls"
    _validate(call)
    # The client's own parsing of strict pydantic tools reads the arguments into the model.
    parsed = client.chat.completions.parse(model="tiny-tools", messages=ASK, max_tokens=200, seed=1,
                                           tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, Weather)


@RunIf(serve=True)
@pytest.mark.parametrize("tool_choice, parallel", [("required", False), ("required", True),
                                                    ({"type": "function", "function": {"name": "get_weather"}}, True)],
                         ids=["required-one", "required-parallel", "named"])
def test_streamed_tool_calls_put_together_equal_the_whole_answer(client, tool_choice, parallel):
    kw = dict(model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
              temperature=0, parallel_tool_calls=parallel)
    whole = client.chat.completions.create(**kw).choices[0]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content, names, args, fragments = "", [], {}, {}
    for delta in (c.choices[0].delta for c in chunks if c.choices):
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.id is not None:  # a call's first delta: index, id, type and name
                assert tc.index == len(names) and tc.type == "function" and tc.function.arguments == ""
                names.append(tc.function.name)
                args[tc.index], fragments[tc.index] = "", 0
            else:
                assert tc.function.name is None
                args[tc.index] += tc.function.arguments
                fragments[tc.index] += 1
    assert list(zip(names, args.values())) == expected
    # The arguments go out as they are generated (a token or a few at a time), not once the call is complete.
    assert all(fragments[i] >= 2 for i, (_, a) in enumerate(expected) if len(a) > 8)
    assert content == (whole.message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    if whole.finish_reason == "tool_calls":  # the client's stream helper (it refuses a "length" answer)
        with client.chat.completions.stream(**kw) as stream:
            final = stream.get_final_completion().choices[0]
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == expected


@RunIf(serve=True)
def test_auto_parses_what_the_model_writes_streamed_or_not(client):
    # The model is made to write a Hermes block after some text (a regex through vLLM's structured_outputs): "auto"
    # parses it with the parser the template chose, and the stream holds the markup back.
    regex = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7], '
             r'"metric": (true|false)\}\}\n</tool_call>')
    kw = dict(model="tiny-tools", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "Sure. " and whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    _validate(call)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(contents) == "Sure. " and not any("<" in x for x in contents)
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # "none": the same text comes back as content, nothing parsed.
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert plain.message.tool_calls is None and plain.message.content.startswith("Sure. <tool_call>\n{")
    assert plain.finish_reason == "stop"


@RunIf(serve=True)
def test_a_tool_result_is_rendered_back_in_the_next_request(engine, client):
    from energon_infer import SamplingParams
    from energon_infer.loading.hf_files import ChatTemplate

    first = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model="tiny-tools", messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    args = json.loads(call.function.arguments)
    rendered = ChatTemplate.for_engine(engine).render(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}], tools=TOOLS)
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in rendered
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>' in rendered
    assert '"name": "get_weather"' in rendered.split("</tools>")[0]  # the tools themselves
    expected = engine.generate([rendered], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.choices[0].message.content == expected.text and out.choices[0].message.tool_calls is None


@RunIf(serve=True)
@pytest.mark.parametrize("body, match", [
    ({"tool_choice": "required"}, r"'tool_choice'='required' needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     r"names the function 'nope', which is not in 'tools' \(get_weather, noop\); name one of them"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, r"'has space' must be 1 to 64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     r"'parameters' has type 'array': it must be the JSON schema of an object"),
    ({"tools": [{"function": {"name": "f"}}]}, r"'tools.0.type' is required"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, r"'tool_choice' must be 'none', 'auto', 'required' or"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     r"tool_choice='required' constrains the output to tool calls, and the request also constrains it"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"},
     r"tools\[0\]\.function\.parameters at #/properties/x cannot be compiled: Regex parsing error"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     r"tools\[1\]\.function\.parameters at #/properties/x cannot be compiled"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                          "function": {"name": "f", "arguments": "{"}}]}]},
     r"'messages\[0\].tool_calls\[0\].function.arguments': 'arguments'='\{' is not the JSON text of an object"),
])
def test_bad_tools_get_400_naming_value_and_rule(server, body, match):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert pytest.importorskip("re").search(match, r.json()["error"]["message"]), r.json()["error"]["message"]


@RunIf(serve=True)
def test_completions_refuse_tools(server):
    import httpx

    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and "tools are served by /v1/chat/completions" in r.json()["error"]["message"]


def test_server_config_refuses_an_unknown_parser():
    from energon_infer.serving.server_config import ServerConfig

    with pytest.raises(ValueError, match=r"tool_call_parser='qwen' is not one of hermes, llama3, mistral, none"):
        ServerConfig(tool_call_parser="qwen")


@RunIf(serve=True)
def test_serve_states_the_parser_at_start_and_takes_the_flag(model_dir):
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from tests.helpers.multiprocess import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tightfit.cli", "serve", str(model_dir), "--port", str(port),
                             "--log-level", "warning", "--tool-call-parser", "mistral", "--no-packed-weights"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert ("energon: chat template: the model's chat template; tool calls: mistral (from --tool-call-parser; "
            "--tool-call-parser hermes|llama3|mistral|none to change)") in out, out
