"""One table's software cache: the full table in host memory, ``capacity`` hot rows in device slots.

:class:`TableCache` owns the device side (slot weights, slot optimizer state, the index) and
references the host side (the table ``Parameter`` of its collection, the per-row optimizer state,
the per-row use counts). Every batch goes through :meth:`TableCache.prepare`: unique ids -> slots
(:func:`tightfit.cuda.cache_lookup`), victims for the misses (:func:`tightfit.cuda.select_victims`),
write-back of evicted rows *with their optimizer state and counts*, loads of the missed rows
(:func:`tightfit.cuda.gather_rows` / :func:`tightfit.cuda.scatter_rows`). A batch with more unique
ids than the cache can hold is not an error: the rows that find no slot are read straight from
host memory for that batch (a logged "spill") and updated there.

Row ids are mapped to host *positions* when the table is stored in frequency order (``reorder``);
everything below the range check works on positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tightfit.cuda import gather_rows, scatter_rows
from tightfit.cuda.cache_lookup import EMPTY_SCORE, LFU, LRU, STATIC, cache_lookup, select_victims
from torchrec_cache.config import RowOptimizer
from torchrec_cache.optim import apply_update, initial_state

__all__ = ["Batch", "TableCache", "STAT_KEYS"]

log = logging.getLogger("torchrec_cache")
_SPILL_WARNED = False

_MODES = {"lfu": LFU, "lru": LRU, "static": STATIC}
STAT_KEYS = ("steps", "lookups", "hits", "misses", "rows_loaded", "rows_written_back", "rows_spilled",
             "bytes_to_device", "bytes_to_host")


@dataclass
class Batch:
    """What :meth:`TableCache.prepare` resolved for one batch of one table."""

    uniq: torch.Tensor  # (U,) unique row ids, sorted
    rows: torch.Tensor  # (U,) their host positions (== uniq unless the table is reordered)
    inv: torch.Tensor  # (L,) index of each id of the batch in uniq
    slots: torch.Tensor  # (U,) slot of each unique row, -1 for rows that spilled
    spill_pos: torch.Tensor  # positions in uniq of the rows read from host memory for this batch


class TableCache(nn.Module):
    """The device slots of one table and the index that maps rows to them.

    Args:
        name: the table's name (for errors and stats).
        host_table: the module whose ``weight`` (rows x dim, CPU) is the full table.
        capacity: number of slots on the device.
        policy: ``"lfu"``, ``"lru"`` or ``"static"``.
        optimizer: the fused :class:`RowOptimizer`, or ``None`` for plain autograd (sparse gradient
            on the host table; the cache only reads).
        device: where the slots live.
        static_freq: (rows,) dataset counts in host-position order (needed by ``"static"``).
        prior_counts: (rows,) starting LFU counts in host-position order.
        remap: (rows,) id -> host position, when the host table is stored in frequency order.
    """

    def __init__(self, *, name: str, host_table: nn.Module, capacity: int, policy: str,
                 optimizer: RowOptimizer | None, device: torch.device, static_freq: torch.Tensor | None = None,
                 prior_counts: torch.Tensor | None = None, remap: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = host_table.weight
        rows, dim = weight.shape
        if policy == "static" and static_freq is None:
            raise ValueError(f"table {name!r}: policy='static' ranks rows by dataset frequency; pass "
                             "frequencies=collect_frequencies(...) or use policy='lfu'")
        if rows >= 2**31:
            raise ValueError(f"table {name!r} has {rows} rows; the int32 slot index supports < 2**31 rows")
        self.name = name
        self.__dict__["_host_table"] = host_table  # referenced, not registered: its weight is the collection's
        self.num_rows, self.dim = rows, dim
        self.capacity = max(1, min(int(capacity), rows))
        self.policy = policy
        self.mode = _MODES[policy]
        self.optimizer = optimizer
        self.host_state = initial_state(optimizer, rows, dim)
        self.host_count = (prior_counts.clone().long() if prior_counts is not None
                           else torch.zeros(rows, dtype=torch.int64))
        self.static_freq = static_freq.long() if static_freq is not None else None
        self.step = 0  # prepare() calls
        self.opt_step = 0  # optimizer steps (Adam's bias correction)
        c, s = self.capacity, self.host_state.shape[1]
        self.register_buffer("weight", torch.zeros(c, dim, dtype=weight.dtype, device=device), persistent=False)
        self.register_buffer("state", torch.zeros(c, s, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("slot_row", torch.full((c,), -1, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("slot_score", torch.full((c,), EMPTY_SCORE, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("pinned_until", torch.full((c,), -1, dtype=torch.int64, device=device),
                             persistent=False)
        # 4 bytes per table row on the device: 1/dim of the table at fp32 (see README, "limits").
        self.register_buffer("row_slot", torch.full((rows,), -1, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("remap", remap.long().to(device) if remap is not None else None, persistent=False)
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.last_step = dict.fromkeys(STAT_KEYS, 0)
        self._dirty: list[torch.Tensor] = []  # rows given a sparse gradient (autograd mode)
        self._seen_version = weight._version

    # ------------------------------------------------------------------ properties
    @property
    def host_weight(self) -> torch.Tensor:
        return self.__dict__["_host_table"].weight

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def fused(self) -> bool:
        return self.optimizer is not None

    def _row_bytes(self) -> int:
        return self.dim * self.weight.element_size() + self.state.shape[1] * 4

    def resident_rows(self) -> torch.Tensor:
        """Host positions of the rows now in the cache."""
        return self.slot_row[self.slot_row >= 0]

    # ------------------------------------------------------------------ host <-> device moves
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=t.is_pinned())

    def _evict(self, slots: torch.Tensor) -> None:
        """Write back the rows held by ``slots`` (weights, optimizer state, counts) and free the slots."""
        occupied = slots[self.slot_row.index_select(0, slots) >= 0]
        if occupied.numel() == 0:
            return
        self._write_back(occupied)
        rows = self.slot_row.index_select(0, occupied)
        self.row_slot.index_fill_(0, rows, -1)
        self.slot_row.index_fill_(0, occupied, -1)
        self.slot_score.index_fill_(0, occupied, EMPTY_SCORE)

    def _write_back(self, slots: torch.Tensor) -> None:
        rows = self.slot_row.index_select(0, slots)
        host_rows = rows.cpu()
        if self.mode == LFU:
            self.host_count.index_copy_(0, host_rows, self.slot_score.index_select(0, slots).cpu())
        if not self.fused:
            return  # autograd mode: the host table is the truth, slots are read-only copies
        w = gather_rows(self.weight, slots, validate=False).cpu()
        scatter_rows(self.host_weight.data, host_rows, w, validate=False)
        if self.state.shape[1]:
            scatter_rows(self.host_state, host_rows, gather_rows(self.state, slots, validate=False).cpu(),
                         validate=False)
        n = slots.numel()
        self.stats["rows_written_back"] += n
        self.stats["bytes_to_host"] += n * self._row_bytes()

    def _load(self, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor | None, pin_until: int) -> None:
        """Copy host rows (and their state and counts) into free ``slots`` and index them."""
        host_rows = rows.cpu()
        w = gather_rows(self.host_weight.data, host_rows, validate=False)
        scatter_rows(self.weight, slots, self._to_device(w), validate=False)
        if self.state.shape[1]:
            st = gather_rows(self.host_state, host_rows, validate=False)
            scatter_rows(self.state, slots, self._to_device(st), validate=False)
        if self.mode == LFU:
            score = self._to_device(self.host_count.index_select(0, host_rows))
            if counts is not None:
                score = score + counts
        elif self.mode == LRU:
            score = torch.full_like(slots, self.step)
        else:
            score = self._to_device(self.static_freq.index_select(0, host_rows))  # type: ignore[union-attr]
        self.slot_score.index_copy_(0, slots, score)
        self.slot_row.index_copy_(0, slots, rows)
        self.row_slot.index_copy_(0, rows, slots.to(torch.int32))
        self.pinned_until.index_copy_(0, slots, torch.full_like(slots, max(pin_until, self.step)))
        n = rows.numel()
        self.stats["rows_loaded"] += n
        self.stats["bytes_to_device"] += n * self._row_bytes()

    # ------------------------------------------------------------------ the per-batch path
    def check_range(self, uniq: torch.Tensor) -> None:
        """Raise if a (sorted, unique) id is outside the table."""
        if uniq.numel() == 0:
            return
        lo, hi = int(uniq[0]), int(uniq[-1])
        if lo < 0 or hi >= self.num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"table {self.name!r}: id {bad} is outside its range [0, {self.num_rows}); "
                             f"ids must satisfy 0 <= id < num_embeddings={self.num_rows} (hash or clip the "
                             "feature before the lookup, or enlarge the table)")

    def prepare(self, ids: torch.Tensor, *, pin_until: int = 0, count: bool = True) -> Batch:
        """Make the batch's rows resident (or spill them); returns the resolved :class:`Batch`."""
        self.maybe_refresh()
        ids = ids.to(self.device, torch.int64)
        uniq, inv, counts = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
        self.check_range(uniq)
        rows = self.remap.index_select(0, uniq) if self.remap is not None else uniq
        before = dict(self.stats)
        if count:
            self.step += 1
        step = self.step
        touch = counts if count else torch.zeros_like(counts)
        slots = cache_lookup(self.row_slot, rows, touch, self.slot_score, self.pinned_until, step,
                             self.mode if count else STATIC)
        miss = torch.nonzero(slots < 0).squeeze(1)
        m = miss.numel()
        spill_pos = miss[:0]
        if m:
            victims = select_victims(self.slot_score, self.pinned_until, step, m)
            room = victims.numel()
            if self.mode == LRU or room == 0:
                load_pos, spill_pos = miss[:room], miss[room:]
            else:
                # Frequency-aware admission: a miss takes a slot only from a colder row (free slots are
                # coldest of all), hottest misses first; the rest are served from host memory this batch.
                # Candidates sorted down and victims sorted up make "miss beats victim" a prefix.
                cand, order = torch.sort(self._admission_scores(rows.index_select(0, miss),
                                                                touch.index_select(0, miss)), descending=True)
                vic, vorder = torch.sort(self.slot_score.index_select(0, victims))
                k = min(room, m)
                admit = int((cand[:k] > vic[:k]).sum())
                victims = victims.index_select(0, vorder[:admit])
                load_pos, spill_pos = miss.index_select(0, order[:admit]), miss.index_select(0, order[admit:])
            if load_pos.numel():
                self._evict(victims[: load_pos.numel()])
                self._load(rows.index_select(0, load_pos), victims[: load_pos.numel()],
                           touch.index_select(0, load_pos), pin_until)
                slots.index_copy_(0, load_pos, victims[: load_pos.numel()])
            if m > room and count:  # a prefetch that finds no room simply loads less
                self._spill_notice(uniq.numel(), m - room)
            if spill_pos.numel() and count and self.mode == LFU:
                self.host_count.index_add_(0, rows.index_select(0, spill_pos).cpu(),
                                           counts.index_select(0, spill_pos).cpu())
        if pin_until > step:
            hit = slots[slots >= 0]
            self.pinned_until.index_copy_(0, hit, self.pinned_until.index_select(0, hit).clamp(min=pin_until))
        if count:
            self.stats["steps"] += 1
            self.stats["lookups"] += uniq.numel()
            self.stats["hits"] += uniq.numel() - m
            self.stats["misses"] += m
            self.stats["rows_spilled"] += spill_pos.numel()
        self.last_step = {k: self.stats[k] - before[k] for k in STAT_KEYS}
        return Batch(uniq=uniq, rows=rows, inv=inv, slots=slots, spill_pos=spill_pos)

    def _admission_scores(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """What a missed row would score in a slot (LFU: its count with this batch; static: dataset count)."""
        host_rows = rows.cpu()
        if self.mode == LFU:
            return self._to_device(self.host_count.index_select(0, host_rows)) + counts
        return self._to_device(self.static_freq.index_select(0, host_rows))  # type: ignore[union-attr]

    def _spill_notice(self, unique: int, spilled: int) -> None:
        msg = (f"table {self.name!r}: the batch has {unique} unique ids but only {self.capacity} slots "
               f"(some pinned); {spilled} rows are read from and updated in host memory for this batch. "
               "Raise CacheConfig.capacity or use smaller batches to avoid the host round trip.")
        global _SPILL_WARNED
        if not _SPILL_WARNED:
            log.warning(msg + " (logged once per process; later spills at DEBUG level, counted in cache_stats()"
                        "['rows_spilled'])")
            _SPILL_WARNED = True
        else:
            log.debug(msg)

    def gather(self, batch: Batch) -> torch.Tensor:
        """The (U, dim) rows of the batch, from the slots and, for spilled rows, from host memory."""
        if batch.spill_pos.numel() == 0:
            return gather_rows(self.weight, batch.slots, validate=False)
        out = torch.empty(batch.slots.numel(), self.dim, dtype=self.weight.dtype, device=self.device)
        resident = torch.nonzero(batch.slots >= 0).squeeze(1)
        scatter_rows(out, resident, gather_rows(self.weight, batch.slots.index_select(0, resident),
                                                validate=False), validate=False)
        host_rows = batch.rows.index_select(0, batch.spill_pos).cpu()
        spilled = self._to_device(gather_rows(self.host_weight.data, host_rows, validate=False))
        scatter_rows(out, batch.spill_pos, spilled, validate=False)
        return out

    def apply_grad(self, batch: Batch, grad_rows: torch.Tensor) -> None:
        """Fused optimizer step on the batch's rows, wherever each row is now (slot or host)."""
        assert self.optimizer is not None
        self.opt_step += 1
        if batch.rows.numel() == 0:
            return
        # Resolve again: another forward may have moved rows between this batch's forward and backward.
        slots = self.row_slot.index_select(0, batch.rows).long()
        resident = torch.nonzero(slots >= 0).squeeze(1)
        if resident.numel():
            s = slots.index_select(0, resident)
            w, st = apply_update(self.optimizer, gather_rows(self.weight, s, validate=False),
                                 gather_rows(self.state, s, validate=False), grad_rows.index_select(0, resident),
                                 self.opt_step)
            scatter_rows(self.weight, s, w, validate=False)
            if st.shape[1]:
                scatter_rows(self.state, s, st, validate=False)
        elsewhere = torch.nonzero(slots < 0).squeeze(1)
        if elsewhere.numel():
            host_rows = batch.rows.index_select(0, elsewhere).cpu()
            w, st = apply_update(self.optimizer, gather_rows(self.host_weight.data, host_rows, validate=False),
                                 gather_rows(self.host_state, host_rows, validate=False),
                                 grad_rows.index_select(0, elsewhere).cpu(), self.opt_step)
            scatter_rows(self.host_weight.data, host_rows, w, validate=False)
            if st.shape[1]:
                scatter_rows(self.host_state, host_rows, st, validate=False)

    def sparse_grad(self, batch: Batch, grad_rows: torch.Tensor) -> torch.Tensor:
        """Autograd mode: the host table's sparse gradient; the rows are refreshed after the optimizer step."""
        host_rows = batch.rows.cpu()
        self._dirty.append(host_rows)
        return torch.sparse_coo_tensor(host_rows.unsqueeze(0), grad_rows.to("cpu", self.host_weight.dtype),
                                       tuple(self.host_weight.shape), check_invariants=False)

    def maybe_refresh(self) -> None:
        """Autograd mode: copy rows an optimizer changed on the host back into their slots."""
        version = self.host_weight._version
        if version == self._seen_version:
            return
        self._seen_version = version
        if not self._dirty:
            return
        rows = torch.unique(torch.cat(self._dirty))
        self._dirty.clear()
        slots = self.row_slot.index_select(0, rows.to(self.device)).long()
        resident = torch.nonzero(slots >= 0).squeeze(1)
        if resident.numel():
            w = gather_rows(self.host_weight.data, rows.index_select(0, resident.cpu()), validate=False)
            scatter_rows(self.weight, slots.index_select(0, resident), self._to_device(w), validate=False)

    # ------------------------------------------------------------------ whole-cache operations
    def warm(self, rows: torch.Tensor) -> int:
        """Load ``rows`` (host positions, hottest first) into free slots; returns how many were loaded."""
        rows = rows.to(self.device, torch.int64)
        rows = rows[self.row_slot.index_select(0, rows) < 0]
        free = torch.nonzero(self.slot_row < 0).squeeze(1)
        n = min(free.numel(), rows.numel())
        if n:
            self._load(rows[:n], free[:n], None, 0)
            self.stats["rows_loaded"] -= n  # warm-up is not traffic of a training step
            self.stats["bytes_to_device"] -= n * self._row_bytes()
        return n

    def flush(self) -> None:
        """Write every resident row back to host memory (the slots stay valid)."""
        occupied = torch.nonzero(self.slot_row >= 0).squeeze(1)
        if occupied.numel():
            self._write_back(occupied)

    def reload(self) -> None:
        """Re-read every resident row (and its state) from host memory, after the host table changed."""
        occupied = torch.nonzero(self.slot_row >= 0).squeeze(1)
        if occupied.numel():
            host_rows = self.slot_row.index_select(0, occupied).cpu()
            w = gather_rows(self.host_weight.data, host_rows, validate=False)
            scatter_rows(self.weight, occupied, self._to_device(w), validate=False)
            if self.state.shape[1]:
                st = gather_rows(self.host_state, host_rows, validate=False)
                scatter_rows(self.state, occupied, self._to_device(st), validate=False)
        self._dirty.clear()
        self._seen_version = self.host_weight._version

    def pin_host_memory(self) -> None:
        """Page-lock the host table and state so host-to-device copies run asynchronously (CUDA only)."""
        if not torch.cuda.is_available():
            return
        weight = self.host_weight
        if not weight.is_pinned():
            weight.data = weight.data.pin_memory()
            self._seen_version = weight._version
        if not self.host_state.is_pinned():
            self.host_state = self.host_state.pin_memory()

    def extra_repr(self) -> str:
        return (f"table={self.name!r}, rows={self.num_rows}, dim={self.dim}, slots={self.capacity}, "
                f"policy={self.policy!r}, optimizer={self.optimizer.kind if self.optimizer else None!r}")
