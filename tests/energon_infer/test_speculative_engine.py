"""Speculative decoding through the engine (spawned worker, the controller, delivery, /metrics): outputs, streams,
logprobs, stop strings and n as without it; the options' errors before any worker starts."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from energon_infer import ModelRunner, SamplingParams
from energon_infer.engine.engine import Engine
from energon_infer.errors import OptionError
from energon_infer.scheduling.speculation import SpeculativeConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [12, 13], list(range(20, 61)), [50]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTS = dict(progress=False, threads_per_worker=1, block_size=4, kv_cache_tokens=2048)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from energon_infer.demo import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("spec_engine") / "m", layers=2, hidden=32, heads=4, kv_heads=2,
                              intermediate=64, max_positions=256)


@pytest.fixture(scope="module")
def alone(model_dir):
    runner = ModelRunner.from_pretrained(model_dir, progress=False, block_size=4)
    return runner


@pytest.fixture(scope="module")
def engine(model_dir):
    # The model drafts for itself: every greedy proposal is accepted, so each step carries several tokens.
    spec = SpeculativeConfig(method="draft", draft_model=str(model_dir), num_speculative_tokens=3, adaptive=False)
    with Engine.from_pretrained(model_dir, speculative=spec, **OPTS) as eng:
        yield eng


def test_engine_outputs_streams_and_logprobs_as_without_speculation(engine, alone):
    # The default two steps in flight: a speculating request sits out the step planned while it is verified.
    assert engine.config.depth == 2 and engine.scheduler.speculator.config.method == "draft"
    steps0 = engine.metrics.steps
    out = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == [g.token_ids for g in alone.generate(PROMPTS, GREEDY)]
    assert engine.metrics.steps - steps0 < GREEDY.max_tokens  # several tokens per step
    seeded = [SamplingParams(temperature=0.9, seed=i, max_tokens=10, ignore_eos=True) for i in range(len(PROMPTS))]
    assert [c.token_ids for c in engine.generate(PROMPTS, seeded)] == [
        g.token_ids for g in alone.generate(PROMPTS, seeded)]
    lp = dataclasses.replace(GREEDY, logprobs=2)

    async def consume(prompt, params):
        return [e async for e in engine.stream(prompt, params)]

    events = asyncio.run(consume("every rank holds a slice", lp))
    final = events[-1].completion
    assert [e.token_id for e in events] == final.token_ids and len(final.token_ids) == lp.max_tokens
    assert [e.logprobs for e in events] == final.logprobs  # each event its own token's, not the step's last
    assert "".join(e.text for e in events) == final.text
    assert final.token_ids == alone.generate(["every rank holds a slice"], GREEDY)[0].token_ids
    # n completions of one prompt (the server submits one request per choice): each as alone.
    same = engine.generate([PROMPTS[0]] * 3, GREEDY)
    assert all(c.token_ids == out[0].token_ids for c in same)
    metrics = engine.render_metrics()
    assert "energon_spec_proposed_tokens_total" in metrics and "energon_spec_acceptance_ratio" in metrics
    spec = engine.scheduler.speculator  # sampled requests reject some proposals; the counts agree
    assert (engine.metrics.spec_proposed, engine.metrics.spec_accepted) == (spec.proposed, spec.accepted)
    assert 0 < spec.accepted < spec.proposed


def test_stop_strings_cut_an_accepted_run(engine):
    long = dataclasses.replace(GREEDY, max_tokens=24)
    full = engine.generate(["every rank holds a slice"], long)[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]

    async def consume():
        return [e async for e in engine.stream("every rank holds a slice", dataclasses.replace(long, stop=(stop,)))]

    events = asyncio.run(consume())
    final = events[-1].completion
    assert final.finish_reason == "stop" and final.text == full[: full.find(stop)]
    assert "".join(e.text for e in events) == final.text and stop not in final.text


def test_options_fail_before_any_worker_starts(model_dir, tmp_path):
    from energon_infer.demo import write_random_llama

    with pytest.raises(OptionError, match="num_speculative_tokens=0 must be an integer >= 1"):
        Engine.from_pretrained(model_dir, speculative={"method": "ngram", "num_speculative_tokens": 0}, **OPTS)
    with pytest.raises(OptionError, match="speculative decoding runs on one worker"):
        Engine.from_pretrained(model_dir, speculative="ngram", tp=2, **OPTS)
    other = write_random_llama(tmp_path / "other", vocab=300, layers=1, hidden=16, heads=2, kv_heads=1,
                               intermediate=32)
    with pytest.raises(OptionError, match="has vocab_size=300 but the served model 256"):
        Engine.from_pretrained(model_dir, speculative=str(other), **OPTS)


def test_serve_flags_fail_in_one_line(model_dir, tmp_path):
    import subprocess
    import sys

    from energon_infer.demo import write_random_llama

    def serve(*flags):
        return subprocess.run([sys.executable, "-m", "tightfit.cli", "serve", str(model_dir), "--port", "0", *flags],
                              capture_output=True, text=True, timeout=300)

    out = serve("--num-speculative-tokens", "3")
    assert out.returncode == 2 and "--num-speculative-tokens 3 needs --speculative ngram" in out.stderr
    other = write_random_llama(tmp_path / "other", vocab=300, layers=1, hidden=16, heads=2, kv_heads=1,
                               intermediate=32)
    out = serve("--speculative", str(other))
    assert out.returncode != 0 and "has vocab_size=300 but the served model 256" in out.stderr
    assert "Traceback" not in out.stderr and "serving" not in out.stderr


def test_per_request_counts_in_the_response(engine):
    """A completion carries its speculation counts; the response's ``metrics.speculative_decoding`` is vLLM's shape
    (single-sequence requests only), and its numbers are the engine's for that request."""
    from energon_infer.serving.openai_format import CompletionReply

    spec = engine.scheduler.speculator
    before = (spec.proposed, spec.accepted, spec.steps)
    (done,) = engine.generate([PROMPTS[2]], GREEDY)
    proposed, accepted, steps = (a - b for a, b in zip((spec.proposed, spec.accepted, spec.steps), before))
    assert done.spec_proposed == proposed > 0 and len(done.spec_histogram) == 3 + 1  # num_speculative_tokens=3
    answer = CompletionReply("cmpl-1", "m", [""], 1, None).response([done], len(PROMPTS[2]))
    got = answer["metrics"]["speculative_decoding"]
    assert (got["num_draft_tokens"], got["num_accepted_draft_tokens"], got["num_spec_steps"]) == (proposed, accepted,
                                                                                                     steps)
    assert got["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert got["draft_acceptance_rate"] == pytest.approx(accepted / proposed) and got["num_spec_tokens"] == 3
    assert answer["usage"]["completion_tokens"] == GREEDY.max_tokens
    two = engine.generate([PROMPTS[2]] * 2, GREEDY)  # n > 1: left out, as vLLM does
    assert "metrics" not in CompletionReply("cmpl-2", "m", [""], 2, None).response(two, len(PROMPTS[2]))


def test_a_structured_request_beside_speculating_ones_keeps_its_grammar_and_theirs_stay_exact(engine, alone):
    import re

    from energon_infer.structured import StructuredOutput

    constrained = SamplingParams(temperature=0, max_tokens=12, structured=StructuredOutput(regex="[a-c]{3,6}"))
    proposed0 = engine.scheduler.speculator.proposed
    out = engine.generate([PROMPTS[0], PROMPTS[2], "every rank"], [GREEDY, GREEDY, constrained])
    assert re.fullmatch("[a-c]{3,6}", out[2].text), out[2].text
    assert [c.token_ids for c in out[:2]] == [g.token_ids for g in alone.generate([PROMPTS[0], PROMPTS[2]], GREEDY)]
    assert engine.scheduler.speculator.proposed > proposed0  # the others speculated once the grammar's steps ended


def test_a_stream_ends_with_the_requests_speculative_counts(engine):
    """vLLM puts a request's ``metrics.speculative_decoding`` on its stream's final chunk: the same counts as the
    answer without streaming (greedy, the model drafting for itself: the same steps); ``n > 1`` leaves them out."""
    import json

    import httpx

    from energon_infer.serving.server import BackgroundServer, ServerConfig

    def sse(r):
        lines = [x[len("data: "):] for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(x) for x in lines[:-1]]

    req = {"model": "m", "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with BackgroundServer(engine, ServerConfig(port=0)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        whole = client.post("/v1/completions", json=req).json()
        with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
            chunks = sse(r)
        chat = {"model": "m", "messages": [{"role": "user", "content": "every rank"}], "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            chat_chunks = sse(r)
        with client.stream("POST", "/v1/completions", json={**req, "n": 2, "stream": True}) as r:
            two = sse(r)
    expected = whole["metrics"]["speculative_decoding"]
    assert expected["num_draft_tokens"] > 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["metrics"]["speculative_decoding"] == expected
    assert all("metrics" not in c for c in chunks[:-1])
    assert chat_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chat_chunks[-1]["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0
    assert all("metrics" not in c for c in two)
