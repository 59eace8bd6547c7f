"""The transformers fallback: a causal LM with no native family runs through transformers' modeling code under
energon's scheduler, batching and paged KV cache, with greedy tokens equal to transformers' own generate (fp32).

Each checkpoint is a tiny random model built with ``AutoModelForCausalLM.from_config`` and saved with
``save_pretrained``; the reference is the same directory loaded by transformers with its own attention, one
prompt at a time.
"""

from __future__ import annotations

import json

import pytest
import torch

from energon_infer.errors import OptionError
from energon_infer.loading.backend import choose_backend
from energon_infer.loading.config import ConfigError, UnsupportedModelError
from energon_infer.sampling import SamplingParams
from energon_infer.worker.hf_runner import TransformersRunner
from tests.energon_infer.tiny import PROMPTS, VOCAB, build_tokenizer, hf_greedy, hf_logits, save_tiny

GREEDY_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
OPTS = dict(progress=False, block_size=4, kv_cache_tokens=512)

_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: checkpoints of model types without a native family that transformers builds: name -> (model_type, what sets it
#: apart). The first six call transformers' attention interface; falcon, mpt and xglm attend with their own code.
FALLBACK = {
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5)),  # partial rotary, parallel residual
    "phi": ("phi", dict(num_key_value_heads=2)),  # partial rotary, grouped-query attention
    "stablelm": ("stablelm", dict(num_key_value_heads=2, qk_layernorm=True)),  # per-head q/k LayerNorm
    "cohere": ("cohere", dict(num_key_value_heads=2, logit_scale=0.5)),  # interleaved rotary, scaled logits
    "gpt_bigcode": ("gpt_bigcode", dict(multi_query=True)),  # one key/value head, learned positions
    "starcoder2": ("starcoder2", dict(num_key_value_heads=1, sliding_window=None)),
    "falcon": ("falcon", dict()),  # Falcon-7B's layout: multi-query, parallel attention and MLP
    "falcon-new": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),  # Falcon-40B's: grouped kv
    "mpt": ("mpt", dict()),  # ALiBi position bias
    "xglm": ("xglm", dict()),  # sinusoidal positions
}


def _save(model_type: str, path, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**_SHAPE, **overrides}))
    with torch.no_grad():  # as tiny.save_tiny: larger weights keep greedy decoding off near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fallback_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fallback_models")
    return {name: str(_save(t, root / name, **kw)) for name, (t, kw) in FALLBACK.items()}


@pytest.fixture(scope="module")
def phi_dir(fallback_dirs) -> str:
    return fallback_dirs["phi"]


def test_choose_backend_names_the_path_and_why(fallback_dirs, tmp_path):
    llama = save_tiny("llama", tmp_path / "llama", shard=None)
    assert choose_backend(llama) == ("native", "llama runs on energon's native llama family")
    backend, why = choose_backend(fallback_dirs["phi"])
    assert backend == "transformers"
    assert why == "phi runs through transformers' modeling code (no native family for this model type)"
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    with pytest.raises(UnsupportedModelError, match=r"'not_a_model' has no native energon family .*builds no causal"):
        choose_backend(tmp_path / "odd")
    (tmp_path / "odd" / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        choose_backend(tmp_path / "odd")


def test_an_option_the_native_family_refuses_falls_back_exactly(tmp_path):
    """A native model type with an option its family does not implement (an activation here) runs through
    transformers instead of being refused, and the reason names the refusal."""
    path = save_tiny("llama", tmp_path / "llama", shard=None, hidden_act="gelu_fast")
    backend, why = choose_backend(path)
    assert backend == "transformers"
    assert why.startswith("llama runs through transformers' modeling code (its native family refuses it: ")
    assert "'gelu_fast'" in why
    outs = TransformersRunner.from_pretrained(path, **OPTS).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, PROMPTS, GREEDY_TOKENS)


