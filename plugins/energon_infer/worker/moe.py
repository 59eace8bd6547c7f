"""The Mixture-of-Experts MLP of the native MoE families (Mixtral, Qwen 2 / 3 MoE, gpt-oss), on packed tokens.

A router scores every token against every expert; each token runs through its ``experts_per_token`` best experts
and the block's output is their outputs weighted by the router's probabilities. The math follows transformers'
``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock`` term for term: router logits in
the activations' dtype, softmax in fp32, top-k, the chosen probabilities renormalised to sum to 1 where the model
says (Mixtral always, Qwen's ``norm_topk_prob``), kept in fp32 when they scale the experts' outputs (Mixtral) or cast
to the activations' dtype first (Qwen); Qwen 2 MoE adds a shared expert that every token runs, scaled by a sigmoid
gate. gpt-oss (``GptOssMLP``) routes the other way round: its router has a bias, the top-k of the logits are chosen
and a softmax over those k alone (in the activations' dtype) weights them; its experts have biases and a clamped
SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``.

The experts run grouped, in one call per layer (:func:`tightfit.kernels.grouped_experts.grouped_experts`: a native
CPU kernel for fp32, the same grouping in PyTorch otherwise): the step's (token, expert) pairs are sorted by expert
once, and each expert that has tokens runs once over all of them (a gate/up product, the gated activation, a down
product), its rows scaled by their routing weights and added back into their tokens' rows. A token's weighted expert
outputs are summed in fp32 and rounded to the activations' dtype once, as transformers' grouped experts (its default
implementation) sum them. :class:`Expert` holds one expert's weights (its ``forward`` runs it alone). Quantized
experts (``quantization="int8"`` / ``"int4"``: :meth:`Expert.set_quantized`, each expert quantized on its own) run
the same grouping with quantized products (:func:`tightfit.kernels.grouped_quant_experts.grouped_quant_experts`).

Tensor parallelism (``tp > 1``): **expert parallelism** where ``tp`` divides the expert count
(:meth:`~energon_infer.loading.config.ModelConfig.expert_parallel`): rank ``r`` holds experts
``r * E/tp .. (r+1) * E/tp - 1`` whole and runs those of them its tokens chose. An expert's products then stay
as wide as the checkpoint made them (a slice of ``moe_intermediate_size / tp`` columns is a thinner product for
the same per-call overhead, and MoE experts are narrow already), each expert's weights are read by one rank only,
and an expert is a whole unit a placement plan can move. Where ``tp`` does not divide the expert count, every rank
holds every expert's slice of the intermediate dimension, split as the dense MLP is (gate/up by rows, down by
columns). The router is replicated (each rank routes every token the same way); either way each rank's output
is a partial sum over experts (or over intermediate slices), the shared expert's slice is added in, and one
all-reduce gives the block's output, as the dense MLP's row-parallel ``down`` does. An expert's ``down`` bias
(gpt-oss) is added, scaled by the expert's routing weight, by one rank only: the rank holding the expert, or
rank 0 where every rank holds a slice of it.

Example:
    >>> from energon_infer.loading.config import config_from_hf
    >>> cfg = config_from_hf({"model_type": "mixtral", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    ...     "num_attention_heads": 2, "intermediate_size": 4, "max_position_embeddings": 16,
    ...     "num_local_experts": 4, "num_experts_per_tok": 2})
    >>> moe = MoE(cfg, Grid(), torch.float32, "cpu")
    >>> sorted(moe.experts), tuple(moe.experts["0"].gate_up.shape)
    (['0', '1', '2', '3'], (8, 8))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from energon_infer.loading.config import ModelConfig
from energon_infer.parallel import ColumnLinear, Grid, linear_weight
from tightfit.kernels.elementwise import silu_mul
from tightfit.kernels.grouped_experts import expert_mlp, grouped_experts
from tightfit.kernels.grouped_quant_experts import QuantWeight, grouped_quant_experts, quant_expert_mlp

__all__ = ["Expert", "MoE", "local_experts", "moe_tp_widths"]


def local_experts(cfg: ModelConfig, grid: Grid) -> range:
    """The experts this rank holds: a contiguous ``E / tp`` of them with expert parallelism, else all."""
    if not cfg.expert_parallel(grid.tp):
        return range(cfg.n_experts)
    per = cfg.n_experts // grid.tp
    return range(grid.tp_rank * per, (grid.tp_rank + 1) * per)


def moe_tp_widths(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    """The MoE widths ``tp`` must divide (for :func:`energon_infer.worker.model.check_tp`): each expert's
    intermediate size where experts are sliced rather than split whole across ranks, and the shared expert's."""
    widths = []
    if cfg.n_sparse and not cfg.expert_parallel(tp):
        widths.append(("expert MLP width (moe_intermediate_size; or a tp dividing num_experts)",
                       cfg.moe_intermediate_size))
    if cfg.n_sparse and cfg.shared_expert_size:
        widths.append(("shared expert width (shared_expert_intermediate_size)", cfg.shared_expert_size))
    return widths


