"""One configurable decoder block for GPT-2, OPT and the LLaMA family, run on packed tokens.

A :class:`DecoderStage` is the part of a model one rank runs: the embedding if it is the first
pipeline stage, its range of blocks, and the final norm and head if it is the last. Every tensor
is ``(tokens, features)``: the new tokens of all sequences in a step back to back with no padding,
so each linear layer does exactly the work of the real tokens, and attention is restricted per
sequence by :func:`tightfit.cuda.varlen_attention.paged_attention`.

The math follows each family's Hugging Face implementation term for term (norm placement, fp32
RMSNorm, rotary ``rotate_half`` layout, OPT's position offset of 2 and its project in/out), which
is what the reference-equality tests hold it to.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from energon_infer.loading.config import ModelConfig
from energon_infer.parallel import ColumnLinear, Grid, RowLinear, VocabEmbedding, VocabHead
from energon_infer.worker.kv_cache import KVCache, StepMetadata
from tightfit.cuda.dispatch import repeated_calls
from tightfit.cuda.elementwise import rms_norm, rotary_, silu_mul
from tightfit.cuda.packed_linear import apply_activation
from tightfit.cuda.varlen_attention import paged_attention, store_kv

__all__ = ["DecoderStage", "Block", "check_tp"]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise unless ``tp`` splits the query heads, key/value heads and MLP evenly."""
    for what, value in (("attention heads", cfg.n_heads), ("key/value heads", cfg.n_kv_heads),
                        ("MLP width (intermediate_size)", cfg.intermediate_size)):
        if value % tp:
            divisors = [d for d in range(1, cfg.n_kv_heads + 1) if cfg.n_kv_heads % d == 0
                        and cfg.n_heads % d == 0 and cfg.intermediate_size % d == 0]
            raise ValueError(
                f"tp={tp} does not divide the {value} {what} of this {cfg.model_type} model; tensor parallelism "
                f"splits them evenly across ranks, so use tp in {divisors}"
            )


#: a model's activation -> the name a projection fuses into its product (``packed_linear.ACTIVATIONS``); SiLU, the
#: one left, runs on its own (or in ``silu_mul`` for a gated MLP)
_FUSED = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return F.silu if name == "silu" else functools.partial(apply_activation, activation=_FUSED[name])


class _Norm(nn.Module):
    """LayerNorm or RMSNorm (RMSNorm in fp32 and cast back, as LLaMA's reference does)."""

    def __init__(self, cfg: ModelConfig, dim: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False) \
            if cfg.norm_affine else None
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False) \
            if cfg.norm_affine and cfg.norm == "layer" else None
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        if x.dtype == torch.float32:
            # One fused op instead of five (pow, mean, add, rsqrt, mul): a decode step runs 2 norms per
            # layer, so at small batches these launches are a visible part of the step; on long prefills
            # on CPU the native kernel is an order of magnitude faster than F.rms_norm (tightfit.cuda.elementwise).
            return rms_norm(x, self.weight, self.eps)
        h = F.rms_norm(x.float(), (self.dim,), None, self.eps).to(x.dtype)  # fp32, cast, then the weight (HF)
        return h * self.weight if self.weight is not None else h


