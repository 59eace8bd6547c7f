"""The native CPU backend: building and caching C libraries, the dispatcher's rule for it, and each native
kernel against its PyTorch reference (paged attention, silu_mul, rotary_) over hypothesis-drawn shapes."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.runif import RunIf
from tests.helpers.threads import torch_threads
from tightfit.kernels import native
from tightfit.kernels.dispatch import KernelError, choose_backend, get_kernel
from tightfit.kernels.elementwise import rms_norm, rotary_, silu_mul
from tightfit.kernels.varlen_attention import paged_attention, store_kv
from tightfit.kernels.varlen_attention_cpu import NATIVE_MAX_Q

_ADD = "#include <stdint.h>\nint64_t tf_add(int64_t a, int64_t b) {{ return a + b + {k}; }}\n"


def _fresh(tmp_path, monkeypatch, k: int) -> str:
    """A source no earlier call has built (load_library is cached per (name, source))."""
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path))
    return _ADD.format(k=k)


@RunIf(native=True)
def test_a_library_is_built_once_into_the_cache_and_loaded(tmp_path, monkeypatch):
    source = _fresh(tmp_path, monkeypatch, 1)
    lib = native.load_library("t_add", source)
    assert lib is not None
    lib.tf_add.restype = ctypes.c_int64
    assert lib.tf_add(ctypes.c_int64(2), ctypes.c_int64(3)) == 6
    built = list((tmp_path / "native").glob("t_add-*.so"))
    assert len(built) == 1 and native.native_error("t_add") == ""
    # Another process (a fresh cache of load_library) finds the file and does not rebuild it.
    stamp = built[0].stat().st_mtime_ns
    native.load_library.cache_clear()
    assert native.load_library("t_add", source) is not None
    assert built[0].stat().st_mtime_ns == stamp
    assert not [p for p in (tmp_path / "native").iterdir() if p.name.startswith(".")]  # no temporary left


def test_no_compiler_means_no_library_and_a_reason(tmp_path, monkeypatch):
    source = _fresh(tmp_path, monkeypatch, 2)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native._compiler.cache_clear()
    try:
        assert native.load_library("t_nocc", source) is None
        assert "no C compiler (/nonexistent/cc not found)" in native.native_error("t_nocc")
    finally:
        native._compiler.cache_clear()


@RunIf(native=True)
def test_a_source_that_does_not_compile_gives_the_compiler_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path))
    assert native.load_library("t_broken", "int f( {") is None
    assert "failed" in native.native_error("t_broken")
    assert not list((tmp_path / "native").glob("*.so"))


_OMP = """
#ifdef _OPENMP
#include <omp.h>
int tf_team(void) { int n = 0;
#pragma omp parallel num_threads(2)
#pragma omp atomic
  n++;
  return n; }
#else
int tf_team(void) { return -1; }
#endif
int tf_k(void) { return K; }
"""


@RunIf(native=True)
def test_an_openmp_library_binds_to_pytorchs_runtime(tmp_path, monkeypatch):
    """openmp=True builds with -fopenmp where PyTorch's libgomp is in the process; the library's regions then run
    on that one runtime (no second libgomp mapped), two threads strong."""
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path))
    if not native.torch_openmp():
        pytest.skip("PyTorch here does not run on GNU OpenMP")
    lib = native.load_library("t_omp", "#define K 1\n" + _OMP, True)
    assert lib is not None and lib.tf_team() == 2
    with open("/proc/self/maps") as maps:
        assert len({line.split()[-1] for line in maps if "libgomp" in line}) == 1


@RunIf(native=True)
def test_an_openmp_library_is_built_without_it_where_fopenmp_fails(tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp (clang without libomp) still gives the library, on its serial paths."""
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path))
    cc = tmp_path / "cc-no-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "unsupported: -fopenmp" >&2; exit 1; }; '
                  'done\nexec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    native._compiler.cache_clear()
    try:
        lib = native.load_library("t_omp_off", "#define K 2\n" + _OMP, True)
        assert lib is not None and lib.tf_k() == 2 and lib.tf_team() == -1
        assert native.native_error("t_omp_off") == ""
    finally:
        native._compiler.cache_clear()


def test_switched_off_by_environment(tmp_path, monkeypatch):
    source = _fresh(tmp_path, monkeypatch, 3)
    monkeypatch.setenv("TIGHTFIT_NATIVE", "0")
    assert native.load_library("t_off", source) is None
    assert native.native_error("t_off") == "TIGHTFIT_NATIVE=0"


