"""Fused element-wise ops of a decoder block: SwiGLU's ``silu(gate) * up``, RMSNorm, rotary embedding in place.

    h = silu_mul(gate_up)                  # (T, 2I) -> (T, I): silu of the first half times the second
    y = rms_norm(x, weight, eps)           # as F.rms_norm over the last dimension
    rotary_(qk, cos, sin)                  # (T, H, D) rotated in place ("rotate_half" layout, as Hugging Face)

In PyTorch each is a chain of ops over the whole activation (``chunk``, ``silu``, ``mul``; ``cat``, ``neg``,
two ``mul`` and an ``add``), each reading and writing every element. The native CPU backend
(``core/kernels/cpu/elementwise.c``, built by :mod:`tightfit.kernels.native`; fp32) does one pass over each row.

A call of more than 16384 elements a thread splits its rows over PyTorch's OpenMP team (each row computed as on
one thread, so the bits do not change). Decode steps stay on the calling thread.

Neither op has a Triton kernel: on CUDA they run the PyTorch reference (a GPU fuses little here but
launches, and CUDA graphs remove those for decode steps).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.nn.functional as F

from tightfit.kernels.dispatch import register_kernel
from tightfit.kernels.native import load_kernel, native_error

__all__ = ["silu_mul", "silu_mul_reference", "rotary_", "rotary_reference", "rms_norm",
           "rms_norm_reference"]


_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> Any:
    return load_kernel("elementwise", (
        ("tf_silu_mul_f32", None, (_P, _I, _P, _I, _I, _I)),
        ("tf_rms_norm_f32", None, (_P, _I, _P, _P, _I, _I, ctypes.c_float, _I)),
        ("tf_rotary_f32", None, (_P, _I, _I, _P, _P, _I, _I, _I, _I, _I))), openmp=True)


def _native_error() -> str:
    return "" if _library() is not None else native_error("elementwise") or "not built"


# --------------------------------------------------------------------------- silu_mul


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_mul_native(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        return silu_mul_reference(x)
    rows = x.reshape(-1, x.shape[-1])  # a view where it can be; a copy keeps the last dimension contiguous too
    half = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    _library().tf_silu_mul_f32(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], half,
                               torch.get_num_threads())
    return out


def _silu_mul_class(x: torch.Tensor) -> tuple:
    return (str(x.dtype), x.shape[-1])


def _silu_mul_probe(x: torch.Tensor) -> tuple[tuple, dict]:
    gen = torch.Generator(device=x.device).manual_seed(0)
    return (torch.randn(5, x.shape[-1], generator=gen, device=x.device).to(x.dtype) * 4,), {}


_silu_mul = register_kernel("silu_mul", reference=silu_mul_reference, triton=None,
                            doc="silu of the first half of the last dimension times the second half (SwiGLU)",
                            shape_class=_silu_mul_class, probe=_silu_mul_probe,
                            native=_silu_mul_native, native_error=_native_error)


def silu_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for a last dimension of ``2n`` (a fused gate/up projection's output)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul: the last dimension ({x.shape[-1]}) must be even: gate and up halves side by "
                         "side, as a fused gate/up projection gives them")
    return _silu_mul(x, backend=backend)


# --------------------------------------------------------------------------- rms_norm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rms_norm_native(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if (x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1
            or (weight is not None and (weight.dtype != torch.float32 or not weight.is_contiguous()))):
        return rms_norm_reference(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _library().tf_rms_norm_f32(x.data_ptr(), x.stride(0), weight.data_ptr() if weight is not None else None,
                               out.data_ptr(), x.shape[0], x.shape[1], float(eps), torch.get_num_threads())
    return out


def _rms_norm_class(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple:
    return (str(x.dtype), x.dim(), x.shape[-1], weight is None)


def _rms_norm_probe(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[tuple, dict]:
    gen = torch.Generator(device=x.device).manual_seed(0)
    n = x.shape[-1]
    w = None if weight is None else torch.randn(n, generator=gen, device=x.device).to(weight.dtype)
    return (torch.randn(*([3] * (x.dim() - 1)), n, generator=gen, device=x.device).to(x.dtype), w, eps), {}


_rms_norm = register_kernel("rms_norm", reference=rms_norm_reference, triton=None,
                            doc="RMSNorm of the last dimension (fp32 statistics), times an optional weight",
                            shape_class=_rms_norm_class, probe=_rms_norm_probe,
                            native=_rms_norm_native, native_error=_native_error)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` (``F.rms_norm`` over the last dimension).

    Every size goes through the dispatcher (``F.rms_norm`` is a composite of about ten ATen ops on the CPU, so
    the one-pass native kernel is used at a decode step's few rows too).
    """
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last dimension of x "
                         f"{tuple(x.shape)}; give one weight per feature")
    return _rms_norm(x, weight, eps, backend=backend)


# --------------------------------------------------------------------------- rotary_


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x.copy_(x * cos + rotated * sin)


def _rotary_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    cs, sn = cos.reshape(t, d), sin.reshape(t, d)  # rotary_ checked one head_dim row per token
    if (x.dtype != torch.float32 or cs.dtype != torch.float32 or x.stride(-1) != 1
            or cs.stride(-1) != 1 or cs.stride() != sn.stride()):
        return rotary_reference(x, cos, sin)
    _library().tf_rotary_f32(x.data_ptr(), x.stride(0), x.stride(1), cs.data_ptr(), sn.data_ptr(), cs.stride(0),
                             t, h, d, torch.get_num_threads())
    return x


def _rotary_class(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    return (str(x.dtype), str(cos.dtype), x.shape[1], x.shape[2])


def _rotary_probe(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[tuple, dict]:
    gen = torch.Generator(device=x.device).manual_seed(0)
    t, h, d = 3, x.shape[1], x.shape[2]
    wide = torch.randn(t, h + 1, d, generator=gen, device=x.device).to(x.dtype)
    angles = torch.rand(t, 1, d, generator=gen, device=x.device) * 6
    return (wide[:, :h], angles.cos().to(cos.dtype), angles.sin().to(sin.dtype)), {}


_rotary = register_kernel("rotary_", reference=rotary_reference, triton=None,
                          doc="rotary position embedding applied in place (rotate_half layout)",
                          shape_class=_rotary_class, probe=_rotary_probe,
                          native=_rotary_native, native_error=_native_error)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` in place by ``cos``/``sin`` ``(T, 1, D)`` (or ``(T, D)``); returns ``x``.

    ``x`` may be a strided view (the query and key columns of a fused QKV output); its last dimension must
    be contiguous for the native backend (otherwise the reference runs).
    """
    if x.dim() != 3 or x.shape[-1] % 2 or cos.shape != sin.shape or cos.numel() != x.shape[0] * x.shape[2]:
        raise ValueError(
            f"rotary_: x must be (tokens, heads, head_dim) with an even head_dim and cos/sin hold one head_dim row "
            f"per token; got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    return _rotary(x, cos, sin, backend=backend)