def rotary_cos_sin(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``(T, head_dim)`` in fp32 for the given positions."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=positions.device)
                                         .float() / d))
    if cfg.rope_scaling is not None and cfg.rope_scaling[0] == "linear":
        inv_freq = inv_freq / cfg.rope_scaling[1]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def step_rope(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``cos, sin`` as ``(T, 1, head_dim)`` in ``dtype``: computed and shaped once per step, not per layer."""
    if cfg.positions != "rotary":
        return None
    cos, sin = rotary_cos_sin(cfg, positions)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class Block(nn.Module):
    """Attention + MLP with residuals; pre-norm or post-norm; fused QKV and (for SwiGLU) fused gate/up.

    Projections are column-parallel (qkv, gate/up) and row-parallel (o, down): two all-reduces per block.
    """

    def __init__(self, cfg: ModelConfig, layer: int, grid: Grid, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        tp = grid.tp
        self.cfg = cfg
        self.heads, self.kv_heads, self.head_dim = cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim) / ((layer + 1) if cfg.attn_scale_by_layer else 1)
        h = cfg.hidden_size
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.attn_norm = _Norm(cfg, h, dtype, device)
        self.qkv = ColumnLinear(h, qkv_out, cfg.qkv_bias, dtype, device)
        self.o = RowLinear(self.heads * self.head_dim, h, cfg.o_bias, grid, dtype, device)
        self.mlp_norm = _Norm(cfg, h, dtype, device)
        inter = cfg.intermediate_size // tp
        self.gated = cfg.mlp == "swiglu"
        self.up = ColumnLinear(h, inter * (2 if self.gated else 1), cfg.mlp_bias, dtype, device)
        self.down = RowLinear(inter, h, cfg.mlp_bias, grid, dtype, device)
        self.act = _activation(cfg.activation)
        self.fused_act = _FUSED.get(cfg.activation, "")
        self.silu = cfg.activation == "silu"

    def attention(self, x: torch.Tensor, meta: StepMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)
        n_q, n_k = self.heads * self.head_dim, self.kv_heads * self.head_dim
        v = qkv[:, n_q + n_k:].view(t, self.kv_heads, self.head_dim)
        if rope is not None:
            # Queries and keys rotated together (heads + kv_heads rows of head_dim), in place in the
            # QKV output: one fused pass on CPU (tightfit.cuda.elementwise), one rotation's ops elsewhere.
            qk = rotary_(qkv[:, :n_q + n_k].view(t, self.heads + self.kv_heads, self.head_dim), *rope)
            q, k = qk[:, :self.heads], qk[:, self.heads:]
        else:
            q = qkv[:, :n_q].view(t, self.heads, self.head_dim)
            k = qkv[:, n_q:n_q + n_k].view(t, self.kv_heads, self.head_dim)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens, meta.kv_lens,
                              scale=self.scale, max_q_len=meta.max_q_len)
        return self.o(out.reshape(t, self.heads * self.head_dim))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated and self.silu:
            return self.down(silu_mul(self.up(x)))  # one fused pass on CPU (tightfit.cuda.elementwise)
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)
        if self.fused_act:
            return self.down(self.up(x, self.fused_act))  # in the product's epilogue where it is packed
        return self.down(self.act(self.up(x)))

    def forward(self, x: torch.Tensor, meta: StepMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if self.cfg.pre_norm:
            x = x + self.attention(self.attn_norm(x), meta, k_cache, v_cache, rope)
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + self.attention(x, meta, k_cache, v_cache, rope))
        return self.mlp_norm(x + self.mlp(x))


class DecoderStage(nn.Module):
    """The layers ``layers`` of a model, plus the embedding (first stage) and final norm + head (last stage).

    Parameter names are the runtime's own (``embed.weight``, ``layers.3.qkv.weight``, ...);
    :mod:`energon_infer.loading.weights` maps each checkpoint format onto them.
    """

    def __init__(self, cfg: ModelConfig, grid: Grid, layers: range, *, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.cfg, self.grid, self.layer_range = cfg, grid, layers
        h, e = cfg.hidden_size, cfg.embed_dim
        self.first, self.last = grid.first, grid.last
        if self.first:
            self.embed = VocabEmbedding(cfg.vocab_size, e, grid, dtype, device)
            if cfg.positions == "learned":
                self.pos_embed = nn.Embedding(cfg.max_positions + cfg.position_offset, h, dtype=dtype, device=device)
                self.pos_embed.weight.requires_grad_(False)
            if e != h:
                self.project_in = nn.Linear(e, h, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, grid, dtype, device) for i in layers})
        if self.last:
            if cfg.final_norm:
                self.final_norm = _Norm(cfg, h, dtype, device)
            if e != h:
                self.project_out = nn.Linear(h, e, bias=False, dtype=dtype, device=device).requires_grad_(False)
            self.lm_head = VocabHead(cfg.vocab_size, e, grid, dtype, device)

    def embed_tokens(self, ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        x = self.embed(ids)
        if hasattr(self, "project_in"):
            x = self.project_in(x)
        if self.cfg.positions == "learned":
            x = x + self.pos_embed(meta.positions + self.cfg.position_offset)
        return x

    def run_layers(self, x: torch.Tensor, meta: StepMetadata, cache: KVCache) -> torch.Tensor:
        rope = step_rope(self.cfg, meta.positions, x.dtype)
        for i, block in enumerate(self.layers.values()):
            x = block(x, meta, cache.k[i], cache.v[i], rope)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and vocabulary projection of the rows given (usually one per sequence)."""
        if self.cfg.final_norm:
            x = self.final_norm(x)
        if hasattr(self, "project_out"):
            x = self.project_out(x)
        return self.lm_head(x)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, meta: StepMetadata, cache: KVCache, *, all_logits: bool = False
                ) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or logits on the last stage, out.

        Logits are computed for each sequence's last new token, or for every token with ``all_logits``.
        """
        if self.first:
            x = self.embed_tokens(x, meta)
        with repeated_calls():  # every layer makes the same kernel calls: decided once per step
            x = self.run_layers(x, meta, cache)
            if not self.last:
                return x
            if not all_logits and meta.n_tokens != meta.last_index.shape[0]:  # decode-only step: every row is last
                x = x.index_select(0, meta.last_index)
            return self.head(x)
