"""Where a structured output's grammar is built and compiled: the engine checks it (its grammar built without the
vocabulary, once per constraint) and compiles nothing; the rank that samples compiles it, once per constraint; a
bad schema is a 400 before the request is admitted; a grammar that fails to compile on the rank fails its request
alone, with a 400. Counted by the counters the code keeps (``compiles()``, ``CHECKS.checks``,
``GrammarMasks.compiles``), on the real engine, server and runner."""

from __future__ import annotations

import json
from typing import Any

import pytest

from energon_infer.sampling import SamplingParams
from energon_infer.structured import (
    CHECKS,
    ON_RANK,
    CheckCache,
    StructuredOutput,
    StructuredOutputError,
    compiles,
)
from tests.energon_infer.test_structured_outputs import OPTS, PERSON, conforms, write_model
from tests.helpers.runif import RunIf

pytest.importorskip("xgrammar")
pytestmark = RunIf(serve=True)


def _person(nonce: int) -> dict[str, Any]:
    """PERSON with bounds no other test uses: a constraint neither side has seen."""
    schema = json.loads(json.dumps(PERSON))
    schema["properties"]["age"]["maximum"] = 1000 + nonce
    return schema


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("structured-compile") / "tiny-json")


@pytest.fixture(scope="module")
def engine(model_dir):
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(model_dir, **OPTS) as eng:
        yield eng


def test_the_engine_compiles_nothing_and_checks_a_constraint_once(engine):
    """Requests with a fresh schema (and a copy of it with its keywords in another order) run valid; this process
    (the engine's: its ranks are other processes) compiled no grammar and built the schema's grammar once."""
    schema = _person(1)
    compiled, checked = compiles(), CHECKS.checks
    so = StructuredOutput(json_schema=schema)
    outs = engine.generate(["a", "b c"], [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured=so)
                                          for i in range(2)])
    outs += engine.generate(["again"], SamplingParams(max_tokens=200, structured=StructuredOutput(
        json_schema=dict(reversed(list(schema.items()))))))
    for out in outs:
        assert out.finish_reason == "stop" and conforms(json.loads(out.text), schema)
    assert compiles() == compiled
    assert CHECKS.checks - checked == 1


def test_a_bad_schema_is_a_400_before_admission(engine):
    from energon_infer.serving.http_guard import engine_error

    bad = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "strng"}}})
    prompt_tokens, checked = engine.metrics.prompt_tokens, CHECKS.checks
    for _ in range(2):  # refused again from the cached outcome
        with pytest.raises(StructuredOutputError, match=r"json_schema at #/properties/a cannot be compiled") as err:
            engine.submit("hello", SamplingParams(max_tokens=4, structured=bad))
        assert engine_error(err.value).status == 400
    assert engine.metrics.prompt_tokens == prompt_tokens  # nothing was admitted
    assert CHECKS.checks - checked == 1


def test_a_grammar_that_fails_on_the_rank_ends_its_request_alone_with_a_400(engine):
    """A grammar given as checked (``compiled=ON_RANK``: prepare leaves it) that cannot compile on the rank fails
    its request with a 400-class error; the request beside it in the same steps completes."""
    from energon_infer.engine.delivery import RequestRefusedError
    from energon_infer.serving.http_guard import engine_error

    bad = SamplingParams(max_tokens=8, structured=StructuredOutput(grammar="root ::= undefined_rule",
                                                                   compiled=ON_RANK))
    good = SamplingParams(max_tokens=8, ignore_eos=True)
    futures = engine.submit_all([("first", bad), ("second", good)])
    with pytest.raises(RequestRefusedError, match="structured output refused: .*undefined_rule") as err:
        futures[0].result(120)
    assert engine_error(err.value).status == 400
    assert len(futures[1].result(120).token_ids) == 8
    assert engine.health()["status"] == "ready"


def test_the_rank_compiles_each_constraint_once(model_dir):
    """On the rank that samples (in process here): two sequences with one constraint and one with another compile
    two grammars; a later sequence with the first constraint compiles none."""
    from energon_infer.worker.runtime import ModelRunner

    runner = ModelRunner.from_pretrained(model_dir, progress=False, block_size=4)
    a = SamplingParams(max_tokens=8, structured=StructuredOutput(json_schema=_person(2), compiled=ON_RANK))
    b = SamplingParams(max_tokens=8, structured=StructuredOutput(choice=("yes", "no"), compiled=ON_RANK))
    before = compiles()
    res = runner.step([(1, [5, 6, 7]), (2, [8, 9]), (3, [10])], {1: a, 2: a, 3: b})
    assert not res.errors
    masks = runner.sampler.grammars.masks
    assert masks is not None and masks.compiles == 2
    res = runner.step([(4, [11, 12])], {4: a})
    assert not res.errors and masks.compiles == 2 and compiles() - before == 2


