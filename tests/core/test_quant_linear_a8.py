"""tightfit.kernels.quant_linear_a8: int8/int4 weights times int8-quantised activations (AVX-512 VNNI).

The native kernel against its PyTorch reference (same quantised activations: fp32 rounding apart), and the
reference's stated error bound against the dequantised weights' exact product (the result torchao's
``dequantize`` gives, tests/energon_infer/test_quantization.py)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.threads import torch_threads
from tightfit.kernels.quant_linear import (
    NATIVE_MAX_ROWS,
    _native_mode,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
)
from tightfit.kernels.quant_linear_a8 import (
    A8_ENV_VAR,
    _call,
    _kernel_rows,
    a8_applies,
    a8_available,
    a8_level,
    activation_block,
    int4_linear_a8,
    int4_tiles_apply,
    int8_linear_a8,
    int8_tiles_apply,
    quantize_activations,
    tile_int4,
    tile_int8,
    untile_int4,
    untile_int8,
)

needs_a8 = pytest.mark.skipif(a8_level() != 1, reason="no AVX-512 VNNI native build on this CPU")
# tiled int4 per block of 128: AVX-512 VNNI, or the AVX2 kernel (core/kernels/cpu/quant_a8_avx2.h)
needs_a8_tiled = pytest.mark.skipif(not a8_available(), reason="no int8-activation native build (AVX2 or AVX-512 "
                                                                "VNNI) on this CPU")


def _int8(n, k, gen):
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) * 0.02


def _int4(n, k, g, gen):
    q = torch.randint(0, 16, (n, k), generator=gen)
    return pack_int4(q, g), torch.rand(n, k // g, generator=gen) * 0.02, torch.randn(n, k // g, generator=gen) * 0.02


def _on_pool(fn, threads):
    with torch_threads(threads), _native_mode(min_work=0):
        return fn()


@needs_a8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, NATIVE_MAX_ROWS])
@pytest.mark.parametrize("n", [1, 3, 6, 37])  # tiles of 4 and 2 features and the odd one
@pytest.mark.parametrize("k", [192, 256])  # activations per block of 32 (K % 128 != 0) and of 128
def test_int8_native_equals_reference(threads, rows, n, k, monkeypatch):
    monkeypatch.delenv(A8_ENV_VAR, raising=False)  # set to fp32, "native" would quietly run the reference
    gen = torch.Generator().manual_seed(rows * 100 + n + threads + k)
    assert activation_block(k) == (32 if k == 192 else 128)
    q, s = _int8(n, k, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 7, generator=gen)[:, 5:5 + k]  # rows apart by more than k
    assert _on_pool(lambda: _call(x, q, s, None, 0, b, n, k), threads) is not None  # the kernel takes the call
    want = int8_linear_a8(x, q, s, b, backend="reference")
    got = _on_pool(lambda: int8_linear_a8(x, q, s, b, backend="native"), threads)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_a8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, NATIVE_MAX_ROWS])
@pytest.mark.parametrize(("k", "group"), [(128, 64), (384, 64), (256, 128), (768, 128), (512, 256), (1024, 512)])
@pytest.mark.parametrize("n", [19, 67])  # 67 on 2 threads: chunks of 16-17 features, a 16-feature tile each
@pytest.mark.parametrize("transposed", [1, NATIVE_MAX_ROWS + 1])  # 16-feature transposed tiles from 1 row / never
def test_int4_native_equals_reference(threads, rows, k, group, n, transposed, monkeypatch):
    monkeypatch.delenv(A8_ENV_VAR, raising=False)  # set to fp32, "native" would quietly run the reference
    gen = torch.Generator().manual_seed(rows * k + group + threads + n)
    p, s, z = _int4(n, k, group, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 3, generator=gen)[:, 1:1 + k]
    assert _on_pool(lambda: _call(x, p, s, z, group, b, n, k), threads) is not None  # the kernel takes the call
    want = int4_linear_a8(x, p, s, z, group, b, backend="reference")
    with _kernel_rows(transposed=transposed):
        got = _on_pool(lambda: int4_linear_a8(x, p, s, z, group, b, backend="native"), threads)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_a8
@pytest.mark.parametrize(("k", "group"), [(256, 128), (1024, 256), (1536, 512)])
def test_int4_transposed_tiles_agree_with_the_4x4_tiles_feature_by_feature(k, group, monkeypatch):
    """Every one of 16 features in a transposed tile is its own: a weight changed in feature f alone changes
    output f alone, by what the 4 x 4 tiles compute (catches a transpose that mixes lanes or inputs)."""
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(k + group)
    n, rows = 48, 6
    q = torch.randint(0, 16, (n, k), generator=gen)
    s, z = torch.rand(n, k // group, generator=gen) * 0.02, torch.randn(n, k // group, generator=gen) * 0.02
    x = torch.randn(rows, k, generator=gen)

    def both(qw):
        p = pack_int4(qw, group)
        out = []
        for t in (1, NATIVE_MAX_ROWS + 1):
            with _kernel_rows(transposed=t):
                out.append(_on_pool(lambda: int4_linear_a8(x, p, s, z, group, backend="native"), 1))
        return out

    base_t, base_4 = both(q)
    torch.testing.assert_close(base_t, base_4, atol=1e-4, rtol=1e-4)
    for f, i in [(0, 0), (5, 3), (17, k // 2 + 1), (31, k - 1), (40, k // 3)]:
        q2 = q.clone()
        q2[f, i] = 15 - q2[f, i]
        got_t, got_4 = both(q2)
        torch.testing.assert_close(got_t, got_4, atol=1e-4, rtol=1e-4)
        changed = (got_t - base_t).abs().amax(0) > 0
        assert changed.nonzero().flatten().tolist() == [f]


@needs_a8
@pytest.mark.parametrize(("k", "group"), [(384, 192), (640, 320), (768, 384)])
def test_int4_groups_of_an_odd_multiple_of_64_or_128_keep_the_exact_path(k, group, monkeypatch):
    """Groups of 64 or 128 x an odd number above 1 are not the kernel's layouts (it reads 64 or 128 bytes at a
    time past the group's half): it refuses them and the native backend answers like the reference."""
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(k + group)
    n = 7
    p, s, z = _int4(n, k, group, gen)
    x = torch.randn(3, k, generator=gen)
    assert not a8_applies(x, k, group)
    assert _on_pool(lambda: _call(x, p, s, z, group, None, n, k), 2) is None
    want = int4_linear_a8(x, p, s, z, group, backend="reference")
    got = _on_pool(lambda: int4_linear_a8(x, p, s, z, group, backend="native"), 2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(tiles=st.integers(1, 5), runs=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_tile_int4_is_a_byte_permutation_its_inverse_undoes(tiles, runs, seed):
    """Same bytes, reordered within each 16 rows as the kernel reads them: byte 4i + b of run u of row f lands at
    u * 1024 + i * 64 + f * 4 + b of its tile; untile_int4 gives the row order back."""
    n, half = 16 * tiles, 64 * runs
    packed = torch.randint(0, 256, (n, half), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    tiled = tile_int4(packed)
    assert tiled.shape == packed.shape and tiled.dtype == torch.uint8
    assert torch.equal(untile_int4(tiled), packed)
    assert torch.equal(tiled.flatten().sort().values, packed.flatten().sort().values)
    t, f, u, i, b = tiles - 1, 5, runs - 1, 9, 3
    assert tiled[16 * t:16 * t + 16].flatten()[u * 1024 + i * 64 + f * 4 + b] == packed[16 * t + f, 64 * u + 4 * i + b]


def test_where_int4_tiles_apply():
    assert int4_tiles_apply(48, 256, 128) and int4_tiles_apply(16, 1024, 512)
    assert not int4_tiles_apply(40, 256, 128)  # 16 features a tile
    assert not int4_tiles_apply(48, 256, 64) and not int4_tiles_apply(48, 384, 384)  # not the block-128 layouts


@needs_a8_tiled
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, NATIVE_MAX_ROWS])
@pytest.mark.parametrize(("k", "group"), [(256, 128), (768, 128), (512, 256), (1024, 512), (1536, 512)])
@pytest.mark.parametrize("n", [16, 80])  # 80 on 2 threads: chunks of 20 features, tiles starting inside each
@pytest.mark.parametrize("block", [1, NATIVE_MAX_ROWS + 1])  # tiled weights: the block kernel from 1 row / never
def test_int4_tiled_native_equals_reference(threads, rows, k, group, n, block, monkeypatch):
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(rows * k + group + threads + n)
    p, s, z = _int4(n, k, group, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 3, generator=gen)[:, 1:1 + k]
    t = tile_int4(p)
    assert _on_pool(lambda: _call(x, t, s, z, group, b, n, k, True), threads) is not None  # the kernel takes it
    want = int4_linear_a8(x, p, s, z, group, b, backend="reference")
    torch.testing.assert_close(int4_linear_a8(x, t, s, z, group, b, tiled=True, backend="reference"), want)
    with _kernel_rows(tiled_block=block):
        got = _on_pool(lambda: int4_linear_a8(x, t, s, z, group, b, tiled=True, backend="native"), threads)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_a8_tiled
def test_int4_tiled_calls_the_kernel_does_not_take_answer_like_the_reference(monkeypatch):
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(3)
    n, k, group = 32, 256, 128
    p, s, z = _int4(n, k, group, gen)
    x = torch.randn(NATIVE_MAX_ROWS + 1, k, generator=gen)
    assert _call(x, tile_int4(p), s, z, group, None, n, k, True) is None  # more rows than the kernel takes
    got = int4_linear_a8(x, tile_int4(p), s, z, group, tiled=True, backend="native")
    torch.testing.assert_close(got, int4_linear_a8(x, p, s, z, group, backend="reference"), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"int4_linear_a8: tiled=True needs a multiple of 16 output features and "
                                         r"groups of 128 or a multiple of 256 \(tile_int4\); got 24 features"):
        int4_linear_a8(x[:2], p[:24], s[:24], z[:24], group, tiled=True)


@settings(max_examples=40, deadline=None)
@given(tiles=st.integers(1, 4), runs=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_tile_int8_is_the_same_byte_permutation_on_int8_rows(tiles, runs, seed):
    """tile_int8 reorders an int8 weight's bytes exactly as tile_int4 reorders packed bytes (weight f's input
    64u + 4i + b at u * 1024 + i * 64 + f * 4 + b of its tile), keeps the dtype, and untile_int8 undoes it."""
    n, k = 16 * tiles, 64 * runs
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    tiled = tile_int8(q)
    assert tiled.shape == q.shape and tiled.dtype == torch.int8
    assert torch.equal(untile_int8(tiled), q)
    assert torch.equal(tiled.view(torch.uint8), tile_int4(q.view(torch.uint8)))
    t, f, u, i, b = tiles - 1, 11, runs - 1, 7, 2
    assert tiled[16 * t:16 * t + 16].flatten()[u * 1024 + i * 64 + f * 4 + b] == q[16 * t + f, 64 * u + 4 * i + b]


def test_where_int8_tiles_apply():
    assert int8_tiles_apply(16, 128) and int8_tiles_apply(48, 2048)
    assert not int8_tiles_apply(40, 256)  # 16 features a tile
    assert not int8_tiles_apply(48, 192)  # activations per block of 32: the row-order kernel's layout


@needs_a8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, NATIVE_MAX_ROWS])
@pytest.mark.parametrize("k", [128, 768, 2048])
@pytest.mark.parametrize("n", [16, 80])  # 80 on 2 threads: chunks of 20 features, tiles starting inside each
def test_int8_tiled_native_equals_reference(threads, rows, k, n, monkeypatch):
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(rows * k + threads + n)
    q, s = _int8(n, k, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 3, generator=gen)[:, 1:1 + k]
    t = tile_int8(q)
    assert _on_pool(lambda: _call(x, t, s, None, 0, b, n, k, True), threads) is not None  # the kernel takes it
    want = int8_linear_a8(x, q, s, b, backend="reference")
    torch.testing.assert_close(int8_linear_a8(x, t, s, b, tiled=True, backend="reference"), want)
    got = _on_pool(lambda: int8_linear_a8(x, t, s, b, tiled=True, backend="native"), threads)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_a8
