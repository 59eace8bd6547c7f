"""Rotary frequencies for a step, term for term as transformers' ``modeling_rope_utils`` computes them.

The static kinds (``default``, ``linear``, ``llama3``, ``yarn``) have one ``inv_freq`` per model, computed once.
Two kinds depend on the sequence's length, which transformers takes per forward call as ``max(position_ids) + 1``;
here each sequence of a packed step uses its own: its context after the step (``kv_lens``), or, for a chunk of a
longer prefill where the step says so (``rope_lens``; a longrope model's), the whole prefill's length, since
transformers runs a prefill in one call:

* ``dynamic``: past ``max_position_embeddings`` the base grows with that length;
* ``longrope``: ``long_factor`` once that length passes ``original_max_position_embeddings``, ``short_factor``
  before. transformers' ``generate`` recomputes the whole sequence when it passes that switch, and so does the
  scheduler (:mod:`energon_infer.scheduling.rope_switch`): a sequence's cached keys are all short-factor or all
  long-factor ones, as transformers' are.

Everything is tensor ops on the step's metadata (no host synchronisation), so a decode step stays capturable in a
CUDA graph.
"""

from __future__ import annotations

import functools
import math

import torch

from energon_infer.loading.config import ModelConfig, Rope
from energon_infer.worker.kv_cache import StepMetadata

__all__ = ["inv_freq", "step_ropes", "token_lengths"]


def _default(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3(rope: Rope, dim: int, device: torch.device) -> torch.Tensor:
    inv = _default(rope.theta, dim, device)
    old, factor = rope.original_max_positions, rope.factor
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_llama)


def _yarn(rope: Rope, dim: int, device: torch.device) -> torch.Tensor:
    base, original = rope.theta, rope.original_max_positions

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope(rope: Rope, dim: int, device: torch.device, factors: tuple[float, ...]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * rope.theta ** shape)


@functools.lru_cache(maxsize=32)
def inv_freq(rope: Rope, dim: int, device: torch.device, long: bool = False) -> torch.Tensor:
    """The ``(dim / 2,)`` inverse frequencies of a static kind (for ``dynamic``: below the growth point; for
    ``longrope``: the short factors, or the long ones with ``long``)."""
    if rope.kind in ("default", "dynamic"):
        return _default(rope.theta, dim, device)
    if rope.kind == "linear":
        return _default(rope.theta, dim, device) / rope.factor
    if rope.kind == "llama3":
        return _llama3(rope, dim, device)
    if rope.kind == "yarn":
        return _yarn(rope, dim, device)
    if rope.kind == "longrope":
        return _longrope(rope, dim, device, rope.long_factor if long else rope.short_factor)
    raise ValueError(f"rope kind {rope.kind!r} has no frequencies here")  # read_rope refuses it first


def token_lengths(meta: StepMetadata) -> torch.Tensor:
    """``(T,)`` the length each new token's sequence is rotated for: its context after this step, or the whole
    prefill's where the step runs a chunk of one (``meta.rope_lens``)."""
    t = meta.positions.shape[0]
    rows = torch.arange(t, dtype=meta.cu_seqlens.dtype, device=meta.cu_seqlens.device)
    seq = torch.searchsorted(meta.cu_seqlens[1:].contiguous(), rows, right=True)
    lens = meta.kv_lens if meta.rope_lens is None else meta.rope_lens
    return lens.long().index_select(0, seq.clamp_(max=lens.shape[0] - 1))


def _frequencies(rope: Rope, dim: int, meta: StepMetadata) -> torch.Tensor:
    """``(T, dim / 2)`` or ``(1, dim / 2)`` inverse frequencies of the step's tokens."""
    device = meta.positions.device
    base = inv_freq(rope, dim, device)[None, :]
    if rope.kind == "dynamic":
        lengths = token_lengths(meta).clamp(min=rope.original_max_positions)
        grown = rope.theta * ((rope.factor * lengths / rope.original_max_positions) - (rope.factor - 1)) ** (
            dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        dyn = 1.0 / (grown[:, None] ** exps[None, :])
        return torch.where((lengths > rope.original_max_positions)[:, None], dyn, base)
    if rope.kind == "longrope":
        long = (token_lengths(meta) > rope.original_max_positions)[:, None]
        return torch.where(long, inv_freq(rope, dim, device, True)[None, :], base)
    return base


def _cos_sin(rope: Rope, dim: int, meta: StepMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = meta.positions.float()[:, None] * _frequencies(rope, dim, meta)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def step_ropes(cfg: ModelConfig, meta: StepMetadata, dtype: torch.dtype
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """``{"global": (cos, sin), "local": ...}``, each ``(T, 1, rotary_dim)`` in ``dtype``: computed once a step,
    not once a layer (``local`` only where sliding-window layers have their own rotary embedding)."""
    if cfg.positions != "rotary":
        return None
    dim = cfg.rotary_dim or cfg.head_dim
    out = {"global": _cos_sin(cfg.rope, dim, meta, dtype)}
    if cfg.local_rope is not None:
        out["local"] = _cos_sin(cfg.local_rope, dim, meta, dtype)
    return out
