"""Streamed tool calls in ``tool_choice="auto"``, as OpenAI and vLLM send them: a call opens with its name as soon
as its head is written and its arguments follow in fragments, the same calls and content for every way the text is
cut into decoded deltas (equal to the answer without streaming, to the character), Mistral's v11 format
``[TOOL_CALLS]name[ARGS]{...}``, and tokenizers whose markers are special tokens (decoding drops them, so the
parser reads a decode that keeps them): from token ids, through the server's real stream, and served end to end."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer.serving.tool_calls import (
    HermesParser,
    Llama3Parser,
    MistralParser,
    ToolCall,
    ToolOutput,
    bind_tokenizer,
    parser_for_template,
)
from energon_infer.serving.tool_stream import MarkerText, special_markers
from tests.helpers.runif import RunIf

MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>")


def _collect(output: ToolOutput, pieces: list[str]) -> tuple[str, list[ToolCall], list[int]]:
    """Feed ``pieces``; the content and calls the deltas put together (checking each delta's shape as OpenAI sends
    it), and how many argument fragments each call came in."""
    s = output.stream()
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, names, args, fragments = "", [], [], []
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1
        content += d.get("content", "")
        for tc in d.get("tool_calls", ()):
            if "id" in tc:  # a call's first delta: index, id, type, name and no arguments yet
                assert tc["index"] == len(names) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                assert set(tc["function"]) == {"name", "arguments"} and tc["id"]
                names.append(tc["function"]["name"])
                args.append("")
                fragments.append(0)
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["index"] < len(names) and tc["function"]["arguments"]
                args[tc["index"]] += tc["function"]["arguments"]
                fragments[tc["index"]] += 1
    return content, [ToolCall(n, a) for n, a in zip(names, args)], fragments


# ---------------------------------------------------------------------- every format, every chunking

_json = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=6)
_args = st.tuples(st.dictionaries(st.text(max_size=5), _json, max_size=3),
                  st.sampled_from([(", ", ": "), (",", ":")]), st.sampled_from([None, 2])).map(
    lambda a: json.dumps(a[0], separators=a[1], indent=a[2] if a[0] else None))
_calls = st.lists(st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,10}", fullmatch=True), _args),
                  min_size=1, max_size=3)


def _written(fmt: str, calls: list[tuple[str, str]]) -> str:
    """``calls`` as each format's model writes them, the arguments' text kept as it is (spacing, indentation)."""
    if fmt == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n</tool_call>' for n, a in calls)
    if fmt == "llama3":
        return "<|python_tag|>" + "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS][" + ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls) + "]"
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)  # mistral v11


FORMATS = {"hermes": HermesParser(), "llama3": Llama3Parser(), "mistral": MistralParser(),
           "mistral-v11": MistralParser(args_format=True)}


@settings(max_examples=200, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), calls=_calls, before=st.sampled_from(["", "Let me check. ", "a\n"]),
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_streamed_calls_equal_the_whole_answer_for_every_chunking(fmt, calls, before, cuts):
    parser = FORMATS[fmt]
    before = "" if fmt == "llama3" else before  # a Llama 3 answer is calls or text, not both
    text = before + _written(fmt, calls)
    expected = [ToolCall(n, a) for n, a in calls]
    # Without streaming: the arguments exactly as written, the content before the calls, no markup.
    assert parser.parse(text) == (before, expected)
    bounds = sorted({0, len(text), *[c for c in cuts if c < len(text)]})
    content, got, _ = _collect(ToolOutput("auto", parser), [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert (content, got) == (before, expected)
    # One character at a time: each call's arguments go out as they are written, not once the call is complete.
    content, got, fragments = _collect(ToolOutput("auto", parser), list(text))
    assert (content, got) == (before, expected) and not any(m in content for m in MARKUP)
    assert all(f >= 2 for f, (_, a) in zip(fragments, calls) if a.startswith("{") and len(a) >= 2)


def test_a_call_opens_at_its_head_and_content_streams_before_it():
    s = ToolOutput("auto", HermesParser()).stream()
    assert s.feed("Checking") == [{"content": "Checking"}]
    assert s.feed(' <tool_call>\n{"name": "get_w') == [{"content": " "}]  # the name is not complete yet
    (head,) = s.feed('eather", "arguments": ')
    assert head["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert s.feed('{"city": "Pa') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}]
    assert s.feed('ris"}}\n</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]},
        {"tool_calls": [{"index": 1, "id": s._ids[1], "type": "function",
                         "function": {"name": "noop", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}]
    assert s.finish() == []


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_call_cut_by_max_tokens_keeps_the_arguments_written(fmt):
    parser = FORMATS[fmt]
    text = _written(fmt, [("get_weather", '{"city": "Paris", "days": 3}')])
    text = text[:text.index("Paris") + 3]
    content, calls = parser.parse(text)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments == '{"city": "Par'
    assert _collect(ToolOutput("auto", parser), list(text))[:2] == (content, calls)


def test_a_block_whose_head_reads_otherwise_is_sent_whole_once_complete():
    s = ToolOutput("auto", HermesParser()).stream()
    text = '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>'
    assert s.feed(text[:-1]) == []  # keys in another order: a call only if the whole block parses as one
    head, args = s.feed(text[-1])
    assert head["tool_calls"][0]["function"]["name"] == "f" and args["tool_calls"][0]["function"] == {
        "arguments": '{"x": 1}'}


def _required_array(calls: list[tuple[str, str]], compact: bool) -> str:
    """``calls`` as ``tool_choice="required"``'s grammar lets a model write them: a JSON array of objects."""
    comma, colon = (",", ":") if compact else (", ", ": ")
    items = [f'{{"name"{colon}{json.dumps(n)}{comma}"arguments"{colon}{a}}}' for n, a in calls]
    return "[" + comma.join(items) + "]"


