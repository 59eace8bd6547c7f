"""``grouped_experts`` (a MoE layer's routed experts, tokens grouped per expert) against a plain per-token loop.

The loop below is the definition, written independently of the kernel: for every token, for each of its ``top_k``
experts held here, the expert's gated MLP on that token's row in float64, times the routing weight, summed. Both the
native backend and the PyTorch reference must give it over hypothesis-drawn token counts, expert counts, top-k,
widths (odd ones, below and above the kernel's tiles), local expert ranges, biases and gpt-oss's clamped SwiGLU,
experts with no tokens and experts with more tokens than one unit of work.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit.kernels.grouped_experts as grouped_experts_module
from tests.helpers.runif import RunIf
from tests.helpers.threads import torch_threads
from tightfit.kernels.dispatch import get_kernel
from tightfit.kernels.grouped_experts import grouped_experts

ALPHA = 1.702
_native_error = get_kernel("grouped_experts").native_error
BACKENDS = ["reference"] + (["native"] if _native_error is not None and not _native_error() else [])


def per_token_loop(x, weights, chosen, gate_up, down, first=0, gate_up_bias=None, down_bias=None, limit=0.0):
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) over the experts first .. first + len(gate_up) - 1, in
    float64, one token and one expert at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j]) - first
            if not 0 <= e < len(gate_up):
                continue
            h = gate_up[e].double() @ x[t].double()
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            gate, up = h[: h.shape[0] // 2], h[h.shape[0] // 2:]
            if limit:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = (up + 1) * gate / (1 + torch.exp(-ALPHA * gate))
            else:
                a = gate / (1 + torch.exp(-gate)) * up
            y = down[e].double() @ a
            if down_bias is not None and down_bias[e] is not None:
                y = y + down_bias[e].double()
            out[t] += float(weights[t, j]) * y
    return out


def _experts(n, hidden, inter, *, bias, gen, input_major=True):
    """n experts' weights, held input-major (the transpose of a contiguous (in, out) tensor) as energon holds them."""
    def weight(out_f, in_f):
        w = torch.randn(in_f, out_f, generator=gen) / in_f ** 0.5
        return w.t() if input_major else w.t().contiguous()
    gate_up = [weight(2 * inter, hidden) for _ in range(n)]
    down = [weight(hidden, inter) for _ in range(n)]
    gub = [torch.randn(2 * inter, generator=gen) for _ in range(n)] if bias else None
    db = [torch.randn(hidden, generator=gen) if e % 2 == 0 else None for e in range(n)] if bias else None
    return gate_up, down, gub, db


def _routing(tokens, n_experts, top_k, gen, *, hot=0):
    """Each token's top_k distinct experts and softmax weights; ``hot`` > 0 sends every token to experts drawn from
    the first ``hot`` (the others get none)."""
    span = max(hot, top_k) if hot else n_experts
    scores = torch.rand(tokens, n_experts, generator=gen)
    scores[:, span:] = -1.0
    weights, chosen = torch.topk(scores.softmax(-1), top_k, dim=-1)
    return weights, chosen


@settings(max_examples=60, deadline=None)
@given(data=st.data(), tokens=st.integers(0, 40), n_experts=st.integers(1, 9),
       hidden=st.sampled_from([1, 3, 8, 16, 17, 40]), inter=st.sampled_from([1, 5, 8, 9, 24]),
       bias=st.booleans(), limit=st.sampled_from([0.0, 0.0, 0.5, 7.0]), threads=st.sampled_from([1, 2]),
       backend=st.sampled_from(BACKENDS))
def test_matches_a_per_token_loop(data, tokens, n_experts, hidden, inter, bias, limit, threads, backend):
    top_k = data.draw(st.integers(1, min(n_experts, 4)), label="top_k")
    first = data.draw(st.integers(0, n_experts - 1), label="first")
    local = data.draw(st.integers(1, n_experts - first), label="local")
    hot = data.draw(st.integers(0, n_experts), label="hot")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    gate_up, down, gub, db = _experts(local, hidden, inter, bias=bias, gen=gen)
    weights, chosen = _routing(tokens, n_experts, top_k, gen, hot=hot)
    x = torch.randn(tokens, hidden, generator=gen) * 2
    with torch_threads(threads):
        got = grouped_experts(x, weights, chosen, gate_up, down, first=first, gate_up_bias=gub, down_bias=db,
                              limit=limit, alpha=ALPHA, backend=backend)
    want = per_token_loop(x, weights, chosen, gate_up, down, first, gub, db, limit)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@RunIf(native=True)
