"""The key space of a :class:`~torchrec_cache.cache.FusedCache`: where each table's keys, sets and slots
lie, computed once (:class:`KeySpace`) and mirrored on the device for per-key arithmetic without a host
read (:class:`KeyIndex`); and the shapes the cache is made of (its slot-tensor groups, its batches).

Every table of a collection has one run of *keys* (id ``v`` of table ``t`` is key ``key_start[t] + v``),
one run of *sets* of ``ways`` slots, and a group: tables of one (dim, dtype) are contiguous in key order
(first-appearance order of their (dim, dtype)) and share one slot tensor and one flat host tensor. A
table whose rows all fit is direct-mapped (row ``i`` in slot ``i`` of its run); the others place a row
in the set a hash of its id picks, with ways beyond the table's planned capacity disabled.

Example:
    >>> space = KeySpace.of([TableSpec(name="a", rows=100, dim=4, capacity=40),
    ...                      TableSpec(name="b", rows=10, dim=8, capacity=10)], ways=8)
    >>> space.key_start, space.sets, space.direct, space.enabled[0], space.num_slots
    ((0, 100), (5, 2), (False, True), (8, 8, 8, 8, 8), 56)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import nn

from tightfit.policy.frequency import mix_hash

__all__ = ["column_order", "check_table_names", "group_feature_spans", "TableSpec", "GroupSpan", "KeySpace", "KeyIndex",
           "SlotGroup", "Batch", "mix_hash", "out_of_range", "spill_notice"]

log = logging.getLogger("torchrec_cache")
_SPILL_WARNED = False


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


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpan:
    """The tables of one (dim, dtype): contiguous keys ``[key_lo, key_hi)`` and slots ``[slot_lo, slot_hi)``."""

    dim: int
    dtype: torch.dtype
    tables: tuple[int, ...]  # table indices, in key order
    key_lo: int
    key_hi: int
    slot_lo: int
    slot_hi: int


@dataclass(frozen=True, kw_only=True, slots=True)
class KeySpace:
    """Where every table's keys, sets and slots lie (per-table tuples in the collection's table order).

    Build it with :meth:`of`. Args:
        tables: the tables, in the collection's order.
        ways: slots per set.
        order: table indices in key order.
        key_start, set_start, sets: per table, its first key, its first set and its number of sets.
        direct: per table, whether all its rows fit (direct-mapped, wholly on the device).
        enabled: per table, the ways of each of its sets that may hold a row (its capacity exactly).
        capacity: per table, its slots (``min(capacity, rows)``).
        groups: the slot-tensor groups, in key order.
        positions, group_index: per table, its place in key order and its group.
        num_keys, num_sets: totals.
    """

    tables: tuple[TableSpec, ...]
    ways: int
    order: tuple[int, ...]
    key_start: tuple[int, ...]
    set_start: tuple[int, ...]
    sets: tuple[int, ...]
    direct: tuple[bool, ...]
    enabled: tuple[tuple[int, ...], ...]
    capacity: tuple[int, ...]
    groups: tuple[GroupSpan, ...]
    positions: tuple[int, ...]
    group_index: tuple[int, ...]
    num_keys: int
    num_sets: int

    def __post_init__(self) -> None:
        if self.ways < 1:
            raise ValueError(f"ways={self.ways}: a set needs at least one slot; pass ways >= 1 (or None for 32)")
        if not self.tables:
            raise ValueError("a FusedCache needs at least one table")

    @staticmethod
    def of(tables: list[TableSpec], ways: int) -> KeySpace:
        """The key space of ``tables``: grouped by (dim, dtype), each table's sets sized to its capacity."""
        by_kind: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, t in enumerate(tables):
            by_kind.setdefault((t.dim, t.dtype), []).append(i)
        order = [i for members in by_kind.values() for i in members]
        n = len(tables)
        key_start, set_start, sets, direct = [0] * n, [0] * n, [0] * n, [False] * n
        enabled: list[tuple[int, ...]] = [()] * n
        capacity = [0] * n
        k = s = 0
        for i in order:
            t = tables[i]
            cap = capacity[i] = min(t.capacity, t.rows)
            key_start[i], set_start[i], direct[i] = k, s, cap >= t.rows
            sets[i] = -(-(t.rows if direct[i] else cap) // ways)
            if direct[i]:
                enabled[i] = tuple(min(ways, t.rows - j * ways) for j in range(sets[i]))
            else:
                enabled[i] = tuple(cap // sets[i] + (j < cap % sets[i]) for j in range(sets[i]))
            k += t.rows
            s += sets[i]
        groups = tuple(GroupSpan(dim=dim, dtype=dtype, tables=tuple(m), key_lo=key_start[m[0]],
                                 key_hi=key_start[m[-1]] + tables[m[-1]].rows, slot_lo=set_start[m[0]] * ways,
                                 slot_hi=(set_start[m[-1]] + sets[m[-1]]) * ways)
                       for (dim, dtype), m in by_kind.items())
        group_index = [0] * n
        for gi, g in enumerate(groups):
            for i in g.tables:
                group_index[i] = gi
        return KeySpace(tables=tuple(tables), ways=ways, order=tuple(order), key_start=tuple(key_start),
                        set_start=tuple(set_start), sets=tuple(sets), direct=tuple(direct), enabled=tuple(enabled),
                        capacity=tuple(capacity), groups=groups, positions=tuple(order.index(i) for i in range(n)),
                        group_index=tuple(group_index), num_keys=k, num_sets=s)

    @property
    def num_slots(self) -> int:
        return self.num_sets * self.ways

    @property
    def key_bounds(self) -> list[int]:
        """The first key of each table in key order, then the number of keys (T + 1)."""
        return [self.key_start[i] for i in self.order] + [self.num_keys]

    def host_offset(self, table: int) -> int:
        """Table ``table``'s first row in its group's flat host tensor."""
        return self.key_start[table] - self.groups[self.group_index[table]].key_lo

    def table_run(self, key_bounds: list[int], table: int) -> tuple[int, int]:
        """Table ``table``'s run in a batch's unique keys (``key_bounds``: :attr:`Batch.key_bounds`)."""
        k = self.positions[table]
        return key_bounds[k], key_bounds[k + 1]

    def group_run(self, key_bounds: list[int], gi: int) -> tuple[int, int]:
        """Group ``gi``'s run in a batch's unique keys (its tables are contiguous in key order)."""
        g = self.groups[gi]
        return key_bounds[self.positions[g.tables[0]]], key_bounds[self.positions[g.tables[-1]] + 1]

    def group_split(self, keys_h: torch.Tensor) -> list[int]:
        """Bounds of each group's run in sorted host keys (G + 1)."""
        if len(self.groups) == 1:
            return [0, keys_h.numel()]
        los = torch.tensor([g.key_lo for g in self.groups] + [self.num_keys], dtype=torch.int64)
        return torch.searchsorted(keys_h, los).tolist()

    def host_constants(self) -> dict[str, torch.Tensor]:
        """The per-table numbers :class:`KeyIndex` keeps on the device, as host tensors."""
        i64 = torch.int64
        return {"key_start": torch.tensor(self.key_start, dtype=i64),
                "rows": torch.tensor([t.rows for t in self.tables], dtype=i64),
                "set_start": torch.tensor(self.set_start, dtype=i64), "sets": torch.tensor(self.sets, dtype=i64),
                "direct": torch.tensor(self.direct, dtype=torch.bool),
                "bounds": torch.tensor(self.key_bounds, dtype=i64), "table_at": torch.tensor(self.order, dtype=i64)}


class KeyIndex(nn.Module):
    """A :class:`KeySpace`'s per-table numbers on the device: a batch's keys, tables and sets, no host read.

    Args:
        space: the key space.
        device: where the batches' ids live.
    """

    # Registered buffers (non-persistent: :meth:`restore` rewrites them), annotated for type checkers.
    key_start: torch.Tensor
    rows: torch.Tensor
    set_start: torch.Tensor
    sets: torch.Tensor
    direct: torch.Tensor
    bounds: torch.Tensor
    table_at: torch.Tensor

    def __init__(self, space: KeySpace, device: torch.device) -> None:
        super().__init__()
        self.space = space
        for name, value in space.host_constants().items():
            self.register_buffer(name, value.to(device), persistent=False)

    def restore(self) -> None:
        """Rewrite the buffers (``to_empty`` off the meta device leaves garbage in them)."""
        for name, value in self.space.host_constants().items():
            getattr(self, name).copy_(value)

    def keys(self, values: torch.Tensor, lengths: torch.Tensor,
             feature_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, tables)`` of a batch's int64 ids on the device: features are contiguous runs of bags
        in ``lengths`` (F * B), ``feature_table`` (F,) the table of each feature."""
        F = feature_table.numel()
        per_bag_table = feature_table.repeat_interleave(lengths.numel() // max(1, F)) if F else feature_table
        tab = per_bag_table.repeat_interleave(lengths.to(values.device), output_size=values.numel())
        return values + self.key_start.index_select(0, tab), tab

    def sorted_keys(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor) -> torch.Tensor:
        """A batch's keys, sorted (a prefetch window's reuse set)."""
        return torch.sort(self.keys(values.to(self.key_start.device, torch.int64), lengths, feature_table)[0]).values

    def out_of_range(self, values: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Whether any id is outside its table (a device bool, read with the batch's sizes)."""
        return ((values < 0) | (values >= self.rows.index_select(0, tables))).any()

    def raise_out_of_range(self, values: torch.Tensor, tables: torch.Tensor) -> NoReturn:
        bad = torch.nonzero((values < 0) | (values >= self.rows.index_select(0, tables))).squeeze(1)[0]
        t = self.space.tables[int(tables[bad])]
        raise out_of_range(t.name, int(values[bad]), t.rows)

    def tables_of(self, keys: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(self.bounds, keys, right=True) - 1
        return self.table_at.index_select(0, pos.clamp(0, len(self.space.tables) - 1))

    def sets_of(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """The set of each key: its row's own set in a direct-mapped table, a hash of the id in the others."""
        t = self.tables_of(keys) if tables is None else tables
        ids = keys - self.key_start.index_select(0, t)
        hashed = mix_hash(ids) % self.sets.index_select(0, t)
        local = torch.where(self.direct.index_select(0, t), ids // self.space.ways, hashed)
        return self.set_start.index_select(0, t) + local


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
    """What :meth:`FusedCache.lookup` (or a prefetch) resolved for one batch (all tables)."""

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


def column_order(tables: list[Any], layout: list[int]) -> torch.Tensor | None:
    """Columns of the key-ordered output in the collection's order (``None`` when they already agree)."""
    if layout == sorted(layout):
        return None
    starts, col = {}, 0
    for i in layout:
        starts[i] = col
        col += tables[i].embedding_dim * len(tables[i].feature_names)
    cols = [starts[i] + j for i, t in enumerate(tables) for j in range(t.embedding_dim * len(t.feature_names))]
    return torch.tensor(cols, dtype=torch.int64)


def check_table_names(tables: list[Any]) -> None:
    """TorchRec's rule: table names are unique; a table without feature names is looked up by its own name."""
    names: set[str] = set()
    for cfg in tables:
        if cfg.name in names:
            raise ValueError(f"Duplicate table name {cfg.name}")
        names.add(cfg.name)
        if not cfg.feature_names:
            cfg.feature_names = [cfg.name]


def group_feature_spans(groups: list[Any], tables: list[Any]) -> list[tuple[int, int]]:
    """Each slot group's ``[start, end)`` in the features ordered by key (its tables' features are contiguous)."""
    spans, f = [], 0
    for g in groups:
        n = sum(len(tables[i].feature_names) for i in g.tables)
        spans.append((f, f + n))
        f += n
    return spans
