"""A Mixture-of-Experts layer's routed experts on weight-only quantized weights (int8 / int4), tokens grouped per expert.

    gate_up = [QuantWeight(qweight, scale, None, 0), ...]          # int8 (quant_linear.int8_linear's format)
    down = [QuantWeight(packed, scale, zero, 32), ...]             # int4 (quant_linear.int4_linear's format)
    out = grouped_quant_experts(x, weights, chosen, gate_up, down)  # (T, H) fp32, as grouped_experts

The same op as :func:`tightfit.kernels.grouped_experts.grouped_experts` (see its module docstring: the pairs sorted by
expert, each expert with tokens run once over all of them, its rows scaled by their routing weights and summed per
token in fp32, in ascending expert order), with each expert's two products run by the quantized linear kernels of
:mod:`tightfit.kernels.quant_linear` on the expert's rows: the native CPU kernel, which dequantises inside its dot
products, up to :data:`~tightfit.kernels.quant_linear.NATIVE_MAX_ROWS` rows (a decode step's share of an expert),
dequantise + BLAS above (prefill). Those kernels split an expert's output features over the threads, each
feature's sum on one thread, so the result does not depend on the thread count where theirs does not. A quantized
expert reads a quarter (int8) or about an eighth (int4) of its fp32 bytes per step, which is what bounds a decode
step's expert time on a CPU.

The weights stay in the row order :func:`~tightfit.kernels.quant_linear.pack_int4` gives (not the tiles of
:mod:`tightfit.kernels.weight_tiles`) and the activations in fp32: the product is torchao's weight-only product, as
the fp32-activation kernels compute it.

Example:
    >>> import torch
    >>> from tightfit.kernels.grouped_experts import expert_mlp
    >>> from tightfit.kernels.quant_linear import dequantize_int8
    >>> def q8(w):
    ...     scale = w.abs().amax(1) / 127
    ...     return QuantWeight((w / scale[:, None]).round().to(torch.int8), scale, None, 0)
    >>> x, gate_up, down = torch.randn(3, 8), [q8(torch.randn(8, 8))], [q8(torch.randn(8, 4))]
    >>> out = grouped_quant_experts(x, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), gate_up, down)
    >>> ref = expert_mlp(x, dequantize_int8(gate_up[0].qweight, gate_up[0].scale, torch.float32),
    ...                  dequantize_int8(down[0].qweight, down[0].scale, torch.float32))
    >>> torch.allclose(out, ref, atol=1e-4)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tightfit.kernels.grouped_experts import (
    Biases,
    check_routing,
    expert_activation,
    expert_bias,
    run_grouped,
)
from tightfit.kernels.quant_linear import int4_linear, int8_linear

__all__ = ["QuantWeight", "quant_linear", "quant_expert_mlp", "grouped_quant_experts"]


class QuantWeight(NamedTuple):
    """One ``(N, K)`` weight held weight-only quantized: int8 (``qweight`` ``(N, K)`` int8, ``scale`` ``(N,)``,
    ``zero`` ``None``) or int4 (``qweight`` ``(N, K/2)`` uint8 packed, ``scale`` and ``zero`` ``(N, K/group_size)``)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: the weight's output and input widths."""
        n, k = self.qweight.shape
        return int(n), int(k) * (1 if self.zero is None else 2)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` with ``W`` held as ``w``."""
    if w.zero is None:
        return int8_linear(x, w.qweight, w.scale, bias)
    return int4_linear(x, w.qweight, w.scale, w.zero, w.group_size, bias)


def quant_expert_mlp(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight,
                     gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                     limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor:
    """One quantized expert's gated MLP on the rows ``x`` (:func:`~tightfit.kernels.grouped_experts.expert_mlp`'s)."""
    return quant_linear(expert_activation(quant_linear(x, gate_up, gate_up_bias), limit, alpha), down, down_bias)


def _check(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: Sequence[QuantWeight],
           down: Sequence[QuantWeight]) -> None:
    check_routing("grouped_quant_experts", x, weights, chosen)
    shapes = [(g.shape, d.shape) for g, d in zip(gate_up, down)]
    if len(down) != len(gate_up) or any(g[1] != x.shape[1] or d[0] != x.shape[1] or g[0] != 2 * d[1]
                                        for g, d in shapes) or len({d[1] for _, d in shapes}) > 1:
        raise ValueError(f"grouped_quant_experts: each expert needs gate_up (2I, {x.shape[1]}) and down "
                         f"({x.shape[1]}, I) of one I; got {shapes} (out, in)")


def grouped_quant_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                          gate_up: Sequence[QuantWeight], down: Sequence[QuantWeight], *, first: int = 0,
                          gate_up_bias: Biases = None, down_bias: Biases = None, limit: float = 0.0,
                          alpha: float = 0.0) -> torch.Tensor:
    """The fp32 ``(T, H)`` sum over each token's routed experts among ``first .. first + len(gate_up) - 1`` of its
    routing weight times the quantized expert's output (see the module docstring)."""
    _check(x, weights, chosen, gate_up, down)
    if not gate_up or x.shape[0] == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return run_grouped(x, weights, chosen, len(gate_up), first, lambda i, rows: quant_expert_mlp(
        rows, gate_up[i], down[i], expert_bias(gate_up_bias, i), expert_bias(down_bias, i), limit, alpha))
