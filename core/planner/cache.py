"""Embedding-cache sizing: how many device slots each table gets from one byte budget.

A pure function (no devices, no processes): table sizes, bytes per cached row and, optionally, the
frequency statistics in; a :class:`CachePlan` out. With statistics the budget goes to the rows
with the most uses per byte across *all* tables (a greedy knapsack, optimal for this objective
because every row has the same value density ordering); without them each table gets the same
fraction of its rows. The plan predicts the hit rate a cache holding exactly those rows would
have on the counted data, which is the static policy's hit rate and a guide for the others.

With a host budget and a disk tier (``host_budget_bytes``, ``disk``) the full tables (rows and optimizer
state) live in files on disk and host memory holds a second cache level: the next most used rows after
the device's, chosen by the same uses-per-byte rule (the frequency-aware policy's admission order), so a
device miss that hits the host costs a copy and only the rest reach the disk. Without a disk tier the full
tables are in host memory, and a host budget smaller than them is refused naming the host tier.

Example:
    >>> t = [CacheTableSpec(name="a", rows=1000, dim=16), CacheTableSpec(name="b", rows=3000, dim=16)]
    >>> plan = plan_cache(t, budget_bytes=64_000)
    >>> plan.slots
    {'a': 136, 'b': 408}
    >>> from tightfit.profiler.types import DiskProfile
    >>> disk = DiskProfile(path="/nvme", free_bytes=10**9)
    >>> plan = plan_cache(t, budget_bytes=64_000, host_budget_bytes=100_000, disk=disk)
    >>> plan.host_rows, plan.disk_bytes  # 100 kB of 64-byte rows + 16-byte index entries; full tables on disk
    ({'a': 312, 'b': 937}, 256000)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tightfit.planner.errors import PlanInfeasibleError
from tightfit.planner.tiers import MemoryTiers, tier_error
from tightfit.profiler.types import DiskProfile
from tightfit.units import format_bytes, format_table

__all__ = ["INDEX_BYTES_PER_ROW", "INDEX_BYTES_PER_SLOT", "HOST_INDEX_BYTES_PER_ROW", "DISK_PAGE_BYTES",
           "CacheTableSpec", "CachePlan", "plan_cache", "split_slots"]

INDEX_BYTES_PER_ROW = 4
"""Device bytes a direct-mapped cache index costs per table row (an int32 slot number). A hashed /
set-associative index (torchrec_cache's) costs nothing per row: pass ``index_bytes_per_row=0``."""
INDEX_BYTES_PER_SLOT = 24
"""Device bytes a cache index costs per slot: the key it holds, its policy score and its pin step (three int64)."""
HOST_INDEX_BYTES_PER_ROW = 16
"""Host bytes the second cache level's index costs per cached row: its table row id and its position in the
host buffer (two int64)."""
DISK_PAGE_BYTES = 4096
"""The smallest read a disk serves: a missed row costs at least one page (rows are read in batches sorted by
offset, so neighbouring rows of one page are read once, which this bound ignores)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheTableSpec:
    """One table to size.

    Args:
        name: the table's name.
        rows: its number of rows.
        dim: its embedding dimension.
        weight_bytes: bytes per element of the weights (4 for fp32).
        state_columns: fp32 optimizer-state columns stored beside each row (0 for SGD, dim for Adagrad).
        index_bytes_per_slot: device bytes of index and policy state per slot (a cache with a frequency
            sketch pays for it here).
    """

    name: str
    rows: int
    dim: int
    weight_bytes: int = 4
    state_columns: int = 0
    index_bytes_per_slot: int = INDEX_BYTES_PER_SLOT

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: rows={self.rows} and dim={self.dim} must both be >= 1")
        if self.index_bytes_per_slot < 0:
            raise ValueError(f"table {self.name!r}: index_bytes_per_slot={self.index_bytes_per_slot} must be >= 0")

    @property
    def row_bytes(self) -> int:
        """Bytes of one full row: weights and optimizer state (what the disk or the host table holds)."""
        return self.dim * self.weight_bytes + 4 * self.state_columns

    @property
    def slot_bytes(self) -> int:
        """Device bytes one cached row costs (weights, optimizer state, index entry)."""
        return self.row_bytes + self.index_bytes_per_slot

    @property
    def host_row_bytes(self) -> int:
        """Host bytes one row of the second cache level costs (the row and its index entry)."""
        return self.row_bytes + HOST_INDEX_BYTES_PER_ROW


@dataclass(frozen=True, kw_only=True, slots=True)
class CachePlan:
    """Slots per table, what they cost, and the hit rate the counted data predicts.

    Args:
        slots: table name -> number of device slots.
        budget_bytes: the budget the plan was made for.
        used_bytes: device bytes the plan uses (slots and index).
        predicted_hit_rate: share of the counted ids that fall on cached rows (``None`` without statistics).
        host_rows: table name -> rows of the host cache level (empty: the full tables are in host memory).
        host_bytes: host bytes the plan uses: the host level, or the full tables when there is no disk tier.
        disk_bytes: bytes of the full tables on disk (0 without a disk tier).
        predicted_host_hit_rate: share of the counted ids on the device or the host level (``None`` without
            statistics or without a disk tier).
        disk_seconds_per_id: predicted disk seconds per looked-up id (the misses of both levels, a page each, at
            the disk profile's measured random reads of that size; ``None`` without statistics or disk).
    """

    slots: dict[str, int] = field(default_factory=dict)
    budget_bytes: int = 0
    used_bytes: int = 0
    predicted_hit_rate: float | None = None
    host_rows: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    disk_bytes: int = 0
    predicted_host_hit_rate: float | None = None
    disk_seconds_per_id: float | None = None

    def explain(self) -> str:
        head = (f"cache plan: {sum(self.slots.values())} slots in {format_bytes(self.used_bytes)} of a "
                f"{format_bytes(self.budget_bytes)} budget")
        if self.predicted_hit_rate is not None:
            head += f"; {self.predicted_hit_rate:.1%} of the counted ids hit the planned rows"
        if self.disk_bytes:
            head += (f"\nfull tables on disk ({format_bytes(self.disk_bytes)}); host level "
                     f"{sum(self.host_rows.values())} rows in {format_bytes(self.host_bytes)}")
            if self.predicted_host_hit_rate is not None:
                head += f"; {self.predicted_host_hit_rate:.1%} of the counted ids on the device or the host"
            rows = [(n, self.slots[n], self.host_rows.get(n, 0)) for n in sorted(self.slots)]
            return head + "\n" + format_table(rows, ("table", "slots", "host rows"), align="lrr")
        return head + "\n" + format_table(sorted(self.slots.items()), ("table", "slots"), align="lr")


def plan_cache(tables: Sequence[CacheTableSpec], *, budget_bytes: int,
               frequencies: Mapping[str, torch.Tensor] | None = None,
               index_bytes_per_row: int = INDEX_BYTES_PER_ROW, host_budget_bytes: int | None = None,
               disk: DiskProfile | None = None, disk_budget_bytes: int | None = None) -> CachePlan:
    """Split ``budget_bytes`` of device memory into per-table cache slots (at least 1 per table).

    ``index_bytes_per_row``: device bytes the index costs per *table* row (0 for a hashed index).
    ``host_budget_bytes``: host memory for the tables (``None``: unbounded); ``disk``: the disk tier the full
    tables live on (then the host budget is a second cache level); ``disk_budget_bytes``: bytes the tables may
    take there (``None``: the disk's free bytes).

    Raises:
        PlanInfeasibleError: the device budget cannot hold the index (``tier="device"``), the full tables do not
            fit the host budget and there is no disk tier (``tier="host"``), or they do not fit the disk
            (``tier="disk"``).
    """
    tiers = MemoryTiers(device_bytes=budget_bytes, host_bytes=host_budget_bytes,
                        disk_bytes=(disk.free_bytes if disk_budget_bytes is None else int(disk_budget_bytes))
                        if disk is not None else 0, disk=disk)
    full = sum(t.rows * t.row_bytes for t in tables)
    if disk is None and host_budget_bytes is not None and full > host_budget_bytes:
        raise tier_error(tiers, "host", needed=full, what=f"storing the full tables ({len(tables)})")
    if disk is not None and full > tiers.disk_bytes:
        raise tier_error(tiers, "disk", needed=full, what=f"storing the full tables ({len(tables)})")
    if not tables:
        raise ValueError("plan_cache needs at least one table")
    fixed = sum(t.rows * index_bytes_per_row + t.slot_bytes for t in tables)
    if budget_bytes < fixed:
        raise PlanInfeasibleError(
            f"a cache budget of {format_bytes(budget_bytes)} cannot hold the index of {len(tables)} tables "
            f"({format_bytes(fixed)}: {index_bytes_per_row} bytes per table row plus one slot each); give at "
            f"least {fixed} bytes, or a ratio such as capacity=0.015", needed_bytes=fixed,
            budget_bytes=budget_bytes, suggestions=("use a ratio capacity such as 0.015",))
    spare = budget_bytes - fixed
    slots = {t.name: 1 for t in tables}
    hit = None
    if frequencies is not None:
        densities, owners, costs = [], [], []
        for i, t in enumerate(tables):
            c = frequencies[t.name].double()
            hot = torch.sort(c[c > 0], descending=True).values[1:]  # the first slot is already paid for
            densities.append(hot / t.slot_bytes)
            owners.append(torch.full_like(hot, i, dtype=torch.int64))
            costs.append(torch.full_like(hot, t.slot_bytes, dtype=torch.int64))
        dens, own, cost = torch.cat(densities), torch.cat(owners), torch.cat(costs)
        order = torch.argsort(dens, descending=True, stable=True)
        take = int((torch.cumsum(cost[order], 0) <= spare).sum())
        chosen = own[order[:take]]
        for i, t in enumerate(tables):
            slots[t.name] += int((chosen == i).sum())
        spare -= int(cost[order[:take]].sum())
    # What is left (all of it without statistics) goes to every table in proportion to its rows.
    room = {t.name: t.rows - slots[t.name] for t in tables}
    per_row_cost = sum(t.slot_bytes * room[t.name] for t in tables)
    if per_row_cost > 0 and spare > 0:
        frac = min(1.0, spare / per_row_cost)
        for t in tables:
            slots[t.name] += int(room[t.name] * frac)
    used_bytes = sum(t.rows * index_bytes_per_row + slots[t.name] * t.slot_bytes for t in tables)
    if frequencies is not None:
        total = sum(float(frequencies[t.name].sum()) for t in tables)
        covered = sum(float(torch.topk(frequencies[t.name].double(), slots[t.name]).values.sum()) for t in tables)
        hit = covered / total if total else 0.0
    plan = CachePlan(slots=slots, budget_bytes=int(budget_bytes), used_bytes=used_bytes, predicted_hit_rate=hit,
                     host_bytes=full if disk is None else 0)
    if disk is None:
        return plan
    return _host_level(plan, tables, frequencies, host_budget_bytes, disk, full)


def _host_level(plan: CachePlan, tables: Sequence[CacheTableSpec], frequencies: Mapping[str, torch.Tensor] | None,
                host_budget: int | None, disk: DiskProfile, full: int) -> CachePlan:
    """The second cache level in host memory over the tables on disk: the next most used rows after the device's."""
    room = {t.name: t.rows - plan.slots[t.name] for t in tables}
    if host_budget is None:  # unbounded host memory: every row not on the device has a host copy
        rows = dict(room)
    elif frequencies is not None:
        dens, own, cost = [], [], []
        for i, t in enumerate(tables):
            after = torch.sort(frequencies[t.name].double(), descending=True).values[plan.slots[t.name]:]
            dens.append(after / t.host_row_bytes)
            own.append(torch.full_like(after, i, dtype=torch.int64))
            cost.append(torch.full_like(after, t.host_row_bytes, dtype=torch.int64))
        d, o, c = torch.cat(dens), torch.cat(own), torch.cat(cost)
        order = torch.argsort(d, descending=True, stable=True)
        chosen = o[order[: int((torch.cumsum(c[order], 0) <= host_budget).sum())]]
        rows = {t.name: int((chosen == i).sum()) for i, t in enumerate(tables)}
    else:  # the same fraction of every table's remaining rows
        per_row = sum(t.host_row_bytes * room[t.name] for t in tables)
        frac = min(1.0, host_budget / per_row) if per_row else 0.0
        rows = {t.name: int(room[t.name] * frac) for t in tables}
    host_hit = per_id = None
    if frequencies is not None:
        total = sum(float(frequencies[t.name].sum()) for t in tables)
        level = {t.name: plan.slots[t.name] + rows[t.name] for t in tables}
        covered = {t.name: float(torch.topk(frequencies[t.name].double(), level[t.name]).values.sum()) for t in tables}
        host_hit = sum(covered.values()) / total if total else 0.0
        # A missed id reads the 4 KiB blocks holding its row, scattered: priced at the profile's measured random
        # reads of that size (profile_disk), in batches whose request latency is paid once per batch, not per id.
        seconds = sum(disk.random_read_seconds(float(frequencies[t.name].sum()) - covered[t.name], _blocks(t.row_bytes))
                      for t in tables)
        per_id = seconds / total if total else 0.0
    return CachePlan(slots=plan.slots, budget_bytes=plan.budget_bytes, used_bytes=plan.used_bytes,
                     predicted_hit_rate=plan.predicted_hit_rate, host_rows=rows,
                     host_bytes=sum(rows[t.name] * t.host_row_bytes for t in tables), disk_bytes=full,
                     predicted_host_hit_rate=host_hit, disk_seconds_per_id=per_id)


def _blocks(row_bytes: int) -> int:
    """Bytes a missed row costs the disk: the whole pages holding it (at most one page more when it straddles
    two, which this bound ignores)."""
    return -(-row_bytes // DISK_PAGE_BYTES) * DISK_PAGE_BYTES


def split_slots(tables: Sequence[CacheTableSpec], total_slots: int, *,
                frequencies: Mapping[str, torch.Tensor] | None = None) -> dict[str, int]:
    """Split one collection's ``total_slots`` across its tables (a ratio capacity is the collection's total).

    With statistics the slots go to the most used rows of all tables (each table keeps at least one).
    Without them every table is assumed to get the same traffic (one feature per table: a batch reads
    as many ids from each) with Zipf-like popularity inside it; then the k-th slot of a table with
    ``n`` rows is worth about ``1 / (k ln n)``, and the greedy split gives each table slots in
    proportion to ``1 / ln n``, never more than its rows. A small table whose rows all fit therefore
    stays wholly on the device, and the rest share what is left: a per-table ratio would give a
    31-row table one slot and make it miss on every batch.

    Example:
        >>> t = [CacheTableSpec(name="small", rows=30, dim=16), CacheTableSpec(name="big", rows=100_000, dim=16)]
        >>> split_slots(t, 1500)
        {'small': 30, 'big': 1470}
    """
    if not tables:
        raise ValueError("split_slots needs at least one table")
    rows = {t.name: t.rows for t in tables}
    total = max(len(tables), min(int(total_slots), sum(rows.values())))
    if frequencies is not None:
        used = torch.cat([torch.sort(frequencies[t.name].double(), descending=True).values[1:] for t in tables])
        owner = torch.cat([torch.full((t.rows - 1,), i, dtype=torch.int64) for i, t in enumerate(tables)])
        take = torch.argsort(used, descending=True, stable=True)[: total - len(tables)]
        got = torch.bincount(owner[take], minlength=len(tables))
        return {t.name: 1 + int(got[i]) for i, t in enumerate(tables)}
    weight = {t.name: 1.0 / math.log(t.rows + 1.0) for t in tables}
    out: dict[str, int] = {}
    left, open_ = total, dict(rows)
    while open_:  # water-filling: tables whose share exceeds their rows take all of them, the rest re-split
        scale = left / sum(weight[n] for n in open_)
        full = {n: r for n, r in open_.items() if weight[n] * scale >= r}
        if not full:
            shares = {n: max(1, int(weight[n] * scale)) for n in open_}
            spare = left - sum(shares.values())
            for n in sorted(open_, key=lambda n: -weight[n])[: max(0, spare)]:
                shares[n] += 1
            out.update(shares)
            break
        out.update(full)
        left -= sum(full.values())
        for n in full:
            del open_[n]
    return out
