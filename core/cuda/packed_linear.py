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
than :data:`MIN_NUMEL` elements are not packed for decode-sized inputs. From :data:`SMALL_MIN_ROWS` rows on they
earn it back (2 threads, F.linear / packed us: 256x256 at 64 rows 45/30, 256 rows 154/78, 1900 rows 1116/484;
128x256 at 64 rows 24/19, 1900 rows 562/250; at 32 rows even, 14/15): :func:`rows_worth_packing` says from how
many rows a weight's packed copy is the faster one, down to weights of :data:`SMALL_NUMEL` elements. The
every-core benchmark's LLaMA 6 x 256 multiplies its 256 x 256 out projection by ~1900 rows a prefill chunk.

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

__all__ = ["ACTIVATIONS", "MIN_NUMEL", "MIN_ROWS", "PACKABLE_DTYPES", "SMALL_MIN_ROWS", "SMALL_NUMEL", "apply_activation",
           "packing_available", "pack_linear_weight", "packed_linear", "rows_worth_packing"]

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
MIN_ROWS = 2  # one row: F.linear is as fast (see the module docstring)
MIN_NUMEL = 1 << 17  # smaller weights: F.linear is as fast (see the module docstring)
SMALL_NUMEL = 1 << 15  # weights of SMALL_NUMEL to MIN_NUMEL elements: packed, used from SMALL_MIN_ROWS rows
SMALL_MIN_ROWS = 64
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


def rows_worth_packing(numel: int) -> int | None:
    """The fewest input rows from which a packed copy of a weight of ``numel`` elements beats ``F.linear``:
    :data:`MIN_ROWS` from :data:`MIN_NUMEL` elements, :data:`SMALL_MIN_ROWS` from :data:`SMALL_NUMEL`, ``None``
    (never worth a copy) below that. See the module docstring for the measurements."""
    if numel >= MIN_NUMEL:
        return MIN_ROWS
    return SMALL_MIN_ROWS if numel >= SMALL_NUMEL else None


def pack_linear_weight(weight: torch.Tensor, *, min_numel: int | None = None) -> torch.Tensor | None:
    """The ``(out, in)`` ``weight`` reordered for :func:`packed_linear`, or ``None`` where that cannot help.

    ``None`` for a weight too small to earn a packed copy at any row count (:func:`rows_worth_packing`; a
    caller's own ``min_numel`` elements instead where given), one that is not a 2-D CPU tensor of a :data:`PACKABLE_DTYPES` dtype, where
    :func:`packing_available` says no, for a weight with NaN or infinite entries (which no probe can check),
    or where the packed copy disagrees with ``F.linear`` on a probe (logged once per dtype on
    ``tightfit.cuda.packed_linear``; the caller then keeps ``F.linear``).
    """
    if (weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES
            or weight.is_mkldnn or not packing_available()):
        return None
    if (rows_worth_packing(weight.numel()) is None if min_numel is None
            else weight.numel() < max(1, min_numel)):
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
    if not _agrees(got, want, w.dtype, scale=float(want.abs().max().clamp_min(1.0))):
        _warn_once(f"check:{w.dtype}", f"oneDNN packed linear disagrees with F.linear for {w.dtype} "
                   f"(max error {(got - want).abs().max().item():.3g}); F.linear is used")
        return None
    return packed


#: activation -> (oneDNN post-op, algorithm) fused into the product's epilogue, and the PyTorch it stands for.
ACTIVATIONS = {
    "gelu_tanh": ("gelu", "tanh", lambda y: F.gelu(y, approximate="tanh")),
    "gelu": ("gelu", "none", F.gelu),
    "relu": ("relu", "", F.relu),
}


def apply_activation(y: torch.Tensor, activation: str) -> torch.Tensor:
    """``y`` through :data:`ACTIVATIONS`' ``activation`` (``""``: unchanged), as PyTorch computes it."""
    return ACTIVATIONS[activation][2](y) if activation else y


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str = "") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from the weight :func:`pack_linear_weight` returned (``x``: ``(..., in)``),
    then ``activation`` (a key of :data:`ACTIVATIONS`, ``""`` for none).

    The activation runs in oneDNN's epilogue, on the output while it is in cache. Measured here, 2 threads, a
    256 -> 1024 projection with bias and tanh GELU (GPT-2's MLP up projection at hidden 256): 32 rows 97 -> 58 us,
    512 rows 1169 -> 602 us, 3000 rows 6.8 -> 3.4 ms, against the product alone 51, 528 and 3012 us: PyTorch's
    separate ``gelu`` cost as much as the product. Where the fused result disagrees with PyTorch's on a probe (checked
    once per activation and dtype), the activation runs separately.
    """
    fused = bool(activation) and _fuses(activation, packed.dtype)
    attr, algorithm = ACTIVATIONS[activation][:2] if fused else ("none", "")
    y = torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, attr, [], algorithm)
    return y if fused else apply_activation(y, activation)


def _agrees(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, *, scale: float = 1.0) -> bool:
    """Whether oneDNN's ``got`` matches PyTorch's fp32 ``want`` within ``dtype``'s tolerance (absolute: ``scale``)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * scale))


_FUSES: dict[tuple[str, torch.dtype], bool] = {}


def _fuses(activation: str, dtype: torch.dtype) -> bool:
    """Whether oneDNN's fused ``activation`` matches PyTorch's on a probe (cached per activation and dtype)."""
    key = (activation, dtype)
    if key not in _FUSES:
        attr, algorithm, ref = ACTIVATIONS[activation]
        w = torch.linspace(-1.0, 1.0, 64 * 32, dtype=torch.float32).view(64, 32).to(dtype)
        probe = torch.linspace(-3.0, 3.0, 5 * 32, dtype=torch.float32).view(5, 32).to(dtype)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            got = torch.ops.mkldnn._linear_pointwise.default(probe, packed, None, attr, [], algorithm).float()
            _FUSES[key] = _agrees(got, ref(F.linear(probe.float(), w.float())), dtype)
        except (RuntimeError, TypeError):
            _FUSES[key] = False
        if not _FUSES[key]:
            _warn_once(f"fuse:{activation}:{dtype}", f"oneDNN's fused {activation} disagrees with PyTorch's for "
                       f"{dtype}; the activation runs separately")
    return _FUSES[key]