@pytest.mark.parametrize("limit", [0.0, 7.0])
def test_experts_with_many_tokens_split_into_units_over_threads_give_the_loops_sums_in_the_same_bits(limit):
    # 300 tokens on 2 of 6 experts: units of up to 64 rows, weight panels copied, two threads; 4 experts get none
    gen = torch.Generator().manual_seed(3)
    gate_up, down, gub, db = _experts(6, 72, 40, bias=limit > 0, gen=gen)
    weights, chosen = _routing(300, 6, 2, gen, hot=2)
    x = torch.randn(300, 72, generator=gen)
    runs = []
    for threads in (1, 2):
        with torch_threads(threads):
            runs.append(grouped_experts(x, weights, chosen, gate_up, down, gate_up_bias=gub, down_bias=db,
                                        limit=limit, alpha=ALPHA, backend="native"))
    assert torch.equal(runs[0], runs[1])  # each token's rows are summed in expert order whatever the threads
    torch.testing.assert_close(runs[0].double(), per_token_loop(x, weights, chosen, gate_up, down, 0, gub, db, limit),
                               atol=1e-4, rtol=1e-4)


@RunIf(native=True)
def test_a_step_past_the_kernels_buffer_runs_in_slices_of_tokens(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    gate_up, down, gub, db = _experts(5, 24, 16, bias=True, gen=gen)
    weights, chosen = _routing(23, 5, 3, gen)
    x = torch.randn(23, 24, generator=gen)
    whole = grouped_experts(x, weights, chosen, gate_up, down, gate_up_bias=gub, down_bias=db, backend="native")
    monkeypatch.setattr(grouped_experts_module, "_BUFFER_FLOATS", 4 * 3 * 24)  # 4 tokens a slice: 6 slices
    sliced = grouped_experts(x, weights, chosen, gate_up, down, gate_up_bias=gub, down_bias=db, backend="native")
    torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=1e-5)  # an expert's rows may take another tile shape
    torch.testing.assert_close(sliced.double(), per_token_loop(x, weights, chosen, gate_up, down, 0, gub, db),
                               atol=1e-4, rtol=1e-4)


@RunIf(native=True)
def test_what_the_native_backend_does_not_take_runs_the_reference():
    gen = torch.Generator().manual_seed(5)
    gate_up, down, _, _ = _experts(3, 16, 8, bias=False, gen=gen, input_major=False)  # contiguous (out, in)
    weights, chosen = _routing(10, 3, 2, gen)
    x = torch.randn(10, 16, generator=gen)
    got = grouped_experts(x, weights, chosen, gate_up, down, backend="native")
    torch.testing.assert_close(got.double(), per_token_loop(x, weights, chosen, gate_up, down), atol=1e-4, rtol=1e-4)
    bf = [w.to(torch.bfloat16) for w in gate_up], [w.to(torch.bfloat16) for w in down]
    args = (x.to(torch.bfloat16), weights.to(torch.bfloat16), chosen, *bf)
    assert torch.equal(grouped_experts(*args, backend="native"), grouped_experts(*args, backend="reference"))


def test_the_dispatcher_sends_fp32_cpu_calls_to_the_native_backend_where_it_builds():
    gen = torch.Generator().manual_seed(1)
    gate_up, down, _, _ = _experts(2, 8, 4, bias=False, gen=gen)
    weights, chosen = _routing(3, 2, 1, gen)
    want = "native" if "native" in BACKENDS else "reference"
    assert get_kernel("grouped_experts").backend_for(torch.randn(3, 8), weights, chosen, gate_up, down) == want


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.randn(4, 9)), r"gate_up \(2I, 9\) and down \(9, I\)"),
    (dict(chosen=torch.zeros(4, 2)), "must be an integer tensor, not torch.float32"),
    (dict(weights=torch.rand(4, 3)), r"weights \(4, 3\), chosen \(4, 2\)"),
    (dict(down=[torch.randn(8, 4), torch.randn(8, 4).t()]), "gate_up .* and down .* of one I"),
    (dict(gate_up_bias=[torch.zeros(8)]), r"gate_up_bias must hold one \(8,\) tensor or None per expert \(2\)"),
])
def test_bad_arguments_are_refused_in_one_line_naming_them(change, match):
    args = dict(x=torch.randn(4, 8), weights=torch.rand(4, 2), chosen=torch.zeros(4, 2, dtype=torch.long),
                gate_up=[torch.randn(8, 8)] * 2, down=[torch.randn(8, 4)] * 2)
    args.update(change)
    extra = {k: args.pop(k) for k in ("gate_up_bias",) if k in args}
    with pytest.raises(ValueError, match=match):
        grouped_experts(args["x"], args["weights"], args["chosen"], args["gate_up"], args["down"], **extra)


def test_the_module_docstring_example_runs():
    result = doctest.testmod(grouped_experts_module)
    assert result.failed == 0 and result.attempted > 0
