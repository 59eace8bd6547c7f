"""GeGLU's ``gelu_tanh(gate) * up`` in one pass: the gated MLP of Gemma 1, 2 and 3.

    h = gelu_tanh_mul(gate_up)             # (T, 2I) -> (T, I): gelu (tanh form) of the first half times the second

In PyTorch it is three ops over the activation (``chunk``, ``gelu(approximate="tanh")``, ``mul``), the gelu a
polynomial and a tanh per element; a Gemma decode step runs it once per layer on every row. The native CPU backend
(``core/kernels/cpu/gelu_mul.c``, built by :mod:`tightfit.kernels.native`; fp32) reads the gate and up halves once
and writes the product: ``0.5 * x * (1 + tanh(u))`` is computed as ``x / (1 + exp(-2u))`` (the same function: ``0.5 * (1 +
tanh(u))`` is the logistic of ``2u``), one ``expf`` per element, which the compiler vectorises, and no cancellation
near 0. Rows split over PyTorch's OpenMP team as :mod:`tightfit.kernels.elementwise`'s ``silu_mul`` does.

No Triton kernel: on CUDA the PyTorch reference runs (CUDA graphs remove the launches of decode steps there).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.nn.functional as F

from tightfit.kernels.dispatch import register_kernel
from tightfit.kernels.native import load_kernel, native_error

__all__ = ["gelu_tanh_mul", "gelu_tanh_mul_reference"]


_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> Any:
    return load_kernel("gelu_mul", (("tf_gelu_tanh_mul_f32", None, (_P, _I, _P, _I, _I, _I)),), openmp=True)


def _native_error() -> str:
    return "" if _library() is not None else native_error("gelu_mul") or "not built"


def gelu_tanh_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _gelu_tanh_mul_native(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        return gelu_tanh_mul_reference(x)
    rows = x.reshape(-1, x.shape[-1])  # a view where it can be; a copy keeps the last dimension contiguous too
    half = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    _library().tf_gelu_tanh_mul_f32(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], half,
                                    torch.get_num_threads())
    return out


def _class(x: torch.Tensor) -> tuple:
    return (str(x.dtype), x.shape[-1])


def _probe(x: torch.Tensor) -> tuple[tuple, dict]:
    gen = torch.Generator(device=x.device).manual_seed(0)
    return (torch.randn(5, x.shape[-1], generator=gen, device=x.device).to(x.dtype) * 4,), {}


_gelu_tanh_mul = register_kernel("gelu_tanh_mul", reference=gelu_tanh_mul_reference, triton=None,
                                 doc="gelu (tanh form) of the first half of the last dimension times the second",
                                 shape_class=_class, probe=_probe, native=_gelu_tanh_mul_native,
                                 native_error=_native_error)


def gelu_tanh_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``gelu(x[..., :n], approximate="tanh") * x[..., n:]`` for a last dimension of ``2n`` (a fused gate/up
    projection's output).

    Example:
        >>> x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
        >>> torch.allclose(gelu_tanh_mul(x), F.gelu(x[:, :2], approximate="tanh") * x[:, 2:])
        True
    """
    if x.shape[-1] % 2:
        raise ValueError(f"gelu_tanh_mul: the last dimension ({x.shape[-1]}) must be even: gate and up halves side "
                         "by side, as a fused gate/up projection gives them")
    return _gelu_tanh_mul(x, backend=backend)
