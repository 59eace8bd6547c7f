"""A compact GPT-2: token + position embeddings, pre-LN blocks in ``model.blocks``, a tied LM head.

Parameter names follow Hugging Face's GPT-2 (``attn.c_attn``, ``mlp.c_fc``, ``ln_1``) with plain
``nn.Linear`` layers, so :func:`convert_hf_gpt2_state_dict` loads a ``GPT2LMHeadModel`` checkpoint
(its ``Conv1D`` weights transposed) and the two models produce the same logits.

Presets: GPT-2 small/medium/large/xl and the GPT-2 shapes the Elixir paper trains (4B, 10B, 15B,
20B). Build any of them on the meta device to profile or plan without memory, then materialise with
``model.to_empty(device=...)`` and ``model.init_weights()`` (which re-ties the head).

Example:
    >>> import torch
    >>> model = build_gpt("gpt2-tiny")
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
    >>> build_gpt("gpt2-20b", device="meta").num_params() / 1e9   # doctest: +ELLIPSIS
    19.7...
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "PRESETS", "gpt_config", "build_gpt", "convert_hf_gpt2_state_dict"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of a GPT-2-style model.

    Args:
        vocab_size: tokens in the vocabulary (GPT-2: 50257).
        n_positions: longest sequence (learned position embeddings).
        hidden: model width (GPT-2 ``n_embd``).
        layers: transformer blocks (GPT-2 ``n_layer``).
        heads: attention heads; ``hidden`` must be a multiple.
        mlp_ratio: MLP width / hidden (GPT-2: 4).
        dropout: dropout on embeddings, attention output and MLP output (0: off; GPT-2 trained with 0.1).
        layer_norm_eps: LayerNorm epsilon.
        tie_embeddings: the LM head shares the token-embedding matrix (GPT-2 does).
        name: preset name or ``"custom"`` (shown in profiles and plans).
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    mlp_ratio: int = 4
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_positions", "hidden", "layers", "heads", "mlp_ratio"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{field}={value!r} must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(
                f"GPTConfig: hidden={self.hidden} is not divisible by heads={self.heads}; pick heads that divide "
                f"hidden (e.g. heads={max(1, self.hidden // 64)} for 64-wide heads)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            raise ValueError(f"GPTConfig.layer_norm_eps={eps!r} must be a finite number > 0 (a norm divides by "
                             "sqrt(var + eps)); use the trained model's value, e.g. 1e-5")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Exact parameter count (tied head counted once), computed without building the model."""
        h, f = self.hidden, self.mlp_ratio * self.hidden
        block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.n_positions * h + self.layers * block + 2 * h + head

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GPTConfig:
        """From our own field names or a Hugging Face GPT-2 ``config.json`` (``n_embd``, ``n_layer``, ...)."""
        hf = {"n_embd": "hidden", "n_layer": "layers", "n_head": "heads", "layer_norm_epsilon": "layer_norm_eps",
              "resid_pdrop": "dropout", "tie_word_embeddings": "tie_embeddings"}
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            name = hf.get(key, key)
            if name in known and name not in kwargs:
                kwargs[name] = value
        if "n_inner" in data and data["n_inner"]:
            hidden = int(kwargs.get("hidden", GPTConfig().hidden))
            ratio, rest = divmod(int(data["n_inner"]), hidden)
            if rest:
                raise ValueError(f"n_inner={data['n_inner']} is not a multiple of n_embd; GPTConfig needs mlp_ratio")
            kwargs["mlp_ratio"] = ratio
        if not {"hidden", "layers", "heads"} & set(kwargs):
            raise ValueError(
                f"this config has none of hidden/layers/heads (or n_embd/n_layer/n_head); keys: {sorted(data)}"
            )
        return cls(**kwargs)


