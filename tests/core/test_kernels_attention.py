"""tightfit's kernels of energon's runtime: paged variable-length attention, KV store, pack/unpack.

(Moved from tests/energon_infer/test_kernels.py; the whole-model check stays there as test_runtime_triton.py.)

Triton runs under its CPU interpreter (TRITON_INTERPRET=1, set in tests/conftest.py); both backends
are checked against a float64 attention written out from the definition.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runif import RunIf
from tests.helpers.threads import torch_threads
from tightfit.kernels.dispatch import get_kernel
from tightfit.kernels.packing import pack, unpack
from tightfit.kernels.varlen_attention import paged_attention, store_kv

BACKENDS = ["reference", pytest.param("triton", marks=RunIf(triton=True))]
ATTENTION_BACKENDS = [*BACKENDS, pytest.param("native", marks=RunIf(native=True))]


def _naive(q, keys, values, q_lens, scale):
    out, row = [], 0
    for k, v, n in zip(keys, values, q_lens):
        kv = k.shape[0]
        group = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("nhd,khd->hnk", q[row:row + n].double(), k) * scale
        visible = torch.arange(kv)[None, :] <= (kv - n + torch.arange(n))[:, None]
        out.append(torch.einsum("hnk,khd->nhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v))
        row += n
    return torch.cat(out)


def _case(q_lens, kv_lens, hq, hk, d, block, dtype, seed=0):
    """Random keys/values written through store_kv into shuffled blocks, as the runtime lays them out."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-k // block) for k in kv_lens) + 3
    k_cache = torch.zeros(n_blocks, block, hk, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(n_blocks, generator=g).tolist()
    width = max(-(-k // block) for k in kv_lens)
    tables = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    keys, values = [], []
    for b, kv in enumerate(kv_lens):
        blocks = [free.pop() for _ in range(-(-kv // block))]
        tables[b, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(kv, hk, d, generator=g).to(dtype)
        v = torch.randn(kv, hk, d, generator=g).to(dtype)
        store_kv(k, v, k_cache, v_cache, torch.tensor([blocks[p // block] * block + p % block for p in range(kv)]))
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, cu, torch.tensor(kv_lens, dtype=torch.int32), keys, values


CASES = [
    # (q_lens, kv_lens, q heads, kv heads, head_dim, block_size): prefill, decode, chunked, mixed
    ([7, 2, 21], [7, 2, 21], 4, 2, 8, 4),          # prefill of unequal prompts, GQA 2
    ([1, 1, 1, 1], [5, 33, 1, 70], 4, 1, 12, 16),  # decode steps, MQA, head_dim not a power of two
    ([9, 1, 40], [20, 9, 40], 2, 2, 16, 1),         # chunked prefill + decode + prefill, block size 1
    ([70], [130], 8, 4, 64, 16),                    # a chunk spanning several query tiles and key tiles
]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=["prefill", "decode", "mixed", "long"])
def test_paged_attention_matches_the_definition(backend, case):
    q_lens, kv_lens, hq, hk, d, block = case
    q, kc, vc, bt, cu, kl, keys, values = _case(q_lens, kv_lens, hq, hk, d, block, torch.float32)
    out = paged_attention(q, kc, vc, bt, cu, kl, scale=d ** -0.5, max_q_len=max(q_lens), backend=backend)
    assert out.shape == q.shape
    assert (out.double() - _naive(q, keys, values, q_lens, d ** -0.5)).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_half_precision(backend, dtype):
    q_lens, kv_lens = [5, 1, 17], [5, 30, 20]
    q, kc, vc, bt, cu, kl, keys, values = _case(q_lens, kv_lens, 4, 2, 16, 8, dtype, seed=3)
    out = paged_attention(q, kc, vc, bt, cu, kl, scale=0.25, max_q_len=17, backend=backend)
    assert out.dtype == dtype
    assert (out.double() - _naive(q, keys, values, q_lens, 0.25)).abs().max().item() < 2e-2


def test_paged_attention_checks_shapes():
    q, kc, vc, bt, cu, kl, _, _ = _case([3], [3], 3, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="3 query heads of width 8 do not fit 2 key heads"):
        paged_attention(q, kc, vc, bt, cu, kl, scale=1.0, max_q_len=3)
    q, kc, vc, bt, cu, kl, _, _ = _case([3], [3], 2, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="1 sequences need cu_seqlens_q of length 2"):
        paged_attention(q, kc, vc, bt, cu[:1], kl, scale=1.0, max_q_len=3)


_THREADED = dict(q_lens=[1] * 16, kv_lens=[300 + 37 * i for i in range(16)], hq=8, hk=2, d=64, block=16)


def _attend_on_two_threads(case) -> tuple[torch.Tensor, int]:
    """The native kernel on 2 threads (a decode step with work enough for both), and how it ran."""
    from tightfit.kernels.varlen_attention_cpu import _library

    q, kc, vc, bt, cu, kl = case
    with torch_threads(2):
        out = paged_attention(q, kc, vc, bt, cu, kl, scale=0.125, max_q_len=1, backend="native")
    return out, _library().tf_attention_threading()


def _in_forked_child(queue, case) -> None:
    out, threading = _attend_on_two_threads(case)
    queue.put((out.tolist(), threading))


@RunIf(native=True)
def test_native_attention_over_two_threads_on_openmp_and_in_a_forked_child():
    """Split over 2 threads: on PyTorch's OpenMP team where the library is built with it, and on POSIX threads
    in a child forked after that team ran (GNU OpenMP's team does not survive a fork); exact both ways. (The
    child runs only the kernel: PyTorch's own parallel ops wait forever there.)"""
    import multiprocessing

    from tightfit.kernels.native import torch_openmp

    t = _THREADED
    q, kc, vc, bt, cu, kl, keys, values = _case(t["q_lens"], t["kv_lens"], t["hq"], t["hk"], t["d"], t["block"],
                                                torch.float32, seed=5)
    want = _naive(q, keys, values, t["q_lens"], 0.125)
    out, threading = _attend_on_two_threads((q, kc, vc, bt, cu, kl))
    assert (out.double() - want).abs().max().item() < 1e-5
    assert threading == (1 if torch_openmp() else 0)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(queue, (q, kc, vc, bt, cu, kl)))
    child.start()
    child_out, child_threading = queue.get(timeout=120)
    child.join(30)
    assert (torch.tensor(child_out, dtype=torch.float64) - want).abs().max().item() < 1e-5
    assert child_threading == 0


@RunIf(native=True)
def test_cpu_tensors_use_the_native_kernel_unless_forced(monkeypatch):
    kernel = get_kernel("paged_attention")
    q = torch.zeros(1, 1, 8)
    monkeypatch.delenv("TIGHTFIT_KERNELS", raising=False)
    assert kernel.backend_for(q) == "native"
    monkeypatch.setenv("TIGHTFIT_KERNELS", "reference")
    assert kernel.backend_for(q) == "reference"


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_and_unpack_any_padding(backend):
    g = torch.Generator().manual_seed(0)
    padded = torch.randn(4, 9, 3, 5, generator=g)
    lengths = torch.tensor([9, 4, 1, 6])
    starts = torch.tensor([0, 5, 3, 1])  # full, left-padded, a token in the middle, both sides
    packed, cu = pack(padded, starts, lengths, backend=backend)
    assert cu.tolist() == [0, 9, 13, 14, 20]
    expect = torch.cat([padded[b, s:s + n] for b, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist()))])
    assert torch.equal(packed, expect)
    back = unpack(packed, starts, lengths, 9, backend=backend)
    mask = (torch.arange(9)[None] >= starts[:, None]) & (torch.arange(9)[None] < (starts + lengths)[:, None])
    assert torch.equal(back[mask], padded[mask]) and back[~mask].abs().sum() == 0
    ids = torch.tensor([[0, 0, 7, 8], [5, 6, 9, 0]])
    assert pack(ids, torch.tensor([2, 0]), torch.tensor([2, 3]), backend=backend)[0].tolist() == [7, 8, 5, 6, 9]


def test_pack_checks_its_arguments():
    with pytest.raises(ValueError, match=r"start \+ length <= 4"):
        pack(torch.zeros(2, 4), torch.tensor([0, 3]), torch.tensor([4, 2]))
    with pytest.raises(ValueError, match=r"unpack: packed has 5 rows but lengths add up to 6"):
        unpack(torch.zeros(5, 2), torch.tensor([0, 0]), torch.tensor([4, 2]), 4)


_COMPILE = """
import os, warnings
warnings.simplefilter("ignore")
os.environ.pop("TRITON_INTERPRET", None)
from tightfit.kernels import varlen_attention
from tightfit.kernels.testing import compile_for_gpu
kernel = varlen_attention._kernel()
strides = ("q_st", "q_sh", "k_sb", "k_ss", "k_sh", "v_sb", "v_ss", "v_sh", "o_st", "o_sh", "bt_s0")
# (dtype, dot precision, BLOCK_M, head_dim, BLOCK_D, window/cap/sinks): decode and prefill tiles in bf16, a head
# width that is not a power of two, and the fp16 / fp32 variants; Gemma 2's and gpt-oss's options in bf16 and fp32.
for dt, precision, block_m, head_dim, block_d, options in (
        ("bf16", "tf32", 16, 128, 128, False), ("bf16", "tf32", 64, 128, 128, False),
        ("bf16", "tf32", 64, 80, 128, False), ("fp16", "tf32", 64, 64, 64, False), ("fp32", "ieee", 64, 64, 64, False),
        ("bf16", "tf32", 16, 128, 128, True), ("fp32", "ieee", 64, 64, 64, True)):
    sig = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "v_ptr": "*" + dt, "o_ptr": "*" + dt, "bt_ptr": "*i32",
           "cu_ptr": "*i32", "kvlen_ptr": "*i32", "sink_ptr": "*fp32", "scale": "fp32", "window": "i32",
           "softcap": "fp32", **{s: "i32" for s in strides},
           **{c: "constexpr" for c in ("GROUP", "PAGE", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_D", "UPCAST",
                                       "PRECISION", "WINDOWED", "CAPPED", "SINKS")}}
    consts = {"GROUP": 2, "PAGE": 16, "HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": 64,
              "BLOCK_D": block_d, "UPCAST": False, "PRECISION": precision, "WINDOWED": options, "CAPPED": options,
              "SINKS": options}
    assert compile_for_gpu(kernel, sig, consts)["cubin"]
print("compiled")
"""


@RunIf(triton=True)
def test_paged_attention_compiles_for_sm90_without_a_gpu():
    """The real code generator (not the interpreter) accepts the kernel: the launcher's tile choices, 3 dtypes."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled" in out.stdout
