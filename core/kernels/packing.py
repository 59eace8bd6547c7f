"""Remove padding from a batch of sequences (pack) and put it back (unpack).

    packed, cu_seqlens = pack(padded, starts, lengths)      # (B, L, *F) -> (sum(lengths), *F)
    padded = unpack(packed, starts, lengths, max_len)        # (T, *F) -> (B, max_len, *F), zeros elsewhere

Row ``b`` of ``padded`` holds its ``lengths[b]`` real tokens at positions ``starts[b] ..
starts[b] + lengths[b] - 1``, so left padding (``starts = L - lengths``), right padding
(``starts = 0``) and anything else are one case. Packing is what lets a runtime run a batch of
unequal sequences with no pad token passing through any linear layer: the work is
``sum(lengths)`` rows instead of ``B * L`` (``L / mean(lengths)`` times less; 2.1x for lengths
spread evenly over 16..512).

Both directions are row moves, so they run on the row kernels of :mod:`tightfit.kernels.index_rows`
(Triton on CUDA, ``index_select`` / ``index_copy_`` elsewhere) with the row index built on the
device from ``starts`` and ``lengths``. The one host sync is the total length, which sizes the output.

Example:
    >>> import torch
    >>> x = torch.tensor([[0, 0, 1, 2], [3, 4, 5, 0]])
    >>> packed, cu = pack(x, torch.tensor([2, 0]), torch.tensor([2, 3]))
    >>> packed.tolist(), cu.tolist()
    ([1, 2, 3, 4, 5], [0, 2, 5])
    >>> unpack(packed, torch.tensor([0, 0]), torch.tensor([2, 3]), 3).tolist()
    [[1, 2, 0], [3, 4, 5]]
"""

from __future__ import annotations

import torch

from tightfit.kernels.index_rows import gather_rows, scatter_rows

__all__ = ["pack", "unpack", "padded_row_index", "cu_seqlens"]


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int32 (the offsets of each sequence in a packed tensor)."""
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def padded_row_index(starts: torch.Tensor, lengths: torch.Tensor, max_len: int, total: int) -> torch.Tensor:
    """For each packed token, its row in the padded batch viewed as ``(B * max_len, ...)``."""
    lengths = lengths.long()
    cu = torch.cumsum(lengths, 0) - lengths  # exclusive offsets
    seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                  output_size=total)
    within = torch.arange(total, device=lengths.device) - cu[seq]
    return seq * max_len + starts.long()[seq] + within


def _check(name: str, starts: torch.Tensor, lengths: torch.Tensor, batch: int, max_len: int) -> None:
    if starts.shape != (batch,) or lengths.shape != (batch,):
        raise ValueError(f"{name}: starts and lengths must have shape ({batch},) (one per sequence), got "
                         f"{tuple(starts.shape)} and {tuple(lengths.shape)}")
    if batch and (int(lengths.min()) < 0 or int(starts.min()) < 0 or int((starts + lengths).max()) > max_len):
        raise ValueError(f"{name}: every sequence must satisfy 0 <= start and start + length <= {max_len} "
                         f"(the padded length); got starts {starts.tolist()} lengths {lengths.tolist()}")


def pack(padded: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, *,
         backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, L, *F)`` padded batch -> ``((sum(lengths), *F) packed, cu_seqlens)``."""
    batch, max_len = padded.shape[0], padded.shape[1]
    _check("pack", starts, lengths, batch, max_len)
    total = int(lengths.sum())
    feature = padded.shape[2:]
    rows = padded_row_index(starts, lengths, max_len, total)
    flat = padded.reshape(batch * max_len, -1)
    out = gather_rows(flat, rows, validate=False, backend=backend)
    return out.view(total, *feature), cu_seqlens(lengths)


def unpack(packed: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, max_len: int, *,
           fill: float = 0.0, backend: str | None = None) -> torch.Tensor:
    """``(T, *F)`` packed -> ``(B, max_len, *F)`` with ``fill`` where there is no token."""
    batch = lengths.shape[0]
    _check("unpack", starts, lengths, batch, max_len)
    total = int(lengths.sum())
    if packed.shape[0] != total:
        raise ValueError(f"unpack: packed has {packed.shape[0]} rows but lengths add up to {total}")
    feature = packed.shape[1:]
    out = torch.full((batch * max_len, *feature), fill, dtype=packed.dtype, device=packed.device)
    rows = padded_row_index(starts, lengths, max_len, total)
    scatter_rows(out.view(batch * max_len, -1), rows, packed.reshape(total, -1), validate=False, backend=backend)
    return out.view(batch, max_len, *feature)
