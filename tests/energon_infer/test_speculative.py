"""Speculative decoding in one process (the scheduler driving ModelRunner.run_step, as ModelRunner.generate does):
greedy outputs equal to decoding without it and to transformers' generate; seeded sampling identical and unseeded
sampling equal in distribution (a stated bound, fixed seeds); max_tokens, stop tokens, logprobs, the prefix cache
and preemption as without it; the n-gram proposer and the options' one-line errors."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.errors import OptionError
from energon_infer.scheduling.speculation import NgramProposer, SpeculativeConfig, Speculator, ngram_propose
from energon_infer.worker import speculative
from energon_infer.worker.draft import DraftProposer, check_draft
from energon_infer.worker.kv_cache import KVCache
from energon_infer.worker.offline import run_offline
from tests.energon_infer.tiny import hf_greedy, hf_model, save_tiny

# Repeated runs in the prompts (prompt lookup finds them), a short one, a multi-block one.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [12, 13], [*range(20, 41), *range(20, 30)], [50]]
NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    return {name: save_tiny(name, root / name) for name in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def runners(dirs) -> dict[str, ModelRunner]:
    return {name: ModelRunner.from_pretrained(d, progress=False, block_size=4, kv_cache_tokens=1024)
            for name, d in dirs.items()}


def _run(runner, prompts, params, speculator=None, *, ids=-1000, stats=None, **kw):
    opts = dict(kv_admission="reserve", prefix_caching=False, chunked_prefill=False, preemption="recompute")
    plist = params if isinstance(params, list) else [params] * len(prompts)
    out = run_offline(runner, prompts, plist, seq_ids=itertools.count(ids, -1), decode=None,
                      stats=stats, speculator=speculator, **{**opts, **kw})
    return out


def _spec(method, model_dir, *, k=4, adaptive=False, kv_tokens=1024) -> Speculator:
    if method == "ngram":
        return Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3,
                                            adaptive=adaptive), NgramProposer(1, 3))
    cfg = SpeculativeConfig(method="draft", draft_model=str(model_dir), num_speculative_tokens=k, adaptive=adaptive)
    return Speculator(cfg, DraftProposer.from_pretrained(model_dir, block_size=4, kv_cache_tokens=kv_tokens,
                                                         dtype="float32"))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_equals_plain_decoding_and_transformers(dirs, runners, family, method):
    runner = runners[family]
    plain = [g.token_ids for g in _run(runner, PROMPTS, GREEDY)]
    assert plain == hf_greedy(dirs[family], PROMPTS, NEW)  # the reference itself is transformers'
    stats: dict = {}
    spec = [g.token_ids for g in _run(runner, PROMPTS, GREEDY, _spec(method, dirs[family]), stats=stats)]
    assert spec == plain
    assert stats["spec_proposed_tokens"] > 0
    if method == "draft":  # the model drafting for itself: every greedy proposal is accepted, steps shrink
        assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]
        assert stats["steps"] < NEW // 2
    else:  # a random model rarely repeats its prompt: proposals are rejected too, and the output is unchanged
        assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


def test_rejected_slots_and_the_prefix_cache_stay_consistent(dirs, runners):
    """A small cache (preemptions), prefix caching on, two requests at a time, the same prompts twice: blocks named
    while speculating hold only accepted tokens, so later requests that hit them give the same tokens."""
    runner = runners["llama"]
    prompts = PROMPTS + [PROMPTS[0] + [9, 9], PROMPTS[2]]
    plain = [g.token_ids for g in _run(runner, prompts, GREEDY)]
    for method in ("ngram", "draft"):
        spec = _spec(method, dirs["llama"])
        reqs, sched = _drive(runner, prompts + prompts, GREEDY, spec, kv_blocks=14, max_running=3,
                             kv_admission="on_demand", prefix_caching=True)
        assert [r.generated for r in reqs] == plain + plain
        assert sched.blocks.hit_tokens > 0 and sched.preemptions > 0 and spec.proposed > 0
        assert sum(r.proposed for r in reqs) == spec.proposed and sum(r.accepted for r in reqs) == spec.accepted
    assert runner.cache.sequences() == []  # everything freed


def _drive(runner, prompts, params, speculator, **config):
    """The scheduler driven over ``runner`` as run_offline does, with its config and the requests kept."""
    from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig

    cache = runner.cache
    kw = dict(kv_blocks=cache.num_blocks, block_size=cache.block_size, max_context=128, max_batch_tokens=256)
    kw.update(config)
    sched = Scheduler(SchedulerConfig(**kw), block_ids=cache.free_block_ids()[:kw["kv_blocks"]],
                      seq_ids=itertools.count(-5000, -1), speculator=speculator)
    reqs = [sched.add(Request(str(i), p, params)) for i, p in enumerate(prompts)]
    try:
        while sched.waiting or sched.running:
            plan = sched.schedule(0)
            result = runner.run_step(plan.step)
            sched.complete(plan, result.tokens, result.logprobs, result.errors, result.accepted)
    finally:
        for seq_id in [*sched.take_frees(), *sched.running]:
            if seq_id in cache:
                runner.free(seq_id)
    return reqs, sched


def _drive_ahead(runner, prompts, params, speculator, *, depth=2, **config):
    """The scheduler with ``depth`` steps planned ahead, as the engine's controller and worker run it: a step is
    planned while the ones before it are in flight, runs in order (its placeholders filled with the previous step's
    sampled tokens, as :class:`~energon_infer.worker.token_feedback.TokenFeedback` does) and completes later.
    Returns the requests and the placeholders fed; asserts no step feeds a sequence whose proposals are in flight."""
    from collections import deque

    from energon_infer.scheduling.scheduler import PLACEHOLDER, Request, Scheduler, SchedulerConfig

    cache = runner.cache
    kw = dict(kv_blocks=cache.num_blocks, block_size=cache.block_size, max_context=128, max_batch_tokens=256,
              depth=depth, late_admission=False, **config)
    sched = Scheduler(SchedulerConfig(**kw), block_ids=cache.free_block_ids()[:kw["kv_blocks"]],
                      seq_ids=itertools.count(-7000, -1), speculator=speculator)
    reqs = [sched.add(Request(str(i), p, params)) for i, p in enumerate(prompts)]
    inflight: deque = deque()
    back: dict[int, int] = {}
    placeholders = 0
    try:
        while sched.waiting or sched.running or inflight:
            plan = sched.schedule(0) if len(inflight) < depth else None
            if plan is None:
                assert inflight, "the scheduler planned no step with requests left"
                done, result = inflight.popleft()
                sched.complete(done, result.tokens, result.logprobs, result.errors, result.accepted)
                continue
            step = plan.step
            verifying = {s for p, _ in inflight for s in p.step.proposals}
            assert not verifying & {s for s, _ in step.items}, "fed while its proposals are being verified"
            placeholders += sum(t == [PLACEHOLDER] for _, t in step.items)
            items = [(s, [back[s]] if t == [PLACEHOLDER] else t) for s, t in step.items] if step.take_back else None
            result = runner.run_step(step, items)
            if step.send_back:
                back = dict(zip((s for s, _ in step.items), result.tokens))
            inflight.append((plan, result))
    finally:
        for seq_id in [*sched.take_frees(), *sched.running]:
            if seq_id in cache:
                runner.free(seq_id)
    return reqs, placeholders


class _Wrong:
    """Proposes ``token`` (one the model never emits here) for every request: every proposal is rejected."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, batch):
        return {seq_id: [self.token] * k for seq_id, _, k in batch}

    def release(self, seq_ids):
        return None


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_two_steps_in_flight_keep_greedy_outputs(dirs, runners, method, adaptive):
    """The engine's default depth (two steps of a group in flight): a speculating request sits out the step planned
    while its proposals are verified, and outputs are those of plain decoding, batched and alone."""
    runner = runners["llama"]
    plain = [g.token_ids for g in _run(runner, PROMPTS, GREEDY)]
    spec = _spec(method, dirs["llama"], adaptive=adaptive)
    reqs, _ = _drive_ahead(runner, PROMPTS, GREEDY, spec)
    assert [r.generated for r in reqs] == plain and spec.proposed > 0
    if method == "draft":
        assert spec.accepted == spec.proposed  # the model drafting for itself
    alone, _ = _drive_ahead(runner, PROMPTS[2:3], GREEDY, _spec(method, dirs["llama"], adaptive=adaptive))
    assert alone[0].generated == plain[2]


