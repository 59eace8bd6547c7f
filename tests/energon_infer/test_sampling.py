"""Sampling (temperature, top-k, top-p, seeds) and stop conditions (tokens, strings, max tokens)."""

from __future__ import annotations

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.sampling import Sampler
from tests.energon_infer.tiny import PROMPTS


def _draws(logits, params, n=400):
    sampler = Sampler(seed=1)
    return [sampler.sample(logits, [i], [params])[0] for i in range(n)]  # a fresh sequence (generator) per draw


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    order = logits[0].argsort(descending=True).tolist()  # [5, 0, 1, 2, 3, 4]
    assert set(_draws(logits, SamplingParams(temperature=5.0, top_k=2))) == set(order[:2])
    # top_p: probs at T=1 are [.222, .082, .050, .030, .011, .605]; the top two hold 0.827, so 0.8 keeps
    # two tokens and 0.85 needs a third.
    assert set(_draws(logits, SamplingParams(top_p=0.8))) == set(order[:2])
    assert set(_draws(logits, SamplingParams(top_p=0.85))) == set(order[:3])
    assert set(_draws(logits, SamplingParams(top_p=0.01))) == {order[0]}  # the top token is always kept
    # With no filter every token appears at a high temperature.
    assert set(_draws(logits, SamplingParams(temperature=10.0))) == set(range(6))


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 0.0]])
    cold = _draws(logits, SamplingParams(temperature=0.2)).count(0) / 400
    hot = _draws(logits, SamplingParams(temperature=5.0)).count(0) / 400
    # P(token 0) = sigmoid(1 / T): 0.993 at T=0.2, 0.55 at T=5.
    assert cold > 0.95 and 0.4 < hot < 0.7


def test_seeded_requests_repeat_whatever_else_is_in_the_batch(tiny_dirs):
    runner = ModelRunner.from_pretrained(tiny_dirs["llama"], progress=False)
    p = SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=8, ignore_eos=True)
    alone = runner.generate([PROMPTS[0]], p)[0].token_ids
    batched = runner.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                              [SamplingParams(temperature=1.0, max_tokens=5), p, SamplingParams(temperature=0.7)])
    assert batched[1].token_ids == alone
    other_seed = runner.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_k=20, seed=99, max_tokens=8,
                                                              ignore_eos=True))[0].token_ids
    assert other_seed != alone
    greedy = runner.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    assert runner.generate([PROMPTS[0]], SamplingParams(top_k=1, seed=5, max_tokens=8,
                                                        ignore_eos=True))[0].token_ids == greedy


def test_nearby_seeds_draw_different_tokens():
    flat = torch.zeros(1, 4096)  # every token equally likely: equal draws mean equal noise
    draws = [Sampler().sample(flat, [0], [SamplingParams(temperature=1.0, seed=s)])[0] for s in range(8)]
    assert len(set(draws)) == len(draws), draws


def test_stop_tokens_strings_and_eos(tiny_dirs):
    runner = ModelRunner.from_pretrained(tiny_dirs["llama"], progress=False)
    greedy = runner.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = runner.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == greedy.token_ids[: first + 1] and out.finish_reason == "stop"
    # EOS from config.json (2) stops unless ignore_eos; force it by making it the stop of a short run.
    runner.eos_token_ids = (greedy.token_ids[1],)
    out = runner.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == greedy.token_ids[1]
    runner.eos_token_ids = ()
    # A stop string: the text is cut before it.
    text = greedy.text
    assert text and len(text) > 2
    piece = text[1:3]
    out = runner.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, stop=(piece,)))[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(piece)]
    assert runner.cache.free_blocks == runner.cache.num_blocks


