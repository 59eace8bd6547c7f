"""One configurable decoder block for every family the runtime runs natively, on packed tokens.

A :class:`DecoderStage` is the part of a model one rank runs: the embedding if it is the first
pipeline stage, its range of blocks, and the final norm and head if it is the last. Every tensor
is ``(tokens, features)``: the new tokens of all sequences in a step back to back with no padding,
so each linear layer does exactly the work of the real tokens, and attention is restricted per
sequence by :func:`tightfit.kernels.varlen_attention.paged_attention` (sliding-window, soft-capped and sink layers
too where its native CPU kernel runs; elsewhere :func:`energon_infer.worker.attention.masked_attention`).

The block reads :class:`~energon_infer.loading.config.ModelConfig`'s switches only (norm layout and offset,
q/k norms, rotary width and scaling, windows, soft-caps, multipliers); which family a checkpoint belongs to
is decided once, by its declaration in :mod:`energon_infer.loading.families`. The math follows each
family's Hugging Face implementation term for term (norm placement, fp32 RMSNorm, rotary ``rotate_half``
layout, OPT's position offset of 2 and its project in/out), which is what the reference-equality tests
hold it to.
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
from energon_infer.worker.attention import attention
from energon_infer.worker.kv_cache import KVCache, StepMetadata
from energon_infer.worker.moe import MoE, moe_tp_widths
from energon_infer.worker.rope import step_ropes
from tightfit.kernels.dispatch import repeated_calls
from tightfit.kernels.elementwise import rms_norm, rotary_, silu_mul
from tightfit.kernels.gelu_mul import gelu_tanh_mul
from tightfit.kernels.head_norm import rms_norm_heads_
from tightfit.kernels.packed_linear import apply_activation
from tightfit.kernels.varlen_attention import store_kv

__all__ = ["DecoderStage", "Block", "check_tp", "step_ropes"]

Ropes = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _tp_widths(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    widths = [("attention heads", cfg.n_heads), ("key/value heads", cfg.n_kv_heads)]
    if cfg.n_sparse < cfg.n_layers:  # some layer has the dense MLP
        widths.append(("MLP width (intermediate_size)", cfg.intermediate_size))
    return widths + moe_tp_widths(cfg, tp)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise unless ``tp`` splits the query heads, key/value heads, MLP and experts evenly."""
    for what, value in _tp_widths(cfg, tp):
        if value % tp:
            divisors = [d for d in range(1, cfg.n_kv_heads + 1) if all(v % d == 0 for _, v in _tp_widths(cfg, d))]
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
    """LayerNorm or RMSNorm (RMSNorm in fp32 and cast back, as LLaMA's reference does).

    ``norm_offset`` (Gemma) multiplies by ``offset + weight``; with it or ``norm_weight_fp32`` (OLMo 2) the weight
    multiplies in fp32 before the cast back, as those references do (LLaMA's casts first).
    ``full`` > ``dim``: the norm spans ``full`` features of which this rank holds ``dim`` (OLMo 2's q/k norm
    over all heads, split by tensor parallelism): the sum of squares is all-reduced over the ranks.
    """

    def __init__(self, cfg: ModelConfig, dim: int, dtype: torch.dtype, device: torch.device | str, *,
                 grid: Grid | None = None, full: int = 0):
        super().__init__()
        self.kind, self.eps, self.offset, self.weight_fp32 = cfg.norm, cfg.norm_eps, cfg.norm_offset, \
            cfg.norm_weight_fp32
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False) \
            if cfg.norm_affine else None
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False) \
            if cfg.norm_affine and cfg.norm == "layer" else None
        self.dim = dim
        self.grid: Grid | None = grid if grid is not None and full > dim else None
        self.full = full if self.grid is not None else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        if self.grid is not None:
            return self._split(x)
        if self.offset or (self.weight_fp32 and x.dtype != torch.float32):
            w = self.weight.float() + self.offset if self.weight is not None else None
            if x.dtype == torch.float32:
                return rms_norm(x, w, self.eps)
            h = F.rms_norm(x.float(), (self.dim,), None, self.eps)  # the weight in fp32, then the cast (Gemma, OLMo 2)
            return (h * w if w is not None else h).to(x.dtype)
        if x.dtype == torch.float32:
            # One fused op instead of five (pow, mean, add, rsqrt, mul): a decode step runs 2 norms per
            # layer, so at small batches these launches are a visible part of the step; on long prefills
            # on CPU the native kernel is an order of magnitude faster than F.rms_norm (tightfit.kernels.elementwise).
            return rms_norm(x, self.weight, self.eps)
        h = F.rms_norm(x.float(), (self.dim,), None, self.eps).to(x.dtype)  # fp32, cast, then the weight (HF)
        return h * self.weight if self.weight is not None else h

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        assert self.grid is not None
        h = x.float()
        squares = self.grid.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(squares / self.full + self.eps)
        if self.weight is None:
            return h.to(x.dtype)
        if self.weight_fp32 or self.offset:
            return (h * (self.weight.float() + self.offset)).to(x.dtype)
        return h.to(x.dtype) * self.weight


