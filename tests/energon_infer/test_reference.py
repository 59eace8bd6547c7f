"""Single-process runtime against transformers 5 on tiny random checkpoints (fp32, <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from tests.energon_infer.conftest import GREEDY_TOKENS
from tests.energon_infer.tiny import FAMILIES, PROMPTS, VARIANTS, hf_logits, save_tiny

TOL = 1e-4


def _items(prompts=PROMPTS):
    return list(enumerate(prompts))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_equal_transformers(family, tiny_dirs, hf_refs):
    runner = ModelRunner.from_pretrained(tiny_dirs[family], block_size=4, progress=False)
    logits = runner.forward(_items(), all_logits=True)
    ref = torch.cat(hf_refs[family]["logits"])
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= TOL
    # Next-token logits of a packed batch are the last rows of each prompt.
    for i in _items():
        runner.free(i[0])
    last = runner.forward(_items())
    assert torch.allclose(last, torch.stack([r[-1] for r in hf_refs[family]["logits"]]), atol=TOL, rtol=0)
    for i in _items():
        runner.free(i[0])
    gens = runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert [g.token_ids for g in gens] == hf_refs[family]["greedy"]
    assert all(g.finish_reason == "length" for g in gens)
    assert runner.cache.free_blocks == runner.cache.num_blocks  # generate frees what it used


@pytest.mark.parametrize("variant", VARIANTS)
def test_other_block_variants_equal_transformers(variant, tmp_path):
    path = save_tiny(variant, tmp_path, shard=None)  # also the single-file model.safetensors layout
    runner = ModelRunner.from_pretrained(path, block_size=4, progress=False)
    ref = torch.cat(hf_logits(path, PROMPTS))
    assert (runner.forward(_items(), all_logits=True) - ref).abs().max().item() <= TOL


def test_chunked_prefill_and_decode_steps_match_one_shot(tiny_dirs, hf_refs):
    """Prompts fed in pieces (chunks, then one token per step, mixed in one batch) give the same logits."""
    runner = ModelRunner.from_pretrained(tiny_dirs["llama"], block_size=4, progress=False)
    ref = hf_refs["llama"]["logits"]
    long, short = PROMPTS[2], PROMPTS[0]
    got_long = [runner.forward([(0, long[:9])], all_logits=True)]
    got_long.append(runner.forward([(0, long[9:17]), (1, short[:3])], all_logits=True)[:8])
    for t in long[17:]:  # decode steps, mixed with the other sequence's remaining prompt tokens
        rest = [(1, short[3:])] if runner.cache.length(1) == 3 else []
        got_long.append(runner.forward([(0, [t]), *rest], all_logits=True)[:1])
    assert (torch.cat(got_long) - ref[2]).abs().max().item() <= TOL
    assert runner.cache.length(0) == len(long) and runner.cache.length(1) == len(short)


def test_padding_never_changes_results(tiny_dirs, hf_refs):
    runner = ModelRunner.from_pretrained(tiny_dirs["opt"], block_size=4, progress=False)
    lengths = [len(p) for p in PROMPTS]
    width = max(lengths) + 3
    for side in ("left", "right"):
        ids = torch.full((len(PROMPTS), width), 99, dtype=torch.long)  # a real token id as padding
        mask = torch.zeros_like(ids)
        for b, p in enumerate(PROMPTS):
            start = width - len(p) if side == "left" else 0
            ids[b, start:start + len(p)] = torch.tensor(p)
            mask[b, start:start + len(p)] = 1
        out = runner.forward_padded(ids, mask)
        assert out.shape == (len(PROMPTS), width, 101)
        for b, p in enumerate(PROMPTS):
            start = width - len(p) if side == "left" else 0
            assert (out[b, start:start + len(p)] - hf_refs["opt"]["logits"][b]).abs().max().item() <= TOL
            assert out[b][mask[b] == 0].abs().sum() == 0
    assert runner.cache.free_blocks == runner.cache.num_blocks


def test_continuous_batching_under_a_small_cache_gives_the_same_tokens(tiny_dirs, hf_refs):
    """A cache of 12 blocks of 4 tokens holds ~2 of these requests at once: later prompts wait, then join."""
    runner = ModelRunner.from_pretrained(tiny_dirs["gpt2"], block_size=4, kv_cache_tokens=48, max_batch_tokens=24,
                                         progress=False)
    admitted = []
    step = runner.step

    def spy(items, params=None):
        admitted.append(len(items))
        return step(items, params)

    runner.step = spy  # type: ignore[method-assign]
    gens = runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert [g.token_ids for g in gens] == hf_refs["gpt2"]["greedy"]
    assert max(admitted) < len(PROMPTS)  # never all four at once: the cache bounded the batch
    assert len(admitted) > GREEDY_TOKENS  # later prompts ran after the first ones finished


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_fp32(dtype, tiny_dirs):
    fp32 = ModelRunner.from_pretrained(tiny_dirs["llama"], progress=False).forward(_items(), all_logits=True)
    half = ModelRunner.from_pretrained(tiny_dirs["llama"], dtype=dtype, progress=False)
    assert half.stage.layers["0"].qkv.weight.dtype == getattr(torch, dtype)
    assert half.cache.k.dtype == getattr(torch, dtype)
    out = half.forward(_items(), all_logits=True)
    assert out.dtype == getattr(torch, dtype)
    err = (out.float() - fp32).abs().max().item()
    assert err <= 0.05 * fp32.abs().max().item(), err  # bf16 keeps ~3 significant digits
    assert (out.float().argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.9


def test_text_in_text_out_with_the_saved_tokenizer(tiny_dirs):
    runner = ModelRunner.from_pretrained(tiny_dirs["llama"], progress=False)
    prompt = "the quick brown fox"
    ids = runner.encode(prompt)
    assert runner.decode_text(ids) == prompt
    gen = runner.generate([prompt, ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert gen[0].token_ids == gen[1].token_ids and gen[0].prompt_token_ids == ids
    assert gen[0].text == runner.decode_text(gen[0].token_ids)
