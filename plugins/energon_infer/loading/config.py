"""One configuration for every decoder-only family the runtime runs, read from a Hugging Face ``config.json``.

GPT-2, OPT and the rotary families (LLaMA 3, Mistral, Qwen 2 / 3, OLMo 2, Granite, Gemma 1 / 2 / 3, Phi-3 / 4,
and the Mixture-of-Experts Mixtral, Qwen 2 / 3 MoE and gpt-oss) differ in a handful of switches: the norm
(LayerNorm or RMSNorm, its weight offset) and where it sits (before, after, around the sublayers), positions
(learned table or rotary, with its scaling), q/k norms, the MLP (two matrices with an activation, or gated with
three, or experts behind a router), biases, sliding-window layers, attention sinks, soft-capping and scale factors,
and whether the head is tied to the embedding. :class:`ModelConfig` names those switches once;
:func:`config_from_hf` fills them from each family's declaration (:mod:`energon_infer.loading.families`), so the
model code has one block and no ``if family == ...`` branches.

Example:
    >>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 100, "hidden_size": 32,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "intermediate_size": 64, "max_position_embeddings": 64})
    >>> (cfg.family, cfg.head_dim, cfg.n_kv_heads, cfg.norm, cfg.mlp)
    ('llama', 8, 2, 'rms', 'swiglu')
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from energon_infer.errors import MissingFileError
from energon_infer.loading.config_fields import (
    ConfigError,
    UnsupportedModelError,
    divides,
    eos_ids,
    or_default,
    real,
)
from energon_infer.loading.config_fields import required as _int
from energon_infer.loading.config_fields import whole as _whole
from energon_infer.loading.families import FAMILIES
from energon_infer.loading.rope_config import Rope

__all__ = [
    "ACTIVATIONS",
    "SUPPORTED_MODEL_TYPES",
    "ConfigError",
    "ModelConfig",
    "Rope",
    "UnsupportedModelError",
    "config_from_hf",
    "load_config",
    "read_config_json",
]

# Hugging Face activation names -> the function the model applies (see model._activation).
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu")

#: model_type in config.json -> the family that reads it (GPT-2 and OPT here; the rotary families are declared in
#: energon_infer.loading.families)
SUPPORTED_MODEL_TYPES = {"gpt2": "gpt2", "opt": "opt", **{name: name for name in FAMILIES}}

NORM_LAYOUTS = ("pre", "post", "sandwich", "output")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The shape and switches of a decoder-only transformer.

    Args:
        family: block family and tensor naming: ``"gpt2"``, ``"opt"`` or a rotary family's name
            (:data:`SUPPORTED_MODEL_TYPES`).
        model_type: the ``model_type`` of the checkpoint.
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
        norm_offset: an RMSNorm multiplies by ``norm_offset + weight`` (Gemma: 1, its weights are stored minus 1).
        norm_weight_fp32: an RMSNorm multiplies by its weight in fp32 and then casts to the activations' dtype
            (Gemma, OLMo 2); otherwise it casts first (LLaMA). The same at fp32.
        norm_layout: where each sublayer's norms sit: ``"pre"`` (on its input: GPT-2, LLaMA, most OPT),
            ``"post"`` (after the residual add: OPT-350m), ``"sandwich"`` (on its input and its output before the
            add: Gemma 2 / 3), ``"output"`` (on its output before the add only: OLMo 2).
        final_norm: whether a norm follows the last block.
        qk_norm: RMSNorm of queries and keys before the rotation: ``""`` (none), ``"head"`` (each head over
            ``head_dim``: Qwen 3, Gemma 3) or ``"full"`` (over all heads' features at once: OLMo 2).
        positions: ``"learned"`` (a table added to the embedding) or ``"rotary"``.
        position_offset: rows of the learned table skipped before position 0 (OPT: 2).
        rope: the rotary embedding (base and scaling, :class:`~energon_infer.loading.rope_config.Rope`).
        local_rope: the sliding-window layers' own rotary embedding (Gemma 3), or ``None`` (they share ``rope``).
        rotary_dim: features of each head that are rotated (0: all; Phi-4-mini rotates 3/4).
        windows: each layer's sliding window in tokens (0: full attention); empty: no windowed layer. A query at
            position ``p`` of a windowed layer sees keys ``p - window + 1 .. p``; the context is not capped.
        attn_scale: the attention scores' scale (0: ``head_dim ** -0.5``).
        attn_softcap: attention scores become ``cap * tanh(scores / cap)`` (0: not capped; Gemma 2).
        final_softcap: the same for the logits (Gemma 2 / 3).
        embed_scale: the token embedding is multiplied by it (Gemma: ``sqrt(hidden_size)``; Granite).
        residual_scale: each sublayer's output is multiplied by it before the residual add (Granite).
        logits_divisor: the logits are divided by it (Granite's ``logits_scaling``).
        mlp: ``"dense"`` two-matrix MLP or ``"swiglu"`` (gated: ``act(gate) * up``, any activation).
        activation: one of :data:`ACTIVATIONS`.
        qkv_bias: whether the query, key and value projections have a bias.
        o_bias: whether the attention's output projection has a bias.
        mlp_bias: whether the MLP's projections have a bias.
        n_experts: experts of each Mixture-of-Experts layer (0: a dense model; :mod:`energon_infer.worker.moe`).
        experts_per_token: experts each token runs through in an MoE layer (the router's top-k).
        moe_intermediate_size: each expert's MLP width (``intermediate_size`` stays the dense layers' width).
        moe_step: with experts, every ``moe_step``-th layer (``layer + 1`` a multiple of it) has the MoE MLP
            (Qwen MoE's ``decoder_sparse_step``; 1: every layer).
        dense_layers: layers whose MLP stays dense although ``moe_step`` picks them (Qwen MoE's ``mlp_only_layers``).
        norm_topk: the chosen experts' probabilities are renormalised to sum to 1.
        routing_fp32: the routing weights scale the experts' outputs in fp32 (Mixtral), not cast to the
            activations' dtype first (Qwen MoE). The same at fp32.
        shared_expert_size: width of the shared expert every token of an MoE layer runs, scaled by a sigmoid
            gate (Qwen 2 MoE; 0: none).
        router: how the router picks: ``"softmax"`` (a softmax over every expert, then its top-k: Mixtral, Qwen MoE)
            or ``"topk_softmax"`` (the top-k logits, then a softmax over those k only: gpt-oss).
        expert_bias: the router and each expert's gate/up and down products have biases (gpt-oss).
        swiglu_limit: an expert's gate is clamped to ``<= limit`` and its up to ``[-limit, limit]``, and it computes
            ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` (gpt-oss's clamped SwiGLU; 0: ``silu(gate) * up``).
        swiglu_alpha: the sigmoid's gain in that clamped SwiGLU.
        attn_sinks: each query head has a learned sink logit that joins its softmax's denominator and attends to
            nothing (gpt-oss's ``sinks``).
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
    norm_offset: float = 0.0
    norm_weight_fp32: bool = False
    norm_layout: str = "pre"
    final_norm: bool = True
    qk_norm: str = ""
    positions: str = "learned"
    position_offset: int = 0
    rope: Rope = Rope()
    local_rope: Rope | None = None
    rotary_dim: int = 0
    windows: tuple[int, ...] = ()
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    mlp: str = "dense"
    activation: str = "gelu_new"
    qkv_bias: bool = True
    o_bias: bool = True
    mlp_bias: bool = True
    n_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_step: int = 1
    dense_layers: tuple[int, ...] = ()
    norm_topk: bool = False
    routing_fp32: bool = False
    shared_expert_size: int = 0
    router: str = "softmax"
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    attn_sinks: bool = False
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
        _whole(self.moe_step, "moe_step (decoder_sparse_step)")
        for name in ("position_offset", "embed_dim", "rotary_dim", "n_experts", "experts_per_token",
                     "moe_intermediate_size", "shared_expert_size"):
            _whole(getattr(self, name), name, low=0)
        # A negative or zero epsilon lets a norm divide by ~0 (NaN logits, token 0 forever).
        real(self.norm_eps, "norm_eps (layer_norm_epsilon / rms_norm_eps)")
        for name in ("norm_offset", "attn_scale", "attn_softcap", "final_softcap", "swiglu_limit", "swiglu_alpha"):
            if real(getattr(self, name), name, positive=False) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 0")
        for name in ("embed_scale", "residual_scale", "logits_divisor"):
            real(getattr(self, name), name)
        for rope in (self.rope, self.local_rope):
            if rope is not None:
                real(rope.theta, "rope_theta")
                real(rope.factor, "rope factor")
        for tok in ((self.bos_token_id,) if self.bos_token_id is not None else ()) + self.eos_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok:
                raise ConfigError(f"token id {tok!r} (bos_token_id / eos_token_id) must be a whole number >= 0; "
                                  "fix config.json")
        self._check_switches()
        self._check_experts()
        if self.embed_dim == 0:
            object.__setattr__(self, "embed_dim", self.hidden_size)

    def _check_switches(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: grouped-query "
                "attention shares each key/value head among n_heads/n_kv_heads query heads"
            )
        choices = (("norm", ("layer", "rms")), ("positions", ("learned", "rotary")), ("mlp", ("dense", "swiglu")),
                   ("norm_layout", NORM_LAYOUTS), ("qk_norm", ("", "head", "full")),
                   ("router", ("softmax", "topk_softmax")))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.positions == "rotary" and (self.head_dim % 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise ConfigError(f"head_dim={self.head_dim} and rotary_dim={self.rotary_dim} must be even, rotary_dim "
                              "<= head_dim, for rotary embeddings")
        if self.windows and (len(self.windows) != self.n_layers or any(w < 0 for w in self.windows)):
            raise ConfigError(f"windows={self.windows!r} must give each of the {self.n_layers} layers a window "
                              ">= 0 (0: full attention)")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"{self.model_type}: activation {self.activation!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )

    def _check_experts(self) -> None:
        for i in self.dense_layers:
            _whole(i, "a layer of dense_layers (mlp_only_layers)", low=0)
        if not self.n_experts:
            return
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(f"num_experts_per_tok={self.experts_per_token} must be between 1 and the "
                              f"{self.n_experts} experts (num_experts); fix config.json")
        if not self.moe_intermediate_size:
            raise ConfigError("moe_intermediate_size=0: each expert needs an MLP width >= 1; fix config.json")

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the Mixture-of-Experts one (transformers' rule for Qwen MoE's layers)."""
        return bool(self.n_experts) and (layer + 1) % self.moe_step == 0 and layer not in self.dense_layers

    @property
    def n_sparse(self) -> int:
        """How many layers have the MoE MLP."""
        if not self.n_experts:
            return 0
        dense = {i for i in self.dense_layers if i < self.n_layers and (i + 1) % self.moe_step == 0}
        return self.n_layers // self.moe_step - len(dense)

    def expert_parallel(self, tp: int) -> bool:
        """Whether ``tp`` ranks split the experts whole (each holds ``n_experts / tp`` of them) rather than slicing
        every expert's intermediate dimension: where ``tp`` divides the expert count (why: the docstring of
        :mod:`energon_infer.worker.moe`)."""
        return self.n_experts > 0 and self.n_experts % tp == 0

    def mlp_params(self, sparse: bool) -> int:
        """Parameters of a dense layer's MLP, or of a ``sparse`` one's (every expert, the router and the shared
        expert)."""
        h = self.hidden_size
        if not sparse:
            return h * self.intermediate_size * (3 if self.mlp == "swiglu" else 2)
        shared = 3 * h * self.shared_expert_size + (h if self.shared_expert_size else 0)
        biases = (2 * self.moe_intermediate_size + h + 1) if self.expert_bias else 0  # gate/up, down, router's
        return self.n_experts * (3 * h * self.moe_intermediate_size + h + biases) + shared

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: it attends to the whole context)."""
        return self.windows[layer] if self.windows else 0

    @property
    def n_params(self) -> int:
        """Parameter count (tied head counted once); used for progress output and benchmarks."""
        h, e = self.hidden_size, self.embed_dim
        attn = h * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = (self.n_layers - self.n_sparse) * self.mlp_params(False) + self.n_sparse * self.mlp_params(True)
        embed = self.vocab_size * e * (1 if self.tie_embeddings else 2)
        pos = (self.max_positions + self.position_offset) * h if self.positions == "learned" else 0
        proj = 2 * h * e if e != h else 0
        return self.n_layers * attn + mlp + embed + pos + proj

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face ``config.json`` dictionary.

    Raises :class:`ConfigError` (a missing field, a string or list where a number belongs, a zero
    head count, a size that does not divide) or :class:`UnsupportedModelError` (a model type no family reads, or
    an option its family does not run: the family, the option, the value and the fix), never a bare
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
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}. A new native family is a declaration in "
            "energon_infer.loading.families (docs/model-families.md)"
        )
    family = SUPPORTED_MODEL_TYPES[model_type]
    common: dict[str, Any] = dict(model_type=model_type, family=family, bos_token_id=raw.get("bos_token_id"),
                                  eos_token_ids=eos_ids(raw.get("eos_token_id")))
    if family == "gpt2":
        return ModelConfig(**common, **_gpt2_fields(raw))
    if family == "opt":
        return ModelConfig(**common, **_opt_fields(raw))
    return ModelConfig(**common, **FAMILIES[family].read(raw))


def _gpt2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    h, heads = _int(raw, "n_embd"), _int(raw, "n_head")
    divides(h, heads, "n_embd", "n_head")
    if raw.get("add_cross_attention"):
        raise UnsupportedModelError("GPT-2 with add_cross_attention=True is an encoder-decoder; not supported")
    if not raw.get("scale_attn_weights", True):
        raise UnsupportedModelError("GPT-2 with scale_attn_weights=False is not supported")
    return dict(
        vocab_size=_int(raw, "vocab_size"), hidden_size=h, n_layers=_int(raw, "n_layer"), n_heads=heads,
        n_kv_heads=heads, head_dim=h // heads,
        intermediate_size=_whole(or_default(raw.get("n_inner"), 4 * h), "n_inner"),
        max_positions=_int(raw, "n_positions"), norm="layer",
        norm_eps=real(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon"),
        positions="learned", mlp="dense", activation=raw.get("activation_function", "gelu_new"),
        tie_embeddings=raw.get("tie_word_embeddings", True),
        attn_scale_by_layer=bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
    )


def _opt_fields(raw: dict[str, Any]) -> dict[str, Any]:
    h = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    divides(h, heads, "hidden_size", "num_attention_heads")
    pre = bool(raw.get("do_layer_norm_before", True))
    bias = bool(raw.get("enable_bias", True))
    return dict(
        vocab_size=_int(raw, "vocab_size"), hidden_size=h, n_layers=_int(raw, "num_hidden_layers"),
        n_heads=heads, n_kv_heads=heads, head_dim=h // heads, intermediate_size=_int(raw, "ffn_dim"),
        max_positions=_int(raw, "max_position_embeddings"), norm="layer", norm_eps=1e-5,
        norm_affine=bool(raw.get("layer_norm_elementwise_affine", True)), norm_layout="pre" if pre else "post",
        final_norm=pre and not raw.get("_remove_final_layer_norm", False), positions="learned",
        position_offset=2, mlp="dense", activation=raw.get("activation_function", "relu"),
        qkv_bias=bias, o_bias=bias, mlp_bias=bias, embed_dim=raw.get("word_embed_proj_dim") or h,
        tie_embeddings=raw.get("tie_word_embeddings", True),
    )


def read_config_json(path: str | Path) -> Any:
    """The parsed ``<path>/config.json``: a missing file or bad JSON raises in one line naming the file."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise MissingFileError(f"{file} does not exist: a model directory needs config.json next to its *.safetensors "
                               "(save one with transformers' save_pretrained)")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file} is not valid JSON ({err}); restore it from the original model directory "
                          "or save it again with save_pretrained") from None


def load_config(path: str | Path) -> ModelConfig:
    """Read ``<path>/config.json`` (a Hugging Face model directory); every error names the file."""
    file = Path(path) / "config.json"
    raw = read_config_json(path)
    try:
        return config_from_hf(raw)
    except ConfigError as err:
        raise ConfigError(f"{file}: {err}") from None
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{file}: {err}") from None
