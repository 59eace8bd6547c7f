"""Fixed-size tensor steps of the cache's per-batch path: none reads a device value on the host.

Example:
    >>> uniq, counts, inv, seg = unique_padded(torch.tensor([7, 3, 7]))
    >>> uniq.tolist(), counts.tolist(), inv.tolist(), int(seg[-1]) + 1
    ([3, 7, 4611686018427387904, 4611686018427387904], [1, 2, 0, 0], [1, 0, 1], 2)
"""

from __future__ import annotations

import torch

__all__ = ["unique_padded", "isin_sorted", "compact"]

_SENTINEL = 2**62  # pads the fixed-size unique array: above every key


def unique_padded(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unique keys in fixed-size arrays (``torch.unique`` would read their number on the host).

    Returns ``(uniq, counts, inv, seg)``: the sorted unique keys padded to ``L + 1`` with a sentinel above
    every key, their use counts (padded with 0), each key's index in ``uniq``, and the same in sorted order
    (``seg[-1] + 1`` is the number of unique keys).
    """
    L, dev = keys.numel(), keys.device
    sorted_keys, perm = torch.sort(keys)
    new = torch.ones(L, dtype=torch.bool, device=dev)
    if L > 1:
        torch.ne(sorted_keys[1:], sorted_keys[:-1], out=new[1:])
    seg = torch.cumsum(new, 0) - 1
    inv = torch.empty_like(seg).scatter_(0, perm, seg)
    uniq = torch.full((L + 1,), _SENTINEL, dtype=torch.int64, device=dev).scatter_(0, seg, sorted_keys)
    counts = torch.zeros(L + 1, dtype=torch.int64, device=dev).index_add_(0, seg, torch.ones(L, dtype=torch.int64,
                                                                                             device=dev))
    return uniq, counts, inv, seg


def isin_sorted(keys: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """Whether each of ``keys`` is in one of ``parts`` (non-empty list), without a host read."""
    pool = torch.sort(torch.cat(parts)).values
    at = torch.searchsorted(pool, keys).clamp(max=pool.numel() - 1)
    return pool.index_select(0, at) == keys


def compact(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions of the ``first`` flags, then of the ``second`` (disjoint), each in order, then the rest:
    ``(order, number first, number second)``, the numbers as device scalars."""
    n = first.numel()
    ca, cs = torch.cumsum(first, 0), torch.cumsum(second, 0)
    na, ns = ca[-1], cs[-1]
    dest = torch.where(first, ca - 1, torch.where(second, na + cs - 1, torch.full_like(ca, n)))
    order = torch.zeros(n + 1, dtype=torch.int64, device=first.device).scatter_(
        0, dest, torch.arange(n, device=first.device))[:n]
    return order, na, ns