def test_two_steps_in_flight_where_proposals_keep_failing(runners):
    """Proposals that are never accepted: adaptive speculation turns itself down and the requests run as
    placeholders in the steps planned ahead (two steps in flight, as without speculation); outputs unchanged."""
    runner = runners["llama"]
    plain = [g.token_ids for g in _run(runner, PROMPTS, GREEDY)]
    wrong = next(t for t in range(100) if all(t not in out for out in plain))
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    spec = Speculator(cfg, _Wrong(wrong))
    reqs, placeholders = _drive_ahead(runner, PROMPTS, GREEDY, spec)
    assert [r.generated for r in reqs] == plain and spec.proposed > 0 and spec.accepted == 0
    _, pipelined = _drive_ahead(runner, PROMPTS, GREEDY, None)
    assert placeholders >= 0.75 * pipelined > 0  # most decodes still planned ahead
    fixed = Speculator(dataclasses.replace(cfg, adaptive=False), _Wrong(wrong))
    _, waiting = _drive_ahead(runner, PROMPTS, GREEDY, fixed)  # not adaptive: it always waits to propose
    assert waiting < 0.25 * pipelined


def test_max_tokens_stop_tokens_and_logprobs_as_without_speculation(dirs, runners):
    runner = runners["llama"]
    spec = _spec("draft", dirs["llama"], k=4)
    for n in (1, 2, 3, 5):  # never past max_tokens, however many proposals were accepted
        p = dataclasses.replace(GREEDY, max_tokens=n)
        assert [g.token_ids for g in _run(runner, PROMPTS, p, spec)] == [g.token_ids for g in _run(runner, PROMPTS, p)]
        assert all(len(g.token_ids) == n for g in _run(runner, PROMPTS, p, spec))
    plain = _run(runner, PROMPTS, GREEDY)
    stop = plain[2].token_ids[6]  # a token the third prompt reaches in the middle of an accepted run
    p = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    got, want = _run(runner, PROMPTS, p, spec), _run(runner, PROMPTS, p)
    assert [(g.token_ids, g.finish_reason) for g in got] == [(g.token_ids, g.finish_reason) for g in want]
    assert got[2].finish_reason == "stop" and got[2].token_ids[-1] == stop
    lp = dataclasses.replace(GREEDY, logprobs=3)
    a, b = _logprobs(runner, lp, spec), _logprobs(runner, lp, None)
    assert len(a) == len(b) == NEW * len(PROMPTS)
    for (t1, top1), (t2, top2) in zip(a, b):
        assert t1 == pytest.approx(t2, abs=1e-4) and [i for i, _ in top1] == [i for i, _ in top2]