def test_sampling_params_refuse_what_would_break_a_worker():
    import math

    for bad, match in (({"temperature": 1e-40}, "must be 0 \\(greedy\\) or in \\[0.01, 100\\]"),
                       ({"temperature": math.nan}, "temperature=nan must be a finite number"),
                       ({"temperature": math.inf}, "must be a finite number"),
                       ({"seed": 2**70}, "fits in 64 bits"), ({"seed": True}, "fits in 64 bits"),
                       ({"presence_penalty": 3}, "\\[-2, 2\\]"), ({"repetition_penalty": 0}, "\\(0, 10\\]"),
                       ({"logprobs": 21}, "\\[0, 20\\]")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63) and SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_logprobs_are_the_models_and_the_top_ones_come_sorted():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0], [0.0, 0.0, 5.0, 1.0]])
    out = Sampler().sample_rows(logits, [1, 2], [SamplingParams(temperature=0, logprobs=2),
                                                 SamplingParams(temperature=0.7, seed=0, logprobs=0)])
    ref = torch.log_softmax(logits, dim=-1)
    lp, top = out.logprobs[0]
    assert out.tokens[0] == 3 and lp == approx(float(ref[0, 3]))
    assert [t for t, _ in top] == [3, 0] and [v for _, v in top] == approx(ref[0, [3, 0]].tolist())
    assert out.logprobs[1][0] == approx(float(ref[1, out.tokens[1]])) and out.logprobs[1][1] == []


def test_penalties_follow_hugging_face_and_openai():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 3
    sampler = Sampler()
    sampler.observe(7, [1, 2, 2], prompt=True)
    sampler.observe(7, [5, 5, 9], prompt=False)
    p = SamplingParams(temperature=0, repetition_penalty=1.7)
    # Hugging Face's processor over prompt + output is the reference for repetition_penalty.
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 2, 2, 5, 5, 9]]), logits.clone())
    assert torch.allclose(sampler.apply_penalties(logits[0], 7, p), expected[0])
    # OpenAI's: frequency x count + presence x (count > 0), over the output only.
    q = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=1.5)
    want = logits[0].clone()
    want[5] -= 0.5 * 2 + 1.5
    want[9] -= 0.5 * 1 + 1.5
    assert torch.allclose(sampler.apply_penalties(logits[0], 7, q), want)
    # Strong enough, the penalty moves the greedy choice off a token already generated twice.
    logits[0, 5] = 10.0
    assert sampler.sample(logits, [7], [SamplingParams(temperature=0)]) == [5]
    assert sampler.sample(logits, [7], [SamplingParams(temperature=0, frequency_penalty=2, presence_penalty=2,
                                                       repetition_penalty=10)]) != [5]


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.tensor([[1.0, 2.0, 3.0], [float("nan")] * 3, [3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=1.0, seed=0)] * 3
    out = Sampler().sample_rows(logits, [1, 2, 3], params)
    assert list(out.errors) == [1] and "no finite logit" in out.errors[1]
    assert out.tokens[0] in (0, 1, 2) and out.tokens[2] in (0, 1, 2)


def approx(value):
    return pytest.approx(value, rel=1e-5, abs=1e-6)


def test_banned_tokens_are_never_drawn_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [5.0, 1.0, 0.0, -1.0]])
    greedy = SamplingParams(temperature=0, logprobs=1)
    out = Sampler().sample_rows(logits, [1, 2], [greedy, greedy], [3, 3], banned={0: (0,)})
    assert out.tokens == [1, 0]  # row 0 cannot take its argmax; row 1 is untouched
    assert out.logprobs[0][0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    assert out.logprobs[0][1][0][0] == 0  # the raw top token is still reported as the most likely
    hot = SamplingParams(temperature=1.0, seed=3)
    drawn = {Sampler().sample_rows(logits[:1], [1], [hot], [k], banned={0: (0, 1)}).tokens[0] for k in range(200)}
    assert drawn == {2, 3}


def test_min_tokens_is_checked_against_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens=9 must be in \[0, max_tokens=4\]"):
        SamplingParams(max_tokens=4, min_tokens=9)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
