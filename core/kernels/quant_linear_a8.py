"""Weight-only int8/int4 linears with the activations quantised to int8 on the fly (llama.cpp's Q8_0 scheme).

    y = int8_linear_a8(x, qweight, scale, bias)                    # same weights as quant_linear.int8_linear
    y = int4_linear_a8(x, packed, scale, zero, group_size, bias)   # same weights as quant_linear.int4_linear
    if a8_applies(x, k, group_size): ...                           # where the native kernel takes this call

Each row of ``x`` is quantised per block of inputs: ``d = max|x_block| / 127``, ``xq = round(x / d)``
(nearest even, in -127..127), ``x^ = d * xq``. Blocks are of 128 inputs for int8 weights (where ``K % 128 == 0``)
and int4 groups of 128 (the default) or a multiple of 256, else of 32 (llama.cpp's Q8_0 block)
(:func:`activation_block`): a block's two ``vpdpbusd`` add in int32 and are converted and scaled once
(llama.cpp's K-quants quantise their activations per 256). From four rows on, int4 groups of 128 or a multiple of 256 go 16 features at a time:
each block's weights are transposed once (a 16 x 16 transpose of 32-bit words), so one ``vpdpbusd`` takes four
inputs of a row (broadcast) against those inputs' weights of 16 features and the sums land in 16 lanes, one per
feature: no horizontal sum per output, and the zero-point term is one FMA per row and group (4 x 4 tiles spend
about as much on those as on the products). Below four rows the transpose costs more than it saves, so those
rows keep the 4 x 4 tiles.
Weights held in :func:`tile_int4`'s order (same bytes, each 16 rows' reordered so that one 64-byte load is the
16 features' next four inputs; energon holds its int4 projections so where :func:`int4_tiles_apply`) need no
transpose: below 32 rows each run is split in registers and meets groups of four rows at once, at 32 each
block is split once and kept for all rows; the saving is largest at one row, where the transpose's share is.
int8 weights held in :func:`tile_int8`'s order (the same tiles) go 16 features at a time the same way.
The product is then integer: on a CPU with AVX-512 VNNI one
``vpdpbusd`` multiplies 64 weight bytes by 64 input bytes and adds them in fours (the fp32 kernels of
:mod:`tightfit.kernels.quant_linear` convert every weight to float and spend an FMA on each). int8 weights:
``y = s * (x^ . q) + b`` exactly as ``F.linear(x^, W)``; int4 (torchao's tinygemm scheme,
``W = q s + (zero - 8 s)`` per group): ``y = x^ . (q s) + x . (zero - 8 s) + b``: the zero-point term takes the
fp32 ``x`` (its group sums), so only the ``q s`` part sees the rounding of ``x``.

Error bound against torchao's dequantised result ``F.linear(x, W)`` (held by tests/core/test_quant_linear_a8.py):
``|x^_k - x_k| <= d_b / 2 = max|x_block| / 254`` per input, so per output

    |y - F.linear(x, W)| <= sum_k |V_nk| * max|x_block(k)| / 254     (+ fp32 rounding)

with ``V = W`` for int8 and ``V = q s`` for int4. On random inputs the error stays far below that bound: the
inputs' rounding errors mostly cancel. The references below (PyTorch) compute ``x^`` the same way and are what the native
kernel is checked against (dispatcher self-check, tests) to fp32 rounding. The end-to-end bounds (KL, greedy
agreement on the trained fixture) hold with it: tests/energon_infer/test_quantization.py.

Where it runs: fp32 ``x`` of at most :data:`~tightfit.kernels.quant_linear.NATIVE_MAX_ROWS` rows, ``K % 64 == 0``
and (int4) ``group_size`` 64, 128 or a multiple of 256, on a CPU with AVX-512 F/BW/VNNI (the build is ``-march=native``: the
library reports whether it has the loops), unless ``TIGHTFIT_QUANT_ACTIVATIONS=fp32``. Elsewhere callers
keep the fp32 kernels (:func:`a8_applies` says which; energon's quantized projections ask it per call), so
AVX2-only and other CPUs run the fp32 kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tightfit.kernels.dispatch import register_kernel
from tightfit.kernels.native import native_enabled
from tightfit.kernels.quant_linear import (
    NATIVE_MAX_ROWS,
    _library,
    _native_error,
    _native_ok,
    dequantize_int8,
    unpack_int4,
)
from tightfit.kernels.weight_tiles import (
    TILE,
    check_tiled,
    check_tiled_int8,
    int4_tiles_apply,
    int8_tiles_apply,
    tile_int4,
    tile_int8,
    untile_int4,
    untile_int8,
)

__all__ = ["A8_BLOCK", "A8_WIDE_BLOCK", "A8_ENV_VAR", "activation_block", "a8_level", "a8_available", "a8_applies", "quantize_activations", "int8_linear_a8",
           "int4_linear_a8", "int8_linear_a8_reference", "int4_linear_a8_reference", "TILE", "int4_tiles_apply",
           "int8_tiles_apply", "tile_int4", "untile_int4", "tile_int8", "untile_int8"]

A8_BLOCK = 32  # inputs per activation scale (llama.cpp's Q8_0 block): int4 groups of 64, int8 with K % 128 != 0
A8_WIDE_BLOCK = 128  # int8 weights with K % 128 == 0, int4 groups of 128 or a multiple of 256
A8_ENV_VAR = "TIGHTFIT_QUANT_ACTIVATIONS"  # "fp32": callers asking a8_applies keep the fp32-activation kernels


@functools.cache
def a8_level() -> int:
    """Which native int8-activation kernel this CPU runs: 1 every layout (AVX-512 VNNI in the native build),
    2 tiled int4 per block of 128 only (AVX2 without AVX-512 VNNI), 0 none."""
    lib = _library() if native_enabled() else None
    return 0 if lib is None else int(lib.tf_a8_available())


def a8_available() -> bool:
    """Whether a native int8-activation kernel runs on this CPU (:func:`a8_level` above 0)."""
    return a8_level() > 0


@contextlib.contextmanager
def _kernel_rows(transposed: int | None = None, tiled_block: int | None = None) -> Iterator[None]:
    """Within: int4 calls (groups of 128 / a multiple of 256) of at least ``transposed`` rows take the
    16-feature transposed tiles on row-order weights (fewer: the 4 x 4 ones), and tiled weights
    (:func:`tile_int4`) of at least ``tiled_block`` rows the kernel that splits each block once for all rows
    (fewer: groups of four rows); ``NATIVE_MAX_ROWS + 1``: never. The tests run every kernel so."""
    lib = _library()
    old = [lib.tf_a8_set_rows(w, -1 if v is None else v) for w, v in enumerate((transposed, tiled_block))]
    try:
        yield
    finally:
        for w, v in enumerate(old):
            lib.tf_a8_set_rows(w, v)


def activation_block(k: int, group_size: int = 0) -> int:
    """Inputs per activation scale for ``k`` inputs: 128 for int8 weights (``group_size`` 0) where ``k % 128 == 0``
    and for int4 groups of 128 or a multiple of 256; else 32."""
    if group_size == 0:
        return A8_WIDE_BLOCK if k % A8_WIDE_BLOCK == 0 else A8_BLOCK
    return A8_WIDE_BLOCK if group_size == 128 or group_size % 256 == 0 else A8_BLOCK


def a8_applies(x: torch.Tensor, k: int, group_size: int = 0, tiled: bool = False) -> bool:
    """Whether :func:`int8_linear_a8` / :func:`int4_linear_a8` (``group_size`` > 0; ``tiled``: weights in
    :func:`tile_int8` / :func:`tile_int4`'s order) run natively for ``x``."""
    level = a8_level()
    return (x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= NATIVE_MAX_ROWS and k % 64 == 0
            and (group_size in (0, 64, 128) or group_size % 256 == 0) and not x.is_cuda
            and (level == 1 or (level == 2 and tiled and group_size >= 128))
            and os.environ.get(A8_ENV_VAR, "int8") != "fp32")


def quantize_activations(x: torch.Tensor, block: int = A8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, d)``: ``x (M, K)`` as int8 ``(M, K)`` and one fp32 scale per block of ``block`` inputs
    ``(M, K / block)``."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(-1)
    # torch.full_like(...) / amax divides once; `127.0 / amax` is reciprocal(amax) * 127 (two roundings), an ulp
    # off the kernel's division, which flips x * inv where it lies within an ulp of a rounding tie
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return xq.reshape(m, k), amax / 127.0


def _dequantize_activations(x: torch.Tensor, block: int = A8_BLOCK) -> torch.Tensor:
    xq, d = quantize_activations(x, block)
    m, k = x.shape
    return (xq.float().reshape(m, k // block, block) * d[..., None]).reshape(m, k)


def int8_linear_a8_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                             bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    xd = _dequantize_activations(x, activation_block(x.shape[1]))
    q = untile_int8(qweight) if tiled else qweight
    return F.linear(xd, dequantize_int8(q, scale, torch.float32), bias).to(x.dtype)


def int4_linear_a8_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                             group_size: int, bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    q = unpack_int4(untile_int4(packed) if tiled else packed, group_size).float()
    n, k = q.shape
    ng = k // group_size
    qs = (q.reshape(n, ng, group_size) * scale.float()[:, :, None]).reshape(n, k)
    xf = x.float()
    y = F.linear(_dequantize_activations(xf, activation_block(k, group_size)), qs, bias) + xf.reshape(
        -1, ng, group_size).sum(-1) @ (
        zero.float() - 8.0 * scale.float()).t()
    return y.to(x.dtype)


def _call(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
          bias: torch.Tensor | None, n: int, k: int, tiled: bool = False) -> torch.Tensor | None:
    if not (a8_applies(x, k, group_size, tiled) and _native_ok(x, q, scale, zero, bias) and scale.dtype == torch.float32
            and (zero is None or zero.dtype == torch.float32) and (bias is None or bias.dtype == torch.float32)):
        return None
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    rc = _library().tf_a8_linear_f32(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(),
                                     None if zero is None else zero.data_ptr(),
                                     None if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0], n, k,
                                     group_size, int(tiled), torch.get_num_threads())
    if rc == -1:
        raise MemoryError(f"int{8 if zero is None else 4}_linear_a8: no memory for {x.shape[0]} x {k} int8 inputs")
    return y if rc == 0 else None


def _int8_native(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    y = _call(x, qweight, scale, None, 0, bias, qweight.shape[0], qweight.shape[1], tiled)
    return int8_linear_a8_reference(x, qweight, scale, bias, tiled) if y is None else y


def _int4_native(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    y = _call(x, packed, scale, zero, group_size, bias, packed.shape[0], packed.shape[1] * 2, tiled)
    return int4_linear_a8_reference(x, packed, scale, zero, group_size, bias, tiled) if y is None else y


def _probe_x(x: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(min(x.shape[0], 5), x.shape[1], generator=gen).to(x.dtype)


def _int8_class(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                tiled: bool = False) -> tuple:
    return (str(x.dtype), tuple(qweight.shape), bias is None, tiled)


def _int4_class(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, tiled: bool = False) -> tuple:
    return (str(x.dtype), tuple(packed.shape), group_size, bias is None, tiled)


_int8 = register_kernel(
    "int8_linear_a8", reference=int8_linear_a8_reference, triton=None, native=_int8_native, native_error=_native_error,
    doc="x (int8 per block of 32) @ (int8 weight * per-row scale)^T + bias", shape_class=_int8_class,
    probe=lambda x, q, s, b=None, t=False: ((_probe_x(x), q, s, b, t), {}))
_int4 = register_kernel(
    "int4_linear_a8", reference=int4_linear_a8_reference, triton=None, native=_int4_native, native_error=_native_error,
    doc="x (int8 per block of 32) @ dequantised int4 weight^T + bias", shape_class=_int4_class,
    probe=lambda x, p, s, z, g, b=None, t=False: ((_probe_x(x), p, s, z, g, b, t), {}))


def _check_k(name: str, x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or k % A8_BLOCK:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be 2-D with {k} inputs (the weight's), a multiple of "
                         f"{A8_BLOCK} (one activation scale per block of {A8_BLOCK}); use the fp32-activation "
                         f"kernel (tightfit.kernels.quant_linear) for this shape")


def int8_linear_a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   *, tiled: bool = False, backend: str | None = None) -> torch.Tensor:
    """:func:`~tightfit.kernels.quant_linear.int8_linear` with ``x`` quantised to int8 per block (module docstring);
    ``tiled``: ``qweight`` is in :func:`tile_int8`'s order."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.numel() != qweight.shape[0]:
        raise ValueError(f"int8_linear_a8: needs an int8 qweight (N, K) and N scales; got qweight {qweight.dtype} "
                         f"{tuple(qweight.shape)}, scale {tuple(scale.shape)}")
    if tiled:
        check_tiled_int8("int8_linear_a8", *qweight.shape)
    _check_k("int8_linear_a8", x, qweight.shape[1])
    return _int8(x, qweight, scale, bias, tiled, backend=backend)


def int4_linear_a8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None = None, *, tiled: bool = False, backend: str | None = None) -> torch.Tensor:
    """:func:`~tightfit.kernels.quant_linear.int4_linear` with ``x`` quantised to int8 per block (module docstring);
    ``tiled``: ``packed`` is in :func:`tile_int4`'s order."""
    n, half = packed.shape if packed.dim() == 2 else (0, 0)
    k = half * 2
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or group_size < 2 or group_size % 2 or k % group_size
            or tuple(scale.shape) != (n, k // group_size) or scale.shape != zero.shape):
        raise ValueError(f"int4_linear_a8: needs a uint8 packed weight (N, K/2), an even group_size dividing K and "
                         f"scale/zero (N, K / group_size); got packed {packed.dtype} {tuple(packed.shape)}, "
                         f"group_size {group_size}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)}")
    if tiled:
        check_tiled("int4_linear_a8", n, k, group_size)
    _check_k("int4_linear_a8", x, k)
    return _int4(x, packed, scale, zero, group_size, bias, tiled, backend=backend)
