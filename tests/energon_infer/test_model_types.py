"""The model types users bring load as a new user loads them, and give transformers' greedy tokens.

Each checkpoint is built the way a user's would be: ``AutoConfig.for_model(model_type, ...)`` with only the sizes
shrunk (every other option at transformers' default for that type), ``AutoModelForCausalLM.from_config``,
``save_pretrained``. energon picks the path (:func:`~energon_infer.loading.backend.choose_backend`: a native
family, or transformers' modeling code) and must give the greedy tokens transformers' own ``generate`` gives.
The per-family and per-path suites (``test_families.py``, ``test_transformers_backend.py``) test each path's
options in depth; this one is the list of types as users meet them.
"""

from __future__ import annotations

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.loading.backend import choose_backend
from energon_infer.worker.hf_runner import TransformersRunner
from tests.energon_infer.tiny import VOCAB, hf_greedy

NEW_TOKENS = 5
PROMPTS = [[1, 17, 42, 99, 7, 3, 50, 11], [1, 5, 9], [1, 100, 13, 77, 31, 64, 8, 20, 45, 2, 19, 6]]  # ids < VOCAB

#: model type -> the path it takes (the MoE types on energon's native MoE families, energon_infer.worker.moe)
TYPES = {
    "gpt2": "native", "opt": "native", "llama": "native", "mistral": "native", "qwen2": "native",
    "qwen3": "native", "gemma": "native", "gemma2": "native", "gemma3_text": "native", "phi3": "native",
    "olmo2": "native", "granite": "native",
    "phi": "transformers", "gpt_neox": "transformers", "falcon": "transformers", "stablelm": "transformers",
    "cohere": "transformers",
    "mixtral": "native", "qwen2_moe": "native", "qwen3_moe": "native", "gpt_oss": "native",
}

# Sizes only: the names each type's config takes for them (those it does not take are left out).
_SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=128, head_dim=8, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
              n_embd=32, n_layer=2, n_head=4, n_positions=128, ffn_dim=64, word_embed_proj_dim=32,
              bos_token_id=1, eos_token_id=None, pad_token_id=0)  # no eos: generate(min_new_tokens) masks it


def _save(model_type: str, path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    probe = AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in _SIZES.items() if (hasattr(probe, k) or k in probe.attribute_map)
             and not isinstance(getattr(type(probe), k, None), property)}  # a derived size (falcon's head_dim)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))
    with torch.no_grad():  # larger weights keep greedy decoding off near-ties between random logits
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_the_model_types_users_bring_load_and_give_transformers_tokens(model_type, tmp_path):
    path = _save(model_type, tmp_path / model_type)
    backend, why = choose_backend(path)
    assert backend == TYPES[model_type], why
    runner_class = ModelRunner if backend == "native" else TransformersRunner
    runner = runner_class.from_pretrained(path, progress=False, block_size=4, kv_cache_tokens=512, dtype="float32")
    got = [g.token_ids for g in runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                           ignore_eos=True))]
    assert got == hf_greedy(path, PROMPTS, NEW_TOKENS)
