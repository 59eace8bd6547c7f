"""One fused software cache per collection: every table's rows in one key space, hot rows in device slots.

Layout (as FBGEMM's table-batched embeddings do it; :mod:`torchrec_cache.layout`): table ``t`` owns keys
``[key_start[t], key_start[t] + rows[t])`` and a run of *sets* of ``WAYS`` slots. A key lives only in its own set (a
hash of the row id picks it), so the id -> slot index is the slots' own key array: no entry per table row, device
memory proportional to the cache. A table whose rows all fit is direct-mapped and stays wholly on the device. Ways
beyond a table's planned capacity are disabled, so the per-table split of the planner (:mod:`tightfit.planner.cache`)
holds exactly. Tables of one embedding dim and dtype share one slot tensor (:mod:`torchrec_cache.rows`); the index,
the policy and the per-batch work are one for the whole collection.

A batch enters through one of three entry points, all tables at once: :meth:`FusedCache.lookup` (a forward: counted,
its rows held until the backward), :meth:`FusedCache.prefetch` (a later batch's rows loaded ahead and pinned until it
runs) and :meth:`FusedCache.enter_window` (a batch entering the prefetch window: its cached rows learn when they are
used next). They share the stages: settle what earlier batches left, dedupe the ids (sort based, fixed sizes), probe
the sets, choose slots for the misses (:mod:`torchrec_cache.policy`), move the rows, hold them. A lookup reads device
values on the host twice (:func:`torchrec_cache.sync.read_host`): the batch's sizes, then the keys to load and spill.
The backward reads none. A batch with more distinct rows in a set than the set can give is not an error: those rows
are read from host memory for this batch (a logged "spill") and updated there.

Rows a batch reads are held (a per-slot count) until its backward, or in eval until its lookup read
them, so gradient accumulation and a prefetch thread cannot move them; rows it spilled stay out until then.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch
from torch import nn

import torchrec_cache.policy as rules
from torchrec_cache.config import RowOptimizer
from torchrec_cache.counters import STAT_KEYS, CacheCounters
from torchrec_cache.layout import Batch, KeyIndex, KeySpace, SlotGroup, TableSpec, spill_notice
from torchrec_cache.policy import DISABLED, FREE, TRASH_KEY
from torchrec_cache.rows import RowStore
from torchrec_cache.sketch import SKETCH_BYTES_PER_SLOT, FrequencySketch
from torchrec_cache.sync import StepClock, read_host
from torchrec_cache.tensors import compact, isin_sorted, unique_padded
from torchrec_cache.tier import DiskSpec
from torchrec_cache.window import Window

__all__ = ["WAYS", "STAT_KEYS", "SLOT_OVERHEAD_BYTES", "TableSpec", "Batch", "Window", "FusedCache"]


# Device bytes per slot besides the row and its state: key 8, score 8, pin 4, hold 4, next use 4, sketch.
SLOT_OVERHEAD_BYTES = 28 + SKETCH_BYTES_PER_SLOT
WAYS = 32  # slots per set: FBGEMM's GPU cache uses 32 (one warp compares a key with every way at once)
_POLICIES = ("lfu", "lru", "static")
_NO_KEYS = torch.empty(0, dtype=torch.int64)  # a batch's host spill keys until it has some (read only)


class _Moves(NamedTuple):
    """What sync 2 read back: the loads and spills of a batch, positions in its unique keys."""

    load_pos: torch.Tensor  # device
    spill_pos: torch.Tensor  # device
    load_keys: torch.Tensor  # host, sorted
    spill_keys: torch.Tensor  # host, sorted
    evicted: torch.Tensor  # host: the key each load evicts (-1: a free slot)
    victims: torch.Tensor  # device: the slot of each load


class FusedCache(nn.Module):
    """The device slots of all tables of a collection and the set-associative index over them.

    Args:
        tables: the :class:`TableSpec` list, in the collection's table order.
        policy: ``"lfu"`` (frequency from a count-min sketch, aged like TinyLFU), ``"lru"`` or ``"static"``
            (the dataset frequencies, frozen).
        optimizer: the fused :class:`RowOptimizer`, or ``None`` for plain autograd (sparse gradients on the
            host tables; the cache only reads).
        device: where the slots live (``"meta"``: nothing is allocated until :meth:`materialize_host`).
        ways: slots per set.
        disk: the full tables on disk with a host cache level (:class:`~torchrec_cache.tier.DiskSpec`).

    Example:
        >>> c = FusedCache([TableSpec(name="t", rows=1000, dim=4, capacity=64)], policy="lfu", optimizer=None,
        ...                device="cpu")
        >>> c.finish_setup(); b = c.lookup(torch.tensor([5, 7, 5]), torch.tensor([3]), torch.tensor([0]))
        >>> b.uniq.tolist(), c.stats_total()["misses"]
        ([5, 7], 2)
    """

    # Registered buffers, annotated so type checkers do not read them as ``Tensor | Module``.
    slot_key: torch.Tensor
    slot_score: torch.Tensor
    next_use: torch.Tensor
    pinned_until: torch.Tensor
    hold: torch.Tensor
    hit_level: torch.Tensor

    def __init__(self, tables: list[TableSpec], *, policy: str, optimizer: RowOptimizer | None,
                 device: torch.device | str, ways: int | None = None, disk: DiskSpec | None = None) -> None:
        super().__init__()
        if policy not in _POLICIES:
            raise ValueError(f"policy {policy!r} is unknown; choose one of {', '.join(_POLICIES)}")
        if not tables:
            raise ValueError("a FusedCache needs at least one table")
        device = torch.device(device)
        self.space = space = KeySpace.of(list(tables), int(ways or WAYS))
        self.specs, self.policy, self.optimizer, self.ways = list(tables), policy, optimizer, space.ways
        self.names = [t.name for t in tables]
        self.index = {t.name: i for i, t in enumerate(tables)}
        self.layout = list(space.order)  # table indices in key order
        self.capacity = {t.name: space.capacity[i] for i, t in enumerate(tables)}
        self.num_keys, self.num_sets, self.num_slots = space.num_keys, space.num_sets, space.num_slots
        self.lock = threading.RLock()  # the prefetch thread and the training thread share the cache
        self.clock = StepClock()  # the step of the last batch whose lookup has read its rows
        self.step_trains = False  # whether that lookup's rows are held for a backward
        self.step = 0
        self._next_batch = 0
        self._spill_held: dict[int, torch.Tensor] = {}
        self._released: list[tuple[int, torch.Tensor]] = []  # holds of batches whose graph died without a backward
        self.key_index = KeyIndex(space, device)
        self._register_slot_buffers(device)
        self.sketch = FrequencySketch(self.num_slots, device=device)
        tier = None if disk is None else disk.open(space, [self._row_bytes(t) for t in tables], self.sketch, self.lock,
                                                   device)
        self.store = RowStore(space, optimizer, device, lock=self.lock, tier=tier)
        self.counters = CacheCounters(row_bytes=[self._row_bytes(t) for t in tables],
                                      key_starts=torch.tensor(space.key_bounds, dtype=torch.int64),
                                      key_order=list(space.order))

    def _register_slot_buffers(self, device: torch.device) -> None:
        """Per slot (+1 trash slot at index C that absorbs writes for rows without a slot): 28 bytes."""
        n = self.num_slots + 1
        for name, fill, dtype in (("slot_key", DISABLED, torch.int64), ("slot_score", 0, torch.int64),
                                  ("next_use", 0, torch.int32), ("pinned_until", -1, torch.int32),
                                  ("hold", 0, torch.int32)):
            self.register_buffer(name, torch.full((n,), fill, dtype=dtype, device=device), persistent=False)
        self.register_buffer("hit_level", torch.zeros(1, device=device), persistent=False)  # recent traffic hit rate

    def _row_bytes(self, t: TableSpec) -> int:
        """Bytes one row of ``t`` moves (weights and optimizer state)."""
        state = self.optimizer.state_columns(t.dim) if self.optimizer else 0
        return t.dim * torch.empty((), dtype=t.dtype).element_size() + 4 * state

    # ------------------------------------------------------------------ basic properties
    @property
    def device(self) -> torch.device:
        return self.slot_key.device

    @property
    def fused(self) -> bool:
        return self.optimizer is not None

    @property
    def groups(self) -> list[SlotGroup]:
        """The slot-tensor groups (their host tables included): :attr:`store`'s."""
        return self.store.groups

    def group_of(self, name: str) -> int:
        """Index of the slot-tensor group holding table ``name``."""
        return self.space.group_index[self.index[name]]

    def key_start(self, name: str) -> int:
        """First key of table ``name`` in the collection's key space."""
        return self.space.key_start[self.index[name]]

    # ------------------------------------------------------------------ set-up
    def materialize_host(self) -> None:
        """Allocate the host tables of a cache built on the meta device (uninitialised, like ``to_empty``)."""
        self.sketch.table.zero_()
        self.store.materialize()

    def pin_host_memory(self) -> bool:
        """Page-lock the host tables and state so host-to-device copies run asynchronously (CUDA only)."""
        return self.store.pin()

    def seed_frequencies(self, counts: dict[str, torch.Tensor]) -> None:
        """Add dataset counts to the frequency sketch (the ``static`` policy reads only these)."""
        for name, c in counts.items():
            ids = torch.nonzero(c > 0).squeeze(1)
            self.sketch.add((ids + self.key_start(name)).to(self.device), c.index_select(0, ids).to(self.device))

    def finish_setup(self, hottest: dict[str, torch.Tensor] | None = None) -> None:
        """Empty the cache, load every direct-mapped table wholly and warm the others with ``hottest`` ids."""
        with self.lock:
            self.key_index.restore()
            self.slot_key.fill_(DISABLED)
            self.slot_key[self.num_slots] = TRASH_KEY
            self.slot_score.zero_()
            self.hit_level.zero_()
            self.next_use.zero_()
            self.pinned_until.fill_(-1)
            self.hold.zero_()
            W, space = self.ways, self.space
            for i, t in enumerate(self.specs):
                base = space.set_start[i] * W
                for j, e in enumerate(space.enabled[i]):
                    self.slot_key[base + j * W: base + j * W + e] = FREE
                key0 = space.key_start[i]
                if space.direct[i]:
                    ids = torch.arange(t.rows)
                    self._load_free(ids + key0, (ids + base).to(self.device))
                elif hottest is not None and t.name in hottest:
                    keys = hottest[t.name].long()[: self.capacity[t.name]].to(self.device) + key0
                    chosen, slots = rules.free_ways(self.slot_key, self.key_index.sets_of(keys), W)
                    self._load_free(keys.index_select(0, chosen).cpu(), slots)
            self.counters.reset()

    def _load_free(self, keys_h: torch.Tensor, slots: torch.Tensor) -> None:
        """Load rows ``keys_h`` (host) into free ``slots`` outside any batch (set-up, no stats)."""
        if keys_h.numel() == 0:
            return
        keys = keys_h.to(self.device)
        self.store.load(keys_h, slots)
        self.slot_key.index_copy_(0, slots, keys)
        score = self.sketch.estimate(keys) if self.policy != "lru" else torch.zeros_like(keys)
        self.slot_score.index_copy_(0, slots, score)

    def find(self, keys: torch.Tensor, sets: torch.Tensor | None = None) -> torch.Tensor:
        """Slot of each key, -1 where it is not cached (no side effects)."""
        if keys.numel() == 0:
            return keys.new_empty(0)
        sets = self.key_index.sets_of(keys) if sets is None else sets
        ways = self.slot_key[: self.num_slots].view(self.num_sets, self.ways).index_select(0, sets)
        match = ways == keys.unsqueeze(1)
        way = match.to(torch.uint8).argmax(1)
        return torch.where(match.any(1), sets * self.ways + way, torch.full_like(sets, -1))

    # ------------------------------------------------------------------ the entry points of a batch
    def lookup(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor, *,
               value_bounds: list[int] | None = None, train: bool = True) -> Batch:
        """A forward's batch: its rows made resident (or spilled) for all tables at once, counted in the
        stats and the policy, and held until its backward (``train``) or until the lookup read them.

        Args:
            values: (L,) row ids of every feature, feature after feature (features grouped as the key order).
            lengths: (F * B,) bag lengths, feature-major as in a ``KeyedJaggedTensor``.
            feature_table: (F,) the table index of each feature (a device tensor).
            value_bounds: per slot-tensor group, its ids' run in ``values`` (G + 1 host ints); needed only
                when the tables have several embedding dims.
            train: hold the rows until :meth:`release` (the backward updates them) rather than until
                :meth:`gathered`.
        """
        self.store.wait_staged(self.step + 1)  # the disk tier's read-ahead of this batch, waited for unlocked
        with self.lock:
            batch = self._counted(values, lengths, feature_table, value_bounds)
        batch.train = train
        batch.groups_left = len(self.groups)
        return batch

    def prefetch(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor, *, until: int,
                 value_bounds: list[int] | None = None, window: Window | None = None) -> Batch:
        """Load the rows of a batch that runs at step ``until`` now, and pin them until then. Not counted in
        the stats or the policy; a row that finds no slot is left to the batch's own lookup.

        ``window``: the keys later batches of the prefetch window need and when; a missing row needed
        sooner than a cached one takes its slot (Belady inside the window). Other arguments: :meth:`lookup`.
        """
        self.store.wait_staged(until)  # its rows' read-ahead, waited for without holding the step up
        with self.lock:
            self._settle(after_lookups=True)
            batch, counts = self._dedupe(self._ids(values), lengths, feature_table, value_bounds)
            if batch.uniq.numel():
                self._place(batch, counts, until=max(batch.step, until), counted=False, window=window)
            return batch

    def enter_window(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor, *,
                     step: int, value_bounds: list[int] | None = None) -> Batch:
        """Window bookkeeping: a batch entering the prefetch window, to run at ``step``. Its rows already
        cached learn that step as their next use (inside the window the row used last leaves first);
        nothing is loaded or counted. Arguments: :meth:`lookup`."""
        with self.lock:
            self._settle(after_lookups=True)
            batch, _ = self._dedupe(self._ids(values), lengths, feature_table, value_bounds)
            if batch.uniq.numel():
                _, hit, batch.slots = self._probe(batch.uniq)
                self._note_next_use(batch.slots, batch.step, max(batch.step, step))
                keys = read_host(batch.uniq[~hit]) if self.store.tier is not None else None
        if batch.uniq.numel() and keys is not None:  # the window reaches the disk: misses read ahead, unlocked
            self.store.stage(keys, max(batch.step, step))
        return batch

    # ------------------------------------------------------------------ the stages they share
    def _counted(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor,
                 value_bounds: list[int] | None) -> Batch:
        """A lookup's stages (under the lock): a new step, its rows placed, counted and held."""
        self._settle(after_lookups=False)
        values = self._ids(values)
        self.step += 1
        self.store.forget_staged(self.step)
        batch, counts = self._dedupe(values, lengths, feature_table, value_bounds)
        if batch.uniq.numel():
            self._place(batch, counts, until=batch.step, counted=True, window=None)
            self._hold(batch)
        return batch

    def _settle(self, *, after_lookups: bool) -> None:
        """Before a batch: finish pending host updates, drop the holds of dead batches, refresh rows a host
        optimizer changed; a prefetch's loads also wait for every lookup queued before it (CUDA)."""
        self.store.mover.apply_pending()
        self.store.write_back()  # disk tier: the rows earlier batches evicted; a failed write raises here
        self._release_dead()
        self.store.refresh_if_changed(self.find)
        if after_lookups and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(torch.cuda.default_stream(self.device))

    def _ids(self, values: torch.Tensor) -> torch.Tensor:
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got dtype {values.dtype}; a float id such as 1.7 is "
                            "not a row: cast the feature to int64 before the lookup (as TorchRec requires)")
        return values.to(self.device, torch.int64)

    def _dedupe(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor,
                value_bounds: list[int] | None) -> tuple[Batch, torch.Tensor]:
        """The batch's sorted unique keys, each id's index among them and each table's run (sync 1 of 2),
        with the keys' use counts; ids outside their table raise here."""
        L = values.numel()
        keys, tab = self.key_index.keys(values, lengths, feature_table)
        bad = self.key_index.out_of_range(values, tab)
        uniq_pad, counts_pad, inv, seg = unique_padded(keys)
        bounds = torch.searchsorted(uniq_pad, self.key_index.bounds)  # per key-ordered table, its run in uniq
        head = torch.cat([torch.stack([seg[-1] + 1 if L else seg.new_zeros(()), bad.long()]), bounds])
        sizes = read_host(head)  # sync 1 of 2: the number of unique keys and each table's share
        U = int(sizes[0])
        if bool(sizes[1]):
            self.key_index.raise_out_of_range(values, tab)
        if value_bounds is None:
            if len(self.groups) > 1:
                raise ValueError("a cache over tables of several embedding dims needs value_bounds per group")
            value_bounds = [0, L]
        bid = self._next_batch
        self._next_batch += 1
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        batch = Batch(uniq=uniq_pad[:U], inv=inv, slots=empty, key_bounds=sizes[2:].tolist(),
                      value_bounds=value_bounds, spill_pos=empty, spill_keys=_NO_KEYS,
                      step=self.step, id=bid)
        return batch, counts_pad[:U]

    def _probe(self, uniq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sets, hit, slot)`` of each unique key: its set, whether it is cached, and its slot (the
        trash slot C where it is not)."""
        sets = self.key_index.sets_of(uniq)
        slot = self.find(uniq, sets)
        hit = slot >= 0
        return sets, hit, torch.where(hit, slot, self.num_slots)

    def _note_next_use(self, hit_slots: torch.Tensor, step: int, until: int) -> None:
        """The cached rows ``hit_slots`` are used at step ``until`` (kept if they are needed sooner)."""
        nu = self.next_use.index_select(0, hit_slots)
        self.next_use.index_copy_(0, hit_slots, torch.where(nu > step, torch.clamp(nu, max=until),
                                                            torch.full_like(nu, until)))

    def _place(self, batch: Batch, counts: torch.Tensor, *, until: int, counted: bool, window: Window | None) -> None:
        """Pin the batch's hits until ``until`` (so no miss of the batch evicts them), choose slots for its
        misses, read the plan on the host (sync 2 of 2), move the rows; fills ``batch``'s slots and spills."""
        sets, hit, hit_or_trash = self._probe(batch.uniq)
        self.pinned_until.index_copy_(0, hit_or_trash, torch.clamp(
            self.pinned_until.index_select(0, hit_or_trash), min=until))
        # Each row's next use in the window (NEVER: none known); a prefetched batch's hits learn theirs too.
        miss_next = window.next_use(batch.uniq) if window is not None else torch.full_like(batch.uniq, rules.NEVER)
        next_use = None  # without a window every row's next use is unknown: 0
        if window is not None:
            next_use = torch.where(miss_next < rules.NEVER, miss_next, 0)
            self.next_use.index_copy_(0, hit_or_trash, next_use.int())
        if counted:  # policy scores of the hits, drift reset, sketch counts and their ageing
            rules.observe(self.policy, self.sketch, self.slot_score, self.hit_level, hit_or_trash, hit, batch.uniq,
                          counts, batch.step, batch.inv.numel())
        prio = self.sketch.estimate(batch.uniq) if self.policy != "lru" else torch.zeros_like(batch.uniq)
        admit, victim, spill = self._choose(batch, sets, hit, prio, miss_next, counted)
        moves = self._read_moves(batch.uniq, admit, spill, victim)
        if moves.load_keys.numel():
            self._load(moves, batch.uniq.index_select(0, moves.load_pos), prio.index_select(0, moves.load_pos),
                       batch.step, until)
            if next_use is None:
                self.next_use.index_fill_(0, moves.victims, 0)
            else:
                self.next_use.index_copy_(0, moves.victims, next_use.index_select(0, moves.load_pos).int())
            batch.slots = hit_or_trash.index_copy(0, moves.load_pos, moves.victims)
        else:
            batch.slots = hit_or_trash
        batch.spill_pos, batch.spill_keys = moves.spill_pos, moves.spill_keys
        self.counters.account(counted, batch.key_bounds, moves.load_keys, moves.spill_keys,
                              moves.evicted if self.fused else moves.evicted[:0])
        self.store.write_back()  # disk tier: the rows this placement evicted, written while the step computes
        if moves.spill_keys.numel() and counted:
            spill_notice(batch.uniq.numel(), moves.spill_keys.numel(), self.num_slots)

    def _choose(self, batch: Batch, sets: torch.Tensor, hit: torch.Tensor, prio: torch.Tensor,
                miss_next: torch.Tensor, counted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(admit, victim slot, spill)`` per unique key: which misses take which slot, which a lookup reads
        from host memory instead (a prefetch leaves those to the lookup)."""
        C = self.num_slots
        miss = ~hit
        # Rows a held batch spilled stay out of the cache until its backward.
        miss_ok = miss & ~isin_sorted(batch.uniq, list(self._spill_held.values())) if self._spill_held else miss
        # A lookup keeps its own rows. An eval lookup's rows are free for the prefetch once it read them (held
        # until then): as Belady may, the next batch's loads may evict them. A training step's rows are held
        # until its backward, which the prefetch overlaps: they stay whatever the timing, so it is reproducible.
        vkey = rules.victim_keys(self.slot_key[:C], self.slot_score[:C], self.pinned_until[:C], self.hold[:C],
                                 self.next_use[:C], batch.step, counted or self.step_trains)
        admit, victim = rules.choose_slots(self.policy, vkey, self.ways, sets, miss, prio, miss_next, batch.step,
                                           allowed=miss_ok)
        spill = miss & ~admit if counted else torch.zeros_like(miss)
        return admit, victim, spill

    def _read_moves(self, uniq: torch.Tensor, admit: torch.Tensor, spill: torch.Tensor,
                    victim: torch.Tensor) -> _Moves:
        """Compact loads then spills (order kept) and read them on the host with the evicted keys (sync 2)."""
        U = uniq.numel()
        ordr, na_d, ns_d = compact(admit, spill)
        evict = torch.where(admit, self.slot_key.index_select(0, torch.where(admit, victim, self.num_slots)), -1)
        packed = read_host(torch.cat([torch.stack([na_d, ns_d]), uniq.index_select(0, ordr),
                                      evict.index_select(0, ordr)]))  # sync 2 of 2
        na, ns = int(packed[0]), int(packed[1])
        load_pos = ordr[:na]
        return _Moves(load_pos=load_pos, spill_pos=ordr[na:na + ns], load_keys=packed[2:2 + na],
                      spill_keys=packed[2 + na:2 + na + ns], evicted=packed[2 + U:2 + U + na],
                      victims=victim.index_select(0, load_pos))

    def _load(self, moves: _Moves, keys: torch.Tensor, prio: torch.Tensor, step: int, until: int) -> None:
        """The loads: evicted rows written back, new rows copied in, their slots' key, score and pin set."""
        self.store.exchange(moves.load_keys, moves.evicted, moves.victims)
        self.slot_key.index_copy_(0, moves.victims, keys)
        self.slot_score.index_copy_(0, moves.victims, torch.full_like(keys, step) if self.policy == "lru" else prio)
        self.pinned_until.index_fill_(0, moves.victims, until)

    def _hold(self, batch: Batch) -> None:
        """Hold the batch's slots (and keep the rows it spilled out) until :meth:`release`."""
        self.hold.index_add_(0, batch.slots, torch.ones_like(batch.slots, dtype=torch.int32))
        batch.held = True
        if batch.spill_keys.numel() and self.fused:
            self._spill_held[batch.id] = batch.uniq.index_select(0, batch.spill_pos)
        batch.finalizer = weakref.finalize(batch, self._released.append, (batch.id, batch.slots))

    # ------------------------------------------------------------------ rows, gradients, release
    def release(self, batch: Batch) -> None:
        """The batch's backward is done: its rows may move again."""
        if not batch.held:
            return
        with self.lock:
            batch.held = False
            if batch.finalizer is not None:
                batch.finalizer.detach()
            self._spill_held.pop(batch.id, None)
            self.hold.index_add_(0, batch.slots, torch.full_like(batch.slots, -1, dtype=torch.int32))

    def gathered(self, batch: Batch) -> None:
        """The lookup has read the batch's rows: an eval batch's rows may move now; a prefetch waiting for this
        step goes on (its loads may then evict them, as Belady may evict the rows of the previous batch)."""
        self.step_trains = batch.train
        if not batch.train:
            self.release(batch)
        self.clock.advance(batch.step)

    def _release_dead(self) -> None:
        while self._released:
            bid, slots = self._released.pop()
            self._spill_held.pop(bid, None)
            self.hold.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))

    # ------------------------------------------------------------------ whole-cache operations
    def flush(self) -> None:
        """Write every resident row (weights and optimizer state) back to host memory; the slots stay valid."""
        with self.lock:
            self.store.flush(self.slot_key)

    def reload(self) -> None:
        """Re-read every resident row (and its state) from host memory, after the host tables changed."""
        with self.lock:
            self.store.reload(self.slot_key)

    def resident_rows(self, name: str) -> torch.Tensor:
        """Ids of table ``name`` now in the cache."""
        i = self.index[name]
        keys = self.slot_key[self.slot_key >= 0]
        k0 = self.space.key_start[i]
        return keys[(keys >= k0) & (keys < k0 + self.specs[i].rows)] - k0

    def stats_total(self) -> dict[str, int]:
        """Counters since construction (per table and last step: :attr:`counters`)."""
        return self.counters.total()

    def extra_repr(self) -> str:
        return (f"tables={len(self.specs)}, slots={self.num_slots} in {self.num_sets} sets of {self.ways}, "
                f"groups={len(self.groups)}, policy={self.policy!r}, "
                f"optimizer={self.optimizer.kind if self.optimizer else None!r}")