@pytest.mark.parametrize("name", list(FALLBACK))
def test_greedy_tokens_equal_transformers_generate(fallback_dirs, name):
    """Prompts of different lengths (7, 2, 21 and 1 tokens over 4-token blocks) run together in packed steps:
    each sequence's tokens are transformers' for that prompt alone, so the paged cache keeps them apart."""
    path = fallback_dirs[name]
    runner = TransformersRunner.from_pretrained(path, **OPTS)
    assert runner.config.family == "transformers" and runner.config.model_type == FALLBACK[name][0]
    assert runner.stage.own_attention == (name in ("falcon", "falcon-new", "mpt", "xglm"))
    stats: dict[str, int] = {}
    outs = runner.generate(PROMPTS, GREEDY, stats=stats)
    assert stats["steps"] < len(PROMPTS) * GREEDY_TOKENS  # the prompts shared steps
    assert [o.token_ids for o in outs] == hf_greedy(path, PROMPTS, GREEDY_TOKENS)


def test_a_native_model_type_runs_through_the_fallback_too(tmp_path):
    """The fallback is not tied to unknown types: a llama checkpoint through it gives transformers' tokens (what
    a comparison of the two paths on one model needs)."""
    path = save_tiny("llama", tmp_path / "llama", shard=None)
    outs = TransformersRunner.from_pretrained(path, **OPTS).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, PROMPTS, GREEDY_TOKENS)


@pytest.mark.parametrize("name", ["phi", "gpt_bigcode", "cohere", "falcon", "mpt"])
def test_prompt_logits_match_transformers(fallback_dirs, name):
    path = fallback_dirs[name]
    runner = TransformersRunner.from_pretrained(path, **OPTS)
    width = max(map(len, PROMPTS))
    ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(PROMPTS):  # right padding: the runner packs the rows without it
        ids[row, :len(p)] = torch.tensor(p)
        mask[row, :len(p)] = 1
    logits = runner.forward_padded(ids, mask)
    for row, (p, ref) in enumerate(zip(PROMPTS, hf_logits(path, PROMPTS))):
        torch.testing.assert_close(logits[row, :len(p)], ref, atol=1e-4, rtol=1e-4)
    assert not runner.cache.sequences()  # forward_padded frees what it ran


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["phi", "falcon"])
def test_chunks_shared_prefixes_and_preemption_keep_the_tokens(fallback_dirs, name, preemption):
    """The scheduler's other modes over the fallback: prompts cut into chunks, a shared prefix read from another
    sequence's blocks, and a cache too small for all of them at once (sequences preempted, then recomputed or
    swapped back in from host memory)."""
    shared = list(range(30, 46))  # four full blocks every prompt starts with
    prompts = [shared + [60 + i] * (i + 1) for i in range(4)]
    path = fallback_dirs[name]
    runner = TransformersRunner.from_pretrained(path, progress=False, block_size=4, kv_cache_tokens=40,
                                                max_batch_tokens=12, swap_space_tokens=128)
    stats: dict[str, int] = {}
    outs = runner.generate(prompts, GREEDY, prefix_caching=True, chunked_prefill=True, kv_admission="on_demand",
                           preemption=preemption, stats=stats)
    assert stats["prefix_hit_tokens"] > 0 and stats["preemptions"] > 0
    assert (stats["swaps"] > 0) == (preemption == "swap")
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, GREEDY_TOKENS)


@pytest.mark.parametrize("name", ["phi", "falcon"])
def test_engine_serves_a_fallback_model_and_says_why(tmp_path, capfd, name):
    """The Engine path: worker processes load the fallback, its scheduler batches the prompts, the tokenizer turns
    text into ids, and the start says which path the model takes and why."""
    from tokenizers import Tokenizer

    from energon_infer.engine.engine import Engine

    model_type, overrides = FALLBACK[name]
    path = _save(model_type, tmp_path / name, **overrides)
    build_tokenizer(path)
    with Engine.from_pretrained(path, progress=True, threads_per_worker=1, block_size=4, kv_cache_tokens=512,
                                max_batch_tokens=24) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        text = engine.generate(["the quick brown fox"], GREEDY)[0]
        assert engine.worker_info[0]["config"]["family"] == "transformers"
    assert [o.token_ids for o in outs] == hf_greedy(path, PROMPTS, GREEDY_TOKENS)
    assert text.prompt_token_ids == Tokenizer.from_file(str(path / "tokenizer.json")).encode("the quick brown fox").ids
    assert text.token_ids == hf_greedy(path, [text.prompt_token_ids], GREEDY_TOKENS)[0]
    assert f"energon: {model_type} runs through transformers' modeling code (no native family for this model type)" \
        in capfd.readouterr().err


