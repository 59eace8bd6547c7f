"""longrope (Phi-3 / Phi-4-mini) sequences that pass the short/long switch while generating, against transformers.

transformers' ``generate`` recomputes a Phi-3 sequence whole, with the long factors, at the step whose input first
passes ``original_max_position_embeddings`` (16 in the tiny Phi-4-mini-shaped checkpoint); the scheduler recomputes
such a sequence too (:mod:`energon_infer.scheduling.rope_switch`). Greedy tokens (and the engine's logprobs) equal
transformers' ``generate`` in fp32 for prompts shorter than the switch that generate past it, beside prompts that
never reach it and prompts already past it; in chunks, with prefix caching, at tp=2 and through the engine's
spawned worker (steps planned ahead, where the token that passes the switch is still being sampled when the next
step is planned). The scheduler's own steps are checked against the rule written out as a plain loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.scheduling.blocks import BlockManager
from energon_infer.scheduling.requests import Request
from energon_infer.scheduling.rope_switch import LONG_ROOT
from energon_infer.scheduling.scheduler import PLACEHOLDER, Scheduler, SchedulerConfig
from tests.energon_infer.tiny import hf_model, save_tiny
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

SWITCH = 16  # the tiny checkpoint's original_max_position_embeddings
NEW = 14
# 7, 12 and 16 tokens (the last one exactly at the switch) pass it while generating 14 tokens; the 2-token prompt
# ends at 16 tokens, on the switch, never past it; the 5-token one stops at 9 (max_tokens 4); 21 tokens start past it.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [50, 51], list(range(20, 32)), list(range(30, 51)), list(range(3, 19)),
           [60, 61, 62, 63, 64]]
MAX_TOKENS = [NEW, NEW, NEW, NEW, NEW, 4]
CROSSING = sum(len(p) <= SWITCH < len(p) + n for p, n in zip(PROMPTS, MAX_TOKENS))
OPTS = dict(block_size=4, progress=False)


def _params(logprobs: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def phi_dir(tmp_path_factory) -> str:
    return str(save_tiny("phi4-mini", tmp_path_factory.mktemp("longrope") / "phi4-mini"))


@torch.no_grad()
def _transformers(path: str, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy ``generate`` of each prompt alone (fp32): its tokens and each token's log-probability."""
    model = hf_model(Path(path))
    out = []
    for p in prompts:
        res = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens = res.sequences[0, len(p):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(res.logits, tokens)]
        out.append((tokens, logprobs))
    return out


@pytest.fixture(scope="module")
def reference(phi_dir) -> list[tuple[list[int], list[float]]]:
    """Each prompt's first ``max_tokens`` tokens of transformers' generate (greedy: a prefix of a longer run)."""
    return [(t[:n], lp[:n]) for (t, lp), n in zip(_transformers(phi_dir, PROMPTS, NEW), MAX_TOKENS)]


def test_the_reference_does_recompute_at_the_switch(phi_dir, reference):
    """Kept from the short factors, the keys before the switch give other tokens than transformers' past it (so
    equality below means the recompute happened); up to the switch they are transformers'."""
    runner = ModelRunner.from_pretrained(phi_dir, **OPTS)
    p = PROMPTS[0]
    ids = list(p)
    for _ in range(NEW):  # one token a step, the cache kept across the switch
        logits = runner.forward([(0, ids[runner.cache.length(0):])])
        ids.append(int(logits[0].argmax()))
    assert ids[len(p):] != reference[0][0]
    assert ids[len(p):SWITCH + 1] == reference[0][0][:SWITCH + 1 - len(p)]


@pytest.mark.parametrize("mode,runtime", [
    (dict(), dict()),  # prompt + max_tokens reserved at admission
    (dict(chunked_prefill=True), dict(max_batch_tokens=8)),  # prompts and recomputes in chunks of at most 8 tokens
    (dict(kv_admission="on_demand", prefix_caching=True), dict()),
    # a cache of 12 blocks: sequences are preempted too, recomputed or swapped out and back, before or after the switch
    (dict(kv_admission="on_demand", preemption="recompute"), dict(kv_cache_tokens=48)),
    (dict(kv_admission="on_demand", preemption="swap"), dict(kv_cache_tokens=48, swap_space_tokens=64)),
])
def test_sequences_passing_the_switch_while_generating_equal_transformers(phi_dir, reference, mode, runtime):
    runner = ModelRunner.from_pretrained(phi_dir, **OPTS, **runtime)
    stats: dict[str, int] = {}
    gens = runner.generate(PROMPTS, _params(), stats=stats, **mode)
    assert [g.token_ids for g in gens] == [t for t, _ in reference]
    assert all(g.finish_reason == "length" for g in gens)
    assert stats["rope_recomputes"] == CROSSING == 3  # once per sequence that passes it, never for the others
    assert stats["preemptions"] > 0 if "kv_cache_tokens" in runtime else stats["preemptions"] == 0
    assert runner.cache.free_blocks == runner.cache.num_blocks