def test_int8_tiled_calls_the_kernel_does_not_take_answer_like_the_reference(monkeypatch):
    """More rows than the kernel takes: refused in C, answered from the tiles by the reference; a shape with no
    tiled layout is refused in one line naming the fix."""
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(4)
    n, k = 32, 256
    q, s = _int8(n, k, gen)
    x = torch.randn(NATIVE_MAX_ROWS + 1, k, generator=gen)
    assert _call(x, tile_int8(q), s, None, 0, None, n, k, True) is None
    got = int8_linear_a8(x, tile_int8(q), s, tiled=True, backend="native")
    torch.testing.assert_close(got, int8_linear_a8(x, q, s, backend="reference"), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"int8_linear_a8: tiled=True needs a multiple of 16 output features and of "
                                         r"128 inputs \(tile_int8\); got 24 features, 256 inputs: pass the row-order"):
        int8_linear_a8(x[:2], q[:24], s[:24], tiled=True)


def _bound(x, v, block=32):
    """The module's bound: sum_k |V_nk| max|x_block(k)| / 254 per output."""
    m, k = x.shape
    amax = x.abs().reshape(m, k // block, block).amax(-1)
    e = amax.repeat_interleave(block, dim=1) / 254
    return e @ v.abs().t()


def _rounding_sigma(x, v, block, levels=127):
    """Per output, the standard deviation of ``sum_k V_nk e_k`` for independent roundings ``e_k`` uniform over
    one step ``d = max|x_block(k)| / levels``: ``sqrt(sum_k V_nk^2 d_k^2 / 12)``."""
    m, k = x.shape
    d = x.abs().reshape(m, k // block, block).amax(-1) / levels
    return ((d.repeat_interleave(block, dim=1) ** 2 / 12) @ (v ** 2).t()).sqrt()


def _assert_int8_rounding_noise(err, x, v, block):
    """The error is what rounding the inputs to int8 (127 levels a side) makes, not more and not less: every
    output within 5 standard deviations of independent roundings, and their RMS within [0.5, 1.3] of it. The
    worst-case bound above is loose by about sqrt(K) on random inputs (5-bit activations, 15 levels, stay
    under it); these are not (7 bits already give an RMS of about 2, 5 bits about 8)."""
    z = err / _rounding_sigma(x, v, block)
    assert z.max() <= 5.0, f"an output {z.max():.2f} standard deviations of int8 rounding off"
    rms = z.pow(2).mean().sqrt().item()
    assert 0.5 <= rms <= 1.3, f"the error's RMS is {rms:.2f} of int8 rounding's"


def _coarse_activations(x, block, levels):
    """``x`` rounded per block of ``block`` inputs to ``levels`` steps a side (a plain loop over the blocks)."""
    out = torch.empty_like(x)
    for b in range(x.shape[1] // block):
        part = x[:, b * block:(b + 1) * block]
        d = part.abs().amax(-1, keepdim=True) / levels
        out[:, b * block:(b + 1) * block] = torch.where(d > 0, torch.round(part / d) * d, torch.zeros_like(part))
    return out


@pytest.mark.parametrize("levels", [63, 15], ids=["7-bit", "5-bit"])
def test_the_rounding_noise_check_rejects_coarser_activations(levels):
    """The check of the test below fails activations rounded to fewer bits than int8, which the worst-case bound
    alone lets through."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 512, generator=gen)
    q, s = _int8(40, 512, gen)
    w8 = dequantize_int8(q, s, torch.float32)
    err = (F.linear(_coarse_activations(x, 128, levels), w8) - F.linear(x, w8)).abs()
    if levels == 15:
        assert (err <= _bound(x, w8, 128) * 1.001 + 1e-4).all()  # within the worst-case bound all the same
    with pytest.raises(AssertionError, match="of int8 rounding"):
        _assert_int8_rounding_noise(err, x, w8, 128)
    _assert_int8_rounding_noise((F.linear(_coarse_activations(x, 128, 127), w8) - F.linear(x, w8)).abs(), x, w8,
                                128)  # and passes int8's own


@pytest.mark.parametrize("backend", ["reference", pytest.param("native", marks=needs_a8)])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("group", [64, 128, 256])
def test_error_is_within_the_stated_bound_of_the_dequantised_product(backend, outliers, group):
    gen = torch.Generator().manual_seed(11 + outliers + group)
    n, k = 40, 512
    x = torch.randn(7, k, generator=gen)
    if outliers:  # a few channels 50x the rest (as LLM activations have): their blocks lose resolution
        x[:, ::97] *= 50
    q, s = _int8(n, k, gen)
    w8 = dequantize_int8(q, s, torch.float32)
    err8 = (int8_linear_a8(x, q, s, backend=backend) - F.linear(x, w8)).abs()
    assert activation_block(k) == 128
    assert (err8 <= _bound(x, w8, 128) * 1.001 + 1e-4).all()
    _assert_int8_rounding_noise(err8, x, w8, 128)  # and of the size int8 rounding makes
    p, s4, z4 = _int4(n, k, group, gen)
    w4 = dequantize_int4(p, s4, z4, group, torch.float32)
    qs = w4 - (z4 - 8 * s4).repeat_interleave(group, dim=1)  # V = q s: the zero point meets the fp32 x
    err4 = (int4_linear_a8(x, p, s4, z4, group, backend=backend) - F.linear(x, w4)).abs()
    block = activation_block(k, group)
    assert block == (32 if group == 64 else 128)
    assert (err4 <= _bound(x, qs, block) * 1.001 + 1e-4).all()
    _assert_int8_rounding_noise(err4, x, qs, block)
    if block > 32:  # the same product with blocks of 32 stays within the tighter bound, which this one may not
        assert _bound(x, qs, 32).max() <= _bound(x, qs, block).max()


def test_quantize_activations_per_block_of_128():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 256, generator=gen)
    x[0, 130] = 40.0  # one outlier: its whole block of 128 (not of 32) takes its scale
    xq, d = quantize_activations(x, 128)
    assert d.shape == (2, 2) and d[0, 1] == pytest.approx(40.0 / 127)
    assert (xq[0, 128:].abs() <= 127).all() and xq[0, 130] == 127
    back = xq.float().reshape(2, 2, 128) * d[..., None]
    assert ((back - x.reshape(2, 2, 128)).abs() <= d[..., None] / 2 * 1.0001 + 1e-7).all()


def test_quantize_activations_rounds_within_half_a_step():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=gen)
    x[1, :32] = 0  # an all-zero block: scale 0, inputs 0
    xq, d = quantize_activations(x)
    assert xq.dtype == torch.int8 and d.shape == (3, 3) and xq.abs().max() <= 127
    assert d[1, 0] == 0 and (xq[1, :32] == 0).all()
    back = xq.float().reshape(3, 3, 32) * d[..., None]
    assert ((back - x.reshape(3, 3, 32)).abs() <= d[..., None] / 2 * 1.0001 + 1e-7).all()
    assert (xq.reshape(3, 3, 32).abs().amax(-1)[d > 0] == 127).all()  # every block uses its full range


def test_where_it_applies(monkeypatch):
    x = torch.zeros(4, 128)
    assert not a8_applies(x, 128, 32)  # int4 group 32: the fp32-activation kernel
    assert not a8_applies(torch.zeros(4, 96), 96)  # K % 64
    assert not a8_applies(torch.zeros(NATIVE_MAX_ROWS + 1, 128), 128)  # prefill: dequantise + BLAS
    assert not a8_applies(x.bfloat16(), 128)
    assert a8_applies(x, 128) == a8_applies(x, 128, 128) == (a8_level() == 1)  # AVX-512 VNNI: every layout
    assert a8_applies(torch.zeros(4, 512), 512, 256) == (a8_level() == 1)
    # tiled int4 per block of 128: also the AVX2 kernel; groups of 64 never tiled
    assert a8_applies(x, 128, 128, tiled=True) == a8_applies(torch.zeros(4, 512), 512, 256, True) == a8_available()
    assert not a8_applies(torch.zeros(4, 384), 384, 384)  # 128 x an odd number above 1: not the kernel's layout
    monkeypatch.setenv(A8_ENV_VAR, "fp32")
    assert not a8_applies(x, 128)


def test_bad_shapes_are_refused_in_one_line():
    q, s = _int8(8, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"int8_linear_a8: x \(2, 40\) must be 2-D with 64 inputs"):
        int8_linear_a8(torch.zeros(2, 40), q, s)
    p = torch.zeros(8, 24, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"int4_linear_a8: x \(2, 48\) must be 2-D with 48 inputs \(the weight's\), "
                                         r"a multiple of 32"):
        int4_linear_a8(torch.zeros(2, 48), p, torch.ones(8, 3), torch.ones(8, 3), 16)


@needs_a8
def test_concurrent_callers_each_quantise_their_own_inputs():
    """Python threads at once (each keeps its own buffer of quantised inputs): every result is right."""
    gen = torch.Generator().manual_seed(8)
    q, s = _int8(257, 192, gen)
    p, s4, z4 = _int4(257, 256, 64, gen)
    xs = [torch.randn(1 + i % 7, 192, generator=gen) for i in range(8)]
    x4 = [torch.randn(1 + i % 7, 256, generator=gen) for i in range(8)]
    want8 = [int8_linear_a8(x, q, s, backend="reference") for x in xs]
    want4 = [int4_linear_a8(x, p, s4, z4, 64, backend="reference") for x in x4]

    def both():
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            g8 = list(ex.map(lambda x: [int8_linear_a8(x, q, s, backend="native") for _ in range(30)][-1], xs))
            g4 = list(ex.map(lambda x: [int4_linear_a8(x, p, s4, z4, 64, backend="native") for _ in range(30)][-1],
                             x4))
        return g8 + g4

    for g, w in zip(_on_pool(both, 2), want8 + want4):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(a8_level() != 2, reason="the AVX2 kernel's own refusals: a CPU with AVX2 but no AVX-512 VNNI")
def test_the_avx2_kernel_takes_tiled_int4_only_and_the_rest_answer_like_the_reference(monkeypatch):
    """Where only the AVX2 kernel is built, int8 weights and row-order int4 are refused in C (callers asking
    a8_applies keep the fp32-activation kernels) and the native backend answers like the reference."""
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(12)
    n, k = 32, 256
    q, s = _int8(n, k, gen)
    p, s4, z4 = _int4(n, k, 128, gen)
    x = torch.randn(4, k, generator=gen)
    assert not a8_applies(x, k) and not a8_applies(x, k, 128) and a8_applies(x, k, 128, tiled=True)
    assert _call(x, q, s, None, 0, None, n, k) is None and _call(x, p, s4, z4, 128, None, n, k) is None
    assert _call(x, tile_int4(p), s4, z4, 128, None, n, k, True) is not None
    assert _call(x, tile_int8(q), s, None, 0, None, n, k, True) is None  # int8 tiles: AVX-512 VNNI only
    assert not a8_applies(x, k, 0, tiled=True)
    torch.testing.assert_close(int8_linear_a8(x, q, s, backend="native"), int8_linear_a8(x, q, s, backend="reference"))
    torch.testing.assert_close(int8_linear_a8(x, tile_int8(q), s, tiled=True, backend="native"),
                               int8_linear_a8(x, q, s, backend="reference"))
    torch.testing.assert_close(int4_linear_a8(x, p, s4, z4, 128, backend="native"),
                               int4_linear_a8(x, p, s4, z4, 128, backend="reference"))


@needs_a8_tiled
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("group", [128, 256])
def test_tiled_native_error_is_within_the_stated_bound(outliers, group, monkeypatch):
    monkeypatch.delenv(A8_ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(21 + outliers + group)
    n, k = 48, 512
    x = torch.randn(7, k, generator=gen)
    if outliers:
        x[:, ::97] *= 50
    p, s4, z4 = _int4(n, k, group, gen)
    w4 = dequantize_int4(p, s4, z4, group, torch.float32)
    qs = w4 - (z4 - 8 * s4).repeat_interleave(group, dim=1)
    got = _on_pool(lambda: int4_linear_a8(x, tile_int4(p), s4, z4, group, tiled=True, backend="native"), 2)
    err = (got - F.linear(x, w4)).abs()
    assert (err <= _bound(x, qs, 128) * 1.001 + 1e-4).all()
    _assert_int8_rounding_noise(err, x, qs, 128)


@needs_a8_tiled
def test_concurrent_callers_of_the_tiled_kernel_each_quantise_their_own_inputs():
    gen = torch.Generator().manual_seed(9)
    p, s4, z4 = _int4(64, 512, 128, gen)
    t = tile_int4(p)
    xs = [torch.randn(1 + i % 9, 512, generator=gen) for i in range(8)]
    want = [int4_linear_a8(x, p, s4, z4, 128, backend="reference") for x in xs]

    def run():
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            return list(ex.map(lambda x: [int4_linear_a8(x, t, s4, z4, 128, tiled=True, backend="native")
                                          for _ in range(30)][-1], xs))

    for g, w in zip(_on_pool(run, 2), want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
