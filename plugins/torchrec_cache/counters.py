"""Per-table traffic counters of a cache, kept on the host from the keys the batch already read there.

Example:
    >>> c = CacheCounters(row_bytes=[64], key_starts=torch.tensor([0, 100]), key_order=[0])
    >>> c.account(True, [0, 5], torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([-1, 7]))
    >>> c.total()["hits"], c.total()["rows_loaded"], c.total()["bytes_to_host"]
    (2, 2, 64)
"""

from __future__ import annotations

import torch

__all__ = ["STAT_KEYS", "CacheCounters"]

STAT_KEYS = ("steps", "lookups", "hits", "misses", "rows_loaded", "rows_written_back", "rows_spilled",
             "bytes_to_device", "bytes_to_host")
_K = {k: i for i, k in enumerate(STAT_KEYS)}


class CacheCounters:
    """Totals and last-step counts of :data:`STAT_KEYS` per table.

    Args:
        row_bytes: per table, the bytes one row moves (weights and optimizer state).
        key_starts: the first key of each table in key order, then the number of keys (T + 1).
        key_order: the table index at each position of the key order.
    """

    def __init__(self, *, row_bytes: list[int], key_starts: torch.Tensor, key_order: list[int]) -> None:
        self.n = len(row_bytes)
        self.row_bytes = torch.tensor(row_bytes, dtype=torch.int64)
        self.key_starts = key_starts
        self.to_key_order = torch.tensor([key_order.index(i) for i in range(self.n)], dtype=torch.int64)
        self.totals = torch.zeros(self.n, len(STAT_KEYS), dtype=torch.int64)
        self.latest = torch.zeros_like(self.totals)
        self.prefetched = torch.zeros_like(self.totals)  # prefetch traffic since the last counted step

    def _per_table(self, keys_h: torch.Tensor) -> torch.Tensor:
        if keys_h.numel() == 0:
            return torch.zeros(self.n, dtype=torch.int64)
        pos = torch.searchsorted(self.key_starts, keys_h, right=True) - 1
        return torch.bincount(pos, minlength=self.n).index_select(0, self.to_key_order)

    def account(self, count: bool, key_bounds: list[int], loads: torch.Tensor, spills: torch.Tensor,
                evicted: torch.Tensor) -> None:
        """One batch (``count``) or prefetch: host keys loaded, spilled and evicted (-1: a free slot)."""
        last = torch.zeros(self.n, len(STAT_KEYS), dtype=torch.int64)
        nl, nsp, nwb = self._per_table(loads), self._per_table(spills), self._per_table(evicted[evicted >= 0])
        last[:, _K["rows_loaded"]] = nl
        last[:, _K["rows_written_back"]] = nwb
        last[:, _K["bytes_to_device"]] = nl * self.row_bytes
        last[:, _K["bytes_to_host"]] = nwb * self.row_bytes
        if count:
            kb = torch.tensor(key_bounds)
            lookups = (kb[1:] - kb[:-1]).index_select(0, self.to_key_order)
            last[:, _K["steps"]] = 1
            last[:, _K["lookups"]] = lookups
            last[:, _K["misses"]] = nl + nsp
            last[:, _K["hits"]] = lookups - nl - nsp
            last[:, _K["rows_spilled"]] = nsp
            self.totals += last
            self.latest = last + self.prefetched  # a prefetch's traffic belongs to the step it precedes
            self.prefetched.zero_()
        else:
            self.totals += last
            self.prefetched += last

    def table(self, i: int) -> dict[str, int]:
        return dict(zip(STAT_KEYS, self.totals[i].tolist()))

    def total(self) -> dict[str, int]:
        out = dict(zip(STAT_KEYS, self.totals.sum(0).tolist()))
        out["steps"] = int(self.totals[:, 0].max()) if self.n else 0
        return out

    def last(self) -> dict[str, int]:
        return dict(zip(STAT_KEYS, self.latest.sum(0).tolist()))

    def reset(self) -> None:
        self.totals.zero_()
        self.latest.zero_()
        self.prefetched.zero_()
