"""Tiny random Hugging Face checkpoints and a locally trained tokenizer for the runtime's tests.

Everything is built here from configs (nothing is downloaded): ``save_tiny(family, dir)`` writes
``config.json`` + sharded ``*.safetensors`` with ``transformers.save_pretrained`` and a
``tokenizer.json`` trained with the ``tokenizers`` library on a few sentences.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CORPUS", "FAMILIES", "GPT_OSS", "MOE", "NATIVE", "VARIANTS", "PROMPTS", "build_tokenizer", "save_tiny",
           "hf_model", "hf_logits", "hf_greedy"]

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny model loads from a directory and generates a few tokens",
    "padding free batches run every sequence without wasted work",
    "tensor and pipeline parallel ranks share one model",
] * 4

# Unequal lengths (7, 2, 21, 1): packed steps, single-token prompts and a multi-block prompt.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 41)), [50]]

# Odd vocabulary (101): tensor-parallel vocabulary shards are then uneven and the padding rows are exercised.
VOCAB = 101


def _config(family: str, **overrides):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

    if family == "gpt2":
        kw = dict(n_embd=32, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=1, eos_token_id=2)
        return GPT2Config(**{**kw, **overrides})
    if family == "opt":
        kw = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64, vocab_size=VOCAB,
                  max_position_embeddings=128, word_embed_proj_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return OPTConfig(**{**kw, **overrides})
    if family == "llama":
        kw = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                  rope_theta=500.0)
        return LlamaConfig(**{**kw, **overrides})
    # Variants that exercise the other switches of the one block (tested at tp=1).
    if family == "gpt2-layerscale":  # scale_attn_by_inverse_layer_idx, exact gelu, untied head
        return _config("gpt2", scale_attn_by_inverse_layer_idx=True, activation_function="gelu",
                       tie_word_embeddings=False, **overrides)
    if family == "opt-postln":  # OPT-350m style: norm after the residual add, no final norm, no projection
        return _config("opt", do_layer_norm_before=False, word_embed_proj_dim=32, **overrides)
    if family == "qwen2":  # q/k/v biases, tied head
        kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=True)
        return Qwen2Config(**{**kw, **overrides})
    if family == "mistral":  # sliding window longer than the context used
        kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=256, sliding_window=96)
        return MistralConfig(**{**kw, **overrides})
    if family in NATIVE or family in MOE or family in GPT_OSS:
        return _native_config(family, overrides)
    raise ValueError(family)


FAMILIES = ("gpt2", "opt", "llama")
VARIANTS = ("gpt2-layerscale", "opt-postln", "qwen2", "mistral")

# The rotary families' checkpoints (tests/energon_infer/test_families.py): model_type and the options that set
# each apart. 3-4 layers of 4 query / 2 key-value heads; windows of 6 tokens, shorter than the 21-token prompt.
# No eos_token_id: transformers' generate (min_new_tokens) would mask it, the runner's ignore_eos does not.
_ROTARY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=None,
               pad_token_id=0)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
NATIVE: dict[str, tuple[str, dict]] = {
    # Llama 3.x: llama3 rope scaling, tied (3.2) and untied (3.1) heads; the other scaling kinds
    "llama3-tied": ("llama", dict(rope_theta=500.0, rope_scaling=_LLAMA3, tie_word_embeddings=True)),
    "llama3-untied": ("llama", dict(rope_theta=500.0, rope_scaling=_LLAMA3, tie_word_embeddings=False)),
    "llama-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # NTK: the base grows past max_position_embeddings (16), which the 21-token prompt passes
    "llama-dynamic": ("llama", dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama-yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32})),
    "qwen3": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3-window": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "olmo2": ("olmo2", dict()),
    "granite": ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.25,
                                logits_scaling=4.0)),
    "gemma": ("gemma", dict(head_dim=16, hidden_act="gelu")),
    "gemma2": ("gemma2", dict(num_hidden_layers=4, head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=4, head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                "sliding_attention"], final_logit_softcapping=3.0,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}})),
    "mistral-window": ("mistral", dict(sliding_window=6)),
    "phi3": ("phi3", dict(sliding_window=6)),
    # Phi-4-mini's shape: 3/4 of each head rotated, longrope past 16 tokens (the 21-token prompt), tied head
    "phi4-mini": ("phi3", dict(hidden_size=64, tie_word_embeddings=True, max_position_embeddings=64,
                               original_max_position_embeddings=16, partial_rotary_factor=0.75,
                               rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0],
                                             "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})),
}


# The Mixture-of-Experts families' checkpoints (tests/energon_infer/test_moe.py). At tp=2 "mixtral" and "qwen3_moe"
# split their experts whole across the ranks (4 and 6 experts); "mixtral-sliced" and "qwen2_moe" (3 and 5) slice
# every expert's intermediate dimension. Qwen 2 MoE's middle layer is dense (mlp_only_layers).
MOE: dict[str, tuple[str, dict]] = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-sliced": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=24, mlp_only_layers=[1])),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16, head_dim=16,
                                    norm_topk_prob=True)),
}


# gpt-oss (tests/energon_infer/test_gpt_oss.py): attention sinks, q/k/v/o biases, sliding and full layers in turn,
# yarn, a biased router and biased experts with the clamped SwiGLU (a limit of 1, which the tiny model's gates and
# ups pass, so the clamps bind). At tp=2 "gpt_oss" splits its 4 experts whole, "gpt_oss-sliced" slices its 3.
_GPT_OSS = dict(head_dim=16, intermediate_size=24, num_experts_per_tok=2, sliding_window=6, swiglu_limit=1.0,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
GPT_OSS: dict[str, tuple[str, dict]] = {
    "gpt_oss": ("gpt_oss", dict(_GPT_OSS, num_local_experts=4)),
    "gpt_oss-sliced": ("gpt_oss", dict(_GPT_OSS, num_local_experts=3)),
}


def _native_config(name: str, overrides: dict):
    from transformers import AutoConfig

    model_type, kw = NATIVE[name] if name in NATIVE else MOE[name] if name in MOE else GPT_OSS[name]
    return AutoConfig.for_model(model_type, **{**_ROTARY, **kw, **overrides})


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 5, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(Path(path) / "tokenizer.json"))


def save_tiny(family: str, path: Path, *, seed: int = 0, shard: str | None = "40KB", **overrides) -> Path:
    """Save a random tiny ``family`` model (fp32) with its tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, **overrides))
    # Random init is small (std 0.02): scale it up so logits differ clearly between positions and
    # greedy decoding does not sit on near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
            elif family in NATIVE or family in MOE or family in GPT_OSS:
                p.add_(torch.randn_like(p) * 0.3)  # norms start at 1 (or 0 with Gemma's 1 + w): each its own
        for name, p in model.named_parameters():
            if family in GPT_OSS and name.endswith("_bias"):  # gpt-oss's experts' biases start at zero
                p.normal_(0.0, 0.3)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    build_tokenizer(path)
    return path


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position, one prompt at a time (no padding involved in the reference)."""
    model = hf_model(path)
    return [model(torch.tensor([p])).logits[0] for p in prompts]


@torch.no_grad()
def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = hf_model(path)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def save_all(names, root: Path) -> dict[str, str]:
    """Each of ``names`` (keys of the family tables above) saved as a tiny model under ``root``."""
    return {name: str(save_tiny(name, Path(root) / name)) for name in names}


def references(dirs: dict[str, str], new_tokens: int) -> dict[str, dict]:
    """transformers' logits (every position of PROMPTS, one prompt at a time) and greedy tokens of each model."""
    return {n: {"logits": hf_logits(d, PROMPTS), "greedy": hf_greedy(d, PROMPTS, new_tokens)} for n, d in dirs.items()}