def _logprobs(runner, params, speculator):
    # run_offline's Generation drops logprobs: the requests keep them.
    return [lp for r in _drive(runner, PROMPTS, params, speculator)[0] for lp in r.logprobs]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_draws_the_same_tokens(dirs, runners, method):
    """Each position draws with the request's seed and the position (counter-based noise), speculating or not."""
    runner = runners["llama"]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=NEW, ignore_eos=True)
              for i in range(len(PROMPTS))]
    stats: dict = {}
    spec = [g.token_ids for g in _run(runner, PROMPTS, params, _spec(method, dirs["llama"]), stats=stats)]
    assert spec == [g.token_ids for g in _run(runner, PROMPTS, params)]
    assert stats["spec_proposed_tokens"] > 0
    if method == "draft":  # both branches taken: accepted and rejected proposals
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


def test_penalties_verify_each_position_as_after_the_accepted_prefix(dirs, runners):
    """Presence, frequency and repetition penalties with speculation: each proposal's row is penalised for the
    proposals before it, the accepted ones count as output after, so greedy and seeded outputs equal plain
    decoding's (one step at a time and two in flight), with proposals both accepted and rejected. The model drafts
    for itself without the penalties, so its proposals are right until a penalty turns the argmax (penalised
    outputs avoid repeating themselves, so prompt lookup finds little to propose here)."""
    method = "draft"
    runner = runners["llama"]
    pen = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)
    greedy = dataclasses.replace(GREEDY, **pen)
    plain = [g.token_ids for g in _run(runner, PROMPTS, greedy)]
    assert plain != [g.token_ids for g in _run(runner, PROMPTS, GREEDY)]  # the penalties change the outputs
    stats: dict = {}
    assert [g.token_ids for g in _run(runner, PROMPTS, greedy, _spec(method, dirs["llama"]), stats=stats)] == plain
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    spec = _spec(method, dirs["llama"], adaptive=True)
    reqs, _ = _drive_ahead(runner, PROMPTS, greedy, spec)
    assert [r.generated for r in reqs] == plain and spec.proposed > 0
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=NEW, ignore_eos=True, **pen)
              for i in range(len(PROMPTS))]
    assert [g.token_ids for g in _run(runner, PROMPTS, seeded, _spec(method, dirs["llama"]))] == \
        [g.token_ids for g in _run(runner, PROMPTS, seeded)]