def test_the_check_cache_keeps_outcomes_by_constraint():
    cache = CheckCache(size=2)
    good = [StructuredOutput(regex=f"a{{{n}}}") for n in range(3)]
    for so in good + good[-1:]:
        cache.check(so)
    assert cache.checks == 3  # the last one again: a hit
    cache.check(good[0])  # dropped past size: built again
    assert cache.checks == 4
    with pytest.raises(StructuredOutputError, match="regex cannot be compiled"):
        cache.check(StructuredOutput(regex="a("))


@pytest.mark.parametrize("seed", range(4))
def test_the_bitmask_masks_its_rows_like_a_reference(seed):
    """The sampler's mask (xgrammar's CPU kernel for float32 CPU logits) against a per-token reference, on a batch
    where only some rows are constrained and their bitmask rows come in another order."""
    import torch

    from energon_infer.sampling import _mask_rows

    gen = torch.Generator().manual_seed(seed)
    width = 100  # not a multiple of 32
    words = -(-width // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    rows = [0, 2, 3, 4, 5]  # the rows of the batch in scores
    masked = {5: 0, 2: 1, 0: 2}  # batch row -> its row of the bitmask
    scores = torch.randn(len(rows), width, generator=gen)
    expect = scores.clone()
    for j, i in enumerate(rows):
        if i in masked:
            for t in range(width):
                if not (int(bitmask[masked[i], t // 32]) >> (t % 32)) & 1:
                    expect[j, t] = float("-inf")
    assert torch.equal(_mask_rows(scores.clone(), rows, masked, bitmask), expect)


def test_properties_come_in_the_schema_order(engine):
    """The grammar keeps the schema's property order (a tool call's name before its arguments), whatever the
    sampler draws; the same schema with its keys in another order is another constraint."""
    from energon_infer.serving.tool_calls import required_schema

    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 9}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    for seed in range(3):
        out = engine.generate(["order"], SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                                                        structured=StructuredOutput(json_schema=schema)))[0]
        assert list(json.loads(out.text)) == ["zeta", "alpha"]
    calls = required_schema([("f", {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                                    "additionalProperties": False})])
    out = engine.generate(["call"], SamplingParams(temperature=1.0, seed=1, max_tokens=80,
                                                   structured=StructuredOutput(json_schema=calls)))[0]
    assert all(list(call) == ["name", "arguments"] for call in json.loads(out.text))
    flipped = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    assert StructuredOutput(json_schema=flipped) != StructuredOutput(json_schema=schema)


@pytest.mark.parametrize(("text", "ok"), [
    (rb'{"a": "\ud83d\ude00 \u00e9 \uFFFD"}', True),  # a surrogate pair, and escapes outside the surrogates
    ('{"a": "\u8e69 \U0001f600"}'.encode(), True),  # raw UTF-8 of 3 and 4 bytes
    (rb'{"a": "\ud800"}', False), (rb'{"a": "\udc00x"}', False), (rb'{"a": "\ud83d\u0041"}', False),
    (b'{"a": "\xed\xac\x82"}', False),  # the 3 bytes that would encode U+DB02: not UTF-8
])
def test_strings_hold_no_surrogate(engine, text, ok):
    """A JSON string the grammar allows has no lone surrogate escape and no surrogate's bytes, which Pydantic's
    JSON parser (the independent reference) refuses."""
    import xgrammar
    from pydantic import BaseModel, ValidationError

    from energon_infer.structured import json_grammar, tokenizer_info

    class A(BaseModel):
        a: str

    info = tokenizer_info(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(json_grammar(StructuredOutput(json_object=True)))
    matcher = xgrammar.GrammarMatcher(compiled)
    assert (matcher.accept_string(text) and matcher.accept_token(engine.eos_token_ids[0])) == ok
    try:
        A.model_validate_json(text)
        parses = True
    except ValidationError:
        parses = False
    assert parses == ok
