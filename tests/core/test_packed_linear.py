"""oneDNN-packed CPU linear weights (tightfit.kernels.packed_linear) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.kernels.packed_linear import (
    ACTIVATIONS,
    MIN_NUMEL,
    MIN_ROWS,
    SMALL_MIN_ROWS,
    SMALL_NUMEL,
    apply_activation,
    pack_linear_weight,
    packed_linear,
    packing_available,
    rows_worth_packing,
)

needs_onednn = pytest.mark.skipif(not packing_available(), reason="PyTorch built without oneDNN")


@needs_onednn
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), inp=st.integers(1, 70), out=st.integers(1, 90), bias=st.booleans(),
       transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_linear_equals_f_linear_fp32(rows, inp, out, bias, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    # Input-major storage (energon's linear_weight) is packed from the same logical (out, in) matrix.
    w = torch.randn(inp, out, generator=g).t() if transposed else torch.randn(out, inp, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    x = torch.randn(rows, inp, generator=g)
    packed = pack_linear_weight(w, min_numel=0)
    assert packed is not None
    torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), inp=st.integers(1, 70), out=st.integers(1, 90), bias=st.booleans(),
       activation=st.sampled_from(sorted(ACTIVATIONS)), seed=st.integers(0, 2**16))
def test_an_activation_fused_into_the_product_equals_pytorch_after_it(rows, inp, out, bias, activation, seed):
    # GPT-2's tanh GELU (and GELU, ReLU) run in oneDNN's epilogue: the same values as F.linear, then PyTorch's op.
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    x = torch.randn(rows, inp, generator=g) * 2
    packed = pack_linear_weight(w, min_numel=0)
    assert packed is not None
    want = apply_activation(F.linear(x, w, b), activation)
    torch.testing.assert_close(packed_linear(x, packed, b, activation), want, rtol=1e-5, atol=1e-5)


def test_apply_activation_is_pytorch_and_refuses_an_unknown_name():
    y = torch.linspace(-4, 4, 17)
    torch.testing.assert_close(apply_activation(y, "gelu_tanh"), F.gelu(y, approximate="tanh"))
    torch.testing.assert_close(apply_activation(y, "relu"), F.relu(y))
    assert apply_activation(y, "") is y
    with pytest.raises(KeyError):
        apply_activation(y, "swish")


def _onednn_bf16() -> bool:
    # oneDNN's bf16 reorder needs avx512bw/vl/dq or avx_ne_convert; on other CPUs (AVX2 only) it raises
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else True


@needs_onednn
def test_packed_linear_bf16_and_batched_inputs():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=g).bfloat16(), torch.randn(2, 5, 32, generator=g).bfloat16()
    packed = pack_linear_weight(w, min_numel=0)
    if not _onednn_bf16():
        assert packed is None  # this CPU cannot: F.linear is kept (warned once), never an error
        return
    assert packed is not None
    torch.testing.assert_close(packed_linear(x, packed).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_what_is_not_packed(monkeypatch):
    # Weights too small to earn a packed copy at any row count are left to F.linear by default (oneDNN's fixed
    # cost per call outweighs the gain there); the size is rows_worth_packing's, or a caller's own.
    too_small = torch.randn(SMALL_NUMEL // 256 - 1, 256)
    assert rows_worth_packing(too_small.numel()) is None and pack_linear_weight(too_small) is None
    assert pack_linear_weight(too_small, min_numel=0) is not None
    assert pack_linear_weight(torch.randn(SMALL_NUMEL // 256, 256)) is not None  # packed, used from SMALL_MIN_ROWS
    assert pack_linear_weight(torch.randn(MIN_NUMEL // 256, 256)) is not None
    assert pack_linear_weight(torch.randn(MIN_NUMEL // 256, 256), min_numel=MIN_NUMEL + 1) is None
    assert pack_linear_weight(torch.randn(4, 4, dtype=torch.float64), min_numel=0) is None  # no fp64 matmul
    assert pack_linear_weight(torch.randn(4), min_numel=0) is None
    assert pack_linear_weight(torch.empty(0, 4), min_numel=0) is None
    assert pack_linear_weight(torch.empty(4, 4, device="meta"), min_numel=0) is None
    nan = torch.tensor([[1.0, float("nan")], [0.0, 1.0]])
    assert pack_linear_weight(nan, min_numel=0) is None  # F.linear keeps NaN's spread
    monkeypatch.setenv("TIGHTFIT_KERNELS", "reference")  # the A/B switch turns packing off with the CPU kernels
    assert not packing_available() and pack_linear_weight(torch.randn(4, 4), min_numel=0) is None


@given(numel=st.integers(0, 1 << 20))
def test_rows_worth_packing_grows_as_weights_shrink(numel):
    rows = rows_worth_packing(numel)
    if numel >= MIN_NUMEL:
        assert rows == MIN_ROWS
    elif numel >= SMALL_NUMEL:
        assert rows == SMALL_MIN_ROWS > MIN_ROWS
    else:
        assert rows is None
    bigger = rows_worth_packing(numel * 2)  # a larger weight is never packed from more rows
    assert bigger is not None if rows is not None else True
    assert rows is None or bigger <= rows  # type: ignore[operator]