def test_rule_for_the_native_backend(monkeypatch):
    monkeypatch.delenv("TIGHTFIT_KERNELS", raising=False)
    cpu = torch.ones(2)
    assert choose_backend(cpu, native_error=lambda: "") == "native"
    assert choose_backend(cpu, native_error=lambda: "no compiler") == "reference"
    assert choose_backend(cpu) == "reference"  # a kernel without a native backend
    with pytest.raises(KernelError, match="has no native CPU backend"):
        choose_backend(cpu, backend="native")
    with pytest.raises(KernelError, match=r"cannot be built here \(no compiler\).*TIGHTFIT_KERNELS=reference"):
        choose_backend(cpu, backend="native", native_error=lambda: "no compiler")
    with pytest.raises(KernelError, match="has no Triton backend"):
        choose_backend(cpu, backend="triton", has_triton=False)
    # Forced through the environment, native applies where a kernel has it; the others decide as auto.
    monkeypatch.setenv("TIGHTFIT_KERNELS", "native")
    assert choose_backend(cpu) == "reference"
    assert choose_backend(cpu, native_error=lambda: "") == "native"


@RunIf(native=True)
def test_the_environment_still_decides_after_a_call_was_remembered(monkeypatch):
    x = torch.randn(3, 8)
    monkeypatch.delenv("TIGHTFIT_KERNELS", raising=False)
    assert get_kernel("silu_mul").backend_for(x) == "native"
    silu_mul(x)
    monkeypatch.setenv("TIGHTFIT_KERNELS", "reference")
    calls = []
    kernel = get_kernel("silu_mul")
    monkeypatch.setattr(type(kernel), "_impl", lambda self, b: calls.append(b) or self.reference)
    silu_mul(x)
    assert calls == ["reference"]


# --------------------------------------------------------------------------- kernels against references