@settings(max_examples=200, deadline=None)
@given(calls=_calls, compact=st.booleans(), cut=st.none() | st.integers(0, 400),
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_required_streams_argument_fragments_for_every_chunking(calls, compact, cut, cuts):
    out = ToolOutput("required", HermesParser())
    whole = _required_array(calls, compact)
    text = whole if cut is None else whole[:cut]  # an output cut by max_tokens anywhere
    content, expected = out.extract(text)
    bounds = sorted({0, len(text), *[c for c in cuts if c < len(text)]})
    assert _collect(out, [text[a:b] for a, b in zip(bounds, bounds[1:])])[:2] == (content, expected)
    streamed, got, fragments = _collect(out, list(text))
    assert (streamed, got) == (content, expected)
    if text == whole:  # the arguments as written, each sent in fragments as it is written
        assert (content, got) == ("", [ToolCall(n, a) for n, a in calls])
        assert all(f >= 2 for f, (_, a) in zip(fragments, calls) if len(a) >= 2)
        return
    # Cut short: the calls finished, then the one cut with the arguments written so far; a call cut before its head
    # is written stays content (nothing is lost).
    assert [c.name for c in got] == [n for n, _ in calls[:len(got)]]
    assert all(c.arguments == a for c, (_, a) in zip(got[:-1], calls))
    assert not got or calls[len(got) - 1][1].startswith(got[-1].arguments)
    assert content == (text if not got else "") or (text.endswith(content) and content.startswith("{"))


def test_required_opens_each_call_at_its_head():
    s = ToolOutput("required", HermesParser()).stream()
    assert s.feed('[{"name": "get_weather", "argum') == []
    (head,) = s.feed('ents": ')
    assert head["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""} and head["tool_calls"][0]["id"]
    assert s.feed('{"city": "Pa') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}]
    assert s.feed('ris"}}, {"name": "noop", "arguments": {}}]') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]},
        {"tool_calls": [{"index": 1, "id": s._ids[1], "type": "function",
                         "function": {"name": "noop", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}]
    assert s.finish() == []


# ---------------------------------------------------------------------- Mistral's v11 format


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]noop[ARGS]{}', "",
     [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("noop", "{}")]),
    ('Sure.[TOOL_CALLS]f[ARGS]{"q": [1, {"r": "[ARGS]"}]}', "Sure.", [ToolCall("f", '{"q": [1, {"r": "[ARGS]"}]}')]),
    ('[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"x": 1}', "", [ToolCall("f", '{"x": 1}')]),  # v13's call id: skipped
    ('[TOOL_CALLS]f[ARGS]{"x": 1', "", [ToolCall("f", '{"x": 1')]),  # cut short: what was written
    ("[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),  # no [ARGS]: nothing lost
])
def test_mistral_v11_calls_parse_streamed_or_not(text, content, calls):
    parser = MistralParser()
    assert parser.parse(text) == (content, calls)
    assert _collect(ToolOutput("auto", parser), list(text))[:2] == (content, calls)


