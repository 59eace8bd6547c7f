"""The native CPU backend of :func:`tightfit.kernels.varlen_attention.paged_attention` (fp32).

Decode steps are where a CPU server spends its time, and there the PyTorch reference first copies every
sequence's pages out of the pool with ``index_select`` and then runs ``scaled_dot_product_attention``
on the copy with a key mask: two passes over the keys and values, plus a dozen op launches per layer.
This kernel reads keys and values in place through the block table, once: per sequence it walks the pages
in memory order, scores every query head against each key (a query head reads its group's key head), takes
an exact softmax (max, exp, sum in fp32) and accumulates the values. The C is
``core/kernels/cpu/paged_attention.c``, built by :mod:`tightfit.kernels.native`.

Where the CPU has AVX2 + FMA (the library is built with ``-march=native``, keyed by the CPU's flags) and the
head width is a multiple of 8, keys are scored 8 at a time: one register of 8 dot products from 8 accumulators
and a single hadd tree, instead of a horizontal sum per key and head; the values are accumulated a tile at a
time too. Other widths and CPUs keep the loop above.

A sliding window, tanh soft-capping and per-head sinks (the options of
:func:`~tightfit.kernels.varlen_attention.paged_attention`) run here too: a query's walk starts at its window's first
key, so the pages before it are never read (the scheduler releases them: their table entries may be ``-1``); the
scaled scores are capped (``softcap * tanh(score / softcap)``) before the exact softmax; a sink logit joins the
softmax's max and sum, and its share is dropped. Rows are split over threads by the keys each sees within its window.

Sequences of up to :data:`NATIVE_MAX_Q` new tokens run here, prefill chunks included: a call's rows are split over
the threads in runs of about equal work (the keys each row sees), a lone prompt's too. Longer chunks are left to
the reference's per-sequence ``scaled_dot_product_attention``, whose blocked matmuls beat a loop over queries
there (with a window, soft-cap or sinks, the reference's masked softmax); one call serves a mixed step by
splitting it that way. Other dtypes than fp32, and caches that are not contiguous, go to the reference whole.

With ``torch.get_num_threads() > 1`` the sequences are split over that many threads, in runs of about equal
keys x queries, when the call has enough work for them (about 200k multiply-adds per thread). Where PyTorch
runs on GNU OpenMP the library is built with ``-fopenmp`` and the runs go to PyTorch's own team (see
:mod:`tightfit.kernels.quant_linear`).
Elsewhere, and in a child forked after a parallel region, each call starts POSIX threads.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from tightfit.kernels.native import load_kernel, native_error

__all__ = ["NATIVE_MAX_Q", "paged_attention_native", "native_attention_error", "native_runs", "store_kv_native"]

NATIVE_MAX_Q = 512  # new tokens per sequence up to which the native kernel beats sdpa's blocked matmuls



_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> Any:
    return load_kernel("paged_attention", (
        ("tf_paged_attention_f32", ctypes.c_int,
         (_P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, ctypes.c_float, _P, _I, _I)),
        ("tf_store_kv_f32", None, (_P, _I, _P, _I, _P, _P, _P, _I, _I)),
        ("tf_attention_threading", ctypes.c_int, ())), openmp=True)


def native_attention_error() -> str:
    """Why the native kernel cannot run here ('' when it can; builds it on the first call)."""
    return "" if _library() is not None else native_error("paged_attention") or "not built"


def store_kv_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Native launcher of :func:`~tightfit.kernels.varlen_attention.store_kv` (one call for keys and values)."""
    from tightfit.kernels.varlen_attention import store_kv_reference

    width = k_cache.shape[2] * k_cache.shape[3]
    k2, v2 = k.reshape(-1, width), v.reshape(-1, width)
    if (k_cache.dtype != torch.float32 or k2.dtype != torch.float32 or v2.dtype != torch.float32
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k2.stride(1) != 1 or v2.stride(1) != 1):
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    _library().tf_store_kv_f32(
        k2.data_ptr(), k2.stride(0), v2.data_ptr(), v2.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), k2.shape[0], width)


def native_runs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention_native` runs these tensors itself (fp32, on the CPU, contiguous caches, the
    library built) rather than handing them to the reference."""
    return (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and v_cache.dtype == torch.float32
            and q.device.type == "cpu" and k_cache.device.type == "cpu" and k_cache.is_contiguous()
            and v_cache.is_contiguous() and _library() is not None)


def paged_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                           *, scale: float, max_q_len: int, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Native launcher (no argument checks; call :func:`~tightfit.kernels.varlen_attention.paged_attention`)."""
    from tightfit.kernels.varlen_attention import attend_sequences, paged_attention_reference

    options = {"window": window, "softcap": softcap, "sinks": sinks}
    if not native_runs(q, k_cache, v_cache):
        return paged_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, scale=scale,
                                         max_q_len=max_q_len, **options)
    lib = _library()
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()  # heads side by side in each token's row; the rows may be apart (a view of a QKV output)
    out = torch.empty(q.shape, dtype=q.dtype)
    batch = kv_lens.shape[0]
    if batch == 0 or q.shape[0] == 0:
        return out
    # No-ops for the runtime's own metadata (already contiguous int32); a copy for anything else.
    bt, cu, lens = (t.to(torch.int32).contiguous() for t in (block_tables, cu_seqlens_q, kv_lens))
    sink = sinks.to(torch.float32).contiguous() if sinks is not None else None
    failed = lib.tf_paged_attention_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), bt.data_ptr(), bt.stride(0),
        cu.data_ptr(), lens.data_ptr(), batch, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
        float(scale), int(window), float(softcap), sink.data_ptr() if sink is not None else None, NATIVE_MAX_Q,
        torch.get_num_threads())
    if failed:
        raise MemoryError(f"paged_attention (native): could not allocate its score buffer (code {failed})")
    if max_q_len > NATIVE_MAX_Q:
        starts = cu.tolist()
        long = [b for b in range(batch) if starts[b + 1] - starts[b] > NATIVE_MAX_Q]
        attend_sequences(q, k_cache, v_cache, block_tables, starts, lens.tolist(), long, out, scale=scale, **options)
    return out
