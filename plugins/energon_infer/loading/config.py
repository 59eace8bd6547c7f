"""One configuration for every decoder-only family the runtime runs, read from a Hugging Face ``config.json``.

GPT-2, OPT and the LLaMA family (LLaMA, Mistral, Qwen2) differ only in a handful of switches: the
norm (LayerNorm or RMSNorm), where it sits (pre or post), positions (learned table or rotary),
the MLP (two matrices with an activation, or SwiGLU with three), which projections carry a bias,
and whether the head is tied to the embedding. :class:`ModelConfig` names those switches once and
:func:`config_from_hf` fills them from each family's own field names, so the model code has one
block and no ``if family == ...`` branches.

Example:
    >>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 100, "hidden_size": 32,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "intermediate_size": 64, "max_position_embeddings": 64})
    >>> (cfg.family, cfg.head_dim, cfg.n_kv_heads, cfg.norm, cfg.mlp)
    ('llama', 8, 2, 'rms', 'swiglu')
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from energon_infer.errors import BadInputError, MissingFileError

__all__ = [
    "ACTIVATIONS",
    "SUPPORTED_MODEL_TYPES",
    "ConfigError",
    "ModelConfig",
    "UnsupportedModelError",
    "config_from_hf",
    "load_config",
]

# Hugging Face activation names -> the function the model applies (see model._activation).
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu")

# model_type in config.json -> family of blocks. Other LLaMA-style models can be added here when
# their checkpoints use the same tensor names (q_proj/k_proj/v_proj/o_proj, gate/up/down_proj).
SUPPORTED_MODEL_TYPES = {"gpt2": "gpt2", "opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}


class UnsupportedModelError(BadInputError, ValueError):
    """The checkpoint's architecture or one of its options is not one this runtime implements."""


class ConfigError(BadInputError, ValueError):
    """``config.json`` (or a :class:`ModelConfig`) holds a value of the wrong type or out of range."""


def _or_default(value: object, default: int) -> object:
    """GPT-2's "null or 0 means the default" (an empty string or False is a mistake, not a default)."""
    return default if value is None or (type(value) is int and value == 0) else value


def _whole(value: Any, name: str, *, low: int = 1) -> int:
    """``value`` as a whole number >= ``low``; a bool, a string or ``2.5`` raises naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and (not math.isfinite(value) or value != int(value))):
        raise ConfigError(f"{name}={value!r} must be a whole number >= {low}; fix config.json "
                          "(numbers without quotes, e.g. 12)")
    if value < low:
        raise ConfigError(f"{name}={value!r} must be a whole number >= {low}; fix config.json")
    return int(value)


def _real(value: Any, name: str, *, positive: bool = True) -> float:
    """``value`` as a finite float (> 0 when ``positive``); raises naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and not value > 0):
        raise ConfigError(f"{name}={value!r} must be a finite number{' > 0' if positive else ''}; fix config.json "
                          "(e.g. 1e-5 for a norm epsilon, 10000.0 for rope_theta)")
    return float(value)


