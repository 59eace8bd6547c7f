"""Per-head RMSNorm of queries and keys, in place in a fused QKV projection's output (Qwen 3, Gemma 3 q/k norms).

    rms_norm_heads_(qk, split, w_first, w_second, eps, offset=0.0)   # qk: (T, heads, D), heads side by side

Each of the ``heads`` rows of ``D`` features of every token is normalised over its ``D`` features (statistics in
fp32), then multiplied by ``offset + w_first`` for heads ``< split`` (the queries) and ``offset + w_second`` for
the rest (the keys), as those models' references do (the weight after the normalisation; Gemma's ``1 + w``).
``qk`` is a view of the QKV output: its tokens may be apart in memory (the values follow the keys in each row).

In PyTorch this is, per layer, a copy of the query heads out of the QKV output (a strided view cannot be reshaped
to rows in place), a norm, a copy back, and the same for the keys: six ops, launch-bound at the few rows of a
decode step. The native CPU backend (C on raw pointers, see :mod:`tightfit.kernels.native`; fp32) does it in one call
in place. No Triton kernel: on CUDA the reference runs.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.nn.functional as F

from tightfit.kernels.dispatch import register_kernel
from tightfit.kernels.native import load_kernel, native_error

__all__ = ["rms_norm_heads_", "rms_norm_heads_reference"]


_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> Any:
    return load_kernel("head_norm", (
        ("tf_rms_norm_heads_f32", None, (_P, _I, _I, _I, _I, _I, _P, _P, ctypes.c_float, ctypes.c_float)),))


def _native_error() -> str:
    return "" if _library() is not None else native_error("head_norm") or "not built"


def rms_norm_heads_reference(qk: torch.Tensor, split: int, w_first: torch.Tensor, w_second: torch.Tensor,
                             eps: float, offset: float = 0.0) -> torch.Tensor:
    h = F.rms_norm(qk.float(), (qk.shape[-1],), None, eps)
    qk[:, :split].copy_(h[:, :split] * (w_first.float() + offset))
    qk[:, split:].copy_(h[:, split:] * (w_second.float() + offset))
    return qk


def _rms_norm_heads_native(qk: torch.Tensor, split: int, w_first: torch.Tensor, w_second: torch.Tensor,
                           eps: float, offset: float = 0.0) -> torch.Tensor:
    if (qk.dtype != torch.float32 or qk.stride(2) != 1 or qk.stride(1) != qk.shape[2]
            or w_first.dtype != torch.float32 or w_second.dtype != torch.float32):
        return rms_norm_heads_reference(qk, split, w_first, w_second, eps, offset)
    w1, w2 = w_first.contiguous(), w_second.contiguous()
    _library().tf_rms_norm_heads_f32(qk.data_ptr(), qk.stride(0), qk.shape[0], qk.shape[1], qk.shape[2], split,
                                     w1.data_ptr(), w2.data_ptr(), float(eps), float(offset))
    return qk


def _class(qk: torch.Tensor, split: int, w_first: torch.Tensor, w_second: torch.Tensor, eps: float,
           offset: float = 0.0) -> tuple:
    return (str(qk.dtype), qk.shape[1], qk.shape[2], split, offset != 0.0)


def _probe(qk: torch.Tensor, split: int, w_first: torch.Tensor, w_second: torch.Tensor, eps: float,
           offset: float = 0.0) -> tuple[tuple, dict]:
    gen = torch.Generator(device=qk.device).manual_seed(0)
    heads, d = qk.shape[1], qk.shape[2]
    rows = torch.randn(3, heads * d + 5, generator=gen, device=qk.device).to(qk.dtype)  # tokens apart, as in QKV
    x = rows[:, :heads * d].view(3, heads, d)
    w1, w2 = (torch.randn(d, generator=gen, device=qk.device).to(w.dtype) for w in (w_first, w_second))
    return (x, split, w1, w2, eps, offset), {}


_heads = register_kernel("rms_norm_heads_", reference=rms_norm_heads_reference, triton=None,
                         doc="per-head RMSNorm of queries and keys in place, a weight for each side (q/k norms)",
                         shape_class=_class, probe=_probe, native=_rms_norm_heads_native, native_error=_native_error)


def rms_norm_heads_(qk: torch.Tensor, split: int, w_first: torch.Tensor, w_second: torch.Tensor, eps: float,
                    offset: float = 0.0, *, backend: str | None = None) -> torch.Tensor:
    """Normalise every head of ``qk`` ``(T, heads, D)`` in place (see the module docstring); returns ``qk``.

    Example:
        >>> qk = torch.randn(2, 3, 4)
        >>> w1, w2 = torch.randn(4), torch.randn(4)
        >>> want = torch.cat([F.rms_norm(qk[:, :2], (4,), w1, 1e-6), F.rms_norm(qk[:, 2:], (4,), w2, 1e-6)], 1)
        >>> torch.allclose(rms_norm_heads_(qk, 2, w1, w2, 1e-6), want, atol=1e-6)
        True
    """
    if qk.dim() != 3 or not 0 <= split <= qk.shape[1] or w_first.shape != (qk.shape[2],) \
            or w_second.shape != (qk.shape[2],):
        raise ValueError(f"rms_norm_heads_: qk must be (tokens, heads, head_dim) with 0 <= split <= heads and each "
                         f"weight (head_dim,); got qk {tuple(qk.shape)}, split {split}, weights "
                         f"{tuple(w_first.shape)} and {tuple(w_second.shape)}")
    return _heads(qk, split, w_first, w_second, eps, offset, backend=backend)