def _norm_or_none(present: bool, cfg: ModelConfig, dim: int, dtype: torch.dtype, device: torch.device | str
                  ) -> _Norm | None:
    return _Norm(cfg, dim, dtype, device) if present else None


class Block(nn.Module):
    """Attention + MLP with residuals and the norms ``norm_layout`` places; fused QKV and (gated) fused gate/up.

    Projections are column-parallel (qkv, gate/up) and row-parallel (o, down): two all-reduces per block.
    """

    def __init__(self, cfg: ModelConfig, layer: int, grid: Grid, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        tp = grid.tp
        self.cfg = cfg
        self.heads, self.kv_heads, self.head_dim = cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.head_dim
        scale = cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim)
        self.scale = scale / ((layer + 1) if cfg.attn_scale_by_layer else 1)
        self.window, self.softcap = cfg.window(layer), cfg.attn_softcap
        self.rope_key = "local" if self.window and cfg.local_rope is not None else "global"
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        h = cfg.hidden_size
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        layout = cfg.norm_layout
        self.attn_norm = _norm_or_none(layout != "output", cfg, h, dtype, device)
        self.attn_out_norm = _norm_or_none(layout in ("sandwich", "output"), cfg, h, dtype, device)
        self.qkv = ColumnLinear(h, qkv_out, cfg.qkv_bias, dtype, device)
        self.q_norm, self.k_norm = self._qk_norms(cfg, grid, dtype, device)
        # gpt-oss: one sink logit per query head of this rank (energon_infer.worker.attention)
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=dtype, device=device), requires_grad=False) \
            if cfg.attn_sinks else None
        self.o = RowLinear(self.heads * self.head_dim, h, cfg.o_bias, grid, dtype, device)
        self.mlp_norm = _norm_or_none(layout != "output", cfg, h, dtype, device)
        self.mlp_out_norm = _norm_or_none(layout in ("sandwich", "output"), cfg, h, dtype, device)
        inter = cfg.intermediate_size // tp
        self.gated = cfg.mlp == "swiglu"
        # a Mixture-of-Experts layer's MLP (energon_infer.worker.moe) in place of up / down
        self.moe = MoE(cfg, grid, dtype, device) if cfg.sparse(layer) else None
        if self.moe is None:
            self.up = ColumnLinear(h, inter * (2 if self.gated else 1), cfg.mlp_bias, dtype, device)
            self.down = RowLinear(inter, h, cfg.mlp_bias, grid, dtype, device)
        self.act = _activation(cfg.activation)
        self.fused_act = _FUSED.get(cfg.activation, "")
        self.silu = cfg.activation == "silu"

    def _qk_norms(self, cfg: ModelConfig, grid: Grid, dtype: torch.dtype, device: torch.device | str
                  ) -> tuple[_Norm | None, _Norm | None]:
        if cfg.qk_norm == "head":  # one norm per head (its weight shared by every head)
            return _Norm(cfg, self.head_dim, dtype, device), _Norm(cfg, self.head_dim, dtype, device)
        if cfg.qk_norm == "full":  # one norm over all heads' features (its weight split by rank as the heads are)
            d = self.head_dim
            return (_Norm(cfg, self.heads * d, dtype, device, grid=grid, full=cfg.n_heads * d),
                    _Norm(cfg, self.kv_heads * d, dtype, device, grid=grid, full=cfg.n_kv_heads * d))
        return None, None

    def _norm_qk(self, qkv: torch.Tensor, n_q: int, n_k: int) -> None:
        """q/k norms, written back into the QKV output (the rotation then runs on it in place)."""
        assert self.q_norm is not None and self.k_norm is not None
        wq, wk = self.q_norm.weight, self.k_norm.weight
        if self.cfg.qk_norm == "head" and self.cfg.norm == "rms" and qkv.dtype == torch.float32 \
                and wq is not None and wk is not None:  # one pass in place on CPU (tightfit.kernels.head_norm)
            qk = qkv[:, :n_q + n_k].view(qkv.shape[0], self.heads + self.kv_heads, self.head_dim)
            rms_norm_heads_(qk, self.heads, wq, wk, self.q_norm.eps, self.q_norm.offset)
            return
        q, k = qkv[:, :n_q], qkv[:, n_q:n_q + n_k]
        width = self.head_dim if self.cfg.qk_norm == "head" else None
        q.copy_(self.q_norm(q.reshape(-1, width or n_q)).view(q.shape))
        k.copy_(self.k_norm(k.reshape(-1, width or n_k)).view(k.shape))

    def attention(self, x: torch.Tensor, meta: StepMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)
        n_q, n_k = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.q_norm is not None:
            self._norm_qk(qkv, n_q, n_k)
        v = qkv[:, n_q + n_k:].view(t, self.kv_heads, self.head_dim)
        qk = qkv[:, :n_q + n_k].view(t, self.heads + self.kv_heads, self.head_dim)
        if rope is not None:
            # Queries and keys rotated together (heads + kv_heads rows of head_dim; the first rotary_dim features
            # of each), in place in the QKV output: one fused pass on CPU (tightfit.kernels.elementwise).
            rotary_(qk if self.rotary_dim == self.head_dim else qk[..., :self.rotary_dim], *rope)
        q, k = qk[:, :self.heads], qk[:, self.heads:]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = attention(q, k_cache, v_cache, meta, scale=self.scale, window=self.window, softcap=self.softcap,
                        sinks=self.sinks)
        return self.o(out.reshape(t, self.heads * self.head_dim))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x)
        if self.gated and self.silu:
            return self.down(silu_mul(self.up(x)))  # one fused pass on CPU (tightfit.kernels.elementwise)
        if self.gated and self.fused_act == "gelu_tanh":  # GeGLU (Gemma): one fused pass on CPU too
            return self.down(gelu_tanh_mul(self.up(x)))
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)
        if self.fused_act:
            return self.down(self.up(x, self.fused_act))  # in the product's epilogue where it is packed
        return self.down(self.act(self.up(x)))

    def _add(self, x: torch.Tensor, h: torch.Tensor, out_norm: _Norm | None) -> torch.Tensor:
        """The residual add of a sublayer's output ``h``: normed first (sandwich, output layouts), scaled (Granite)."""
        if out_norm is not None:
            h = out_norm(h)
        scale = self.cfg.residual_scale
        return x + (h * scale if scale != 1.0 else h)

    def forward(self, x: torch.Tensor, meta: StepMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ropes: Ropes | None) -> torch.Tensor:
        rope = ropes[self.rope_key] if ropes is not None else None
        if self.cfg.norm_layout == "post":  # OPT-350m: the norm follows the residual add
            assert self.attn_norm is not None and self.mlp_norm is not None
            x = self.attn_norm(x + self.attention(x, meta, k_cache, v_cache, rope))
            return self.mlp_norm(x + self.mlp(x))
        h = self.attention(x if self.attn_norm is None else self.attn_norm(x), meta, k_cache, v_cache, rope)
        x = self._add(x, h, self.attn_out_norm)
        return self._add(x, self.mlp(x if self.mlp_norm is None else self.mlp_norm(x)), self.mlp_out_norm)


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
        # Rounded to the activations' dtype as Gemma's reference rounds it (a host float: no copy to the device
        # inside a captured CUDA graph)
        self.embed_scale = float(torch.tensor(cfg.embed_scale, dtype=dtype))
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
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        return x

    def run_layers(self, x: torch.Tensor, meta: StepMetadata, cache: KVCache) -> torch.Tensor:
        ropes = step_ropes(self.cfg, meta, x.dtype)
        for i, block in enumerate(self.layers.values()):
            k_cache, v_cache, layer_meta = cache.layer(i, meta)  # its KV group's keys, values and tables
            x = block(x, layer_meta, k_cache, v_cache, ropes)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and vocabulary projection of the rows given (usually one per sequence)."""
        if self.cfg.final_norm:
            x = self.final_norm(x)
        if hasattr(self, "project_out"):
            x = self.project_out(x)
        logits = self.lm_head(x)
        if self.cfg.logits_divisor != 1.0:
            logits = logits / self.cfg.logits_divisor
        if self.cfg.final_softcap:
            cap = self.cfg.final_softcap  # in place on the logits just made: one (rows, vocab) tensor, not three
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

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