def test_the_mistral_format_is_picked_from_the_template():
    v11 = parser_for_template("{{ '[TOOL_CALLS]' + call.name + '[ARGS]' + call.arguments }}")
    old = parser_for_template("{{ '[TOOL_CALLS]' + (calls | tojson) }}")
    assert isinstance(v11, MistralParser) and v11.args_format and not old.args_format
    calls = [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    assert v11.render(calls) == '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert old.render(calls).startswith("[TOOL_CALLS][{")
    assert v11.parse(old.render(calls)) == old.parse(v11.render(calls)) == ("", calls)  # each reads both


# ---------------------------------------------------------------------- markers that are special tokens

TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if tools %}Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>
{% endif %}<|im_start|>assistant
"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def special_dir(tmp_path_factory):
    """A model whose tokenizer has ``<tool_call>`` and ``</tool_call>`` as special tokens (as Qwen's mark them)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path_factory.mktemp("special") / "tiny-special", vocab=384, layers=2, hidden=32,
                              heads=4, kv_heads=2, intermediate=64, max_positions=1024)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([json.dumps(TOOLS), '{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 4,
                            trainers.BpeTrainer(vocab_size=380, special_tokens=["<unk>", "<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tok.add_special_tokens(["<tool_call>", "</tool_call>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def special_engine(special_dir):
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(special_dir, max_queue=16, progress=False, threads_per_worker=1, block_size=4,
                                kv_cache_tokens=4096) as eng:
        yield eng


WRITTEN = 'Let me see.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _output_ids(engine) -> list[int]:
    """The token ids a model writes ``WRITTEN`` as (the markers one special token each), then its end token."""
    ids = engine.tokenizer.encode(WRITTEN).ids
    assert engine.tokenizer.token_to_id("<tool_call>") in ids
    return [*ids, engine.tokenizer.token_to_id("</s>")]


@RunIf(serve=True)
def test_special_markers_are_found_and_kept_by_the_parsers_decode(special_engine):
    ids = _output_ids(special_engine)
    assert "<tool_call>" not in special_engine.decode(ids)  # the plain decode drops them: parsing it finds no call
    assert HermesParser().parse(special_engine.decode(ids))[1] == []
    parser = bind_tokenizer(HermesParser(), special_engine)
    assert sorted(parser.special.values()) == ["</tool_call>", "<tool_call>"]
    keep = MarkerText(special_engine.decode, parser.special)
    assert keep(ids) == WRITTEN  # the markers kept, the end token (special too) still dropped
    assert special_markers(special_engine.tokenizer, special_engine.decode, ["[TOOL_CALLS]"]) == {}


async def _sse(reply, events, completion) -> list[dict]:
    from energon_infer.serving.streaming import TokenStream

    stream = TokenStream(reply, include_usage=False, prompt_tokens=1, closing_since=lambda: None, drain_timeout_s=5)
    listen = stream.listener(0)
    for ev in events:
        listen(ev)
    done: Future = Future()
    done.set_result(completion)
    out = [chunk async for chunk in stream.body([done])]
    return [json.loads(c[len(b"data: "):]) for c in out if not c.startswith(b"data: [DONE]")]


@RunIf(serve=True)
def test_special_markers_stream_and_answer_from_the_tokens(special_engine):
    from energon_infer.engine.delivery import Completion, TokenEvent
    from energon_infer.scheduling.detokenizer import IncrementalDetokenizer
    from energon_infer.serving.openai_format import ChatReply

    parser = bind_tokenizer(HermesParser(), special_engine)
    ids = _output_ids(special_engine)
    plain = IncrementalDetokenizer(special_engine.decode)  # the engine's own text: markers dropped
    events = [TokenEvent("r", t, plain.add(t), "stop" if i == len(ids) - 1 else None) for i, t in enumerate(ids)]
    completion = Completion("r", [1], ids, plain.finish(), "stop", 0.0, 0.0, 0.0)
    whole = ChatReply("c", "m", special_engine.decode, ToolOutput("auto", parser)).response([completion], 1)
    message = whole["choices"][0]["message"]
    assert message["content"] == "Let me see." and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    chunks = asyncio.run(_sse(ChatReply("c", "m", special_engine.decode, ToolOutput("auto", parser)), events,
                              completion))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert content == "Let me see." and calls[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}' and len(calls) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@RunIf(serve=True)
def test_served_auto_streams_argument_fragments_with_special_markers_in_the_vocabulary(special_engine):
    openai = pytest.importorskip("openai")
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    regex = r'Ok\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'
    kw = dict(model="tiny-special", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=120,
              temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    with BackgroundServer(special_engine, ServerConfig(port=0, max_tokens_limit=256)) as srv:
        # The parser knows the markers are special, so the server reads the output decoded from its tokens.
        assert sorted(srv.energon.tool_parser.special.values()) == ["</tool_call>", "<tool_call>"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        whole = client.chat.completions.create(**kw).choices[0]
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert whole.message.content == "Ok. " and whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Ok. "
    fragments = [tc.function.arguments for d in deltas for tc in d.tool_calls or () if tc.id is None]
    assert "".join(fragments) == call.function.arguments and len(fragments) > 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
