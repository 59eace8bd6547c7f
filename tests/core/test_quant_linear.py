"""tightfit.cuda.quant_linear: the native int8/int4 weight-only matmuls against their pure-PyTorch references.

(torchao's own quantizers and dequantisation are the references of the formats: tests/energon_infer/test_quantization.py.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.cuda.quant_linear import (
    NATIVE_MAX_ROWS,
    dequantize_int4,
    int4_linear,
    int8_linear,
    pack_int4,
    unpack_int4,
)


def _int8(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) * 0.02


def _int4(n: int, k: int, g: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), generator=gen)
    return pack_int4(q, g), torch.rand(n, k // g, generator=gen) * 0.02, torch.randn(n, k // g, generator=gen) * 0.02


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 17, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 3])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_native_equals_reference(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    n, k = 37, 96  # odd output width: the threads' ranges split unevenly
    q, s = _int8(n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    want = int8_linear(x, q, s, b, backend="reference")
    got = int8_linear(x, q, s, b, backend="native")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The reference is the dequantised weight times x: nothing else.
    torch.testing.assert_close(want, x @ (q.float() * s[:, None]).t() + (b if bias else 0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16, NATIVE_MAX_ROWS + 1])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_native_equals_reference(rows, group):
    gen = torch.Generator().manual_seed(rows * group)
    n, k = 45, 256
    p, s, z = _int4(n, k, group, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    want = int4_linear(x, p, s, z, group, b, backend="reference")
    got = int4_linear(x, p, s, z, group, b, backend="native")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_strided_rows_and_threads():
    """A view whose rows are apart (a slice of a wider activation) and several threads give the same result."""
    gen = torch.Generator().manual_seed(1)
    p, s, z = _int4(1501, 512, 64, gen)  # 6 x 1501 x 512 multiply-adds: two threads (one per ~4M)
    wide = torch.randn(6, 700, generator=gen)
    x = wide[:, 100:612]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = int4_linear(x, p, s, z, 64, backend="native")
        q8, s8 = _int8(1501, 512, gen)
        got8 = int8_linear(x, q8, s8, backend="native")
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(got, int4_linear(x.contiguous(), p, s, z, 64, backend="reference"), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got8, int8_linear(x.contiguous(), q8, s8, backend="reference"), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_take_the_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    q, s = _int8(16, 64, gen)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    y = int8_linear(x, q, s)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), x.float() @ (q.float() * s[:, None]).t(), atol=0.1, rtol=0.05)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), groups=st.integers(1, 4), g=st.sampled_from([2, 8, 32]), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(n, groups, g, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, groups * g), generator=gen)
    packed = pack_int4(q, g)
    assert packed.shape == (n, groups * g // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, g), q.to(torch.uint8))


def test_dequantize_int4_is_the_affine_formula():
    gen = torch.Generator().manual_seed(3)
    p, s, z = _int4(4, 64, 32, gen)
    q = unpack_int4(p, 32).float().reshape(4, 2, 32)
    want = ((q - 8) * s[:, :, None] + z[:, :, None]).reshape(4, 64)
    torch.testing.assert_close(dequantize_int4(p, s, z, 32, torch.float32), want)


def test_bad_shapes_are_refused_in_one_line():
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"int8_linear: x \(2, 32\) needs an int8 qweight \(N, 32\)"):
        int8_linear(torch.zeros(2, 32), q, torch.ones(8))
    p = torch.zeros(8, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"even group_size dividing 64"):
        int4_linear(torch.zeros(2, 64), p, torch.ones(8, 1), torch.ones(8, 1), 48)
