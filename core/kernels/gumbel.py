"""Gumbel-max sampling with counter-based noise: one draw from each row's softmax, in one pass over the row.

    u = counter_uniform(seeds, positions, vocab)    # (B, V) uniforms: a pure function of (seed, position, column)
    idx = gumbel_argmax(scores, seeds, positions)   # (B,): argmax_j scores[b, j] - log(-log(u[b, j]))

``argmax(scores - log(-log(u)))`` is exactly a draw from ``softmax(scores)``. The noise is a hash of the row's
seed, its position and the column, so a row draws the same token whatever else is in the batch and whatever
ran before it (a preemption, a prefill split into chunks), with no generator state to keep.

The uniforms are ``(k + 1/2) / 2**23`` for a 23-bit hash ``k``: every one is exact in fp32 and lies in
``[2**-24, 1 - 2**-24]``, so the noise is finite (a ``u`` that rounded to 1 would give ``+inf`` and pick its
column whatever the scores, a filtered-out one included).

In PyTorch the noise is two dozen int64 element-wise ops over the whole ``(B, V)`` batch, then two logs. The native
CPU backend (``core/kernels/cpu/gumbel.c``, built by :mod:`tightfit.kernels.native`) hashes in 32-bit lanes
(the hash keeps 31 bits, so the low halves of the products suffice) and takes the argmax in the same call.
Its logs are the C library's vectorised ones rather than PyTorch's, so a draw can differ from the
reference's only where two columns' noisy scores tie to the last bit. On CUDA the reference runs.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from tightfit.kernels.dispatch import register_kernel
from tightfit.kernels.native import load_kernel, native_error

__all__ = ["counter_uniform", "first_max", "gumbel_argmax", "gumbel_argmax_reference"]

_M31 = 0x7FFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 31-bit values (int64 tensors; products stay below 2**58, so nothing overflows)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(B, vocab)`` fp32 uniforms in ``[2**-24, 1 - 2**-24]``, a pure function of each row's ``(seed,
    position)`` (non-negative int64, ``(B,)``) and the column."""
    dev = seeds.device
    key = _mix((seeds ^ (seeds >> 31)) & _M31)
    key = _mix(key ^ _mix((positions * 0x2545F491) & _M31))
    cols = (torch.arange(vocab, device=dev, dtype=torch.long) * 0x9E3779B1) & _M31
    x = _mix(_mix((key[:, None] ^ cols[None, :]) & _M31) ^ key[:, None])
    return ((x >> 8).float() + 0.5) * 2.0 ** -23


def first_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index, like ``argmax`` (a NaN counts as the maximum); ``max(dim).indices`` is the
    same index and, on CPU, the faster kernel."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


def gumbel_argmax_reference(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    gumbel = -torch.log(-torch.log(counter_uniform(seeds, positions, scores.shape[-1])))
    return first_max(scores.float() + gumbel)



_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> Any:
    return load_kernel("gumbel", (("tf_gumbel_argmax_f32", None, (_P, _I, _P, _P, _I, _I, _P, _P)),))


def _native_error() -> str:
    return "" if _library() is not None else native_error("gumbel") or "not built"


def _gumbel_argmax_native(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        scores = scores.float().contiguous()
    seeds = seeds.to(torch.long).contiguous()
    positions = positions.to(torch.long).contiguous()
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.long)
    work = torch.empty(vocab, dtype=torch.float32)
    _library().tf_gumbel_argmax_f32(scores.data_ptr(), scores.stride(0), seeds.data_ptr(), positions.data_ptr(),
                                    rows, vocab, work.data_ptr(), out.data_ptr())
    return out


def _class(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> tuple:
    return (str(scores.dtype), scores.shape[-1])


def _probe(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> tuple[tuple, dict]:
    gen = torch.Generator(device=scores.device).manual_seed(0)
    probe = (torch.randn(4, scores.shape[-1], generator=gen, device=scores.device) * 3).to(scores.dtype)
    return (probe, torch.tensor([1, 2, 3, 4 << 40], device=scores.device),
            torch.tensor([0, 7, 100, 4095], device=scores.device)), {}


_gumbel_argmax = register_kernel("gumbel_argmax", reference=gumbel_argmax_reference, triton=None,
                                 doc="one Gumbel-max draw per row with counter-based noise of (seed, position)",
                                 shape_class=_class, probe=_probe, native=_gumbel_argmax_native,
                                 native_error=_native_error)


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                  backend: str | None = None) -> torch.Tensor:
    """One draw per row of ``scores`` ``(B, V)`` (logits already divided by the temperature; ``-inf`` for
    tokens that cannot be drawn) from its softmax: ``argmax(scores - log(-log(counter_uniform(...))))``.
    ``seeds`` and ``positions``: ``(B,)`` non-negative integers."""
    if scores.dim() != 2 or seeds.shape != (scores.shape[0],) or positions.shape != (scores.shape[0],):
        raise ValueError(f"gumbel_argmax: scores must be (B, V) with seeds and positions (B,); got "
                         f"{tuple(scores.shape)}, {tuple(seeds.shape)} and {tuple(positions.shape)}")
    if scores.shape[1] == 0:
        raise ValueError("gumbel_argmax: scores has no columns; a row needs at least one token to draw")
    return _gumbel_argmax(scores, seeds, positions, backend=backend)
