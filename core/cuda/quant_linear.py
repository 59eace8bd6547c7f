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

Why a native CPU kernel: a decode step multiplies a few rows by every weight, so it is bound by the bytes of
weight read. torchao's CPU paths on this machine's torch 2.13 are slower than fp32 there (one 1024 x 1024
projection, 1 / 8 / 32 rows, us: fp32 ``F.linear`` 1587 / 225 / 7738 on a loaded machine; ``Int8Tensor``
2732 / 6177 / 15762; the tinygemm int4 ``Int4OpaqueTensor`` 6527 / 16192 / 61445). This kernel dequantises
inside the dot products (each weight byte is read once per call, converted in registers) and splits the
output features over ``torch.get_num_threads()`` POSIX threads. It runs for fp32 inputs of up to
:data:`NATIVE_MAX_ROWS` rows; above that (prefill) the native backend dequantises the weight in C (all threads)
and multiplies with BLAS, whose blocked matmul wins once the weight's bytes are amortised over many rows (the
pure-PyTorch dequantisation of a 2048 x 5632 weight alone took ~60 ms here). Other dtypes run the reference.
Figures: benchmarks/energon_quant.py.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.nn.functional as F

from tightfit.cuda.dispatch import register_kernel
from tightfit.cuda.native import load_functions, native_error

__all__ = ["NATIVE_MAX_ROWS", "INT4_GROUP_SIZES", "int8_linear", "int8_linear_reference", "int4_linear",
           "int4_linear_reference", "pack_int4", "unpack_int4", "dequantize_int4", "dequantize_int8"]

NATIVE_MAX_ROWS = 32  # rows up to which the native kernel runs (above: dequantise + BLAS)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # torchao's int4 group sizes

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_THREADS 64

typedef struct {
    const float *x, *scale, *zero, *bias, *xsum;
    const void *w;
    float *y;
    int64_t xs, M, N, K, G, n0, n1;
} job_t;

/* int8: y[m, n] = scale[n] * sum_k x[m, k] q[n, k] + bias[n]; four rows share each pass over q[n]. */
static void *int8_range(void *arg) {
    const job_t *j = arg;
    const int8_t *W = j->w;
    const int64_t K = j->K, N = j->N, M = j->M, xs = j->xs;
    for (int64_t n = j->n0; n < j->n1; n++) {
        const int8_t *q = W + n * K;
        const float s = j->scale[n], b = j->bias ? j->bias[n] : 0.f;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const float *x0 = j->x + m * xs, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const float w = (float)q[k];
                a0 += x0[k] * w; a1 += x1[k] * w; a2 += x2[k] * w; a3 += x3[k] * w;
            }
            j->y[m * N + n] = a0 * s + b; j->y[(m + 1) * N + n] = a1 * s + b;
            j->y[(m + 2) * N + n] = a2 * s + b; j->y[(m + 3) * N + n] = a3 * s + b;
        }
        for (; m < M; m++) {
            const float *x0 = j->x + m * xs;
            float a0 = 0.f;
            for (int64_t k = 0; k < K; k++) a0 += x0[k] * (float)q[k];
            j->y[m * N + n] = a0 * s + b;
        }
    }
    return NULL;
}

/* int4: W[n, k] = (q - 8) * scale[n, g] + zero[n, g] = q * s + (zero - 8 s), so per group
   y += s * dot(x_g, q_g) + (zero - 8 s) * sum(x_g), with sum(x_g) = xsum[m, g] computed once per call.
   Byte j of a group holds element j (low nibble) and element j + G/2 (high nibble). */
static void *int4_range(void *arg) {
    const job_t *j = arg;
    const uint8_t *W = j->w;
    const int64_t K = j->K, N = j->N, M = j->M, xs = j->xs, G = j->G, H = G / 2, ng = K / G;
    for (int64_t n = j->n0; n < j->n1; n++) {
        const uint8_t *row = W + n * (K / 2);
        const float *sc = j->scale + n * ng, *zc = j->zero + n * ng;
        const float b = j->bias ? j->bias[n] : 0.f;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const float *x0 = j->x + m * xs, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
            const float *s0 = j->xsum + m * ng;
            float y0 = b, y1 = b, y2 = b, y3 = b;
            for (int64_t g = 0; g < ng; g++) {
                const uint8_t *p = row + g * H;
                const int64_t o = g * G;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
                for (int64_t i = 0; i < H; i++) {
                    const float lo = (float)(p[i] & 15), hi = (float)(p[i] >> 4);
                    a0 += x0[o + i] * lo + x0[o + H + i] * hi;
                    a1 += x1[o + i] * lo + x1[o + H + i] * hi;
                    a2 += x2[o + i] * lo + x2[o + H + i] * hi;
                    a3 += x3[o + i] * lo + x3[o + H + i] * hi;
                }
                const float s = sc[g], c = zc[g] - 8.f * s;
                y0 += a0 * s + c * s0[g]; y1 += a1 * s + c * s0[ng + g];
                y2 += a2 * s + c * s0[2 * ng + g]; y3 += a3 * s + c * s0[3 * ng + g];
            }
            j->y[m * N + n] = y0; j->y[(m + 1) * N + n] = y1; j->y[(m + 2) * N + n] = y2; j->y[(m + 3) * N + n] = y3;
        }
        for (; m < M; m++) {
            const float *x0 = j->x + m * xs, *s0 = j->xsum + m * ng;
            float y0 = b;
            for (int64_t g = 0; g < ng; g++) {
                const uint8_t *p = row + g * H;
                const int64_t o = g * G;
                float a0 = 0.f;
                for (int64_t i = 0; i < H; i++)
                    a0 += x0[o + i] * (float)(p[i] & 15) + x0[o + H + i] * (float)(p[i] >> 4);
                const float s = sc[g];
                y0 += a0 * s + (zc[g] - 8.f * s) * s0[g];
            }
            j->y[m * N + n] = y0;
        }
    }
    return NULL;
}

