"""Bad input fails early with an error that names the value, the rule and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from energon_infer import (
    ContextLengthError,
    KVCacheFullError,
    ModelRunner,
    SamplingParams,
    UnsupportedModelError,
    WeightError,
)
from energon_infer.loading.config import config_from_hf, load_config


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture_lists_the_supported_ones(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["gpt2"], tmp_path / "m")
    _edit_config(path, model_type="bert", architectures=["BertForMaskedLM"])
    with pytest.raises(UnsupportedModelError, match=r"model_type 'bert' \(architectures \['BertForMaskedLM'\]\) is "
                                                    r"not supported; supported model types: gemma, gemma2, "
                                                    r"gemma3_text, gpt2, gpt_oss, granite, llama, mistral"):
        load_config(path)
    # transformers builds a causal LM for it: ModelRunner (native families only) names the runner that loads it
    with pytest.raises(UnsupportedModelError, match=r"bert runs through transformers' modeling code .* "
                                                    r"TransformersRunner\.from_pretrained"):
        ModelRunner.from_pretrained(path, progress=False)
    with pytest.raises(UnsupportedModelError, match="llama: rope_type='ntk_v2' is not supported"):
        config_from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "intermediate_size": 8, "max_position_embeddings": 8,
                        "rope_parameters": {"rope_type": "ntk_v2", "factor": 4.0}})


def test_missing_weights_are_named(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["llama"], tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "layers.1.mlp.up_proj" not in k}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight.*config\.json "
                                          r"belongs to these weights"):
        ModelRunner.from_pretrained(path, progress=False)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard files that are not there: \\['{shard.name}'\\]"):
        ModelRunner.from_pretrained(path, progress=False)


def test_weights_that_do_not_fit_the_config_are_named(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["opt"], tmp_path / "m")
    _edit_config(path, ffn_dim=96)
    with pytest.raises(WeightError, match=r"'model\.decoder\.layers\.0\.fc1\.weight' has shape \(64, 32\), but opt "
                                          r"config\.json implies \(96, 32\).*different models"):
        ModelRunner.from_pretrained(path, progress=False)


def test_pickled_weights_are_refused(tmp_path, tiny_dirs):
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(tiny_dirs["gpt2"] + "/config.json", path)
    torch.save({"x": torch.zeros(1)}, path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin.*never loaded.*safe_serialization=True"):
        ModelRunner.from_pretrained(path, progress=False)


def test_tp_must_divide_the_heads(tiny_dirs):
    # LLaMA tiny: 4 query heads, 2 key/value heads, MLP 64 -> tp in {1, 2}
    with pytest.raises(ValueError, match=r"tp=3 does not divide the 4 attention heads.*use tp in \[1, 2\]"):
        ModelRunner.from_pretrained(tiny_dirs["llama"], tp=3, progress=False)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 key/value heads.*use tp in \[1, 2\]"):
        ModelRunner.from_pretrained(tiny_dirs["llama"], tp=4, progress=False)
    with pytest.raises(ValueError, match=r"pp=4 stages for a model of 3 layers.*pp <= 3"):
        ModelRunner.from_pretrained(tiny_dirs["llama"], pp=4, progress=False)
    with pytest.raises(RuntimeError, match=r"tp=2 x pp=1 needs 2 processes.*torchrun --nproc-per-node 2"):
        ModelRunner.from_pretrained(tiny_dirs["llama"], tp=2, progress=False)


def test_prompts_longer_than_the_context(tiny_dirs):
    runner = ModelRunner.from_pretrained(tiny_dirs["gpt2"], progress=False)  # n_positions=128
    with pytest.raises(ContextLengthError, match=r"sequence 0 would reach 129 tokens but this gpt2 model's context "
                                                 r"is 128.*shorten the prompt"):
        runner.forward([(0, [3] * 129)])
    with pytest.raises(ContextLengthError, match=r"prompt 0 has 200 tokens; prompts need 1 to 128 tokens"):
        runner.generate([[3] * 200])
    # A sequence that reaches the context while generating stops with "length".
    gen = runner.generate([[3] * 125], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert gen.finish_reason == "length" and len(gen.token_ids) == 4  # 125 + 3 cached + the last sampled one
    with pytest.raises(ValueError, match=r"token ids \[101\] are outside the vocabulary \[0, 101\)"):
        runner.forward([(0, [5, 101])])


def test_kv_cache_full_and_unknown_sequences(tiny_dirs):
    runner = ModelRunner.from_pretrained(tiny_dirs["gpt2"], block_size=4, kv_cache_tokens=16, progress=False)
    greedy = SamplingParams(temperature=0)
    runner.prefill({0: [1] * 10}, greedy)  # 3 of 4 blocks
    with pytest.raises(KVCacheFullError, match=r"needs 2 more blocks of 4 tokens but only 1 of 4 are free"):
        runner.prefill({1: [1] * 6}, greedy)
    assert runner.cache.free_blocks == 1 and 1 not in runner.cache  # the failed step changed nothing
    with pytest.raises(ValueError, match="sequence 5 is not running; prefill it first"):
        runner.decode([5])
    with pytest.raises(ValueError, match="sequence 0 is already running"):
        runner.prefill({0: [1]}, greedy)
    with pytest.raises(ValueError, match=r"sequence 9 is new: give its SamplingParams"):
        runner.step([(9, [1])])
    runner.free(0)
    with pytest.raises(KeyError, match="cannot free sequence 0"):
        runner.free(0)
    with pytest.raises(ValueError, match=r"prompt 0 \(10 tokens \+ max_tokens=16\) needs 7 KV blocks; the cache has 4"):
        runner.generate([[1] * 10])


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), r"temperature=-1 must be >= 0; use 0 for greedy"),
    (dict(top_k=-2), r"top_k=-2 must be >= 0"),
    (dict(top_p=0.0), r"top_p=0\.0 must be in \(0, 1\]"),
    (dict(max_tokens=0), r"max_tokens=0 must be >= 1"),
    (dict(stop=("",)), r"contains an empty string"),
])
def test_sampling_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_runtime_config_is_validated():
    from energon_infer import RuntimeConfig

    with pytest.raises(ValueError, match=r"dtype='int8' is not supported; use 'auto' or one of float32"):
        RuntimeConfig(dtype="int8")
    with pytest.raises(ValueError, match=r"kv_cache_tokens=8 at least one block"):
        RuntimeConfig(block_size=16, kv_cache_tokens=8)
