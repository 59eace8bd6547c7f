"""tightfit.kernels.quant_linear: the native int8/int4 weight-only matmuls against their pure-PyTorch references.

(torchao's own quantizers and dequantisation are the references of the formats: tests/energon_infer/test_quantization.py.)
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.threads import torch_threads
from tightfit.kernels import quant_linear
from tightfit.kernels.native import native_error, torch_openmp
from tightfit.kernels.quant_linear import (
    NATIVE_MAX_ROWS,
    _library,
    _native_mode,
    dequantize_int4,
    int4_linear,
    int8_linear,
    pack_int4,
    unpack_int4,
)
from tightfit.kernels.weight_tiles import tile_int4, tile_int8


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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [3, NATIVE_MAX_ROWS + 1, 70])  # the fp32-activation loops; prefill (dequantised)
@pytest.mark.parametrize(("k", "group"), [(256, 128), (768, 128), (512, 256), (1536, 512)])
def test_int4_tiled_weights_answer_like_the_row_order(threads, rows, k, group):
    """tile_int4's order (tiled=True): prefill dequantises straight from the tiles in C (each 64-byte run of a
    row gathered from its tile), and both backends give the row-order weight's result."""
    gen = torch.Generator().manual_seed(rows + k + group)
    n = 48
    p, s, z = _int4(n, k, group, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    t = tile_int4(p)
    assert not torch.equal(t, p)
    want = int4_linear(x, p, s, z, group, b, backend="reference")
    torch.testing.assert_close(int4_linear(x, t, s, z, group, b, tiled=True, backend="reference"), want)
    with torch_threads(threads), _native_mode(min_work=0):
        got = int4_linear(x, t, s, z, group, b, tiled=True, backend="native")
        deq = quant_linear._dequantize_native(t, s, z, group, tiled=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(deq, quant_linear._dequantize_native(p, s, z, group))  # the same weight, value for value
    with pytest.raises(ValueError, match=r"int4_linear: tiled=True needs a multiple of 16 output features"):
        int4_linear(x, p[:40], s[:40], z[:40], group, tiled=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [3, NATIVE_MAX_ROWS + 1, 70])  # the fp32-activation loops; prefill (dequantised)
@pytest.mark.parametrize("k", [128, 768])
def test_int8_tiled_weights_answer_like_the_row_order(threads, rows, k):
    """tile_int8's order (tiled=True): prefill dequantises straight from the tiles in C, and both backends give the
    row-order weight's result."""
    gen = torch.Generator().manual_seed(rows + k)
    n = 48
    q, s = _int8(n, k, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    t = tile_int8(q)
    assert not torch.equal(t, q)
    want = int8_linear(x, q, s, b, backend="reference")
    torch.testing.assert_close(int8_linear(x, t, s, b, tiled=True, backend="reference"), want)
    with torch_threads(threads), _native_mode(min_work=0):
        got = int8_linear(x, t, s, b, tiled=True, backend="native")
        deq = quant_linear._dequantize_native(t, s, None, 0, tiled=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(deq, quant_linear._dequantize_native(q, s, None, 0))  # the same weight, value for value
    with pytest.raises(ValueError, match=r"int8_linear: tiled=True needs a multiple of 16 output features and of "
                                         r"128 inputs \(tile_int8\); got 40 features"):
        int8_linear(x, q[:40], s[:40], tiled=True)


def test_strided_rows_and_threads():
    """A view whose rows are apart (a slice of a wider activation) and several threads give the same result."""
    gen = torch.Generator().manual_seed(1)
    p, s, z = _int4(1501, 512, 64, gen)  # 6 x 1501 x 512 multiply-adds: two threads (one per ~4M)
    wide = torch.randn(6, 700, generator=gen)
    x = wide[:, 100:612]
    q8, s8 = _int8(1501, 512, gen)
    with torch_threads(2):
        got = int4_linear(x, p, s, z, 64, backend="native")
        got8 = int8_linear(x, q8, s8, backend="native")
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


# --------------------------------------------------------------------------- the SIMD loops and the thread pool


def _both_paths(fn, threads: int):
    """``fn()`` with the AVX2 loops and with the scalar loops, at ``threads`` threads, every call on the pool."""
    with torch_threads(threads):
        with _native_mode(simd=True, min_work=0) as simd:
            fast = fn()
        with _native_mode(simd=False, min_work=0):
            scalar = fn()
    return fast, scalar, simd


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
@pytest.mark.parametrize("k", [8, 40, 96, 777])  # tails after 32- and 16-wide steps, and no whole step at all
def test_int8_simd_and_scalar_equal_the_reference(threads, rows, k):
    gen = torch.Generator().manual_seed(rows * k + threads)
    n = 23
    q, s = _int8(n, k, gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    want = int8_linear(x, q, s, b, backend="reference")
    fast, scalar, _ = _both_paths(lambda: int8_linear(x, q, s, b, backend="native"), threads)
    torch.testing.assert_close(fast, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scalar, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 4, 5, 11])
@pytest.mark.parametrize(("k", "group"), [(256, 32), (96, 32), (256, 64), (384, 128), (512, 256), (48, 8), (60, 6)])
def test_int4_simd_and_scalar_equal_the_reference(threads, rows, k, group):
    """Groups of 32 with an even and an odd number of groups (the SIMD loop needs K % 64 == 0), whole blocks per
    group (64-256), and groups the SIMD loop does not take (8, 6: the scalar loop either way)."""
    gen = torch.Generator().manual_seed(rows * k + group + threads)
    n = 19
    p, s, z = _int4(n, k, group, gen)
    b = torch.randn(n, generator=gen)
    wide = torch.randn(rows, k + 5, generator=gen)
    x = wide[:, 3:3 + k]  # rows apart by more than k: the permuted copy must follow the stride
    want = int4_linear(x.contiguous(), p, s, z, group, b, backend="reference")
    fast, scalar, _ = _both_paths(lambda: int4_linear(x, p, s, z, group, b, backend="native"), threads)
    torch.testing.assert_close(fast, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scalar, want, atol=1e-4, rtol=1e-4)


def test_simd_loops_run_where_the_cpu_has_avx2():
    """The SIMD switch reports the AVX2 loops in use exactly where this CPU has AVX2 and FMA (the build uses
    -march=native), so the tests above compared two different loops there."""
    flags = ""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if native_error("quant_linear") or quant_linear._library() is None:
        pytest.skip("native library not built here")
    with _native_mode(simd=True) as simd:
        assert simd == ("avx2" in flags.split() and "fma" in flags.split())
    with _native_mode(simd=False) as simd:
        assert not simd


def test_pool_serves_many_calls_and_a_forked_child():
    """The persistent pool gives the same results call after call (every call on it: min_work 0), and a child
    forked after the pool started (whose workers did not survive the fork) starts its own instead of waiting."""
    gen = torch.Generator().manual_seed(7)
    p, s, z = _int4(301, 256, 64, gen)
    x = torch.randn(2, 256, generator=gen)
    want = int4_linear(x, p, s, z, 64, backend="reference")
    with torch_threads(2), _native_mode(min_work=0):
        for _ in range(200):
            torch.testing.assert_close(int4_linear(x, p, s, z, 64, backend="native"), want, atol=1e-4, rtol=1e-4)
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:
            got, child_threading = pool.apply(_child_int4, (x, p, s, z))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert child_threading == 0  # GNU OpenMP's team did not survive the fork: the child runs on the pool


def _child_int4(x, p, s, z):
    torch.set_num_threads(2)
    with _native_mode(min_work=0):
        return int4_linear(x, p, s, z, 64, backend="native"), _library().tf_quant_threading()


def test_calls_run_on_pytorchs_openmp_team_where_it_is_in_the_process():
    """Built with -fopenmp where PyTorch's GNU OpenMP is loaded: the library binds to that one runtime (no second
    libgomp in the process) and its calls run on that team, with results equal to the reference."""
    if _library() is None:
        pytest.skip("native library not built here")
    if not torch_openmp():
        pytest.skip("PyTorch here does not run on GNU OpenMP")
    assert _library().tf_quant_threading() == 1
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) == 1, gomps
    gen = torch.Generator().manual_seed(9)
    p, s, z = _int4(301, 256, 64, gen)
    x = torch.randn(3, 256, generator=gen)
    with torch_threads(2), _native_mode(min_work=0):
        got = [int4_linear(x, p, s, z, 64, backend="native") for _ in range(50)]
    for g in got:
        torch.testing.assert_close(g, int4_linear(x, p, s, z, 64, backend="reference"), atol=1e-4, rtol=1e-4)


def test_concurrent_callers_share_the_pool():
    """Python threads calling at once (ctypes releases the GIL): one uses the pool, the others run on their own
    thread; every result is right."""
    gen = torch.Generator().manual_seed(8)
    q, s = _int8(257, 192, gen)
    p, s4, z4 = _int4(257, 192, 32, gen)
    xs = [torch.randn(1 + i % 5, 192, generator=gen) for i in range(8)]
    want8 = [int8_linear(x, q, s, backend="reference") for x in xs]
    want4 = [int4_linear(x, p, s4, z4, 32, backend="reference") for x in xs]
    with torch_threads(2), _native_mode(min_work=0), concurrent.futures.ThreadPoolExecutor(4) as ex:
        got8 = list(ex.map(lambda x: [int8_linear(x, q, s, backend="native") for _ in range(50)][-1], xs))
        got4 = list(ex.map(lambda x: [int4_linear(x, p, s4, z4, 32, backend="native") for _ in range(50)][-1], xs))
    for g, w in zip(got8 + got4, want8 + want4):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