def _tv_bound(probs: list[float], n: int, delta: float = 1e-6) -> float:
    """Total variation between an ``n``-sample empirical distribution and ``probs``: its mean is at most
    ``sum(sqrt(p (1 - p) / n)) / 2``, and (McDiarmid, each draw moves it by at most 1/n) it exceeds that by more than
    ``sqrt(ln(1/delta) / (2 n))`` with probability below ``delta``."""
    return sum(math.sqrt(p * (1 - p) / n) for p in probs) / 2 + math.sqrt(math.log(1 / delta) / (2 * n))


TRAINED = Path(__file__).parent / "fixtures" / "trained_llama"  # a trained model: peaked, unlike a random one


def _sampled_checks(out, exact, greedy, n):
    """(TV of the second token against its exact marginal, its bound; the share of second tokens that are the
    greedy token after the first, its exact value, Hoeffding's bound at 1e-6)."""
    seen = Counter(g.token_ids[1] for g in out)
    tv = sum(abs(seen.get(t, 0) / n - p) for t, p in enumerate(exact)) / 2
    hits = sum(g.token_ids[1] == greedy[g.token_ids[0]] for g in out) / n
    return tv, _tv_bound(exact, n), hits, math.sqrt(math.log(2e6) / (2 * n))


def test_sampling_with_speculation_is_exact_in_distribution(monkeypatch):
    """Temperature 1, 2000 unseeded draws of the first 3 tokens of a trained model that drafts for itself (its greedy
    token proposed, accepted with the model's own probability of it): the second token's distribution is the model's
    exact marginal (transformers, summed over the first token) within the stated TV bound, and the share of second
    tokens equal to the draft's proposal is its exact value within Hoeffding's bound; plain sampling too, and a
    broken rule (accept every proposal) fails the same checks. Fixed seeds: deterministic, no flakes."""
    runner = ModelRunner.from_pretrained(TRAINED, progress=False, block_size=4, kv_cache_tokens=4096, dtype="float32")
    prompt, n = [5, 6, 7, 8, 5, 6], 2000
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    with torch.no_grad():
        model = hf_model(TRAINED)
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        second = torch.softmax(model(torch.tensor([[*prompt, t] for t in range(first.numel())])).logits[:, -1].double(),
                               -1)
        exact, greedy = (first[:, None] * second).sum(0).tolist(), second.argmax(-1).tolist()
        share = float((first * second.max(-1).values).sum())
    stats: dict = {}
    spec = _run(runner, [prompt] * n, params, _spec("draft", TRAINED, k=2, kv_tokens=20_000), ids=-10_000, stats=stats)
    plain = _run(runner, [prompt] * n, params, ids=-100_000)  # other sequence ids: independent draws
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    for out in (spec, plain):
        tv, tv_bound, hits, hit_bound = _sampled_checks(out, exact, greedy, n)
        assert tv < tv_bound and abs(hits - share) < hit_bound, (tv, tv_bound, hits, share, hit_bound)
    monkeypatch.setattr(speculative, "accept_lengths", lambda proposed, drawn: len(proposed))
    broken = _run(runner, [prompt] * n, params, _spec("draft", TRAINED, k=2, kv_tokens=20_000), ids=-10_000)
    tv, tv_bound, hits, hit_bound = _sampled_checks(broken, exact, greedy, n)
    assert abs(hits - share) > hit_bound  # the checks above can fail


