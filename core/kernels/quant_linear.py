"""Linear layers on weight-only quantized weights: ``y = x W^T + b`` with ``W`` held as int8 or int4.

    y = int8_linear(x, qweight, scale, bias)               # qweight (N, K) int8, scale (N,): W = q * scale
    y = int4_linear(x, packed, scale, zero, group_size, bias)  # packed (N, K/2) uint8 (pack_int4)

The formats are torchao's: int8 is its ``Int8WeightOnlyConfig`` (symmetric, one fp32 scale per output row:
``Int8Tensor.qdata`` and ``.scale``); int4 is its tinygemm affine scheme (``Int4WeightOnlyConfig``'s default
choose-qparams algorithm: unsigned 4-bit ``q`` in 0..15, per row and group of ``group_size`` inputs a scale
and a float zero point, ``W = (q - 8) * scale + zero``). Only the byte order of int4 is this module's own
(:func:`pack_int4`): torchao's CPU int4 layout is the opaque one ATen's ``_convert_weight_to_int4pack_for_cpu``
writes, which only ATen's kernel reads. Here byte ``j`` of a row's group holds the group's element ``j`` in its
low nibble and element ``j + group_size/2`` in its high nibble, so the kernel reads the activation of both
halves contiguously.

Core never imports torchao: the references below dequantise with plain PyTorch and the plugin that
quantises (``energon_infer.loading.quantization``) checks them against torchao's own ``dequantize``.

The native CPU backend (``core/kernels/cpu/quant_linear.c``, built by :mod:`tightfit.kernels.native`) takes fp32
inputs of up to :data:`NATIVE_MAX_ROWS` rows and dequantises inside the dot products: each weight byte is read once
per call and converted in registers. Where the CPU has AVX2 and FMA (the build is ``-march=native``) the loops are
intrinsics: int8 sign-extends and converts eight weights per FMA; int4 reads a 32-byte block as eight 32-bit lanes and
takes nibble ``j`` of every lane with one mask and one convert, having permuted ``x`` once per call into that order
(its inputs pre-scaled by ``16^-j``, exact); groups of 32 or a multiple of 64 with ``K % 64 == 0`` take it, other
shapes the scalar loops, which stay as the SIMD loops' reference in the tests. From four rows on, each pass takes two
output features by four rows. The output features are split over ``torch.get_num_threads()`` threads, in chunks
claimed from one counter: on the GNU OpenMP team PyTorch's own ops run on where the library is built with
``-fopenmp``, else (no OpenMP, or a child forked after a parallel region) on a pool started once per process, the
caller taking chunks too; calls under ~256k multiply-adds stay on the caller. Above :data:`NATIVE_MAX_ROWS` rows
(prefill) the native backend dequantises the weight in C on all threads and multiplies with BLAS. Other dtypes, and
CUDA tensors, run the reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tightfit.kernels.dispatch import register_kernel
from tightfit.kernels.native import load_kernel, native_error
from tightfit.kernels.weight_tiles import check_tiled, check_tiled_int8, untile_int4, untile_int8

__all__ = ["NATIVE_MAX_ROWS", "INT4_GROUP_SIZES", "int8_linear", "int8_linear_reference", "int4_linear",
           "int4_linear_reference", "pack_int4", "unpack_int4", "dequantize_int4", "dequantize_int8"]

NATIVE_MAX_ROWS = 32  # rows up to which the native kernel runs (above: dequantise + BLAS)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # torchao's int4 group sizes


_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> Any:
    return load_kernel("quant_linear", (
        ("tf_a8_linear_f32", ctypes.c_int, (_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I)),
        ("tf_a8_available", ctypes.c_int, ()),
        ("tf_a8_set_rows", ctypes.c_int, (ctypes.c_int, ctypes.c_int)),
        ("tf_int8_linear_f32", ctypes.c_int, (_P, _I, _P, _P, _P, _P, _I, _I, _I, _I)),
        ("tf_int4_linear_f32", ctypes.c_int, (_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I)),
        ("tf_dequantize_f32", ctypes.c_int, (_P, _P, _P, _P, _I, _I, _I, _I, _I)),
        ("tf_quant_set_simd", ctypes.c_int, (ctypes.c_int,)),
        ("tf_quant_set_min_work", _I, (_I,)),
        ("tf_quant_threading", ctypes.c_int, ())), openmp=True)


def _dequantize_native(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
                       tiled: bool = False) -> torch.Tensor:
    """The fp32 ``(N, K)`` weight in row order, dequantised in C over all threads (int8 when ``zero`` is None;
    ``tiled``: ``q`` in :func:`~tightfit.kernels.weight_tiles.tile_int8` / ``tile_int4``'s order)."""
    n, k = q.shape[0], q.shape[1] * (1 if zero is None else 2)
    out = torch.empty((n, k), dtype=torch.float32)
    _library().tf_dequantize_f32(q.data_ptr(), scale.data_ptr(), None if zero is None else zero.data_ptr(),
                                 out.data_ptr(), n, k, 0 if zero is None else group_size, int(tiled),
                                 torch.get_num_threads())
    return out


@contextlib.contextmanager
def _native_mode(simd: bool | None = None, min_work: int | None = None) -> Iterator[bool]:
    """Within: the native kernels' AVX2 loops on or off (``simd``) and the multiply-adds per call below which a
    call stays on the calling thread (``min_work``; 0 always uses the pool). Yields whether the SIMD loops are
    in use. For tests, which hold the intrinsics to the scalar loops and run the pool on small shapes."""
    lib = _library()
    if lib is None:
        yield False
        return
    old_simd = lib.tf_quant_set_simd(-1 if simd is None else int(simd))
    old_work = lib.tf_quant_set_min_work(-1 if min_work is None else min_work)
    try:
        yield lib.tf_quant_set_simd(-1) == 1
    finally:
        lib.tf_quant_set_simd(1 if old_simd else 0)
        lib.tf_quant_set_min_work(old_work)


def _native_error() -> str:
    return "" if _library() is not None else native_error("quant_linear") or "not built"


# --------------------------------------------------------------------------- formats


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(N, K)`` integers in 0..15 -> ``(N, K/2)`` uint8, two per byte (see the module docstring)."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: ``(N, K)`` uint8 in 0..15."""
    n, half = packed.shape
    g = packed.reshape(n, -1, 1, group_size // 2)
    return torch.cat((g & 15, g >> 4), dim=2).reshape(n, half * 2)


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W = q * scale`` (per output row), in ``dtype``."""
    return (qweight.to(torch.float32) * scale.reshape(-1, 1).to(torch.float32)).to(dtype)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """``W = (q - 8) * scale + zero`` per row and group (torchao's tinygemm affine scheme), in ``dtype``."""
    q = unpack_int4(packed, group_size).to(torch.float32)
    n, k = q.shape
    q = q.reshape(n, k // group_size, group_size)
    w = (q - 8.0) * scale.to(torch.float32)[:, :, None] + zero.to(torch.float32)[:, :, None]
    return w.reshape(n, k).to(dtype)


# --------------------------------------------------------------------------- int8


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    q = untile_int8(qweight) if tiled else qweight
    return F.linear(x, dequantize_int8(q, scale, x.dtype), bias)


def _native_ok(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    return (x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1
            and all(t is None or (t.dtype in (torch.float32, torch.int8, torch.uint8) and t.is_contiguous())
                    for t in tensors))


def _int8_native(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    if not _native_ok(x, qweight, scale, bias) or scale.dtype != torch.float32 or (
            bias is not None and bias.dtype != torch.float32):
        return int8_linear_reference(x, qweight, scale, bias, tiled)
    if x.shape[0] > NATIVE_MAX_ROWS:
        return F.linear(x, _dequantize_native(qweight, scale, None, 0, tiled), bias)
    if tiled:  # these loops read the row order (decode takes quant_linear_a8's kernel, which reads the tiles)
        qweight = untile_int8(qweight)
    n, k = qweight.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    _library().tf_int8_linear_f32(x.data_ptr(), x.stride(0), qweight.data_ptr(), scale.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, y.data_ptr(), x.shape[0], n, k,
                                  torch.get_num_threads())
    return y


def _probe_rows(x: torch.Tensor) -> int:
    # A few rows for the decode class, just past the threshold for the prefill class (dequantise + BLAS).
    return min(x.shape[0], 5) if x.shape[0] <= NATIVE_MAX_ROWS else NATIVE_MAX_ROWS + 1


def _int8_class(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                tiled: bool = False) -> tuple:
    return (str(x.dtype), x.shape[0] <= NATIVE_MAX_ROWS, tuple(qweight.shape), bias is None, tiled)


def _int8_probe(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                tiled: bool = False) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(0)
    xp = torch.randn(_probe_rows(x), x.shape[1], generator=gen).to(x.dtype)
    return (xp, qweight, scale, bias, tiled), {}


_int8 = register_kernel("int8_linear", reference=int8_linear_reference, triton=None,
                        doc="x @ (int8 weight * per-row scale)^T + bias (weight-only int8)",
                        shape_class=_int8_class, probe=_int8_probe, native=_int8_native, native_error=_native_error)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                tiled: bool = False, backend: str | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T + bias`` for ``x (M, K)``, ``qweight (N, K)`` int8 (with ``tiled``: in
    :func:`~tightfit.kernels.weight_tiles.tile_int8`'s order), ``scale (N,)``."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or x.shape[-1] != qweight.shape[1] or \
            scale.numel() != qweight.shape[0]:
        raise ValueError(f"int8_linear: x {tuple(x.shape)} needs an int8 qweight (N, {x.shape[-1]}) and N scales; got "
                         f"qweight {qweight.dtype} {tuple(qweight.shape)}, scale {tuple(scale.shape)}")
    if tiled:
        check_tiled_int8("int8_linear", *qweight.shape)
    return _int8(x, qweight, scale, bias, tiled, backend=backend)


# --------------------------------------------------------------------------- int4


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    q = untile_int4(packed) if tiled else packed
    return F.linear(x, dequantize_int4(q, scale, zero, group_size, x.dtype), bias)


def _int4_native(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    if (not _native_ok(x, packed, scale, zero, bias) or scale.dtype != torch.float32 or zero.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32)):
        return int4_linear_reference(x, packed, scale, zero, group_size, bias, tiled)
    if x.shape[0] > NATIVE_MAX_ROWS:
        return F.linear(x, _dequantize_native(packed, scale, zero, group_size, tiled), bias)
    if tiled:  # these loops read the row order (decode takes quant_linear_a8's kernel, which reads the tiles)
        packed = untile_int4(packed)
    n, k = packed.shape[0], packed.shape[1] * 2
    m = x.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    if _library().tf_int4_linear_f32(x.data_ptr(), x.stride(0), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                                     bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                     m, n, k, group_size, torch.get_num_threads()) != 0:
        raise MemoryError(f"int4_linear: no memory for the {m} x {k // group_size} group sums")
    return y


def _int4_class(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, tiled: bool = False) -> tuple:
    return (str(x.dtype), x.shape[0] <= NATIVE_MAX_ROWS, tuple(packed.shape), group_size, bias is None, tiled)


def _int4_probe(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, tiled: bool = False) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(0)
    xp = torch.randn(_probe_rows(x), x.shape[1], generator=gen).to(x.dtype)
    return (xp, packed, scale, zero, group_size, bias, tiled), {}


_int4 = register_kernel("int4_linear", reference=int4_linear_reference, triton=None,
                        doc="x @ dequantised int4 weight^T + bias (weight-only int4, torchao's tinygemm scheme)",
                        shape_class=_int4_class, probe=_int4_probe, native=_int4_native, native_error=_native_error)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, *, tiled: bool = False, backend: str | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W = (q - 8) * scale + zero`` per row and group of ``group_size`` inputs.

    ``packed``: :func:`pack_int4` of ``q`` ``(N, K)``, or with ``tiled`` that in
    :func:`~tightfit.kernels.weight_tiles.tile_int4`'s order; ``scale``, ``zero``: ``(N, K / group_size)``.
    """
    n, half = packed.shape if packed.dim() == 2 else (0, 0)
    k = half * 2
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or x.shape[-1] != k or group_size < 2 or group_size % 2
            or k % group_size or tuple(scale.shape) != (n, k // max(group_size, 1)) or scale.shape != zero.shape):
        raise ValueError(
            f"int4_linear: x {tuple(x.shape)} needs a uint8 packed weight (N, {x.shape[-1] // 2}), an even group_size "
            f"dividing {x.shape[-1]} and scale/zero (N, K / group_size); got packed {packed.dtype} "
            f"{tuple(packed.shape)}, group_size {group_size}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)}")
    if tiled:
        check_tiled("int4_linear", n, k, group_size)
    return _int4(x, packed, scale, zero, group_size, bias, tiled, backend=backend)