def test_with_a_sliding_window_on_every_layer_the_recompute_holds_only_the_windows_blocks(tmp_path):
    """Phi-3 with a 6-token window: the recompute runs in steps no longer than the prompt, its blocks before the
    window released as it goes (as after a preemption), and the tokens stay transformers'."""
    path = str(save_tiny("phi4-mini", tmp_path / "phi4-window", sliding_window=6))
    want = [t for t, _ in _transformers(path, PROMPTS, NEW)]
    runner = ModelRunner.from_pretrained(path, max_batch_tokens=8, **OPTS)
    assert runner.kv_window == 6
    stats: dict[str, int] = {}
    gens = runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), stats=stats,
                           kv_admission="on_demand", chunked_prefill=True)
    assert [g.token_ids for g in gens] == want
    assert stats["rope_recomputes"] == 4  # the 5-token prompt passes the switch too with 14 tokens


def test_a_prompt_past_the_switch_in_chunks_rotates_with_the_whole_prompts_length(phi_dir, reference):
    """The 21-token prompt in chunks of 4: every chunk with the long factors (as transformers' one call), not
    the short ones its first 16 tokens of context would give."""
    runner = ModelRunner.from_pretrained(phi_dir, max_batch_tokens=4, **OPTS)
    gens = runner.generate([PROMPTS[3]], _params()[3], chunked_prefill=True)
    assert gens[0].token_ids == reference[3][0]


def test_the_prefix_cache_never_hands_short_blocks_to_a_long_sequence(phi_dir):
    """A short prompt's first blocks are cached (short factors) when a prompt past the switch starting with the
    same 8 tokens arrives: it computes its own; the short one, recomputed past the switch, then shares the long
    one's blocks, as does a third long prompt with the same start."""
    head = [70, 71, 72, 73, 74, 75, 76, 77]
    prompts = [head + [1, 2, 3, 4], head + list(range(80, 90)), head + list(range(80, 86)) + [9, 9, 9, 9]]
    want = [t for t, _ in _transformers(phi_dir, prompts, 8)]
    runner = ModelRunner.from_pretrained(phi_dir, max_batch_tokens=8, **OPTS)
    stats: dict[str, int] = {}
    gens = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), stats=stats,
                           kv_admission="on_demand", prefix_caching=True, chunked_prefill=True)
    assert [g.token_ids for g in gens] == want
    assert stats["rope_recomputes"] == 1 and stats["prefix_hit_tokens"] >= 16


def _tp2(rank: int, world: int, path: str) -> list[list[int]]:
    runner = ModelRunner.from_pretrained(path, tp=2, **OPTS)
    stats: dict[str, int] = {}
    gens = runner.generate(PROMPTS, _params(), stats=stats, kv_admission="on_demand", prefix_caching=True)
    assert stats["rope_recomputes"] == CROSSING
    return [g.token_ids for g in gens]


@RunIf(min_world=2)
def test_at_tp2_sequences_passing_the_switch_equal_transformers(phi_dir, reference):
    out = run_distributed(_tp2, 2, args=(phi_dir,), timeout=300)
    assert out[0] == out[1] == [t for t, _ in reference]


