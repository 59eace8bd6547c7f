"""Structured outputs (grammar-constrained decoding with xgrammar) on a random-weight model: whatever the weights,
the output parses and validates. Through the official ``openai`` client (``response_format``, vLLM's
``structured_outputs`` / ``guided_*``), through ``Engine.generate`` with ``SamplingParams(structured=...)``, and
the pieces: the constraint type, the bitmask applied by the sampler (where each side compiles:
test_structured_compile.py)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from energon_infer.sampling import Sampler, SamplingParams, allowed_from_bitmask
from energon_infer.structured import StructuredOutput, StructuredOutputError, check
from tests.helpers.runif import RunIf

pytest.importorskip("xgrammar")
pytestmark = RunIf(serve=True)

OPTS = dict(progress=False, threads_per_worker=1, block_size=4, kv_cache_tokens=4096)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOKENIZER_VOCAB, MODEL_VOCAB = 300, 320  # logits wider than the tokenizer: the extra ids must never be drawn
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


def write_model(path: Path) -> Path:
    """A random LLaMA whose byte-level tokenizer can spell any text (every JSON character has a token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from energon_infer.demo import write_random_llama

    path = write_random_llama(path, vocab=MODEL_VOCAB, layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64,
                              max_positions=512)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(['{"name": "fox", "age": 3, "ok": true}', "the quick brown fox"] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """An independent check of the schema subset these tests generate (no jsonschema package here)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
                and all(conforms(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -(1 << 60)) <= value <= schema.get("maximum", 1 << 60))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    raise AssertionError(f"schema outside the tested subset: {schema}")


# ---------------------------------------------------------------------- the pieces (no model)


def test_structured_output_takes_exactly_one_constraint():
    assert StructuredOutput(regex="a+").kind == "regex"
    with pytest.raises(ValueError, match="sets json_schema, regex: set exactly one of"):
        StructuredOutput(json_schema={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="sets nothing"):
        StructuredOutput()
    with pytest.raises(ValueError, match="choice='ab' must be a non-empty list of strings"):
        StructuredOutput(choice="ab")  # type: ignore[arg-type]
    # Equal constraints are equal whatever the order of a schema's keywords (not of its properties: the order the
    # output writes them in; test_structured_compile.py), and travel as JSON.
    a = StructuredOutput(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutput(json_schema={"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert a == b and hash(a) == hash(b) and StructuredOutput.from_json(a.to_json()) == a
    # ... except the order of the properties: the output writes them in it.
    xy = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    yx = {"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}
    assert StructuredOutput(json_schema=xy) != StructuredOutput(json_schema=yx)
    assert StructuredOutput(json_schema={"type": "object"}, strict=False) != StructuredOutput(
        json_schema={"type": "object"})
    with pytest.raises(ValueError, match="structured=.* must be a StructuredOutput"):
        SamplingParams(structured={"type": "object"})  # type: ignore[arg-type]


def test_a_constraint_key_is_computed_once_and_travels_with_it(monkeypatch):
    """The canonical text of a schema (milliseconds for a large one) is computed at the first look-up only: not again
    for the hash, the comparison, a copy through pickle (how a step carries it to the rank) or the engine's marked
    copy (``prepare``)."""
    import pickle

    from energon_infer import structured

    class Engine:  # what prepare reads of an engine
        tokenizer = object()

    computed = []
    real = structured.StructuredOutput._canonical_key
    monkeypatch.setattr(structured.StructuredOutput, "_canonical_key",
                        lambda self: computed.append(1) or real(self))
    a = StructuredOutput(json_schema={"type": "object", "properties": {"y": {"type": "integer"}, "x": {}}})
    key = a.key
    assert computed == [1] and key == ("json_schema", '{"schema":{"properties":{"y":{"type":"integer"},"x":{}},'
                                                      '"type":"object"},"strict":true}')
    travelled = pickle.loads(pickle.dumps(a))
    marked = structured.prepare(Engine(), SamplingParams(structured=a)).structured
    assert marked.compiled == structured.ON_RANK and marked is not a
    assert hash(a) == hash(travelled) == hash(marked) and a == travelled == marked and a.key == marked.key
    assert computed == [1]


@pytest.mark.parametrize(("schema", "path", "rule"), [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "#/properties/a", 'Unsupported type "strin"'),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 5,
                                                                         "maximum": 2}}}},
     "#/properties/a/items", "minimum greater than maximum"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "string", "pattern": "[x"}]}}},
     "#/properties/a/anyOf/1", "Unclosed"),
    ({"$defs": {"P": {"type": "object", "properties": {"x": {"type": "bad"}}}}, "type": "object",
      "properties": {"p": {"$ref": "#/$defs/P"}}}, "#/$defs/P/properties/x", 'Unsupported type "bad"'),
])
def test_bad_schema_names_the_path_and_the_rule(schema, path, rule):
    with pytest.raises(StructuredOutputError, match=f"json_schema at {re.escape(path)} cannot be compiled: .*"
                                                    f"{re.escape(rule)}"):
        check(StructuredOutput(json_schema=schema))
    with pytest.raises(StructuredOutputError, match="regex cannot be compiled: .*parenthesis is not closed"):
        check(StructuredOutput(regex="a(b"))


def test_json_strings_take_no_surrogate_bytes_and_properties_keep_their_order():
    xgrammar = pytest.importorskip("xgrammar")
    from energon_infer.structured import json_grammar

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}, "a": {"type": "string"}},
              "required": ["s", "a"], "additionalProperties": False}
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(
        json_grammar(StructuredOutput(json_schema=schema)))

    def takes(text: bytes) -> bool:
        return xgrammar.GrammarMatcher(compiled).accept_string(text)

    assert takes('{"s": "躩", "a": "é'.encode())
    # U+DB20 as UTF-8 bytes (not valid UTF-8: a decode makes three U+FFFD of it), in either kind of string rule.
    assert not takes(b'{"s": "\xed\xac\xa0') and not takes(b'{"s": "", "a": "\xed\xac\xa0')
    assert not takes(b'{"a": ')  # the schema's order, not the sorted one


def test_sampler_applies_the_grammar_bitmask_to_greedy_and_sampled_rows():
    vocab = 40
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 10.0  # everyone's favourite, which the grammar forbids to rows 0 and 1
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3  # row 0 may take token 3 only
    mask[1, 1] = (1 << 1) | (1 << 2)  # row 1 may take 33 or 34
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0)]
    out = Sampler().sample_rows(logits, [0, 1, 2], params, [1, 1, 1], grammar=([0, 1], mask))
    assert out.tokens[0] == 3 and out.tokens[1] in (33, 34) and out.tokens[2] == 7 and not out.errors
    # Bit 31 is the int32 sign bit, and words past the bitmask (a wider vocab) are not allowed.
    words = torch.tensor([[-(1 << 31), 0]], dtype=torch.int32)
    allowed = allowed_from_bitmask(words, 70)
    assert allowed[0].nonzero().flatten().tolist() == [31]


# ---------------------------------------------------------------------- the engine and the server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("structured") / "tiny-json")


@pytest.fixture(scope="module")
def engine(model_dir):
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(model_dir, max_queue=64, **OPTS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    with BackgroundServer(engine, ServerConfig(port=0, api_key="k", max_tokens_limit=256)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=120)


def test_chat_parse_returns_the_pydantic_object(client):
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        legs: int = Field(ge=0, le=8)
        kind: str = Field(json_schema_extra={"enum": ["cat", "dog"]})
        vaccinated: bool

    for temperature in (0.0, 1.0):
        out = client.chat.completions.parse(model="tiny-json", messages=[{"role": "user", "content": "a pet"}],
                                            response_format=Pet, temperature=temperature, seed=3, max_tokens=200)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        pet = choice.message.parsed
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.legs <= 8


def test_a_fresh_schema_is_compiled_once_across_the_server_engine_and_rank(client, engine, monkeypatch):
    """Three requests with a schema nobody has seen (two at once, one after) compile its grammar once in all: on the
    rank that samples (the count it reports in its stats), and never in this process (the server's and the engine's,
    which only check it): xgrammar's compiler is counted wherever this process calls it."""
    import concurrent.futures

    import xgrammar
    from pydantic import BaseModel, Field

    here: list[str] = []
    for name in [n for n in dir(xgrammar.GrammarCompiler) if n.startswith("compile")]:
        def counted(self: Any, *args: Any, _real: Any = getattr(xgrammar.GrammarCompiler, name), _name: str = name,
                    **kwargs: Any) -> Any:
            here.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(xgrammar.GrammarCompiler, name, counted)

    def rank_compiles() -> int:
        return sum(int(r.get("grammar_compiles", 0)) for r in engine.pipeline_stats()["ranks"])

    class Parcel(BaseModel):
        label: str = Field(max_length=7)
        grams: int = Field(ge=1, le=4321)  # bounds no other test uses: a grammar the rank has not compiled
        fragile: bool

    def ask(seed: int) -> Any:
        out = client.chat.completions.parse(model="tiny-json", messages=[{"role": "user", "content": "a parcel"}],
                                            response_format=Parcel, temperature=1.0, seed=seed, max_tokens=200)
        return out.choices[0].message.parsed

    before = rank_compiles()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        parsed = list(pool.map(ask, (1, 2)))
    parsed.append(ask(3))
    assert all(isinstance(p, Parcel) and 1 <= p.grams <= 4321 for p in parsed), parsed
    assert here == []
    assert rank_compiles() - before == 1


def test_json_object_and_json_schema_on_both_endpoints(client):
    # Greedy, on a prompt these weights close the object after: an object with no bound on its contents may run
    # past max_tokens on random weights (finish_reason "length", as with any model).
    out = client.completions.create(model="tiny-json", prompt="the quick brown fox", max_tokens=200, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict) and len(out.choices[0].text) > 2
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        done = client.completions.create(model="tiny-json", prompt="the quick", max_tokens=200, temperature=1.0,
                                         seed=seed, extra_body={"response_format": fmt})
        assert done.choices[0].finish_reason == "stop"
        value = json.loads(done.choices[0].text)
        assert conforms(value, PERSON) and set(value) == {"name", "age", "ok"}, value


def test_regex_choice_and_grammar_through_vllm_fields(client):
    def complete(**extra: Any) -> str:
        out = client.completions.create(model="tiny-json", prompt="the quick", max_tokens=40, temperature=1.0,
                                        seed=1, extra_body=extra)
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].text

    assert re.fullmatch(r"[a-c]{3}-\d{2}", complete(structured_outputs={"regex": r"[a-c]{3}-\d{2}"}))
    assert re.fullmatch(r"(yes|no)!", complete(guided_regex="(yes|no)!"))
    assert complete(structured_outputs={"choice": ["red fox", "blue \"jay\""]}) in ("red fox", 'blue "jay"')
    assert complete(guided_choice=["up", "down"]) in ("up", "down")
    assert complete(guided_grammar='root ::= "ab" | "cd" [0-9]') in {"ab", *(f"cd{i}" for i in range(10))}
    value = json.loads(complete(guided_json={"type": "object", "properties": {"b": {"type": "boolean"}},
                                             "required": ["b"]}))
    assert isinstance(value["b"], bool)


def test_invalid_schema_is_a_400_naming_the_path(client):
    openai = pytest.importorskip("openai")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "strng"}}}}}}
    with pytest.raises(openai.BadRequestError, match=r"#/properties/tags/items.*Unsupported type \\?\"strng"):
        client.chat.completions.create(model="tiny-json", messages=[{"role": "user", "content": "x"}],
                                       response_format=bad, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="each constrain the output; send one of them"):
        client.completions.create(model="tiny-json", prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    with pytest.raises(openai.BadRequestError, match="regex cannot be compiled"):
        client.completions.create(model="tiny-json", prompt="x", max_tokens=5, extra_body={"guided_regex": "a(b"})


def test_streaming_with_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    stream = client.chat.completions.create(model="tiny-json", messages=[{"role": "user", "content": "who?"}],
                                            response_format=fmt, max_tokens=200, temperature=1.0, seed=7, stream=True)
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop" and len([p for p in parts if p]) > 3  # streamed in pieces
    assert conforms(json.loads("".join(parts)), PERSON)


def test_engine_generate_with_structured_params(engine):
    so = StructuredOutput(json_schema=PERSON)
    outs = engine.generate(["a", "b c", "the quick brown"],
                           [SamplingParams(temperature=t, seed=i, max_tokens=200, structured=so)
                            for i, t in enumerate((0.0, 1.0, 1.0))])
    for out in outs:
        assert out.finish_reason == "stop" and conforms(json.loads(out.text), PERSON)
        assert list(json.loads(out.text)) == list(PERSON["properties"])  # in the schema's order, as OpenAI's
        assert all(t < TOKENIZER_VOCAB for t in out.token_ids)  # the padded ids past the tokenizer are masked
    # ignore_eos: the grammar's end still ends the request.
    out = engine.generate(["x"], SamplingParams(max_tokens=50, ignore_eos=True,
                                                structured=StructuredOutput(choice=("yes", "no"))))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_generated_schemas_always_validate(engine):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    leaf = st.one_of(
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.tuples(st.integers(-50, 50), st.integers(0, 50)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.sampled_from(["a", "b c", "d\"e", "7"]), min_size=1, max_size=3, unique=True).map(
            lambda xs: {"enum": xs}))

    def extend(children: Any) -> Any:
        arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
        objects = st.dictionaries(st.sampled_from(["a", "b", "id", "x y"]), children, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))
        return st.one_of(arrays, objects)

    schemas = st.recursive(leaf, extend, max_leaves=6).map(
        lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"],
                                                        "additionalProperties": False})

    @hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
    @hypothesis.given(schema=schemas, seed=st.integers(0, 1000))
    def run(schema: dict[str, Any], seed: int) -> None:
        out = engine.generate(["json:"], SamplingParams(temperature=1.0, seed=seed, max_tokens=256,
                                                        structured=StructuredOutput(json_schema=schema)))[0]
        assert out.finish_reason == "stop", (schema, out.text)
        assert conforms(json.loads(out.text), schema), (schema, out.text)

    run()


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}])
def test_parallel_engine_keeps_the_grammar(model_dir, layout):
    """tp=2 or pp=2 (steps planned ahead): only the result rank samples, so only it holds the matchers."""
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(model_dir, **layout, **OPTS) as eng:
        outs = eng.generate(["a", "the quick"], SamplingParams(temperature=1.0, seed=2, max_tokens=200,
                                                               structured=StructuredOutput(json_schema=PERSON)))
    assert all(o.finish_reason == "stop" and conforms(json.loads(o.text), PERSON) for o in outs)


