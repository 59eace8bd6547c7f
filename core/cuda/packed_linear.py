"""CPU linear layers whose weights are reordered once into oneDNN's blocked layout.

``F.linear`` on the CPU hands a plain row-major weight to the BLAS on every call. For the few rows of
a decode step the BLAS spends much of the call repacking that weight into the panels its kernel
reads; oneDNN (bundled with PyTorch as ``mkldnn``) can do that reordering once, ahead of time, and
then multiply straight from the blocked copy. Measured on one thread here (AMD EPYC, AVX-512) over
the energon benchmark model's 25 projections per step (21 MB of fp32 weights):

    rows       1     4     8     16    32    64   256    1024
    F.linear  1.16  2.43  3.13  3.81  6.07  9.83  32.2  113.8 ms
    packed    1.18  1.44  2.00  2.53  4.16  7.42  27.7  103.2 ms

At one or two rows the BLAS's matrix-vector path is as fast or faster (another run: 0.75 vs 1.04 ms at 1 row,
1.43 vs 1.48 at 2, 2.29 vs 1.42 at 3), so callers keep ``F.linear`` below :data:`MIN_ROWS` rows. Two rows pack:
with the 25 projections' 50 MB of distinct weights of the serving benchmark's 6 x 384 LLaMA (cold in the caches,
as in a real decode step), F.linear / packed took 4.38 / 3.97 ms at 2 rows on one thread and 4.90 / 2.97 on two
(2.56 / 2.74 at 1 row on two threads: one row stays with the BLAS). Each packed
call also pays ~11 us of fixed oneDNN overhead, which small weights do not earn back (one projection, weights
in cache, F.linear / packed us at 4 and 16 rows: 64x64 2.8/14.1, 15.6/14.7; 256x256 12.4/17.7, 28.0/32.3;
256x512 28.5/25.4, 62.2/59.1; 256x1344 62.3/45.0, 143/117; 256x4096 252/100, 508/319), so weights of fewer
than :data:`MIN_NUMEL` elements are not packed.

The same reorder and op back ``torch.compile``'s CPU weight freezing (``mkldnn::_reorder_linear_weight``,
``mkldnn::_linear_pointwise``); they are PyTorch-internal, so everything here degrades to ``None``
(the caller keeps ``F.linear``) where they are missing, where oneDNN is not built in, or where a packed
weight does not reproduce ``F.linear`` on a probe input at pack time.

    packed = pack_linear_weight(weight)          # None: keep using F.linear(x, weight, bias)
    y = packed_linear(x, packed, bias)

A packed weight is a second copy: the caller keeps the plain tensor (checkpoint loading, memory pools and
``state_dict`` read it) and must drop the packed one when the plain one changes. ``TIGHTFIT_KERNELS=reference``
turns packing off with the other CPU kernels, so an A/B against plain PyTorch is one environment variable.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from tightfit.cuda.dispatch import forced_backend

__all__ = ["MIN_NUMEL", "MIN_ROWS", "PACKABLE_DTYPES", "packing_available", "pack_linear_weight", "packed_linear"]

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
MIN_ROWS = 2  # one row: F.linear is as fast (see the module docstring)
MIN_NUMEL = 1 << 17  # smaller weights: F.linear is as fast (see the module docstring)
log = logging.getLogger(__name__)
_WARNED: set[str] = set()


def packing_available() -> bool:
    """Whether oneDNN weight packing can be used in this process (built in, ops present, not turned off)."""
    if forced_backend() == "reference" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


def pack_linear_weight(weight: torch.Tensor, *, min_numel: int | None = None) -> torch.Tensor | None:
    """The ``(out, in)`` ``weight`` reordered for :func:`packed_linear`, or ``None`` where that cannot help.

    ``None`` for a weight of fewer than ``min_numel`` elements (default :data:`MIN_NUMEL`), one that is
    not a 2-D CPU tensor of a :data:`PACKABLE_DTYPES` dtype, where
    :func:`packing_available` says no, for a weight with NaN or infinite entries (which no probe can check),
    or where the packed copy disagrees with ``F.linear`` on a probe (logged once per dtype on
    ``tightfit.cuda.packed_linear``; the caller then keeps ``F.linear``).
    """
    if (weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES
            or weight.is_mkldnn or weight.numel() < max(1, MIN_NUMEL if min_numel is None else min_numel)
            or not packing_available()):
        return None
    w = weight.detach()
    if not bool(torch.isfinite(w).all()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        probe = torch.linspace(-1.0, 1.0, 3 * w.shape[1], dtype=torch.float32).view(3, -1).to(w.dtype)
        got = packed_linear(probe, packed).float()
    except (RuntimeError, TypeError) as exc:
        _warn_once(f"error:{w.dtype}", f"oneDNN weight packing failed for {w.dtype} ({exc}); F.linear is used")
        return None
    want = F.linear(probe.float(), w.float())
    tol = 1e-4 if w.dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp_min(1.0))):
        _warn_once(f"check:{w.dtype}", f"oneDNN packed linear disagrees with F.linear for {w.dtype} "
                   f"(max error {(got - want).abs().max().item():.3g}); F.linear is used")
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from the weight :func:`pack_linear_weight` returned (``x``: ``(..., in)``)."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")