@pytest.mark.parametrize("option, match", [
    (dict(tp=2), r"tp=2 x pp=1: model_type 'phi' runs through transformers' modeling code, which runs on one rank "
                 r"\(tp=1, pp=1\) only; serve it with tp=1 pp=1"),
    (dict(pp=2), r"tp=1 x pp=2: model_type 'phi' .* serve it with tp=1 pp=1"),
    (dict(quantization="int8"), r"quantization='int8': model_type 'phi' .* drop the quantization option"),
    (dict(memory_pool=0.5), r"memory_pool: model_type 'phi' .* drop memory_pool"),
])
def test_engine_refuses_what_the_fallback_does_not_run(phi_dir, option, match):
    from energon_infer.engine.engine import Engine

    with pytest.raises(OptionError, match=match):
        Engine.from_pretrained(phi_dir, progress=False, **option)


def test_runner_refuses_a_layout_before_loading(phi_dir):
    with pytest.raises(OptionError, match=r"tp=2 x pp=1: model_type 'phi'"):
        TransformersRunner.from_pretrained(phi_dir, progress=False, tp=2)


@pytest.mark.parametrize("model_type, overrides, match", [
    ("bloom", dict(), r"'bloom': a packed step over energon's cache fails \(ValueError"),
    # Mamba layers beside attention: their state is not in the paged cache, so the load check sees the difference
    ("falcon_h1", dict(num_key_value_heads=2),
     r"'falcon_h1': a packed step differs from the model's own forward by .* it does not keep packed sequences"),
    ("gemma2", dict(num_key_value_heads=2, head_dim=8, attn_logit_softcapping=50.0, sliding_window=256),
     r"'gemma2': attention layer 0 asks for softcap=50.0"),
    ("starcoder2", dict(num_key_value_heads=1, sliding_window=8),
     r"'starcoder2': attention layer 0 asks for sliding_window=8"),
])
def test_attention_this_path_would_get_wrong_is_refused(tmp_path, model_type, overrides, match):
    path = _save(model_type, tmp_path / model_type, **overrides)
    with pytest.raises(UnsupportedModelError, match=match):
        TransformersRunner.from_pretrained(path, progress=False)


def test_only_safetensors_weights_load(phi_dir, tmp_path):
    (tmp_path / "config.json").write_text(open(f"{phi_dir}/config.json").read())
    with pytest.raises(UnsupportedModelError, match=r"has no \*.safetensors files; energon loads safetensors"):
        TransformersRunner.from_pretrained(tmp_path, progress=False)


@pytest.mark.parametrize("name", ["phi", "falcon"])
def test_bfloat16_logits_match_transformers_in_bfloat16(fallback_dirs, name):
    from transformers import AutoModelForCausalLM

    path = fallback_dirs[name]
    runner = TransformersRunner.from_pretrained(path, **{**OPTS, "dtype": "bfloat16"})
    assert runner.cache.k.dtype == torch.bfloat16
    ids = torch.tensor([PROMPTS[2]])
    got = runner.forward_padded(ids)[0].float()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids).logits[0].float()
    assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


def test_a_cache_larger_than_memory_is_refused_before_it_is_allocated(phi_dir):
    from energon_infer.loading.weights import ModelTooLargeError

    with pytest.raises(ModelTooLargeError, match=r"phi: the KV cache needs .* GiB but cpu has .* smaller kv_cache_tokens"):
        TransformersRunner.from_pretrained(phi_dir, progress=False, kv_cache_tokens=10**13)
