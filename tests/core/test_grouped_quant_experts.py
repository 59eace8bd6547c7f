"""``grouped_quant_experts`` (an MoE layer's routed experts on int8 / int4 weights) against the per-token loop.

The loop of ``tests/core/test_grouped_experts.py`` (float64, one token and one expert at a time) on the dequantised
weights is the definition; the grouped op must give it over hypothesis-drawn token counts (below and above the
quantized kernels' native row limit), expert counts, top-k, local expert ranges, biases and gpt-oss's clamped
SwiGLU, and the same bits at one thread and two.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit.kernels.grouped_quant_experts as module
from tests.core.test_grouped_experts import _routing, per_token_loop
from tests.helpers.threads import torch_threads
from tightfit.kernels.grouped_quant_experts import QuantWeight, grouped_quant_experts
from tightfit.kernels.quant_linear import dequantize_int4, dequantize_int8, pack_int4


def _quantized(out_f: int, in_f: int, method: str, gen: torch.Generator) -> tuple[QuantWeight, torch.Tensor]:
    """A random weight-only quantized ``(out_f, in_f)`` weight and its dequantised fp32 values."""
    if method == "int8":
        q = torch.randint(-127, 128, (out_f, in_f), generator=gen, dtype=torch.int8)
        scale = torch.rand(out_f, generator=gen) / in_f ** 0.5 / 64
        return QuantWeight(q, scale, None, 0), dequantize_int8(q, scale, torch.float32)
    g = 32
    packed = pack_int4(torch.randint(0, 16, (out_f, in_f), generator=gen), g)
    scale = torch.rand(out_f, in_f // g, generator=gen) / in_f ** 0.5 / 4
    zero = torch.randn(out_f, in_f // g, generator=gen) * 0.01
    return QuantWeight(packed, scale, zero, g), dequantize_int4(packed, scale, zero, g, torch.float32)


@settings(max_examples=30, deadline=None)
@given(tokens=st.sampled_from([0, 1, 3, 40]), n_experts=st.integers(1, 6), method=st.sampled_from(["int8", "int4"]),
       bias=st.booleans(), limit=st.sampled_from([0.0, 0.5]), first=st.integers(0, 2), seed=st.integers(0, 99))
def test_grouped_quant_experts_equals_the_per_token_loop_on_the_dequantised_weights(tokens, n_experts, method, bias,
                                                                                    limit, first, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, top_k = 64, 32, min(2, n_experts + first)
    made = [(_quantized(2 * inter, hidden, method, gen), _quantized(hidden, inter, method, gen))
            for _ in range(n_experts)]
    gate_up, down = [g for (g, _), _ in made], [d for _, (d, _) in made]
    gub = [torch.randn(2 * inter, generator=gen) for _ in range(n_experts)] if bias else None
    db = [torch.randn(hidden, generator=gen) for _ in range(n_experts)] if bias else None
    x = torch.randn(tokens, hidden, generator=gen)
    weights, chosen = _routing(tokens, n_experts + first, top_k, gen)  # experts below ``first``: another rank's
    want = per_token_loop(x, weights, chosen, [w for (_, w), _ in made], [w for _, (_, w) in made], first, gub, db,
                          limit)
    runs = []
    for threads in (1, 2):
        with torch_threads(threads):
            runs.append(grouped_quant_experts(x, weights, chosen, gate_up, down, first=first, gate_up_bias=gub,
                                              down_bias=db, limit=limit, alpha=1.702))
    assert runs[0].dtype == torch.float32 and torch.equal(runs[0], runs[1])  # whatever the thread count
    torch.testing.assert_close(runs[0].double(), want, atol=1e-4 * max([1.0, *want.abs().reshape(-1).tolist()]),
                               rtol=1e-4)


def test_mismatched_experts_are_refused_in_one_line():
    gen = torch.Generator().manual_seed(0)
    gate_up, _ = _quantized(64, 64, "int8", gen)
    down, _ = _quantized(64, 16, "int8", gen)  # I = 16, but gate_up gives 2I = 64
    with pytest.raises(ValueError, match=r"each expert needs gate_up \(2I, 64\) and down \(64, I\) of one I"):
        grouped_quant_experts(torch.randn(2, 64), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), [gate_up],
                              [down])


def test_docstring_example_runs():
    assert doctest.testmod(module).failed == 0
