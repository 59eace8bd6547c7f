"""paged_attention's sliding window, tanh soft-cap and sinks on every backend, against a float64 masked softmax
written from the definition and against transformers' own eager attention (Gemma 2's soft-cap, gpt-oss's sinks).

Pages wholly before a sequence's first query's window are released as the scheduler releases them: their table
entries are -1 and the pages themselves hold NaN, so a backend that read one would fail or return NaN.
Triton runs under its CPU interpreter (TRITON_INTERPRET=1, set in tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.helpers.paged_attention import masked_softmax, released_pages_case
from tests.helpers.runif import RunIf
from tests.helpers.threads import torch_threads
from tightfit.kernels.varlen_attention import paged_attention
from tightfit.kernels.varlen_attention_cpu import NATIVE_MAX_Q

BACKENDS = ["reference", pytest.param("native", marks=RunIf(native=True)),
            pytest.param("triton", marks=RunIf(triton=True))]


@st.composite
def _lens(draw, long: bool):
    """(new tokens, keys) per sequence: decode steps, prefills, chunks; past NATIVE_MAX_Q where ``long``."""
    sizes = [0, 1, 1, 2, 7, 9, 17, 40, 65] + ([NATIVE_MAX_Q + 3] if long else [])
    out = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.sampled_from(sizes))
        out.append((n, n + draw(st.integers(0 if n else 1, 90))))
    if not any(n for n, _ in out):  # a call with no new token at all returns an empty tensor: nothing to compare
        out[0] = (1, out[0][1])
    return out


def _check(backend, lens, heads, d, block, window, softcap, with_sinks, seed, threads=1):
    hq, hk = heads
    args, keys, values = released_pages_case(lens, hq, hk, d, block, window, seed)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2 if with_sinks else None
    with torch_threads(threads):
        got = paged_attention(*args, scale=d ** -0.5, max_q_len=max(n for n, _ in lens), window=window,
                              softcap=softcap, sinks=sinks, backend=backend)
    want = masked_softmax(args[0], keys, values, [n for n, _ in lens], d ** -0.5, window, softcap, sinks)
    assert got.shape == args[0].shape and not got.isnan().any()
    assert (got.double() - want).abs().max().item() < 2e-5


_SHAPES = dict(heads=st.sampled_from([(1, 1), (4, 2), (6, 2), (8, 1)]), d=st.sampled_from([4, 8, 12, 32, 64]),
               block=st.sampled_from([1, 3, 16]), window=st.sampled_from([0, 1, 2, 5, 16, 33, 200]),
               softcap=st.sampled_from([0.0, 0.5, 5.0, 50.0]), with_sinks=st.booleans(), seed=st.integers(0, 99))


@RunIf(native=True)
@settings(max_examples=60, deadline=None)
@given(lens=_lens(long=True), threads=st.sampled_from([1, 2]), **_SHAPES)
def test_native_windows_caps_and_sinks_equal_the_definition(lens, heads, d, block, window, softcap, with_sinks, seed,
                                                            threads):
    """Tiled (widths of 8s) and plain key loops, rows split over threads, and chunks past NATIVE_MAX_Q (the
    masked softmax in PyTorch) in one call."""
    _check("native", lens, heads, d, block, window, softcap, with_sinks, seed, threads)


@settings(max_examples=30, deadline=None)
@given(lens=_lens(long=False), **_SHAPES)
def test_reference_windows_caps_and_sinks_equal_the_definition(lens, heads, d, block, window, softcap, with_sinks,
                                                               seed):
    _check("reference", lens, heads, d, block, window, softcap, with_sinks, seed)


@RunIf(triton=True)
@settings(max_examples=8, deadline=None)
@given(lens=_lens(long=False), **_SHAPES)
def test_triton_windows_caps_and_sinks_equal_the_definition(lens, heads, d, block, window, softcap, with_sinks,
                                                            seed):
    """Query tiles whose first rows' windows start before the later rows' (the loop starts at the first's)."""
    _check("triton", lens, heads, d, block, window, softcap, with_sinks, seed)


class _Layer(nn.Module):
    """What transformers' eager attention reads from its attention module: the group size, training, sinks."""

    def __init__(self, hq: int, hk: int, d: int, sinks: torch.Tensor | None = None):
        super().__init__()
        self.num_key_value_groups, self.head_dim = hq // hk, d
        if sinks is not None:
            self.sinks = nn.Parameter(sinks, requires_grad=False)
        self.eval()


def _transformers_mask(n: int, kv: int, window: int) -> torch.Tensor:
    qpos, kpos = (kv - n + torch.arange(n))[:, None], torch.arange(kv)[None, :]
    visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    return torch.zeros(n, kv).masked_fill(~visible, float("-inf"))[None, None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("n, kv", [(1, 70), (23, 23), (9, 61)], ids=["decode", "prefill", "chunk"])
def test_equal_to_transformers_eager_attention(backend, family, n, kv):
    """Gemma 2's eager attention (soft-cap, window) and gpt-oss's (sinks, window), one sequence."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    hq, hk, d, block, window = 4, 2, 16, 4, 13
    args, keys, values = released_pages_case([(n, kv)], hq, hk, d, block, window, seed=n + kv)
    q = args[0]
    scale, softcap = d ** -0.5, 7.5 if family == "gemma2" else 0.0
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)) if family == "gpt_oss" else None
    mask = _transformers_mask(n, kv, window)
    hf_q, hf_k, hf_v = q.transpose(0, 1)[None], keys[0].transpose(0, 1)[None], values[0].transpose(0, 1)[None]
    if family == "gemma2":
        want, _ = gemma2_eager(_Layer(hq, hk, d), hf_q, hf_k, hf_v, mask, scaling=scale, softcap=softcap)
    else:
        want, _ = gpt_oss_eager(_Layer(hq, hk, d, sinks), hf_q, hf_k, hf_v, mask, scaling=scale)
    got = paged_attention(*args, scale=scale, max_q_len=n, window=window, softcap=softcap, sinks=sinks,
                          backend=backend)
    torch.testing.assert_close(got, want[0], atol=2e-5, rtol=2e-5)


def test_bad_options_are_refused_naming_the_value():
    args, _, _ = released_pages_case([(2, 5)], 4, 2, 8, 4, 0, seed=0)
    with pytest.raises(ValueError, match="window=-3 is negative"):
        paged_attention(*args, scale=1.0, max_q_len=2, window=-3)
    with pytest.raises(ValueError, match="softcap=-1.0 must be a positive cap"):
        paged_attention(*args, scale=1.0, max_q_len=2, softcap=-1.0)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\).*got shape \(2,\)"):
        paged_attention(*args, scale=1.0, max_q_len=2, sinks=torch.zeros(2))