def test_the_engine_with_steps_planned_ahead_equals_transformers_and_its_logprobs(phi_dir, reference):
    """A spawned worker, two steps in flight: the token that passes the switch is still being sampled when the
    next step is planned, so the sequence waits for it, then is recomputed. Tokens, logprobs and streamed events
    as transformers' (every token once)."""
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(phi_dir, threads_per_worker=1, kv_cache_tokens=512, **OPTS) as engine:
        assert engine.scheduler.config.rope_switch == SWITCH and engine.scheduler.config.depth == 2
        events: list[list[int | None]] = [[] for _ in PROMPTS]
        futures = [engine.submit(p, sp, listener=lambda e, i=i: events[i].append(e.token_id))
                   for i, (p, sp) in enumerate(zip(PROMPTS, _params(logprobs=1)))]
        done = [f.result(timeout=300) for f in futures]
        assert engine.scheduler.rope_recomputes == CROSSING
    for c, stream, (tokens, logprobs) in zip(done, events, reference):
        assert c.token_ids == tokens == stream
        assert c.logprobs is not None and len(c.logprobs) == len(tokens)
        assert max(abs(got[0] - want) for got, want in zip(c.logprobs, logprobs)) <= 1e-4


# ---------------------------------------------------------------------- the scheduler's steps, without a model


def _drive(cfg: SchedulerConfig, prompt: list[int], max_tokens: int) -> tuple[Scheduler, list]:
    """Run one request to the end (its n-th token is 100 + n), ``cfg.depth`` steps in flight; every planned step."""
    s = Scheduler(cfg)
    req = s.add(Request("r", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    flight: list = []
    plans = []
    while s.has_work():
        plan = s.schedule(0) if len(flight) < cfg.depth else None
        if plan is not None:
            flight.append(plan)
            plans.append(plan)
            continue
        done = flight.pop(0)
        s.complete(done, [100 + len(req.generated)] * len(done.items))
        s.take_frees()
    assert req.generated == list(range(100, 100 + max_tokens))
    return s, plans


def _feeds(plans: list, tokens: list[int]) -> list[tuple[int, list[int], dict[int, int]]]:
    """Each step's ``(position of its first token, tokens fed, prefill_lengths)`` (a placeholder: the token it
    stands for); a restart starts again at 0."""
    out, at = [], 0
    for plan in plans:
        ((seq, fed),) = plan.step.items
        at = plan.step.starts.get(seq, at)
        out.append((at, [tokens[at]] if fed == [PLACEHOLDER] else fed, dict(plan.step.prefill_lengths)))
        at += len(fed)
    return out


@pytest.mark.parametrize("depth", [1, 2])
def test_the_scheduler_recomputes_a_sequence_once_when_it_passes_the_switch(depth):
    """Prompt of 5, switch at 8, steps of at most 6 tokens: the feed that would make the context 9 becomes a
    restart (its blocks freed, the sequence started again at 0) of all 9 known tokens, in chunks that say the
    prefill is 9 long; then decode as before. Planned ahead, that feed first waits for its token."""
    cfg = SchedulerConfig(kv_blocks=16, block_size=4, max_context=64, max_batch_tokens=6, chunked_prefill=True,
                          rope_switch=8, depth=depth)
    prompt, max_tokens = [1, 2, 3, 4, 5], 7
    s, plans = _drive(cfg, prompt, max_tokens)
    tokens = prompt + list(range(100, 100 + max_tokens))
    # The rule as a plain loop: the prompt, then one token a step, except the feed that passes the switch.
    want = [(0, prompt, {})]
    computed = len(prompt)
    for known in range(len(prompt) + 1, len(prompt) + max_tokens):
        if computed <= 8 < computed + 1:
            want += [(0, tokens[:6], {1: known}), (6, tokens[6:known], {})]
        else:
            want.append((computed, [tokens[computed]], {}))
        computed = known
    assert _feeds(plans, tokens) == want
    assert s.rope_recomputes == 1 and s.preemptions == 0
    restart = next(p for p in plans if p.step.prefill_lengths)
    assert restart.step.frees == [1] and restart.step.starts == {1: 0}
    assert PLACEHOLDER not in restart.step.items[0][1]


def test_long_and_short_blocks_are_named_in_separate_chains():
    m = BlockManager(num_blocks=8, block_size=4)
    m.start(1, [1, 2, 3, 4, 5])
    m.grow(1, 5)
    m.commit(1, [1, 2, 3, 4, 5])
    m.start(2, [1, 2, 3, 4, 6], root=LONG_ROOT)
    assert m.lookup([1, 2, 3, 4, 9])[0] != [] and m.lookup([1, 2, 3, 4, 9], LONG_ROOT)[0] == []
    m.grow(2, 5)
    m.commit(2, [1, 2, 3, 4, 6])
    assert m.lookup([1, 2, 3, 4, 9], LONG_ROOT)[0] == m.tables[2][:1] != m.lookup([1, 2, 3, 4, 9])[0]
