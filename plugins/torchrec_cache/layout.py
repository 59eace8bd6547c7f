"""The shapes a :class:`~torchrec_cache.cache.FusedCache` is made of: its tables, its slot-tensor groups,
the batches it resolves, and the hash that places a row in its set.

Example:
    >>> TableSpec(name="t", rows=1000, dim=16, capacity=15).capacity
    15
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TableSpec", "SlotGroup", "Batch", "mix_hash", "unique_padded", "isin_sorted", "compact", "out_of_range",
           "spill_notice"]

log = logging.getLogger("torchrec_cache")
_SPILL_WARNED = False

_M32 = 0xFFFFFFFF
_SENTINEL = 2**62  # pads the fixed-size unique array: above every key


def mix_hash(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 keys (low bits of the products are exact under int64 wrap-around)."""
    x = (x ^ (x >> 32)) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


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


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSpec:
    """One table of a :class:`FusedCache`.

    Args:
        name: the table's name.
        rows: its number of rows.
        dim: its embedding dim.
        dtype: its weights' dtype.
        capacity: device slots planned for it (clipped to ``rows``; ``rows`` makes it direct-mapped).
    """

    name: str
    rows: int
    dim: int
    dtype: torch.dtype = torch.float32
    capacity: int = 1

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: rows={self.rows} and dim={self.dim} must be >= 1")
        if self.rows >= 2**40:
            raise ValueError(f"table {self.name!r} has {self.rows} rows; the cache's keys support < 2**40 rows")
        if self.capacity < 1:
            raise ValueError(f"table {self.name!r}: capacity={self.capacity} slots must be >= 1")


@dataclass
class SlotGroup:
    """Tables of one (dim, dtype): one slot tensor on the device, one flat host tensor."""

    dim: int
    dtype: torch.dtype
    tables: list[int]
    key_lo: int
    key_hi: int
    slot_lo: int
    slot_hi: int
    host: torch.Tensor  # (rows of the group, dim): the full tables, in position order
    host_state: torch.Tensor  # (rows of the group, state columns) fp32
    remap: torch.Tensor | None = None  # group-local id -> host position (``reorder``)
    order: torch.Tensor | None = None  # host position -> group-local id
    opt_step: int = 0
    dirty: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (keys, positions) autograd mode
    seen_version: int = -1


@dataclass
class Batch:
    """What :meth:`FusedCache.prepare` resolved for one batch (all tables)."""

    uniq: torch.Tensor  # (U,) unique keys, sorted
    inv: torch.Tensor  # (L,) index of each id in uniq
    slots: torch.Tensor  # (U,) slot of each unique key; the trash slot C for rows read from host memory
    key_bounds: list[int]  # tables in key order: table k's keys are uniq[key_bounds[k]:key_bounds[k + 1]]
    value_bounds: list[int]  # per group, its ids' range in the batch (G + 1 entries)
    spill_pos: torch.Tensor  # device positions in uniq of the spilled keys
    spill_keys: torch.Tensor  # host keys of the spilled rows (sorted)
    step: int = 0
    id: int = 0
    groups_left: int = 0  # slot-tensor groups whose backward has not run yet
    held: bool = False
    train: bool = True  # the rows stay held until the backward (else until the lookup gathered them)
    finalizer: Any = None


def out_of_range(table: str, value: int, rows: int) -> IndexError:
    return IndexError(f"table {table!r}: id {value} is outside its range [0, {rows}); ids must satisfy "
                      f"0 <= id < num_embeddings={rows} (hash or clip the feature before the lookup, or enlarge "
                      "the table)")


def spill_notice(unique: int, spilled: int, slots: int) -> None:
    """Log (once per process, then at DEBUG) that a batch read rows from host memory; lines fit 110 columns."""
    msg = (f"{spilled} of a batch's {unique} unique rows found no free or colder slot in their set\n"
           f"  (the cache holds {slots} slots, some pinned): they are read from and updated in host memory\n"
           "  for this batch. Raise CacheConfig.capacity or use smaller batches to avoid the round trip.")
    global _SPILL_WARNED
    if not _SPILL_WARNED:
        log.warning(msg + "\n  (logged once per process; later spills at DEBUG, counted in cache_stats()['rows_spilled'])")
        _SPILL_WARNED = True
    else:
        log.debug(msg)