def test_ngram_proposals():
    assert ngram_propose([1, 2, 3, 4, 1, 2], k=3, min_n=1, max_n=3) == [3, 4, 1]
    assert ngram_propose([1, 2, 3, 9, 2, 3], k=2, min_n=2, max_n=2) == [9, 2]  # the latest earlier match
    assert ngram_propose([7, 1, 2, 7, 3, 2, 7], k=2, min_n=1, max_n=2) == [3, 2]  # longest n first: "2 7"
    assert ngram_propose([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []
    assert ngram_propose([4], k=3, min_n=1, max_n=3) == []
    assert NgramProposer(1, 2).propose([(1, [1, 2, 1], 4), (2, [5, 6], 4)]) == {1: [2, 1]}


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), n=st.tuples(st.integers(1, 3), st.integers(0, 2)),
       k=st.integers(1, 5), grow=st.integers(1, 4))
def test_the_indexed_proposer_equals_the_scan_as_a_sequence_grows(tokens, n, k, grow):
    lo, hi = n[0], n[0] + n[1]
    proposer = NgramProposer(lo, hi)
    for size in range(0, len(tokens) + 1, grow):  # several tokens a step, as an accepted run adds them
        got = proposer.propose([(7, tokens[:size], k)]).get(7, [])
        assert got == ngram_propose(tokens[:size], k=k, min_n=lo, max_n=hi)
    proposer.release([7])
    assert proposer.propose([(7, tokens[:3], k)]).get(7, []) == ngram_propose(tokens[:3], k=k, min_n=lo, max_n=hi)


def test_options_fail_in_one_line(dirs, tmp_path):
    with pytest.raises(OptionError, match="num_speculative_tokens=0 must be an integer >= 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(OptionError, match="method='eagle' is not one of"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(OptionError, match="a draft model goes with method='draft'"):
        SpeculativeConfig(method="draft")
    with pytest.raises(OptionError, match="prompt_lookup_min=3, prompt_lookup_max=2"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    other = save_tiny("llama", tmp_path / "other", vocab_size=103)
    (other / "tokenizer.json").unlink()
    with pytest.raises(OptionError, match="vocab_size=103 but the served model 101"):
        check_draft(_without_tokenizer(dirs["llama"], tmp_path), other)
    with pytest.raises(OptionError, match="has another tokenizer"):
        check_draft(dirs["llama"], _other_tokenizer(dirs["gpt2"], tmp_path))
    with pytest.raises(OptionError, match="is not a model directory"):
        check_draft(dirs["llama"], tmp_path / "nothing")
    check_draft(dirs["llama"], dirs["gpt2"])  # the same tokenizer: a draft of another family is fine


def _without_tokenizer(d: Path, tmp: Path) -> Path:
    out = tmp / "no_tok"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    return out


def _other_tokenizer(d: Path, tmp: Path) -> Path:
    import json

    out = tmp / "other_tok"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, another tokenizer
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def test_kv_cache_truncate_keeps_the_table():
    cache = KVCache(n_layers=1, num_blocks=4, block_size=4, n_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.assign(1, [0, 1])
    cache.prepare([(1, 7)], "cpu")
    cache.truncate(1, 5)
    assert cache.length(1) == 5 and cache.block_table(1) == [0, 1]
    with pytest.raises(ValueError, match="cannot truncate sequence 1 to 6 tokens: it holds 5"):
        cache.truncate(1, 6)