class Expert(nn.Module):
    """One expert's gated MLP on this rank: ``gate_up`` (gate rows, then up rows) and ``down``, held input-major
    (:func:`~energon_infer.parallel.linear_weight`); whole, or this rank's slice of the intermediate dimension.

    With ``bias`` (gpt-oss), ``gate_up_bias`` and, where ``down_bias`` (the one rank that adds it), ``down_bias``;
    with ``limit`` > 0 the clamped SwiGLU of gain ``alpha`` (see the module docstring) replaces ``silu(gate) * up``.

    Quantized (:meth:`set_quantized`, weight-only int8 / int4 as the dense projections are): ``gate_up`` and
    ``down`` give way to ``<part>_qweight``, ``<part>_qscale`` (and, int4, ``<part>_qzero``), in
    :func:`energon_infer.loading.quantization.quantize_weight`'s formats; the biases stay as loaded.
    """

    # "int8" / "int4" once both parts hold quantized weights (set_quantized); None: the model's dtype
    quant: str | None = None
    group_size: int = 0

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str, *,
                 bias: bool = False, down_bias: bool = False, limit: float = 0.0, alpha: float = 0.0):
        super().__init__()
        self.gate_up = linear_weight(2 * inter, hidden, dtype, device)
        self.down = linear_weight(hidden, inter, dtype, device)
        self.gate_up_bias = nn.Parameter(torch.empty(2 * inter, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.down_bias = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device), requires_grad=False) \
            if down_bias else None
        self.limit, self.alpha = limit, alpha

    def set_quantized(self, method: str, tensors: dict[str, torch.Tensor], group_size: int | None, *,
                      part: str) -> int:
        """Hold ``part`` (``"gate_up"`` or ``"down"``) quantized (``tensors``: ``quantize_weight``'s of its
        ``(out, in)`` weight); the bytes it now holds."""
        if part not in ("gate_up", "down"):
            raise ValueError(f"Expert.set_quantized: part={part!r} is not one of 'gate_up', 'down'")
        self._parameters.pop(part, None)
        for key in ("qweight", "scale", "zero"):
            if key in tensors:
                name = f"{part}_{key if key == 'qweight' else 'q' + key}"
                self._parameters[name] = nn.Parameter(tensors[key], requires_grad=False)
        self.quant, self.group_size = method, group_size or 0
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def quant_weight(self, part: str) -> QuantWeight:
        """``part``'s quantized weight (after :meth:`set_quantized`)."""
        zero = self._parameters.get(f"{part}_qzero")
        return QuantWeight(self._parameters[f"{part}_qweight"], self._parameters[f"{part}_qscale"], zero,
                           self.group_size if zero is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_expert_mlp(x, self.quant_weight("gate_up"), self.quant_weight("down"), self.gate_up_bias,
                                    self.down_bias, self.limit, self.alpha)
        return expert_mlp(x, self.gate_up, self.down, self.gate_up_bias, self.down_bias, self.limit, self.alpha)


class MoE(nn.Module):
    """A sparse MLP: router, this rank's experts (:func:`local_experts`) and, where the model has one, the shared
    expert with its sigmoid gate (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, grid: Grid, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        h, tp = cfg.hidden_size, grid.tp
        self.grid, self.n_experts, self.top_k = grid, cfg.n_experts, cfg.experts_per_token
        self.norm_topk, self.fp32_weights, self.topk_first = cfg.norm_topk, cfg.routing_fp32, \
            cfg.router == "topk_softmax"
        self.bias, self.limit, self.alpha = bias, limit, alpha = cfg.expert_bias, cfg.swiglu_limit, cfg.swiglu_alpha
        self.router = nn.Linear(h, cfg.n_experts, bias=bias, dtype=dtype, device=device).requires_grad_(False)
        inter = cfg.moe_intermediate_size // (1 if cfg.expert_parallel(tp) else tp)
        self.local = local_experts(cfg, grid)
        down_bias = bias and (cfg.expert_parallel(tp) or grid.tp_rank == 0)
        self.experts = nn.ModuleDict({str(e): Expert(h, inter, dtype, device, bias=bias, down_bias=down_bias,
                                                     limit=limit, alpha=alpha)
                                      for e in self.local})
        self.shared_up = self.shared_down = self.shared_expert_gate = None
        if cfg.shared_expert_size:
            shared = cfg.shared_expert_size // tp
            self.shared_up = ColumnLinear(h, 2 * shared, False, dtype, device)
            self.shared_down = ColumnLinear(shared, h, False, dtype, device)  # a row slice: reduced with the experts
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, dtype=dtype, device=device).requires_grad_(False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``(tokens, top_k)``: the chosen experts and their routing weights."""
        if self.topk_first:  # gpt-oss: the top-k logits, a softmax over them in the activations' dtype
            logits, chosen = torch.topk(self.router(x), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), chosen
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(x.dtype)), chosen

    # Set by an expert pool (energon_infer.worker.expert_pool) where some experts are read when routed: called
    # with the router's picks and the layer's input before the experts run (the input lets the pool predict the
    # next layer's picks and read them while these experts run), and after.
    fetch_experts: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    release_experts: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if self.fetch_experts is not None:
            self.fetch_experts(chosen, x)
        experts = cast(list[Expert], list(self.experts.values()))
        biases = dict(gate_up_bias=[e.gate_up_bias for e in experts] if self.bias else None,
                      down_bias=[e.down_bias for e in experts] if self.bias else None)
        if experts and experts[0].quant is not None:  # weight-only int8 / int4 (energon_infer.loading.quantization)
            out = grouped_quant_experts(x, weights, chosen, [e.quant_weight("gate_up") for e in experts],
                                        [e.quant_weight("down") for e in experts], first=self.local.start,
                                        limit=self.limit, alpha=self.alpha, **biases)
        else:
            out = grouped_experts(x, weights, chosen, [e.gate_up for e in experts], [e.down for e in experts],
                                  first=self.local.start, limit=self.limit, alpha=self.alpha, **biases)
        out = out.to(x.dtype)
        if self.release_experts is not None:
            self.release_experts()
        if self.shared_up is not None:
            assert self.shared_down is not None and self.shared_expert_gate is not None
            shared = self.shared_down(silu_mul(self.shared_up(x)))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.grid.all_reduce(out)