def _paged_case(draw_lens: list[tuple[int, int]], hq: int, hk: int, d: int, block: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    kv_lens = [kv for _, kv in draw_lens]
    q_lens = [q for q, _ in draw_lens]
    n_blocks = sum(-(-k // block) for k in kv_lens) + 2
    kc, vc = torch.zeros(n_blocks, block, hk, d), torch.zeros(n_blocks, block, hk, d)
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables = torch.zeros(len(kv_lens), max(-(-k // block) for k in kv_lens), dtype=torch.int32)
    for b, kv in enumerate(kv_lens):
        blocks = [free.pop() for _ in range(-(-kv // block))]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[p // block] * block + p % block for p in range(kv)])
        store_kv(torch.randn(kv, hk, d, generator=g), torch.randn(kv, hk, d, generator=g), kc, vc, slots)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, tables, cu, torch.tensor(kv_lens, dtype=torch.int32)


@st.composite
def _sequences(draw):
    n = draw(st.integers(1, 5))
    out = []
    for _ in range(n):
        q = draw(st.sampled_from([0, 1, 1, 2, 7, 32, 33, 50, 200, NATIVE_MAX_Q, NATIVE_MAX_Q + 1]))
        out.append((q, q + draw(st.integers(0 if q else 1, 40))))
    return out


@RunIf(native=True)
@settings(max_examples=40, deadline=None)
@given(lens=_sequences(), heads=st.sampled_from([(1, 1), (4, 2), (6, 2), (8, 1)]), d=st.sampled_from([4, 8, 12, 32, 40]),
       block=st.sampled_from([1, 3, 16]), threads=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_native_paged_attention_equals_the_reference(lens, heads, d, block, threads, seed):
    q, kc, vc, bt, cu, kl = _paged_case(lens, heads[0], heads[1], d, block, seed)
    max_q = max(n for n, _ in lens)
    with torch_threads(threads):  # the native kernel splits sequences over this many threads
        got = paged_attention(q, kc, vc, bt, cu, kl, scale=d ** -0.5, max_q_len=max_q, backend="native")
    want = paged_attention(q, kc, vc, bt, cu, kl, scale=d ** -0.5, max_q_len=max_q, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@RunIf(native=True)
@pytest.mark.parametrize("heads", [(8, 4), (6, 2), (12, 4), (3, 3)])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("block", [5, 16])
def test_native_paged_attention_tiles_of_keys_equal_the_reference(heads, d, block):
    # Widths that are a multiple of 8 take the tiled path (8 keys scored at once): key counts on both sides of
    # a whole tile and of a page, pages scattered over the pool, and query heads in groups of 1-3 per key head.
    lens = [(1, 1), (1, 7), (1, 8), (1, 9), (1, 15), (1, 16), (1, 17), (2, 23), (5, 40), (1, 130)]
    q, kc, vc, bt, cu, kl = _paged_case(lens, heads[0], heads[1], d, block, seed=d + block)
    got = paged_attention(q, kc, vc, bt, cu, kl, scale=d ** -0.5, max_q_len=5, backend="native")
    want = paged_attention(q, kc, vc, bt, cu, kl, scale=d ** -0.5, max_q_len=5, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@RunIf(native=True)
def test_prefill_chunks_run_in_the_kernel_up_to_native_max_q():
    # The sdpa path's bits are the reference's own (the same per-sequence call); the kernel's differ in the last
    # places. A lone prompt's rows are split over the threads; a longer chunk goes to sdpa, beside a decode row.
    def both(lens):
        q, kc, vc, bt, cu, kl = _paged_case(lens, 8, 4, 32, 16, seed=3)
        with torch_threads(2):
            return [paged_attention(q, kc, vc, bt, cu, kl, scale=0.2, max_q_len=max(n for n, _ in lens), backend=b)
                    for b in ("native", "reference")]
    for lens in ([(300, 300)], [(100, 100), (120, 130)], [(NATIVE_MAX_Q, NATIVE_MAX_Q + 20)]):
        got, want = both(lens)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert not torch.equal(got, want)
    got, want = both([(NATIVE_MAX_Q + 1, NATIVE_MAX_Q + 1), (1, 50)])
    assert torch.equal(got[:NATIVE_MAX_Q + 1], want[:NATIVE_MAX_Q + 1])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@RunIf(native=True)
@settings(max_examples=15, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 60)), min_size=1, max_size=4),
       threads=st.integers(2, 4), seed=st.integers(0, 99))
def test_rows_split_over_threads_give_the_bits_of_one_thread(lens, threads, seed):
    # Every row (of a lone prompt too) is computed the same way whichever thread runs it: a row left out or
    # written twice by the split would show.
    lens = [(n, n + extra) for n, extra in lens]
    q, kc, vc, bt, cu, kl = _paged_case(lens, 8, 4, 32, 16, seed)
    outs = []
    for t in (1, threads):
        with torch_threads(t):
            outs.append(paged_attention(q, kc, vc, bt, cu, kl, scale=0.2, max_q_len=max(n for n, _ in lens),
                                        backend="native"))
    assert torch.equal(outs[0], outs[1])


@RunIf(native=True)
def test_native_paged_attention_splits_work_over_threads_on_a_large_call():
    # ~3 M multiply-adds: enough for the kernel to start threads (it starts none for small calls).
    q, kc, vc, bt, cu, kl = _paged_case([(1, 300)] * 24, 8, 4, 32, 16, seed=5)
    with torch_threads(4):
        got = paged_attention(q, kc, vc, bt, cu, kl, scale=0.2, max_q_len=1, backend="native")
    want = paged_attention(q, kc, vc, bt, cu, kl, scale=0.2, max_q_len=1, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@RunIf(native=True)
@settings(max_examples=20, deadline=None)
@given(t=st.integers(0, 20), hk=st.integers(1, 4), d=st.sampled_from([1, 8, 32]), strided=st.booleans(),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_native_store_kv_equals_the_reference(t, hk, d, strided, slot_dtype):
    g = torch.Generator().manual_seed(t * 31 + hk * 7 + d)
    shape = (5, 4, hk, d)
    fresh = torch.randn(t, 3 * hk, d, generator=g)  # k and v as views into a fused projection's output
    k, v = (fresh[:, :hk], fresh[:, hk:2 * hk]) if strided else (fresh[:, :hk].clone(), fresh[:, hk:2 * hk].clone())
    slots = torch.randperm(20, generator=g)[:t].to(slot_dtype)
    caches = {b: (torch.randn(shape, generator=torch.Generator().manual_seed(1)),
                  torch.randn(shape, generator=torch.Generator().manual_seed(2))) for b in ("native", "reference")}
    for b, (kc, vc) in caches.items():
        store_kv(k, v, kc, vc, slots, backend=b)
    assert torch.equal(caches["native"][0], caches["reference"][0])
    assert torch.equal(caches["native"][1], caches["reference"][1])


@RunIf(native=True)
def test_native_paged_attention_hands_other_dtypes_to_the_reference():
    q, kc, vc, bt, cu, kl = _paged_case([(3, 9), (1, 5)], 4, 2, 8, 4, seed=1)
    half = [t.to(torch.bfloat16) for t in (q, kc, vc)]
    got = paged_attention(*half, bt, cu, kl, scale=0.3, max_q_len=3, backend="native")
    want = paged_attention(*half, bt, cu, kl, scale=0.3, max_q_len=3, backend="reference")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@RunIf(native=True)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), half=st.integers(1, 70), extra=st.integers(0, 3), lead=st.booleans())
def test_native_silu_mul_equals_the_reference(rows, half, extra, lead):
    g = torch.Generator().manual_seed(rows * 100 + half)
    wide = torch.randn(rows, 2 * half + extra, generator=g) * 4
    x = wide[:, :2 * half]  # rows further apart than their width, as a slice of a wider output
    if lead:
        x = x.reshape(1, rows, 2 * half) if rows else x
    got = silu_mul(x, backend="native")
    torch.testing.assert_close(got, silu_mul(x, backend="reference"), atol=1e-5, rtol=1e-5)
    assert got.shape == (*x.shape[:-1], half)


@RunIf(native=True)
@settings(max_examples=25, deadline=None)
@given(t=st.integers(0, 30), h=st.integers(1, 6), d=st.sampled_from([2, 8, 32, 64]), extra=st.integers(0, 2))
def test_native_rotary_equals_the_reference_in_place(t, h, d, extra):
    g = torch.Generator().manual_seed(t * 10 + h)
    wide = torch.randn(t, (h + extra) * d, generator=g)
    angles = torch.rand(t, 1, d, generator=g) * 7
    a, b = wide.clone(), wide.clone()
    xa, xb = a[:, :h * d].view(t, h, d), b[:, :h * d].view(t, h, d)  # strided views, as in a fused QKV output
    out = rotary_(xa, angles.cos(), angles.sin(), backend="native")
    rotary_(xb, angles.cos(), angles.sin(), backend="reference")
    assert out.data_ptr() == xa.data_ptr()
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the columns past h * d are untouched by both


@RunIf(native=True)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 80), n=st.integers(1, 300), weighted=st.booleans(), extra=st.integers(0, 3),
       scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_native_rms_norm_equals_the_reference(rows, n, weighted, extra, scale):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, n + extra, generator=g) * scale)[:, :n]  # rows further apart than their width
    w = torch.randn(n, generator=g) if weighted else None
    got = rms_norm(x, w, 1e-6, backend="native")
    torch.testing.assert_close(got, rms_norm(x, w, 1e-6, backend="reference"), atol=1e-5, rtol=1e-5)


@RunIf(native=True)
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(60, 700), threads=st.integers(2, 4), seed=st.integers(0, 99))
def test_element_wise_kernels_split_large_calls_over_threads_with_the_same_bits(rows, threads, seed):
    # A prefill-sized call (over 16384 elements a thread) runs its rows on several threads; every row is computed as
    # on one thread, so the results are bit-equal, and equal the reference.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * 300 + 1, generator=g)[:, :600] * 3
    w = torch.randn(300, generator=g)
    angles = torch.rand(rows, 1, 64, generator=g) * 7
    qk = torch.randn(rows, 6, 64, generator=g)

    def run() -> list[torch.Tensor]:
        return [silu_mul(x, backend="native"), rms_norm(x[:, :300], w, 1e-6, backend="native"),
                rotary_(qk.clone(), angles.cos(), angles.sin(), backend="native")]
    with torch_threads(1):
        one = run()
    with torch_threads(threads):
        many = run()
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    torch.testing.assert_close(many[0], silu_mul(x, backend="reference"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(many[1], rms_norm(x[:, :300], w, 1e-6, backend="reference"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(many[2], rotary_(qk.clone(), angles.cos(), angles.sin(), backend="reference"),
                               atol=1e-5, rtol=1e-5)


@RunIf(native=True)
def test_rms_norm_of_one_row_runs_native(monkeypatch):
    kernel = get_kernel("rms_norm")
    calls = []
    monkeypatch.setattr(type(kernel), "_impl", lambda self, b: calls.append(b) or self.reference)
    rms_norm(torch.randn(1, 8), None, 1e-6)  # a decode step's single row too (no size threshold)
    assert calls and set(calls) == {"native"}  # (its first call of a class is also checked on a probe)


def test_elementwise_inputs_are_checked():
    with pytest.raises(ValueError, match=r"last dimension \(5\) must be even"):
        silu_mul(torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"even head_dim.*got x \(2, 3, 5\)"):
        rotary_(torch.ones(2, 3, 5), torch.ones(2, 1, 5), torch.ones(2, 1, 5))
    with pytest.raises(ValueError, match=r"weight of shape \(3,\) does not match the last dimension of x \(2, 4\)"):
        rms_norm(torch.ones(2, 4), torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="one head_dim row per token"):
        rotary_(torch.ones(2, 3, 4), torch.ones(3, 1, 4), torch.ones(3, 1, 4))


@RunIf(native=True)
def test_loading_the_native_kernels_keeps_subnormal_floats(tmp_path, monkeypatch):
    # A library linked with -ffast-math would set flush-to-zero for the whole process when it loads.
    import sys

    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path))  # a fresh build with today's flags
    assert native.load_library("t_subnormal", _ADD.format(k=4)) is not None
    silu_mul(torch.randn(2, 4), backend="native")
    tiny = sys.float_info.min
    assert tiny / 2 > 0.0
    assert torch.tensor([tiny], dtype=torch.float64).div(2).item() > 0.0
    assert torch.tensor([1e-40], dtype=torch.float32).item() != 0.0
