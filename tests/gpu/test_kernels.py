"""Every Triton kernel, compiled for the GPU, against its PyTorch reference on CUDA tensors (fp32, bf16, fp16).

The CPU suite checks the same kernels under Triton's interpreter (tests/core/test_kernels.py,
tests/energon_infer/test_kernels.py); what only a GPU shows is the compiled code: real block sizes,
``tl.dot`` on tensor cores, int64 offsets, the fp32 ``ieee`` dot, masked loads past the last row.
Shapes are odd on purpose (not multiples of any block). Attention is also checked against a float64
attention written from the definition, so kernel and reference cannot agree on a shared mistake.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.gpu.common import cuda, kernels_compiled
from tests.helpers.runif import RunIf
from tightfit.kernels.testing import FLOAT_DTYPES, ODD_SHAPES, assert_matches_reference

pytestmark = RunIf(cuda=True, triton=True)
DTYPES = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["fp32", "fp16", "bf16"])


def _table(rows: int, cols: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, cols, generator=g, device=device).to(dtype)


def check_row_kernels(device: torch.device, dtype: torch.dtype) -> None:
    from tightfit.kernels import get_kernel

    g = torch.Generator(device=device).manual_seed(1)
    for rows, cols in (*ODD_SHAPES, (4097, 129), (70_000, 64)):
        src = _table(rows, cols, dtype, device)
        for idx_dtype in (torch.int32, torch.int64):
            n = 2 * rows + 3 if rows else 0
            index = torch.randint(0, max(rows, 1), (n,), generator=g, device=device).to(idx_dtype)
            out = torch.full((n, cols), float("nan"), device=device).to(dtype)  # poisoned: every row must be written
            got = assert_matches_reference(get_kernel("gather_rows"), src, index, out)
            assert torch.equal(got, src[index.long()])
            if rows:
                # scatter needs unique destinations (duplicates: one unspecified write wins)
                uniq = torch.randperm(rows, generator=g, device=device)[: max(1, rows // 2)].to(idx_dtype)
                upd = _table(uniq.numel(), cols, dtype, device, seed=2)
                assert_matches_reference(get_kernel("scatter_rows"), src.clone(), uniq, upd)
                # scatter-add with a duplicate-heavy index (embedding gradients): fp32 accumulation, one rounding
                hot = (torch.rand(n, generator=g, device=device).pow(4) * rows).long().clamp_max(rows - 1).to(idx_dtype)
                assert_matches_reference(get_kernel("scatter_add_rows"), src.clone(), hot, _table(n, cols, dtype, device, 3))
    # non-contiguous views: the kernels take both strides
    base = _table(300, 70, dtype, device)
    view = base.t().contiguous().t()  # column-major
    idx = torch.randint(0, 300, (123,), generator=g, device=device)
    assert_matches_reference(get_kernel("gather_rows"), view, idx, torch.empty(123, 70, device=device, dtype=dtype))


@DTYPES
def test_row_gather_scatter_scatter_add_on_cuda(dtype):
    kernels_compiled()
    check_row_kernels(cuda(), dtype)


def check_packing(device: torch.device, dtype: torch.dtype) -> None:
    from tightfit.kernels.packing import pack, unpack

    g = torch.Generator(device=device).manual_seed(0)
    lengths = torch.randint(1, 513, (33,), generator=g, device=device)
    lengths[0] = 512
    starts = torch.zeros_like(lengths)
    starts[1::2] = 512 - lengths[1::2]  # left and right padding mixed
    padded = _table(33 * 512, 257, dtype, device).view(33, 512, 257)
    packed_t, cu_t = pack(padded, starts, lengths, backend="triton")
    packed_r, cu_r = pack(padded, starts, lengths, backend="reference")
    assert torch.equal(packed_t, packed_r) and torch.equal(cu_t, cu_r)
    back_t = unpack(packed_t, starts, lengths, 512, backend="triton")
    assert torch.equal(back_t, unpack(packed_r, starts, lengths, 512, backend="reference"))


@DTYPES
def test_pack_and_unpack_on_cuda(dtype):
    kernels_compiled()
    check_packing(cuda(), dtype)


def _naive_attention(q, keys, values, q_lens, scale):
    out, row = [], 0
    for k, v, n in zip(keys, values, q_lens):
        kv, group = k.shape[0], q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("nhd,khd->hnk", q[row:row + n].double(), k) * scale
        visible = torch.arange(kv, device=q.device)[None, :] <= (kv - n + torch.arange(n, device=q.device))[:, None]
        out.append(torch.einsum("hnk,khd->nhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v))
        row += n
    return torch.cat(out)


def attention_case(device, q_lens, kv_lens, hq, hk, d, page, dtype, seed=0):
    """Random keys/values written with store_kv into shuffled pages, as the runtime lays them out."""
    from tightfit.kernels.varlen_attention import store_kv

    g = torch.Generator(device=device).manual_seed(seed)
    n_pages = sum(-(-k // page) for k in kv_lens) + 3
    kc = torch.zeros(n_pages, page, hk, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    free = torch.randperm(n_pages, generator=g, device=device).tolist()
    tables = torch.zeros(len(kv_lens), max(-(-k // page) for k in kv_lens), dtype=torch.int32, device=device)
    keys, values = [], []
    for b, kv in enumerate(kv_lens):
        pages = [free.pop() for _ in range(-(-kv // page))]
        tables[b, : len(pages)] = torch.tensor(pages, device=device)
        k = torch.randn(kv, hk, d, generator=g, device=device).to(dtype)
        v = torch.randn(kv, hk, d, generator=g, device=device).to(dtype)
        slots = torch.tensor([pages[p // page] * page + p % page for p in range(kv)], device=device)
        store_kv(k, v, kc, vc, slots)
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(q_lens), hq, d, generator=g, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, kc, vc, tables, cu, torch.tensor(kv_lens, dtype=torch.int32, device=device), keys, values


ATTENTION_CASES = {
    # (q_lens, kv_lens, q heads, kv heads, head_dim, page): what the runtime sends
    "prefill": ([7, 2, 300, 1], [7, 2, 300, 1], 8, 2, 64, 16),
    "decode": ([1] * 9, [5, 33, 1, 70, 513, 16, 17, 1000, 2], 8, 1, 128, 16),
    "chunked+decode": ([40, 1, 9], [140, 9, 20], 4, 4, 64, 8),
    "odd head_dim, page 1": ([17, 3], [30, 3], 2, 2, 80, 1),
}
# Against float64: fp32 runs the ieee dot (1e-5 on the CPU interpreter; allow accumulation-order noise),
# half precisions carry their rounding of q, k, v, p and the output.
ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def check_attention(device: torch.device, dtype: torch.dtype) -> None:
    from tightfit.kernels.varlen_attention import paged_attention

    for name, (q_lens, kv_lens, hq, hk, d, page) in ATTENTION_CASES.items():
        q, kc, vc, bt, cu, kl, keys, values = attention_case(device, q_lens, kv_lens, hq, hk, d, page, dtype)
        want = _naive_attention(q, keys, values, q_lens, d ** -0.5)
        for backend in ("triton", "reference"):
            out = paged_attention(q, kc, vc, bt, cu, kl, scale=d ** -0.5, max_q_len=max(q_lens), backend=backend)
            assert out.dtype == dtype and not out.isnan().any(), (name, backend)
            err = (out.double() - want).abs().max().item()
            assert err < ATOL[dtype], f"{name} {backend} {dtype}: max error {err:.3g} vs float64"


@DTYPES
def test_paged_varlen_attention_prefill_decode_and_mixed_on_cuda(dtype):
    kernels_compiled()
    check_attention(cuda(), dtype)


def test_every_kernel_passes_its_first_use_check_on_cuda(monkeypatch):
    """``auto`` on CUDA tensors: each kernel's self-check runs on the GPU and passes, so Triton stays on."""
    kernels_compiled()
    from tightfit.kernels import gather_rows, scatter_add_rows, scatter_rows
    from tightfit.kernels.dispatch import ENV_VAR, KernelCheckWarning, kernel_checks, reset_kernel_checks
    from tightfit.kernels.varlen_attention import paged_attention

    monkeypatch.delenv(ENV_VAR, raising=False)
    reset_kernel_checks()
    dev = cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCheckWarning)
        for dtype in FLOAT_DTYPES:
            t = _table(50, 33, dtype, dev)
            idx = torch.tensor([3, 49, 3, 0], device=dev)
            assert torch.equal(gather_rows(t, idx), t[idx])
            scatter_rows(t.clone(), idx[1:], t[:3].clone())
            scatter_add_rows(t.clone(), idx, t[:4].clone())
            q, kc, vc, bt, cu, kl, _, _ = attention_case(dev, [5, 1], [9, 4], 4, 2, 64, 16, dtype)
            paged_attention(q, kc, vc, bt, cu, kl, scale=0.125, max_q_len=5)
            q, kc, vc, bt, cu, kl, _, _ = attention_case(dev, [1, 1], [9, 40], 4, 2, 64, 16, dtype)
            paged_attention(q, kc, vc, bt, cu, kl, scale=0.125, max_q_len=1)
    verdicts = kernel_checks()
    assert {v.kernel for v in verdicts} == {"gather_rows", "scatter_rows", "scatter_add_rows", "paged_attention"}
    assert all(v.passed and v.device.startswith("cuda") for v in verdicts), [v for v in verdicts if not v.passed]
    reset_kernel_checks()


