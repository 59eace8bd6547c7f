"""The rotary decoder families energon runs natively, each a small declaration over one shared block.

A :class:`Family` says four things about a model type, and nothing else:

* ``defaults``: the ``config.json`` defaults of its transformers config class (what a field means when absent);
* ``switches``: the fixed :class:`~energon_infer.loading.config.ModelConfig` switches of its block (norm layout,
  norm weight offset, q/k norms, MLP activation, ...);
* ``options``: readers of the ``config.json`` fields its block depends on (rope, windows, soft-capping,
  multipliers); each returns the ModelConfig fields it sets, and refuses a value the block does not run;
* ``tensors``: where each runtime tensor sits in its checkpoint, under ``model.layers.<i>.`` (an expert's with
  ``{e}`` for its index).

The block (:class:`energon_infer.worker.model.Block`) reads only ModelConfig's switches, so a family is added
here without touching the model code. The GPT-2 and OPT readers (learned positions, their own tensor layouts)
stay in :mod:`energon_infer.loading.config`.

Example:
    >>> sorted(FAMILIES)[:4]
    ['gemma', 'gemma2', 'gemma3_text', 'gpt_oss']
    >>> FAMILIES["qwen3"].switches
    {'mlp_bias': False, 'qk_norm': 'head'}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from energon_infer.loading.config_fields import ConfigError, divides, real, refuse, required, whole
from energon_infer.loading.rope_config import read_rope, rope_sources, rotary_fraction

__all__ = ["FAMILIES", "Family", "GPT_OSS_TENSORS", "LLAMA_TENSORS", "MIXTRAL_TENSORS", "QWEN_MOE_TENSORS",
           "decoder_fields"]

#: an option reader: (config.json, the ModelConfig fields read so far) -> the fields it sets
Option = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]

#: runtime tensor -> checkpoint tensor under ``model.layers.<i>.`` (q, k, v fused into ``qkv`` and gate, up into
#: ``up`` at load; a family whose checkpoint already fuses them names ``qkv`` / ``gate_up`` instead)
LLAMA_TENSORS: Mapping[str, str] = {
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}

#: Mixture-of-Experts layers (:mod:`energon_infer.worker.moe`): the router, each expert's gate / up / down and,
#: Qwen 2 MoE, the shared expert's and its sigmoid gate, as ``save_pretrained`` writes them (one tensor per expert)
MIXTRAL_TENSORS: Mapping[str, str] = {
    **LLAMA_TENSORS, "router": "block_sparse_moe.gate", "expert_gate": "block_sparse_moe.experts.{e}.w1",
    "expert_up": "block_sparse_moe.experts.{e}.w3", "expert_down": "block_sparse_moe.experts.{e}.w2",
}
QWEN_MOE_TENSORS: Mapping[str, str] = {
    **LLAMA_TENSORS, "router": "mlp.gate", "expert_gate": "mlp.experts.{e}.gate_proj",
    "expert_up": "mlp.experts.{e}.up_proj", "expert_down": "mlp.experts.{e}.down_proj",
    "shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
    "shared_down": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate",
}
#: gpt-oss: each head's attention sink, the router (with its bias) and the experts fused in four tensors per layer
#: (``experts`` names their prefix: ``gate_up_proj`` (experts, hidden, 2 x width) with gate and up columns
#: interleaved, ``down_proj`` (experts, width, hidden), and a bias of each), split per expert at load
GPT_OSS_TENSORS: Mapping[str, str] = {
    **LLAMA_TENSORS, "sinks": "self_attn.sinks", "router": "mlp.router", "experts": "mlp.experts",
}


@dataclass(frozen=True)
class Family:
    """One model type's declaration (see the module docstring)."""

    name: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    switches: Mapping[str, Any] = field(default_factory=dict)
    options: tuple[Option, ...] = ()
    tensors: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_TENSORS))
    rope: Option | None = None  # None: rotary() (one rotary embedding, whole heads)

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The :class:`~energon_infer.loading.config.ModelConfig` fields of ``raw`` (config.json)."""
        raw = {**self.defaults, **raw}
        fields = {**decoder_fields(raw), **self.switches}
        for option in (self.rope or rotary(), *self.options):
            fields.update(option(raw, fields))
        return fields


def decoder_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """What every rotary decoder's config.json says the same way (LLaMA's field names)."""
    h, heads = required(raw, "hidden_size"), required(raw, "num_attention_heads")
    if not raw.get("head_dim"):
        divides(h, heads, "hidden_size", "num_attention_heads")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        vocab_size=required(raw, "vocab_size"), hidden_size=h, n_layers=required(raw, "num_hidden_layers"),
        n_heads=heads, n_kv_heads=whole(raw.get("num_key_value_heads") or heads, "num_key_value_heads"),
        head_dim=whole(raw.get("head_dim") or h // heads, "head_dim"),
        intermediate_size=required(raw, "intermediate_size"),
        max_positions=required(raw, "max_position_embeddings"), norm="rms",
        norm_eps=real(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps"), positions="rotary", mlp="swiglu",
        activation=raw.get("hidden_act", "silu"), qkv_bias=bias, o_bias=bias,
        mlp_bias=bool(raw.get("mlp_bias", False)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


# --------------------------------------------------------------------------- option readers


def rotary(*, partial: bool = False, by_layer_type: bool = False) -> Option:
    """The rotary embedding (:mod:`energon_infer.loading.rope_config`); ``partial``: the family rotates only the
    first ``partial_rotary_factor`` of each head (Phi-3); ``by_layer_type``: sliding-window layers have their own
    (Gemma 3's local base)."""

    def read(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        model_type, head_dim = raw["model_type"], fields["head_dim"]
        fraction = rotary_fraction(raw, rope_sources(raw, "full_attention" if by_layer_type else None))
        if fraction != 1.0 and not partial:
            refuse(model_type, "partial_rotary_factor", fraction, "this family rotates whole heads in transformers "
                   "too; remove the field from config.json or serve the model through the transformers fallback")
        rotary_dim = int(head_dim * fraction)
        if rotary_dim % 2 or rotary_dim < 2:
            raise ConfigError(f"partial_rotary_factor={fraction} leaves {rotary_dim} rotated features of head_dim="
                              f"{head_dim}; it must be a positive even number")
        kw = dict(head_dim=head_dim, max_positions=fields["max_positions"], rotary_dim=rotary_dim)
        out: dict[str, Any] = {"rotary_dim": rotary_dim if rotary_dim != head_dim else 0}
        if by_layer_type:
            out["rope"] = read_rope(raw, model_type, layer_type="full_attention", default_theta=1e6, **kw)
            out["local_rope"] = read_rope(raw, model_type, layer_type="sliding_attention",
                                          default_theta=raw.get("rope_local_base_freq", 10000.0), **kw)
        else:
            out["rope"] = read_rope(raw, model_type, **kw)
        if out["rope"].kind == "dynamic":  # NTK scaling exists to run past max_position_embeddings: factor x longer
            out["max_positions"] = int(fields["max_positions"] * out["rope"].factor)
        return out

    return read


def _layer_types(raw: dict[str, Any], n_layers: int, default: Callable[[int], bool]) -> list[bool]:
    """Which layers are sliding-window layers: ``layer_types`` where config.json lists them, else ``default(i)``."""
    types = raw.get("layer_types")
    if types is None:
        return [default(i) for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"layer_types={types!r} must list one type per layer ({n_layers}); fix config.json")
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            refuse(raw["model_type"], "layer_types", t, "energon runs 'full_attention' and 'sliding_attention' "
                   "layers; serve the model through the transformers fallback")
    return [t == "sliding_attention" for t in types]


def windows(rule: str, pattern: int = 2) -> Option:
    """Sliding-window layers, by the family's rule: ``"all"`` (Mistral, Phi-3: every layer when
    ``sliding_window`` is set), ``"qwen"`` (only with ``use_sliding_window``, layers from ``max_window_layers``
    on), ``"qwen2_moe"`` (only with ``use_sliding_window``: ``layer_types``, else the even layers before
    ``max_window_layers``), ``"qwen3_moe"`` (every layer, only with ``use_sliding_window``), ``"pattern"``
    (Gemma 2 / 3: ``layer_types``, else every ``pattern``-th layer global)."""

    def read(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        window, n = raw.get("sliding_window"), fields["n_layers"]
        if window is None or (rule.startswith("qwen") and not raw.get("use_sliding_window")):
            return {}
        window = whole(window, "sliding_window")
        if rule in ("all", "qwen3_moe"):
            sliding = [True] * n
        elif rule.startswith("qwen"):
            first = whole(raw.get("max_window_layers", n), "max_window_layers", low=0)
            moe = rule == "qwen2_moe"
            sliding = _layer_types(raw, n, lambda i: (i < first and i % 2 == 0) if moe else i >= first)
        else:
            every = whole(raw.get("sliding_window_pattern", pattern), "sliding_window_pattern")
            sliding = _layer_types(raw, n, lambda i: bool((i + 1) % every))
        return {"windows": tuple(window if s else 0 for s in sliding)}

    return read


def gemma_scales(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma's embedding scale (``sqrt(hidden_size)``); Gemma 2 / 3's ``query_pre_attn_scalar`` and the tanh
    soft-capping of the final logits (and, Gemma 2, of the attention scores)."""
    out: dict[str, Any] = {"embed_scale": math.sqrt(fields["hidden_size"])}
    if "query_pre_attn_scalar" in raw:
        out["attn_scale"] = real(raw["query_pre_attn_scalar"], "query_pre_attn_scalar") ** -0.5
    for key, name in (("final_logit_softcapping", "final_softcap"), ("attn_logit_softcapping", "attn_softcap")):
        if raw.get(key) is not None:
            out[name] = real(raw[key], key)
    return out


def gemma3_scales(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    # Gemma 3's attention takes no soft-cap in transformers (attn_logit_softcapping is read but not applied).
    return {k: v for k, v in gemma_scales(raw, fields).items() if k != "attn_softcap"}


def gemma_activation(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma's ``hidden_act="gelu"`` means the tanh approximation (transformers rewrites it the same way);
    Gemma 2 / 3 read ``hidden_activation``."""
    act = raw.get("hidden_activation") if raw["model_type"] != "gemma" else None
    act = act or fields["activation"]
    return {"activation": "gelu_pytorch_tanh" if act == "gelu" else act}


def granite_multipliers(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Granite's embedding, residual and attention multipliers and its logits divisor."""
    return {"embed_scale": real(raw.get("embedding_multiplier", 1.0), "embedding_multiplier"),
            "residual_scale": real(raw.get("residual_multiplier", 1.0), "residual_multiplier"),
            "attn_scale": real(raw.get("attention_multiplier", 1.0), "attention_multiplier"),
            "logits_divisor": real(raw.get("logits_scaling", 1.0), "logits_scaling")}


def experts(kind: str, n_experts: int) -> Option:
    """A Mixture-of-Experts MLP (:mod:`energon_infer.worker.moe`), ``n_experts`` its transformers default:
    ``"mixtral"`` (every layer, the chosen experts' probabilities always renormalised and kept in fp32, experts as
    wide as ``intermediate_size``), ``"qwen"`` (layers by ``decoder_sparse_step`` / ``mlp_only_layers``,
    ``norm_topk_prob``, ``moe_intermediate_size``) or ``"qwen_shared"`` (Qwen 2 MoE: and a shared expert of
    ``shared_expert_intermediate_size`` with its sigmoid gate)."""

    def read(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        model_type = raw["model_type"]
        key = next((k for k in ("num_experts", "num_local_experts") if raw.get(k) is not None), "num_experts")
        n = whole(raw.get(key, n_experts), key, low=1 if kind == "mixtral" else 0)  # Qwen: 0 makes every MLP dense
        if fields["activation"] != "silu":
            refuse(model_type, "hidden_act", fields["activation"], "energon's experts run SiLU-gated MLPs; serve "
                   "the model through the transformers fallback")
        out: dict[str, Any] = {"n_experts": n, "experts_per_token": whole(raw["num_experts_per_tok"],
                                                                         "num_experts_per_tok")}
        if kind == "mixtral":
            return {**out, "moe_intermediate_size": fields["intermediate_size"], "norm_topk": True,
                    "routing_fp32": True}
        dense = raw.get("mlp_only_layers")
        dense = [] if dense is None else dense
        if not isinstance(dense, list):
            raise ConfigError(f"mlp_only_layers={dense!r} must be a list of layer indices (e.g. [0, 1]); fix "
                              "config.json")
        out.update(moe_intermediate_size=whole(raw["moe_intermediate_size"], "moe_intermediate_size"),
                   norm_topk=bool(raw.get("norm_topk_prob", False)),
                   moe_step=whole(raw["decoder_sparse_step"], "decoder_sparse_step"),
                   dense_layers=tuple(whole(i, "a layer of mlp_only_layers", low=0) for i in dense))
        if kind == "qwen_shared":
            out["shared_expert_size"] = whole(raw["shared_expert_intermediate_size"],
                                              "shared_expert_intermediate_size", low=0)
        return out

    return read


def gpt_oss_experts(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's experts: every layer's MLP, ``intermediate_size`` wide, picked by the top-k of the router's logits
    (a softmax over those k), with biases and the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``; the experts
    ignore ``hidden_act``, as transformers' do). An MXFP4-quantized checkpoint is refused: its expert tensors are
    packed blocks and scales, not the weights."""
    qc = raw.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ConfigError(f"gpt_oss: quantization_config quant_method={method!r} is not supported; energon runs "
                          "gpt-oss's experts unquantized: dequantize once with transformers (from_pretrained(dir, "
                          "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16), then "
                          "save_pretrained) and serve that directory")
    n = whole(raw["num_local_experts"], "num_local_experts")
    top_k = whole(raw["num_experts_per_tok"], "num_experts_per_tok")
    if top_k > n:
        raise ConfigError(f"num_experts_per_tok={top_k} must be at most num_local_experts={n} (a token runs through "
                          "that many of the experts); fix config.json")
    return {"n_experts": n, "experts_per_token": top_k, "moe_intermediate_size": fields["intermediate_size"],
            "router": "topk_softmax", "expert_bias": True,
            "swiglu_limit": real(raw["swiglu_limit"], "swiglu_limit"),
            "swiglu_alpha": real(raw["swiglu_alpha"], "swiglu_alpha")}


def qwen2_moe_bias(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen 2 MoE names its q/k/v bias ``qkv_bias`` (its output projection has none)."""
    return {"qkv_bias": bool(raw.get("qkv_bias", True)), "o_bias": False}


def causal(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Refuses Gemma's ``use_bidirectional_attention`` (an embedding model's encoder, not a causal LM)."""
    if raw.get("use_bidirectional_attention"):
        refuse(raw["model_type"], "use_bidirectional_attention", True, "energon serves causal language models; "
               "this checkpoint is an encoder (embeddings): run it with transformers or sentence-transformers")
    return {}


# --------------------------------------------------------------------------- the families

#: the bias switches of families whose transformers modeling fixes them (config.json's attention_bias and
#: mlp_bias are ignored there, so here too)
_NO_MLP_BIAS = {"mlp_bias": False}
_NO_BIAS = {"qkv_bias": False, "o_bias": False, "mlp_bias": False}
_GEMMA = {**_NO_MLP_BIAS, "norm_offset": 1.0, "norm_weight_fp32": True}
_QWEN_MOE = {"decoder_sparse_step": 1, "norm_topk_prob": False}
_GEMMA2_TENSORS = {**LLAMA_TENSORS, "attn_out_norm": "post_attention_layernorm",
                   "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama"),
    Family("mistral", switches=_NO_BIAS, options=(windows("all"),)),
    Family("qwen2", switches={"qkv_bias": True, "o_bias": False, "mlp_bias": False}, options=(windows("qwen"),)),
    Family("qwen3", switches={**_NO_MLP_BIAS, "qk_norm": "head"}, options=(windows("qwen"),)),
    Family("olmo2", defaults={"rms_norm_eps": 1e-5},
           switches={**_NO_MLP_BIAS, "norm_layout": "output", "qk_norm": "full", "norm_weight_fp32": True},
           tensors={**LLAMA_TENSORS, "attn_out_norm": "post_attention_layernorm",
                    "mlp_out_norm": "post_feedforward_layernorm"}),
    Family("granite", options=(granite_multipliers,)),
    Family("gemma", defaults={"tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"}, switches=_GEMMA,
           options=(causal, gemma_activation, gemma_scales)),
    Family("gemma2", defaults={"tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                               "sliding_window": 4096},
           switches={**_GEMMA, "norm_layout": "sandwich"}, tensors=_GEMMA2_TENSORS,
           options=(causal, gemma_activation, gemma_scales, windows("pattern", 2))),
    Family("gemma3_text", defaults={"tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                                    "sliding_window": 4096},
           switches={**_GEMMA, "norm_layout": "sandwich", "qk_norm": "head"}, tensors=_GEMMA2_TENSORS,
           rope=rotary(by_layer_type=True), options=(causal, gemma_activation, gemma3_scales, windows("pattern", 6))),
    Family("phi3", defaults={"rms_norm_eps": 1e-5}, switches=_NO_BIAS, rope=rotary(partial=True),
           options=(windows("all"),),
           tensors={**LLAMA_TENSORS, "qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}),
    Family("mixtral", defaults={"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_experts_per_tok": 2}, switches=_NO_BIAS,
           options=(windows("all"), experts("mixtral", 8)), tensors=MIXTRAL_TENSORS),
    Family("qwen2_moe", defaults={**_QWEN_MOE, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                  "shared_expert_intermediate_size": 5632},
           switches=_NO_MLP_BIAS, options=(qwen2_moe_bias, windows("qwen2_moe"), experts("qwen_shared", 60)),
           tensors=QWEN_MOE_TENSORS),
    Family("qwen3_moe", defaults={**_QWEN_MOE, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
           switches={**_NO_MLP_BIAS, "qk_norm": "head"}, options=(windows("qwen3_moe"), experts("qwen", 128)),
           tensors=QWEN_MOE_TENSORS),
    # transformers' GptOssConfig defaults: yarn (factor 32 over 4096 positions), every other layer windowed
    Family("gpt_oss", defaults={"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "head_dim": 64, "num_key_value_heads": 8,
                                "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
                                "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
                                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False,
                                                    "original_max_position_embeddings": 4096}},
           switches={**_NO_MLP_BIAS, "norm_weight_fp32": True, "attn_sinks": True},
           options=(windows("pattern", 2), gpt_oss_experts), tensors=GPT_OSS_TENSORS),
)}
