"""CPU linear layers whose weights are reordered once into oneDNN's blocked layout.

``F.linear`` on the CPU hands a plain row-major weight to the BLAS on every call. For the few rows of
a decode step the BLAS spends much of the call repacking that weight into the panels its kernel
reads; oneDNN (bundled with PyTorch as ``mkldnn``) can do that reordering once, ahead of time, and
then multiply straight from the blocked copy. Timed over the energon benchmark models' projections (one and two
threads, weights cold in the caches as in a real decode step), the packed copy is faster from a few rows up to thousands
of rows, most of all at a decode batch's handful:

* at one row the BLAS's matrix-vector path is as fast or faster, so callers keep ``F.linear`` below
  :data:`MIN_ROWS` rows; from two rows packing pays, more so on two threads than on one;
* each packed call also pays a fixed oneDNN overhead (microseconds), which small weights do not earn back at
  decode-sized inputs, so weights of fewer than :data:`MIN_NUMEL` elements are not packed for those;
* from :data:`SMALL_MIN_ROWS` rows on (a prefill chunk's hundreds to thousands of rows) they earn it back down to
  weights of :data:`SMALL_NUMEL` elements: :func:`rows_worth_packing` says from how many rows a weight's packed
  copy is the faster one.

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

from tightfit.kernels.dispatch import forced_backend

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
    (never worth a copy) below that. The module docstring says why."""
    if numel >= MIN_NUMEL:
        return MIN_ROWS
    return SMALL_MIN_ROWS if numel >= SMALL_NUMEL else None


def pack_linear_weight(weight: torch.Tensor, *, min_numel: int | None = None) -> torch.Tensor | None:
    """The ``(out, in)`` ``weight`` reordered for :func:`packed_linear`, or ``None`` where that cannot help.

    ``None`` for a weight too small to earn a packed copy at any row count (:func:`rows_worth_packing`; a
    caller's own ``min_numel`` elements instead where given), one that is not a 2-D CPU tensor of a :data:`PACKABLE_DTYPES` dtype, where
    :func:`packing_available` says no, for a weight with NaN or infinite entries (which no probe can check),
    or where the packed copy disagrees with ``F.linear`` on a probe (logged once per dtype on
    ``tightfit.kernels.packed_linear``; the caller then keeps ``F.linear``).
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

    The activation runs in oneDNN's epilogue, on the output while it is in cache: on a GPT-2 MLP up projection
    PyTorch's separate ``gelu`` costs about as much as the product itself, and the fused one little. Where the fused result disagrees with PyTorch's on a probe (checked
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