static int run(void *(*fn)(void *), job_t base, int64_t threads) {
    /* A thread per ~4M multiply-adds: a thread started per call waits for a core, which on a busy machine costs
       ms (decode steps of the benchmark model at batch 1 had 16-78 tokens/s with a thread per 150k, interleaved
       with fp32's steady 89-95); one thread streams a few MB of int8 at memory speed anyway. */
    const int64_t N = base.N, enough = 1 + base.M * N * base.K / 4000000;
    if (threads > enough) threads = enough;
    if (threads > N) threads = N;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) {
        fn(&base);
        return 0;
    }
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].n0 = N * t / threads;
        jobs[t].n1 = N * (t + 1) / threads;
        started[t] = t > 0 && pthread_create(&tid[t], NULL, fn, &jobs[t]) == 0;
    }
    fn(&jobs[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else fn(&jobs[t]); /* could not start it: do its share here */
    }
    return 0;
}

/* Dequantise rows [n0, n1) into out (N, K) fp32: the prefill path (many rows) multiplies that with BLAS. */
static void *dequant_range(void *arg) {
    const job_t *j = arg;
    const int64_t K = j->K, G = j->G;
    for (int64_t n = j->n0; n < j->n1; n++) {
        float *o = j->y + n * K;
        if (G == 0) {
            const int8_t *q = (const int8_t *)j->w + n * K;
            const float s = j->scale[n];
            for (int64_t k = 0; k < K; k++) o[k] = (float)q[k] * s;
        } else {
            const uint8_t *row = (const uint8_t *)j->w + n * (K / 2);
            const int64_t H = G / 2, ng = K / G;
            for (int64_t g = 0; g < ng; g++) {
                const uint8_t *p = row + g * H;
                const float s = j->scale[n * ng + g], c = j->zero[n * ng + g] - 8.f * s;
                float *og = o + g * G;
                for (int64_t i = 0; i < H; i++) {
                    og[i] = (float)(p[i] & 15) * s + c;
                    og[H + i] = (float)(p[i] >> 4) * s + c;
                }
            }
        }
    }
    return NULL;
}

int tf_dequantize_f32(const void *q, const float *scale, const float *zero, float *out, int64_t N, int64_t K,
                      int64_t G, int64_t threads) {
    job_t j = {NULL, scale, zero, NULL, NULL, q, out, 0, 1, N, K, G, 0, N};
    return run(dequant_range, j, threads);
}

int tf_int8_linear_f32(const float *x, int64_t xs, const int8_t *q, const float *scale, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t threads) {
    job_t j = {x, scale, NULL, bias, NULL, q, y, xs, M, N, K, 0, 0, N};
    return run(int8_range, j, threads);
}