def test_docs_structured_outputs_snippet_runs(server, capsys):
    from tests.helpers.docs import python_block

    code = python_block("docs/serving.md", "Structured outputs")
    exec(compile(code.replace("http://127.0.0.1:8000", server.url), "docs/serving.md", "exec"),
         {"API_KEY": "k", "MODEL": "tiny-json", "__name__": "docs"})
    name_legs, answer = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r".{0,12} [0-8]", name_legs, re.S) and answer in ("yes", "no")


def test_preempted_and_chunked_requests_keep_their_grammar(model_dir):
    """A small cache preempts the newest request, which is recomputed (whole or in chunks) or swapped back in: its
    matcher restarts from the tokens it had, and each output equals the one it gets alone in a large cache."""
    from energon_infer.worker.runtime import ModelRunner

    opts = dict(progress=False, block_size=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 30))]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured=StructuredOutput(json_schema=PERSON))
              for s in (0, 4, 8)]
    big = ModelRunner.from_pretrained(model_dir, kv_cache_tokens=2048, **opts)
    alone = [big.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    for preemption, chunked in (("recompute", False), ("recompute", True), ("swap", True)):
        small = ModelRunner.from_pretrained(model_dir, kv_cache_tokens=72, swap_space_tokens=256,
                                            max_batch_tokens=16 if chunked else 4096, **opts)
        stats: dict[str, int] = {}
        out = small.generate(prompts, params, kv_admission="on_demand", preemption=preemption, stats=stats,
                             chunked_prefill=chunked)
        assert stats["preemptions"] > 0, stats
        assert [g.token_ids for g in out] == alone, (preemption, chunked)
        assert all(conforms(json.loads(g.text), PERSON) for g in out)


def test_the_bitmask_is_filled_on_the_mask_thread_during_the_forward(model_dir):
    """Each step's bitmask fill is handed to the mask thread before that step's forward starts, and runs there
    (recorded, not replaced: the real fill and the real forward run)."""
    from energon_infer.worker.runtime import ModelRunner

    runner = ModelRunner.from_pretrained(model_dir, progress=False, block_size=4)
    so = StructuredOutput(json_schema=PERSON)
    runner.generate([[5, 6, 7]], SamplingParams(max_tokens=60, structured=so, seed=1))  # makes the matchers' home
    masks = runner.sampler.grammars.masks
    events: list[tuple[str, str]] = []

    def recorded(name: str, fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            events.append((name, threading.current_thread().name))
            return fn(*args, **kw)
        return call

    runner.forward = recorded("forward", runner.forward)  # type: ignore[method-assign]
    masks.fill_async = recorded("submit", masks.fill_async)  # type: ignore[method-assign]
    masks._fill = recorded("fill", masks._fill)  # type: ignore[method-assign]
    out = runner.generate([[8, 9]], SamplingParams(max_tokens=60, structured=so, seed=2))[0]
    assert conforms(json.loads(out.text), PERSON)
    steps = [what for what, _ in events if what != "fill"]
    assert steps.count("submit") == len(out.token_ids) == steps.count("forward")  # one mask per sampled token
    assert all(a == "submit" and b == "forward" for a, b in zip(steps[::2], steps[1::2]))  # each before its forward
    assert {name.split("_")[0] for what, name in events if what == "fill"} == {"energon-mask"}


# ---------------------------------------------------------------------- what a step carries to the rank


def test_a_step_carries_the_constraint_and_the_rank_compiles_it_again_after_a_restart(model_dir, monkeypatch):
    """The engine checks a schema (so a bad one is refused before it runs) and the step carries the constraint
    only (ON_RANK: no compiled grammar, the step a fraction of xgrammar's JSON of it); the rank compiles it and gives
    the same output each time, also in the new group that replaces a worker killed while idle."""
    import os
    import pickle
    import signal
    import time

    import xgrammar

    from energon_infer.engine.engine import Engine
    from energon_infer.protocol import Step
    from energon_infer.structured import ON_RANK, json_grammar, tokenizer_info
    from energon_infer.worker.workers import SpawnedWorkerGroup

    sent: list[Step] = []
    real_send = SpawnedWorkerGroup.send

    def recording(self: Any, cmd: Any) -> None:
        if isinstance(cmd, Step) and any(p.structured is not None for p in cmd.new_params.values()):
            sent.append(cmd)
        real_send(self, cmd)

    monkeypatch.setattr(SpawnedWorkerGroup, "send", recording)
    so = StructuredOutput(json_schema=PERSON)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, structured=so)

    def run_once() -> tuple[list[int], str | None, int]:
        n = len(sent)
        out = eng.generate(["the quick"], params)[0]
        assert out.finish_reason == "stop" and conforms(json.loads(out.text), PERSON)
        (step,) = sent[n:]  # one new sequence: one step carries its params
        (p,) = step.new_params.values()
        return out.token_ids, p.structured.compiled, len(pickle.dumps(step))

    with Engine.from_pretrained(model_dir, max_restarts=1, **OPTS) as eng:
        first, carried, first_bytes = run_once()
        info = tokenizer_info(eng.tokenizer, eng.vocab_size, eng.eos_token_ids)
        compiled_json = xgrammar.GrammarCompiler(info).compile_grammar(json_grammar(so))
        assert carried == ON_RANK and first_bytes < len(compiled_json.serialize_json()) // 2
        again, carried, _ = run_once()
        assert carried == ON_RANK and again == first
        pid = eng.health()["pids"][0]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (eng.health()["restarts"] == 1 and eng.health()["status"] in ("ready", "degraded")
                   and eng.health()["pids"][0] != pid):
            assert time.monotonic() < deadline, eng.health()
            time.sleep(0.05)
        after, carried, _ = run_once()
        assert carried == ON_RANK and after == first


def test_a_grammar_that_fails_on_the_rank_fails_its_request_alone(model_dir):
    """A new sequence's grammar is compiled on the mask thread beside the forward; one that cannot compile there
    fails that sequence (its error names the grammar), and the other sequence of the same steps keeps its own."""
    from energon_infer.structured import ON_RANK
    from energon_infer.worker.runtime import ModelRunner

    runner = ModelRunner.from_pretrained(model_dir, progress=False, block_size=4)
    tok = runner.tokenizer
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput(grammar="root ::= undefined_rule",
                                                                   compiled=ON_RANK))
    good = SamplingParams(max_tokens=8, structured=StructuredOutput(choice=("yes", "no"), compiled=ON_RANK))
    res = runner.step([(1, [5, 6, 7]), (2, [8, 9])], {1: bad, 2: good})
    assert set(res.errors) == {1} and "undefined_rule" in res.errors[1]
    runner.free(1)
    text = [res.tokens[1]]
    while len(text) < 8 and text[-1] not in runner.eos_token_ids:
        res = runner.step([(2, [text[-1]])])
        assert not res.errors
        text.append(res.tokens[0])
    assert tok.decode([t for t in text if t not in runner.eos_token_ids]) in ("yes", "no")
