"""The rotary embedding a checkpoint asks for, read from ``config.json`` as transformers reads it.

transformers 5 writes ``{"rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}}`` (nested by layer type
where layers differ, as Gemma 3's ``{"full_attention": {...}, "sliding_attention": {...}}``); checkpoints saved by
4.x carry ``rope_theta`` and ``rope_scaling`` at the top level (Gemma 3: ``rope_local_base_freq`` for its local
layers; Phi-3: ``original_max_position_embeddings`` at the top level). :func:`read_rope` reads every form into one
:class:`Rope` per layer kind; :mod:`energon_infer.worker.rope` turns it into the frequencies each step uses.

Scaling kinds (``rope_type``), each as in transformers' ``modeling_rope_utils``:

* ``default``: ``inv_freq = 1 / theta ** (2i / d)``;
* ``linear``: positions divided by ``factor``;
* ``dynamic`` (NTK): past ``max_position_embeddings``, ``theta`` grows with the sequence's length;
* ``llama3``: long wavelengths divided by ``factor``, short ones kept, the band between blended;
* ``yarn``: the llama3 idea with a linear ramp over dimensions, and cos/sin scaled by an attention factor;
* ``longrope`` (Phi-3): per-dimension ``short_factor`` up to ``original_max_position_embeddings`` tokens of
  context, ``long_factor`` past it, and an attention factor.

Example:
    >>> read_rope({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
    ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    ...     "llama", head_dim=64, max_positions=131072).kind
    'llama3'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from energon_infer.loading.config_fields import ConfigError, real, refuse, whole

__all__ = ["ROPE_TYPES", "Rope", "read_rope", "rotary_fraction"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_FIX = ("use a checkpoint whose rope_type is one of " + ", ".join(ROPE_TYPES) + ", or serve this one through the "
        "transformers fallback (energon_infer.loading.backend)")


@dataclass(frozen=True, slots=True)
class Rope:
    """The rotary embedding of one kind of layer.

    Args:
        theta: the base (``rope_theta``).
        kind: one of :data:`ROPE_TYPES`.
        factor: the scaling factor (``linear``, ``dynamic``, ``llama3``, ``yarn``; ``longrope``'s only sets the
            default attention factor).
        original_max_positions: the context the model was pretrained with (``llama3``, ``yarn``, ``longrope``) or,
            for ``dynamic``, ``max_position_embeddings`` (the length past which the base grows).
        low_freq_factor / high_freq_factor: ``llama3``'s band edges.
        beta_fast / beta_slow / truncate: ``yarn``'s ramp.
        attention_factor: cos and sin are multiplied by it (``yarn``, ``longrope``; 1 otherwise).
        short_factor / long_factor: ``longrope``'s per-dimension factors (``rotary_dim / 2`` each).
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def rotary_fraction(raw: dict[str, Any], params: dict[str, Any]) -> float:
    """``partial_rotary_factor`` (the fraction of each head that is rotated), from the rope parameters or the top
    level; 1 when absent."""
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if value is None:
        return 1.0
    value = real(value, "partial_rotary_factor")
    if value > 1:
        raise ConfigError(f"partial_rotary_factor={value!r} must be in (0, 1]; fix config.json")
    return value


def _params(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r} must be an object like {{\"rope_type\": \"linear\", \"factor\": 2.0}}")
    return value


def rope_sources(raw: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of ``layer_type``'s layers (``None``: the model's one set), as transformers merges them:
    a top-level ``rope_scaling`` replaces ``rope_parameters`` (4.x checkpoints); nested parameters are per layer
    type."""
    scaling, params = _params(raw, "rope_scaling"), _params(raw, "rope_parameters")
    nested = {k: v for k, v in params.items() if k in ("full_attention", "sliding_attention")}
    if layer_type is None:
        if nested:
            raise ConfigError(f"rope_parameters is nested by layer type ({sorted(nested)}) but model_type "
                              f"{raw.get('model_type')!r} has one kind of layer; fix config.json")
        return dict(scaling or params)
    if nested:
        own = nested.get(layer_type) or {}
        if not isinstance(own, dict):
            raise ConfigError(f"rope_parameters.{layer_type}={own!r} must be an object; fix config.json")
        return dict(own)
    # 4.x form: the scaling applies to the global (full attention) layers only.
    return dict(scaling) if layer_type == "full_attention" else {}


def _number(params: dict[str, Any], key: str, default: float | None = None) -> float:
    value = params.get(key, default)
    if value is None:
        raise ConfigError(f"rope_parameters has no {key!r}, which rope_type {params.get('rope_type')!r} needs; "
                          "fix config.json")
    return real(value, f"rope {key}")


def _factors(params: dict[str, Any], key: str, half: int) -> tuple[float, ...]:
    value = params.get(key)
    if not isinstance(value, (list, tuple)) or len(value) != half:
        raise ConfigError(f"rope {key}={value!r} must be a list of {half} numbers (rotary_dim / 2); fix config.json")
    return tuple(real(v, f"rope {key}") for v in value)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def read_rope(raw: dict[str, Any], model_type: str, *, head_dim: int, max_positions: int,
              layer_type: str | None = None, default_theta: float = 10000.0, rotary_dim: int = 0) -> Rope:
    """The :class:`Rope` of ``layer_type``'s layers (``None``: every layer) in ``raw`` (config.json).

    An unknown ``rope_type`` is refused naming the family, the option, the value and the fix.
    """
    params = rope_sources(raw, layer_type)
    top = raw.get("rope_theta") if layer_type in (None, "full_attention") else None  # local bases: their own key
    theta = real(params.get("rope_theta", top if top is not None else default_theta), "rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if model_type == "phi3" and kind in ("su", "yarn"):  # Phi-3's older names of longrope, as transformers reads them
        kind = "longrope"
    if kind not in ROPE_TYPES:
        refuse(model_type, "rope_type", kind, _FIX)
    if kind == "default":
        return Rope(theta=theta)
    dim = rotary_dim or head_dim
    original = raw.get("original_max_position_embeddings") if layer_type is None else None
    original = whole(original if original is not None else params.get("original_max_position_embeddings",
                                                                       max_positions),
                     "original_max_position_embeddings")
    if kind in ("linear", "dynamic"):
        return Rope(theta=theta, kind=kind, factor=_number(params, "factor"),
                    original_max_positions=max_positions if kind == "dynamic" else 0)
    if kind == "llama3":
        low, high = _number(params, "low_freq_factor"), _number(params, "high_freq_factor")
        if high == low:
            raise ConfigError(f"rope high_freq_factor={high} must differ from low_freq_factor; fix config.json")
        return Rope(theta=theta, kind=kind, factor=_number(params, "factor"), original_max_positions=original,
                    low_freq_factor=low, high_freq_factor=high)
    factor = params.get("factor")
    factor = real(factor, "rope factor") if factor is not None else max_positions / original
    attention = params.get("attention_factor")
    if kind == "yarn":
        if attention is None:
            mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
            attention = (_mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim
                         else _mscale(factor))
        return Rope(theta=theta, kind=kind, factor=factor, original_max_positions=original,
                    beta_fast=real(params.get("beta_fast") or 32, "rope beta_fast"),
                    beta_slow=real(params.get("beta_slow") or 1, "rope beta_slow"),
                    truncate=bool(params.get("truncate", True)), attention_factor=real(attention, "attention_factor"))
    if attention is None:  # longrope
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return Rope(theta=theta, kind=kind, factor=factor, original_max_positions=original,
                attention_factor=real(attention, "attention_factor"),
                short_factor=_factors(params, "short_factor", dim // 2),
                long_factor=_factors(params, "long_factor", dim // 2))