def _int(raw: dict[str, Any], key: str) -> int:
    """Required whole-number field ``key`` of config.json, named as config.json names it."""
    if key not in raw:
        raise ConfigError(f"config.json has no {key!r}, which model_type {raw.get('model_type')!r} needs; "
                          "save the config with transformers' save_pretrained")
    return _whole(raw[key], key)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The shape and switches of a decoder-only transformer.

    Args:
        family: block family and tensor naming: ``"gpt2"``, ``"opt"`` or ``"llama"``.
        model_type: the ``model_type`` of the checkpoint (``"mistral"`` runs as family ``"llama"``).
        vocab_size: rows of the token embedding and the head.
        hidden_size: width of the residual stream.
        n_layers: decoder blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (``< n_heads`` is grouped-query attention).
        head_dim: width of one head.
        intermediate_size: MLP width.
        max_positions: longest context (tokens) the positions support.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm).
        norm_eps: epsilon of every norm.
        norm_affine: whether norms have a weight (and a bias, for LayerNorm).
        pre_norm: norm before attention/MLP (GPT-2, LLaMA, most OPT) or after the residual add (OPT-350m).
        final_norm: whether a norm follows the last block.
        positions: ``"learned"`` (a table added to the embedding) or ``"rotary"``.
        position_offset: rows of the learned table skipped before position 0 (OPT: 2).
        rope_theta: rotary base.
        rope_scaling: ``None`` or ``("linear", factor)``.
        mlp: ``"gelu"``-style two-matrix MLP (``"dense"``) or ``"swiglu"``.
        activation: one of :data:`ACTIVATIONS`.
        qkv_bias: whether the query, key and value projections have a bias.
        o_bias: whether the attention's output projection has a bias.
        mlp_bias: whether the MLP's projections have a bias.
        embed_dim: width of the token embedding; differs from ``hidden_size`` only for OPT-350m, which
            projects in and out.
        tie_embeddings: the head reuses the token embedding.
        attn_scale_by_layer: GPT-2's ``scale_attn_by_inverse_layer_idx`` (scores also divided by layer+1).
        bos_token_id: the beginning-of-sequence token from the config, if any.
        eos_token_ids: the end-of-sequence tokens from the config: they stop generation.
    """

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm: str = "layer"
    norm_eps: float = 1e-5
    norm_affine: bool = True
    pre_norm: bool = True
    final_norm: bool = True
    positions: str = "learned"
    position_offset: int = 0
    rope_theta: float = 10000.0
    rope_scaling: tuple[str, float] | None = None
    mlp: str = "dense"
    activation: str = "gelu_new"
    qkv_bias: bool = True
    o_bias: bool = True
    mlp_bias: bool = True
    embed_dim: int = 0
    tie_embeddings: bool = True
    attn_scale_by_layer: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in set(SUPPORTED_MODEL_TYPES.values()):
            raise UnsupportedModelError(
                f"family={self.family!r} is not one of {sorted(set(SUPPORTED_MODEL_TYPES.values()))}"
            )
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "max_positions"):
            _whole(getattr(self, name), name)
        _whole(self.position_offset, "position_offset", low=0)
        _whole(self.embed_dim, "embed_dim", low=0)
        # A negative or zero epsilon lets a norm divide by ~0 (NaN logits, token 0 forever).
        _real(self.norm_eps, "norm_eps (layer_norm_epsilon / rms_norm_eps)")
        _real(self.rope_theta, "rope_theta")
        if self.rope_scaling is not None:
            _real(self.rope_scaling[1], "rope_scaling factor")
        for tok in ((self.bos_token_id,) if self.bos_token_id is not None else ()) + self.eos_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok:
                raise ConfigError(f"token id {tok!r} (bos_token_id / eos_token_id) must be a whole number >= 0; "
                                  "fix config.json")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: grouped-query "
                "attention shares each key/value head among n_heads/n_kv_heads query heads"
            )
        if self.norm not in ("layer", "rms"):
            raise ConfigError(f"norm={self.norm!r} must be 'layer' or 'rms'")
        if self.positions not in ("learned", "rotary"):
            raise ConfigError(f"positions={self.positions!r} must be 'learned' or 'rotary'")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.mlp not in ("dense", "swiglu"):
            raise ConfigError(f"mlp={self.mlp!r} must be 'dense' or 'swiglu'")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {self.activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        if self.embed_dim == 0:
            object.__setattr__(self, "embed_dim", self.hidden_size)

    @property
    def n_params(self) -> int:
        """Parameter count (tied head counted once); used for progress output and benchmarks."""
        h, e, i = self.hidden_size, self.embed_dim, self.intermediate_size
        attn = h * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = h * i * (3 if self.mlp == "swiglu" else 2)
        embed = self.vocab_size * e * (1 if self.tie_embeddings else 2)
        pos = (self.max_positions + self.position_offset) * h if self.positions == "learned" else 0
        proj = 2 * h * e if e != h else 0
        return self.n_layers * (attn + mlp) + embed + pos + proj

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ConfigError(f"eos_token_id={value!r} must be a token id or a list of token ids; fix config.json")
    return tuple(value)


def _rope(raw: dict[str, Any]) -> tuple[float, tuple[str, float] | None]:
    # transformers 5 writes {"rope_parameters": {"rope_type", "rope_theta", ...}}; 4.x wrote
    # "rope_theta" and "rope_scaling" at the top level. Read both.
    params, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be an object like {{\"rope_type\": \"linear\", \"factor\": 2.0}}")
    theta = _real(params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, ("linear", _real(params.get("factor", scaling.get("factor", 1.0)), "rope factor"))
    raise UnsupportedModelError(
        f"rope_type {kind!r} is not supported (supported: 'default', 'linear'); use a checkpoint without "
        "rope scaling or add the scaling rule to energon_infer.worker.model.rotary_cos_sin"
    )


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face ``config.json`` dictionary.

    Raises :class:`ConfigError` (a missing field, a string or list where a number belongs, a zero
    head count, a size that does not divide) or :class:`UnsupportedModelError`, never a bare
    ``KeyError``/``ZeroDivisionError``.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json holds a {type(raw).__name__}, not an object; it must be a JSON object "
                          'like {"model_type": "gpt2", "n_layer": 12, ...} (save it with save_pretrained)')
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        model_type = repr(model_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = raw.get("architectures") or []
        raise UnsupportedModelError(
            f"model_type {model_type!r} (architectures {archs}) is not supported; supported model types: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}. Convert the checkpoint to one of them or add a "
            "family to energon_infer.loading.config"
        )
    family = SUPPORTED_MODEL_TYPES[model_type]
    common: dict[str, Any] = dict(model_type=model_type, family=family, bos_token_id=raw.get("bos_token_id"),
                  eos_token_ids=_eos(raw.get("eos_token_id")))
    if family == "gpt2":
        h, heads = _int(raw, "n_embd"), _int(raw, "n_head")
        _divides(h, heads, "n_embd", "n_head")
        if raw.get("add_cross_attention"):
            raise UnsupportedModelError("GPT-2 with add_cross_attention=True is an encoder-decoder; not supported")
        if not raw.get("scale_attn_weights", True):
            raise UnsupportedModelError("GPT-2 with scale_attn_weights=False is not supported")
        return ModelConfig(
            **common, vocab_size=_int(raw, "vocab_size"), hidden_size=h, n_layers=_int(raw, "n_layer"),
            n_heads=heads, n_kv_heads=heads, head_dim=h // heads, intermediate_size=_whole(_or_default(raw.get("n_inner"), 4 * h), "n_inner"),
            max_positions=_int(raw, "n_positions"), norm="layer",
            norm_eps=_real(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon"),
            positions="learned", mlp="dense", activation=raw.get("activation_function", "gelu_new"),
            tie_embeddings=raw.get("tie_word_embeddings", True),
            attn_scale_by_layer=bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
        )
    if family == "opt":
        h = _int(raw, "hidden_size")
        heads = _int(raw, "num_attention_heads")
        _divides(h, heads, "hidden_size", "num_attention_heads")
        pre = bool(raw.get("do_layer_norm_before", True))
        bias = bool(raw.get("enable_bias", True))
        return ModelConfig(
            **common, vocab_size=_int(raw, "vocab_size"), hidden_size=h, n_layers=_int(raw, "num_hidden_layers"),
            n_heads=heads, n_kv_heads=heads, head_dim=h // heads, intermediate_size=_int(raw, "ffn_dim"),
            max_positions=_int(raw, "max_position_embeddings"), norm="layer", norm_eps=1e-5,
            norm_affine=bool(raw.get("layer_norm_elementwise_affine", True)), pre_norm=pre,
            final_norm=pre and not raw.get("_remove_final_layer_norm", False), positions="learned",
            position_offset=2, mlp="dense", activation=raw.get("activation_function", "relu"),
            qkv_bias=bias, o_bias=bias, mlp_bias=bias, embed_dim=raw.get("word_embed_proj_dim") or h,
            tie_embeddings=raw.get("tie_word_embeddings", True),
        )
    # llama family
    h = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    if not raw.get("head_dim"):
        _divides(h, heads, "hidden_size", "num_attention_heads")
    theta, scaling = _rope(raw)
    max_positions = _int(raw, "max_position_embeddings")
    window = raw.get("sliding_window")
    if window and (model_type == "mistral" or raw.get("use_sliding_window")):
        window = _whole(window, "sliding_window")
        # Within the window, sliding-window attention equals full attention; beyond it, it does not,
        # and this runtime has no windowed kernel, so the context is capped at the window.
        max_positions = min(max_positions, int(window))
    qkv_bias = bool(raw.get("attention_bias", model_type == "qwen2"))
    act = raw.get("hidden_act", "silu")
    return ModelConfig(
        **common, vocab_size=_int(raw, "vocab_size"), hidden_size=h, n_layers=_int(raw, "num_hidden_layers"),
        n_heads=heads, n_kv_heads=_whole(raw.get("num_key_value_heads") or heads, "num_key_value_heads"),
        head_dim=_whole(raw.get("head_dim") or h // heads, "head_dim"),
        intermediate_size=_int(raw, "intermediate_size"), max_positions=max_positions, norm="rms",
        norm_eps=_real(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps"), positions="rotary",
        rope_theta=theta, rope_scaling=scaling, mlp="swiglu", activation=act, qkv_bias=qkv_bias,
        o_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_embeddings=raw.get("tie_word_embeddings", False),
    )


def _divides(size: int, heads: int, size_name: str, heads_name: str) -> None:
    if size % heads:
        raise ConfigError(f"{size_name}={size} is not divisible by {heads_name}={heads}: every head gets "
                          f"{size_name} / {heads_name} features; fix config.json")


def load_config(path: str | Path) -> ModelConfig:
    """Read ``<path>/config.json`` (a Hugging Face model directory); every error names the file."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise MissingFileError(f"{file} does not exist: a model directory needs config.json next to its *.safetensors "
                               "(save one with transformers' save_pretrained)")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file} is not valid JSON ({err}); restore it from the original model directory "
                          "or save it again with save_pretrained") from None
    try:
        return config_from_hf(raw)
    except ConfigError as err:
        raise ConfigError(f"{file}: {err}") from None
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{file}: {err}") from None