# Elixir's GPT-2 shapes use 128-wide heads; vocabulary and context are GPT-2's.
PRESETS: dict[str, GPTConfig] = {
    "gpt2-tiny": GPTConfig(vocab_size=256, n_positions=128, hidden=64, layers=2, heads=4, name="gpt2-tiny"),
    "gpt2": GPTConfig(hidden=768, layers=12, heads=12, name="gpt2"),
    "gpt2-medium": GPTConfig(hidden=1024, layers=24, heads=16, name="gpt2-medium"),
    "gpt2-large": GPTConfig(hidden=1280, layers=36, heads=20, name="gpt2-large"),
    "gpt2-xl": GPTConfig(hidden=1600, layers=48, heads=25, name="gpt2-xl"),
    "gpt2-4b": GPTConfig(hidden=3072, layers=32, heads=24, name="gpt2-4b"),
    "gpt2-10b": GPTConfig(hidden=4096, layers=48, heads=32, name="gpt2-10b"),
    "gpt2-15b": GPTConfig(hidden=8192, layers=18, heads=64, name="gpt2-15b"),
    "gpt2-20b": GPTConfig(hidden=8192, layers=24, heads=64, name="gpt2-20b"),
}
_ALIASES = {"gpt2-small": "gpt2"}


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """The preset ``name`` (``"gpt2-xl"``, ``"gpt2-20b"``, ...), with fields optionally replaced."""
    key = _ALIASES.get(name, name)
    if key not in PRESETS:
        raise KeyError(f"unknown GPT preset {name!r}; presets: {', '.join(PRESETS)} (or pass a GPTConfig)")
    return dataclasses.replace(PRESETS[key], **overrides) if overrides else PRESETS[key]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads, self.dropout = config.heads, config.dropout
        self.c_attn = nn.Linear(config.hidden, 3 * config.hidden)
        self.c_proj = nn.Linear(config.hidden, config.hidden)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, h)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden, config.mlp_ratio * config.hidden)
        self.c_proj = nn.Linear(config.mlp_ratio * config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style language model; ``forward(input_ids) -> logits`` of shape ``(batch, seq, vocab)``.

    Args:
        config: the shape (:class:`GPTConfig` or a preset via :func:`build_gpt`).

    Example:
        >>> import torch
        >>> model = GPT(GPTConfig(vocab_size=50, n_positions=16, hidden=32, layers=2, heads=2))
        >>> ids = torch.randint(0, 50, (3, 10))
        >>> model.loss(ids[:, :-1], ids[:, 1:]).ndim
        0
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.n_positions, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def tie_weights(self) -> None:
        """Share the token embedding with the LM head (again after ``to_empty``, which unties them)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 * layers)), zero biases."""
        self.tie_weights()
        resid_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith("c_proj") else 0.02
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def num_params(self) -> int:
        """Distinct parameter elements (tied weights once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        if t > self.config.n_positions:
            raise ValueError(f"sequence length {t} exceeds n_positions={self.config.n_positions}; "
                             "truncate the input or build the model with a larger n_positions")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``forward(input_ids)`` against ``targets`` (same shape)."""
        logits = self(input_ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def example_inputs(self, batch: int = 2, seq: int | None = None, device: torch.device | str | None = None
                       ) -> torch.Tensor:
        """Token ids of shape ``(batch, seq)`` on ``device`` (default: the parameters' device)."""
        seq = self.config.n_positions if seq is None else seq
        device = self.wte.weight.device if device is None else device
        return torch.zeros(batch, seq, dtype=torch.long, device=device)


def build_gpt(config: str | GPTConfig, *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None, **overrides: Any) -> GPT:
    """A :class:`GPT` from a preset name or a config; ``device="meta"`` allocates nothing."""
    cfg = gpt_config(config, **overrides) if isinstance(config, str) else (
        dataclasses.replace(config, **overrides) if overrides else config)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = GPT(cfg)
    return model.to(dtype) if dtype is not None else model


_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def convert_hf_gpt2_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face ``GPT2LMHeadModel`` state dict -> :class:`GPT`'s names (``Conv1D`` weights transposed).

    Attention-mask buffers (``attn.bias``, ``attn.masked_bias``) are dropped; ``lm_head.weight`` is
    kept only when it is not the tied embedding.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if name.startswith("h."):
            name = "blocks." + name[2:]
        if name.endswith(_TRANSPOSED):
            value = value.t().contiguous()
        out[name] = value
    if "lm_head.weight" not in out and "wte.weight" in out:
        out["lm_head.weight"] = out["wte.weight"]
    return out