@DTYPES
@pytest.mark.parametrize("window, softcap, sinks", [(13, 0.0, False), (13, 7.5, False), (13, 0.0, True),
                                                   (0, 7.5, True)], ids=["window", "gemma2", "gpt-oss", "cap+sinks"])
def test_paged_attention_windows_caps_and_sinks_on_cuda(dtype, window, softcap, sinks):
    """The Triton kernel's window (released pages: table entries -1, the pages NaN), soft-cap and sinks."""
    kernels_compiled()
    from tests.helpers.paged_attention import masked_softmax, released_pages_case
    from tightfit.kernels.varlen_attention import paged_attention

    lens = [(1, 70), (40, 140), (9, 20), (300, 300)]
    args, keys, values = released_pages_case(lens, 8, 2, 64, 16, window, seed=window)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(1)) if sinks else None
    q, kc, vc, bt, cu, kl = (t.to(cuda()) for t in args)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    want = masked_softmax(q.cpu(), [k.to(dtype) for k in keys], [v.to(dtype) for v in values], [n for n, _ in lens],
                          0.125, window, softcap, sink)
    out = paged_attention(q, kc, vc, bt, cu, kl, scale=0.125, max_q_len=300, window=window, softcap=softcap,
                          sinks=sink.to(cuda()) if sink is not None else None, backend="triton")
    assert out.dtype == dtype and not out.isnan().any()
    err = (out.double().cpu() - want).abs().max().item()
    assert err < ATOL[dtype], f"max error {err:.3g} vs float64"