int tf_int4_linear_f32(const float *x, int64_t xs, const uint8_t *q, const float *scale, const float *zero,
                       const float *bias, const float *xsum, float *y, int64_t M, int64_t N, int64_t K, int64_t G,
                       int64_t threads) {
    job_t j = {x, scale, zero, bias, xsum, q, y, xs, M, N, K, G, 0, N};
    return run(int4_range, j, threads);
}
"""

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> Any:
    return load_functions("quant_linear", _SOURCE, (
        ("tf_int8_linear_f32", ctypes.c_int, (_P, _I, _P, _P, _P, _P, _I, _I, _I, _I)),
        ("tf_int4_linear_f32", ctypes.c_int, (_P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I)),
        ("tf_dequantize_f32", ctypes.c_int, (_P, _P, _P, _P, _I, _I, _I, _I))))


def _dequantize_native(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
                       ) -> torch.Tensor:
    """The fp32 ``(N, K)`` weight, dequantised in C over all threads (int8 when ``zero`` is None)."""
    n, k = q.shape[0], q.shape[1] * (1 if zero is None else 2)
    out = torch.empty((n, k), dtype=torch.float32)
    _library().tf_dequantize_f32(q.data_ptr(), scale.data_ptr(), None if zero is None else zero.data_ptr(),
                                 out.data_ptr(), n, k, 0 if zero is None else group_size, torch.get_num_threads())
    return out


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
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_int8(qweight, scale, x.dtype), bias)


def _native_ok(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    return (x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1
            and all(t is None or (t.dtype in (torch.float32, torch.int8, torch.uint8) and t.is_contiguous())
                    for t in tensors))


def _int8_native(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if not _native_ok(x, qweight, scale, bias) or scale.dtype != torch.float32 or (
            bias is not None and bias.dtype != torch.float32):
        return int8_linear_reference(x, qweight, scale, bias)
    if x.shape[0] > NATIVE_MAX_ROWS:
        return F.linear(x, _dequantize_native(qweight, scale, None, 0), bias)
    n, k = qweight.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    _library().tf_int8_linear_f32(x.data_ptr(), x.stride(0), qweight.data_ptr(), scale.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, y.data_ptr(), x.shape[0], n, k,
                                  torch.get_num_threads())
    return y


def _probe_rows(x: torch.Tensor) -> int:
    # A few rows for the decode class, just past the threshold for the prefill class (dequantise + BLAS).
    return min(x.shape[0], 5) if x.shape[0] <= NATIVE_MAX_ROWS else NATIVE_MAX_ROWS + 1


def _int8_class(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple:
    return (str(x.dtype), x.shape[0] <= NATIVE_MAX_ROWS, tuple(qweight.shape), bias is None)


def _int8_probe(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(0)
    xp = torch.randn(_probe_rows(x), x.shape[1], generator=gen).to(x.dtype)
    return (xp, qweight, scale, bias), {}


_int8 = register_kernel("int8_linear", reference=int8_linear_reference, triton=None,
                        doc="x @ (int8 weight * per-row scale)^T + bias (weight-only int8)",
                        shape_class=_int8_class, probe=_int8_probe, native=_int8_native, native_error=_native_error)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                backend: str | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T + bias`` for ``x (M, K)``, ``qweight (N, K)`` int8, ``scale (N,)``."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or x.shape[-1] != qweight.shape[1] or \
            scale.numel() != qweight.shape[0]:
        raise ValueError(f"int8_linear: x {tuple(x.shape)} needs an int8 qweight (N, {x.shape[-1]}) and N scales; got "
                         f"qweight {qweight.dtype} {tuple(qweight.shape)}, scale {tuple(scale.shape)}")
    return _int8(x, qweight, scale, bias, backend=backend)


# --------------------------------------------------------------------------- int4


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_int4(packed, scale, zero, group_size, x.dtype), bias)


def _int4_native(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if (not _native_ok(x, packed, scale, zero, bias) or scale.dtype != torch.float32 or zero.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32)):
        return int4_linear_reference(x, packed, scale, zero, group_size, bias)
    if x.shape[0] > NATIVE_MAX_ROWS:
        return F.linear(x, _dequantize_native(packed, scale, zero, group_size), bias)
    n, k = packed.shape[0], packed.shape[1] * 2
    m = x.shape[0]
    xsum = x.reshape(m, k // group_size, group_size).sum(-1).contiguous()
    y = torch.empty((m, n), dtype=torch.float32)
    _library().tf_int4_linear_f32(x.data_ptr(), x.stride(0), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, xsum.data_ptr(), y.data_ptr(),
                                  m, n, k, group_size, torch.get_num_threads())
    return y


def _int4_class(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> tuple:
    return (str(x.dtype), x.shape[0] <= NATIVE_MAX_ROWS, tuple(packed.shape), group_size, bias is None)


def _int4_probe(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(0)
    xp = torch.randn(_probe_rows(x), x.shape[1], generator=gen).to(x.dtype)
    return (xp, packed, scale, zero, group_size, bias), {}


_int4 = register_kernel("int4_linear", reference=int4_linear_reference, triton=None,
                        doc="x @ dequantised int4 weight^T + bias (weight-only int4, torchao's tinygemm scheme)",
                        shape_class=_int4_class, probe=_int4_probe, native=_int4_native, native_error=_native_error)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, *, backend: str | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W = (q - 8) * scale + zero`` per row and group of ``group_size`` inputs.

    ``packed``: :func:`pack_int4` of ``q`` ``(N, K)``; ``scale``, ``zero``: ``(N, K / group_size)``.
    """
    n, half = packed.shape if packed.dim() == 2 else (0, 0)
    k = half * 2
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or x.shape[-1] != k or group_size < 2 or group_size % 2
            or k % group_size or tuple(scale.shape) != (n, k // max(group_size, 1)) or scale.shape != zero.shape):
        raise ValueError(
            f"int4_linear: x {tuple(x.shape)} needs a uint8 packed weight (N, {x.shape[-1] // 2}), an even group_size "
            f"dividing {x.shape[-1]} and scale/zero (N, K / group_size); got packed {packed.dtype} "
            f"{tuple(packed.shape)}, group_size {group_size}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)}")
    return _int4(x, packed, scale, zero, group_size, bias, backend=backend)
