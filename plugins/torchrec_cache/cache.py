"""One fused software cache per collection: every table's rows in one key space, hot rows in device slots.

Layout (as FBGEMM's table-batched embeddings do it): table ``t`` owns keys ``[key_offset[t],
key_offset[t] + rows[t])`` and a run of *sets* of ``WAYS`` slots. A key lives only in its own set
(a hash of the row id picks it), so the id -> slot index is the slots' own key array: no entry per
table row, device memory proportional to the cache. A table whose rows all fit is direct-mapped
(row ``i`` in slot ``i`` of its run) and stays wholly on the device. Ways beyond a table's planned
capacity are disabled, so the per-table split of the planner (:mod:`tightfit.planner.cache`) holds
exactly. Tables of one embedding dim and dtype share one slot tensor (a DLRM has one); the index,
the policy and the per-batch work are one for the whole collection.

Every batch goes through :meth:`FusedCache.prepare` once for all tables: unique keys (sort based,
fixed sizes), one set lookup, one victim choice for all misses (:mod:`torchrec_cache.policy`), one
write-back and one load per slot tensor. It reads device values on the host
twice (:func:`torchrec_cache.sync.read_host`): the batch's sizes, then the keys to load and spill.
The backward reads none. A batch with more distinct rows in a set than the set can give is not an
error: those rows are read from host memory for this batch (a logged "spill") and updated there.

Rows a batch reads are held (a per-slot count) until its backward, or in eval until its lookup read
them, so gradient accumulation and a prefetch thread cannot move them; rows it spilled stay out until then.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from torchrec_cache import layout
from torchrec_cache import policy as rules
from torchrec_cache.config import RowOptimizer
from torchrec_cache.counters import STAT_KEYS, CacheCounters
from torchrec_cache.layout import Batch, SlotGroup, TableSpec, mix_hash
from torchrec_cache.optim import apply_update, initial_state
from torchrec_cache.policy import DISABLED, FREE, TRASH_KEY
from torchrec_cache.sketch import SKETCH_BYTES_PER_SLOT, FrequencySketch
from torchrec_cache.sync import StepClock, read_host
from torchrec_cache.transfer import RowMover

__all__ = ["WAYS", "STAT_KEYS", "SLOT_OVERHEAD_BYTES", "TableSpec", "Batch", "FusedCache"]


# Device bytes per slot besides the row and its state: key 8, score 8, pin 4, hold 4, next use 4, sketch.
SLOT_OVERHEAD_BYTES = 28 + SKETCH_BYTES_PER_SLOT
WAYS = 32  # slots per set: FBGEMM's GPU cache uses 32 (one warp compares a key with every way at once)
_POLICIES = ("lfu", "lru", "static")


class FusedCache(nn.Module):
    """The device slots of all tables of a collection and the set-associative index over them.

    Args:
        tables: the :class:`TableSpec` list, in the collection's table order.
        policy: ``"lfu"`` (frequency from a count-min sketch, aged like TinyLFU), ``"lru"`` or ``"static"``
            (the dataset frequencies, frozen).
        optimizer: the fused :class:`RowOptimizer`, or ``None`` for plain autograd (sparse gradients on the
            host tables; the cache only reads).
        device: where the slots live (``"meta"``: nothing is allocated until :meth:`materialize`).
        ways: slots per set.

    Example:
        >>> c = FusedCache([TableSpec(name="t", rows=1000, dim=4, capacity=64)], policy="lfu", optimizer=None,
        ...                device="cpu")
        >>> c.finish_setup(); b = c.prepare(torch.tensor([5, 7, 5]), torch.tensor([3]), torch.tensor([0]))
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
    _t_key_off: torch.Tensor
    _t_rows: torch.Tensor
    _t_set_off: torch.Tensor
    _t_sets: torch.Tensor
    _t_direct: torch.Tensor
    _key_bounds: torch.Tensor
    _key_table: torch.Tensor

    def __init__(self, tables: list[TableSpec], *, policy: str, optimizer: RowOptimizer | None,
                 device: torch.device | str, ways: int | None = None) -> None:
        super().__init__()
        if policy not in _POLICIES:
            raise ValueError(f"policy {policy!r} is unknown; choose one of {', '.join(_POLICIES)}")
        if not tables:
            raise ValueError("a FusedCache needs at least one table")
        device = torch.device(device)
        self.specs = list(tables)
        self.policy, self.optimizer, self.ways = policy, optimizer, int(ways or WAYS)
        self.names = [t.name for t in tables]
        self.index = {t.name: i for i, t in enumerate(tables)}
        self.lock = threading.RLock()  # the prefetch thread and the training thread share the cache
        self.clock = StepClock()  # the step of the last batch whose lookup has read its rows
        self.step_trains = False  # whether that lookup's rows are held for a backward
        self.step = 0
        self._next_batch = 0
        self._spill_held: dict[int, torch.Tensor] = {}
        self._released: list[tuple[int, torch.Tensor]] = []  # holds of batches whose graph died without a backward
        # Key space and sets, tables grouped by (dim, dtype) in first-appearance order.
        groups: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, t in enumerate(tables):
            groups.setdefault((t.dim, t.dtype), []).append(i)
        self.layout = [i for members in groups.values() for i in members]  # table indices in key order
        key_off = [0] * (len(tables) + 1)
        set_off, n_sets, direct, enabled = [0] * len(tables), [0] * len(tables), [False] * len(tables), []
        k = s = 0
        self.capacity: dict[str, int] = {}
        for i in self.layout:
            t = tables[i]
            cap = min(t.capacity, t.rows)
            key_off[i], set_off[i] = k, s
            direct[i] = cap >= t.rows
            n_sets[i] = -(-(t.rows if direct[i] else cap) // self.ways)
            if direct[i]:
                enabled.append([min(self.ways, t.rows - j * self.ways) for j in range(n_sets[i])])
            else:
                enabled.append([cap // n_sets[i] + (j < cap % n_sets[i]) for j in range(n_sets[i])])
            self.capacity[t.name] = cap
            k += t.rows
            s += n_sets[i]
        self.num_keys, self.num_sets = k, s
        self.num_slots = s * self.ways
        self._key_start = torch.tensor([key_off[i] for i in range(len(tables))], dtype=torch.int64)
        self._direct = direct
        self._enabled = enabled
        order_key = sorted(range(len(tables)), key=lambda i: key_off[i])
        self._key_sorted_starts = torch.tensor([key_off[i] for i in order_key] + [k], dtype=torch.int64)
        self._key_sorted_tables = order_key  # position in key order -> table index
        self._kpos = {i: p for p, i in enumerate(order_key)}  # table index -> position in key order
        C = self.num_slots
        dev = device
        # Host copies of the constant index tensors: ``to_empty`` off the meta device leaves garbage in buffers.
        self._constants = {name: torch.tensor(v, dtype=dt) for name, v, dt in (
            ("_t_key_off", key_off[:-1], torch.int64), ("_t_rows", [t.rows for t in tables], torch.int64),
            ("_t_set_off", set_off, torch.int64), ("_t_sets", n_sets, torch.int64), ("_t_direct", direct, torch.bool),
            ("_key_bounds", self._key_sorted_starts.tolist(), torch.int64), ("_key_table", order_key, torch.int64))}
        for name, value in self._constants.items():
            self.register_buffer(name, value.to(dev), persistent=False)
        # Per slot (+1 trash slot at index C that absorbs writes for rows without a slot): 28 bytes.
        self.register_buffer("slot_key", torch.full((C + 1,), DISABLED, dtype=torch.int64, device=dev),
                             persistent=False)
        self.register_buffer("slot_score", torch.zeros(C + 1, dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer("next_use", torch.zeros(C + 1, dtype=torch.int32, device=dev), persistent=False)
        self.register_buffer("pinned_until", torch.full((C + 1,), -1, dtype=torch.int32, device=dev),
                             persistent=False)
        self.register_buffer("hold", torch.zeros(C + 1, dtype=torch.int32, device=dev), persistent=False)
        self.register_buffer("hit_level", torch.zeros(1, device=dev), persistent=False)  # recent traffic hit rate
        self.sketch = FrequencySketch(C, device=dev)
        # Slot tensors and host tensors per group.
        self.groups: list[SlotGroup] = []
        self._group_of_table = [0] * len(tables)
        host_dev = "meta" if dev.type == "meta" else "cpu"
        for gi, ((dim, dtype), members) in enumerate(groups.items()):
            rows = sum(tables[i].rows for i in members)
            lo, hi = set_off[members[0]] * self.ways, (set_off[members[-1]] + n_sets[members[-1]]) * self.ways
            cols = optimizer.state_columns(dim) if optimizer is not None else 0
            g = SlotGroup(dim=dim, dtype=dtype, tables=members, key_lo=key_off[members[0]],
                       key_hi=key_off[members[0]] + rows, slot_lo=lo, slot_hi=hi,
                       host=torch.empty(rows, dim, dtype=dtype, device=host_dev),
                       host_state=(initial_state(optimizer, rows, dim) if host_dev == "cpu"
                                   else torch.empty(rows, cols, device="meta")))
            self.groups.append(g)
            for i in members:
                self._group_of_table[i] = gi
            self.register_buffer(f"weight_{gi}", torch.zeros(hi - lo + 1, dim, dtype=dtype, device=dev),
                                 persistent=False)
            self.register_buffer(f"state_{gi}", torch.zeros(hi - lo + 1, cols, dtype=torch.float32, device=dev),
                                 persistent=False)
        self.counters = CacheCounters(
            row_bytes=[t.dim * torch.empty((), dtype=t.dtype).element_size()
                       + 4 * (optimizer.state_columns(t.dim) if optimizer else 0) for t in tables],
            key_starts=self._key_sorted_starts, key_order=order_key)
        self.mover = RowMover()

    # ------------------------------------------------------------------ basic properties
    @property
    def device(self) -> torch.device:
        return self.slot_key.device

    @property
    def fused(self) -> bool:
        return self.optimizer is not None

    def weight(self, g: int) -> torch.Tensor:
        return getattr(self, f"weight_{g}")

    def state(self, g: int) -> torch.Tensor:
        return getattr(self, f"state_{g}")

    def group_of(self, name: str) -> int:
        """Index of the slot-tensor group holding table ``name``."""
        return self._group_of_table[self.index[name]]

    def key_start(self, name: str) -> int:
        """First key of table ``name`` in the collection's key space."""
        return int(self._key_start[self.index[name]])

    def host_view(self, name: str) -> torch.Tensor:
        """Table ``name``'s rows in host memory (a view of its group's flat tensor, in position order)."""
        i = self.index[name]
        g = self.groups[self._group_of_table[i]]
        a = int(self._key_start[i]) - g.key_lo
        return g.host[a:a + self.specs[i].rows]

    def host_state_view(self, name: str) -> torch.Tensor:
        i = self.index[name]
        g = self.groups[self._group_of_table[i]]
        a = int(self._key_start[i]) - g.key_lo
        return g.host_state[a:a + self.specs[i].rows]

    def materialize_host(self) -> None:
        """Allocate the host tables of a cache built on the meta device (uninitialised, like ``to_empty``)."""
        self.sketch.table.zero_()
        for g in self.groups:
            if g.host.device.type == "meta":
                g.host = torch.empty(g.host.shape, dtype=g.host.dtype)
                g.host_state = initial_state(self.optimizer, g.host.shape[0], g.dim)

    # ------------------------------------------------------------------ set-up
    def set_reorder(self, name: str, order: torch.Tensor) -> None:
        """Store table ``name``'s rows in host memory in ``order`` (position -> id); ids keep their meaning."""
        i = self.index[name]
        g = self.groups[self._group_of_table[i]]
        a = int(self._key_start[i]) - g.key_lo
        n = self.specs[i].rows
        if g.remap is None:
            g.remap = torch.arange(g.key_hi - g.key_lo)
            g.order = torch.arange(g.key_hi - g.key_lo)
        assert g.order is not None
        g.order[a:a + n] = order.long() + a
        g.remap[a + order.long()] = torch.arange(a, a + n)
        with torch.no_grad():
            g.host[a:a + n] = g.host[a:a + n].index_select(0, order.long())
            g.host_state[a:a + n] = g.host_state[a:a + n].index_select(0, order.long())

    def is_reordered(self, name: str) -> bool:
        return self.groups[self._group_of_table[self.index[name]]].remap is not None

    def seed_frequencies(self, counts: dict[str, torch.Tensor]) -> None:
        """Add dataset counts to the frequency sketch (the ``static`` policy reads only these)."""
        for name, c in counts.items():
            i = self.index[name]
            ids = torch.nonzero(c > 0).squeeze(1)
            self.sketch.add((ids + int(self._key_start[i])).to(self.device), c.index_select(0, ids).to(self.device))

    def finish_setup(self, hottest: dict[str, torch.Tensor] | None = None) -> None:
        """Empty the cache, load every direct-mapped table wholly and warm the others with ``hottest`` ids."""
        with self.lock:
            for name, value in self._constants.items():
                getattr(self, name).copy_(value)
            self.slot_key.fill_(DISABLED)
            self.slot_key[self.num_slots] = TRASH_KEY
            self.slot_score.zero_()
            self.hit_level.zero_()
            self.next_use.zero_()
            self.pinned_until.fill_(-1)
            self.hold.zero_()
            W = self.ways
            for i, t in enumerate(self.specs):
                base = int(self._t_set_off[i]) * W
                for j, e in enumerate(self._enabled[self._kpos[i]]):
                    self.slot_key[base + j * W: base + j * W + e] = FREE
                key0 = int(self._key_start[i])
                if self._direct[i]:
                    ids = torch.arange(t.rows)
                    self._load_direct(ids + key0, (ids + base).to(self.device))
                elif hottest is not None and t.name in hottest:
                    ids = hottest[t.name].long()[: self.capacity[t.name]].to(self.device)
                    keys = ids + key0
                    chosen, slots = rules.free_ways(self.slot_key, self._sets(keys), W)
                    self._load_direct(keys.index_select(0, chosen).cpu(), slots)
            self.counters.reset()

    def _load_direct(self, keys_h: torch.Tensor, slots: torch.Tensor) -> None:
        """Load rows ``keys_h`` (host) into free ``slots`` outside any batch (set-up, no stats)."""
        if keys_h.numel() == 0:
            return
        keys = keys_h.to(self.device)
        for gi, g in enumerate(self.groups):
            m = (keys_h >= g.key_lo) & (keys_h < g.key_hi)
            if not bool(m.any()):
                continue
            kh, sl = keys_h[m], slots[m.to(self.device)]
            self._copy_in(gi, kh, sl)
        self.slot_key.index_copy_(0, slots, keys)
        score = self.sketch.estimate(keys) if self.policy != "lru" else torch.zeros_like(keys)
        self.slot_score.index_copy_(0, slots, score)

    # ------------------------------------------------------------------ index helpers
    def _tables_of(self, keys: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(self._key_bounds, keys, right=True) - 1
        return self._key_table.index_select(0, pos.clamp(0, len(self.specs) - 1))

    def _sets(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        t = self._tables_of(keys) if tables is None else tables
        ids = keys - self._t_key_off.index_select(0, t)
        hashed = mix_hash(ids) % self._t_sets.index_select(0, t)
        local = torch.where(self._t_direct.index_select(0, t), ids // self.ways, hashed)
        return self._t_set_off.index_select(0, t) + local

    def keys_of(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor) -> torch.Tensor:
        """Sorted keys of a batch's ids (for the ``reuse`` set of a prefetch window)."""
        dev = self.device
        values = values.to(dev, torch.int64)
        F = feature_table.numel()
        per_bag = feature_table.repeat_interleave(lengths.numel() // max(1, F))
        tab = per_bag.repeat_interleave(lengths.to(dev), output_size=values.numel())
        return torch.sort(values + self._t_key_off.index_select(0, tab)).values

    def find(self, keys: torch.Tensor, sets: torch.Tensor | None = None) -> torch.Tensor:
        """Slot of each key, -1 where it is not cached (no side effects)."""
        if keys.numel() == 0:
            return keys.new_empty(0)
        sets = self._sets(keys) if sets is None else sets
        ways = self.slot_key[: self.num_slots].view(self.num_sets, self.ways).index_select(0, sets)
        match = ways == keys.unsqueeze(1)
        way = match.to(torch.uint8).argmax(1)
        return torch.where(match.any(1), sets * self.ways + way, torch.full_like(sets, -1))

    def _host_pos(self, g: SlotGroup, keys_h: torch.Tensor) -> torch.Tensor:
        pos = keys_h - g.key_lo
        return pos if g.remap is None else g.remap.index_select(0, pos)

    def _group_split(self, keys_h: torch.Tensor) -> list[int]:
        """Bounds of each group's run in sorted host keys."""
        if len(self.groups) == 1:
            return [0, keys_h.numel()]
        los = torch.tensor([g.key_lo for g in self.groups] + [self.num_keys], dtype=torch.int64)
        return torch.searchsorted(keys_h, los).tolist()

    # ------------------------------------------------------------------ host <-> device rows
    def _copy_in(self, gi: int, keys_h: torch.Tensor, slots: torch.Tensor) -> None:
        g = self.groups[gi]
        pos = self._host_pos(g, keys_h)
        local = slots - g.slot_lo
        self.weight(gi).index_copy_(0, local, self.mover.to_device(g.host.index_select(0, pos), self.device, "w"))
        if g.host_state.shape[1]:
            self.state(gi).index_copy_(0, local, self.mover.to_device(g.host_state.index_select(0, pos), self.device, "s"))

    def _copy_out(self, gi: int, keys_h: torch.Tensor, slots: torch.Tensor) -> None:
        g = self.groups[gi]
        pos = self._host_pos(g, keys_h)
        local = slots - g.slot_lo
        self.mover.to_host_later(self.weight(gi).index_select(0, local), g.host, pos)
        if g.host_state.shape[1]:
            self.mover.to_host_later(self.state(gi).index_select(0, local), g.host_state, pos)

    # ------------------------------------------------------------------ the per-batch path
    def prepare(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor, *,
                value_bounds: list[int] | None = None, count: bool = True, pin_until: int = 0,
                hold: bool = False, reuse: torch.Tensor | None = None, reuse_steps: torch.Tensor | None = None,
                load: bool = True) -> Batch:
        """Make the batch's rows resident (or spill them) for all tables at once.

        Args:
            values: (L,) row ids of every feature, feature after feature (features grouped as the key order).
            lengths: (F * B,) bag lengths, feature-major as in a ``KeyedJaggedTensor``.
            feature_table: (F,) the table index of each feature (a device tensor).
            value_bounds: per slot-tensor group, its ids' run in ``values`` (G + 1 host ints); needed only
                when the tables have several embedding dims.
            count: a training/eval lookup (stats, policy) rather than a prefetch.
            pin_until: keep the batch's rows until this step (prefetch).
            hold: hold the rows until :meth:`release` (the backward will update them).
            reuse, reuse_steps: sorted keys that later batches of a prefetch window need, and the step of
                each one's first use there: Belady inside the window (a miss needed sooner than a victim's
                next use takes its slot).
            load: ``False`` only records the next use of the rows already cached (a batch entering the
                prefetch window, to run at step ``pin_until``): inside the window the row used last leaves first.
        """
        with self.lock:
            return self._prepare(values, lengths, feature_table, value_bounds, count, pin_until, hold, reuse,
                                 reuse_steps, load)

    def _prepare(self, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor,
                 value_bounds: list[int] | None, count: bool, pin_until: int, hold: bool,
                 reuse: torch.Tensor | None = None, reuse_steps: torch.Tensor | None = None,
                 load: bool = True) -> Batch:
        self.mover.apply_pending()
        self._release_dead()
        self._refresh_if_changed()
        dev = self.device
        if not count and dev.type == "cuda":  # a prefetch's loads wait for every lookup queued before it
            torch.cuda.current_stream(dev).wait_stream(torch.cuda.default_stream(dev))
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got dtype {values.dtype}; a float id such as 1.7 is "
                            "not a row: cast the feature to int64 before the lookup (as TorchRec requires)")
        values = values.to(dev, torch.int64)
        L = values.numel()
        F = feature_table.numel()
        if count:
            self.step += 1
        step = self.step
        # Table of every id: features are contiguous runs of bags in ``lengths``.
        bags = lengths.numel()
        per_bag_table = feature_table.repeat_interleave(bags // max(1, F)) if F else feature_table
        tab = per_bag_table.repeat_interleave(lengths.to(dev), output_size=L)
        keys = values + self._t_key_off.index_select(0, tab)
        bad = ((values < 0) | (values >= self._t_rows.index_select(0, tab))).any()
        uniq_pad, counts_pad, inv, seg = layout.unique_padded(keys)
        bounds = torch.searchsorted(uniq_pad, self._key_bounds)  # per key-ordered table, its run in uniq
        head = torch.cat([torch.stack([seg[-1] + 1 if L else seg.new_zeros(()), bad.long()]), bounds])
        sizes = read_host(head)  # sync 1 of 2: the number of unique keys and each table's share
        U, is_bad = int(sizes[0]), bool(sizes[1])
        if is_bad:
            self._raise_out_of_range(values, tab)
        kb = sizes[2:].tolist()
        uniq, counts = uniq_pad[:U], counts_pad[:U]
        if value_bounds is None:
            if len(self.groups) > 1:
                raise ValueError("a cache over tables of several embedding dims needs value_bounds per group")
            value_bounds = [0, L]
        bid = self._next_batch
        self._next_batch += 1
        C, W = self.num_slots, self.ways
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        if U == 0:
            return Batch(uniq=uniq, inv=inv, slots=empty, key_bounds=kb, value_bounds=value_bounds,
                         spill_pos=empty, spill_keys=torch.empty(0, dtype=torch.int64), step=step, id=bid)
        tables = self._tables_of(uniq)
        sets = self._sets(uniq, tables)
        slot = self.find(uniq, sets)
        hit = slot >= 0
        hit_or_trash = torch.where(hit, slot, C)
        # Pin the hits for this step (a prefetch: until its batch runs) so no miss of the batch evicts them.
        until = max(step, pin_until)
        if not load:  # a batch entering the window: remember when its cached rows are used next
            nu = self.next_use.index_select(0, hit_or_trash)
            self.next_use.index_copy_(0, hit_or_trash, torch.where(nu > step, torch.clamp(nu, max=until),
                                                                   torch.full_like(nu, until)))
        else:
            self.pinned_until.index_copy_(0, hit_or_trash, torch.clamp(
                self.pinned_until.index_select(0, hit_or_trash), min=until))
        if not load:
            return Batch(uniq=uniq, inv=inv, slots=hit_or_trash, key_bounds=kb, value_bounds=value_bounds,
                         spill_pos=empty, spill_keys=torch.empty(0, dtype=torch.int64), step=step, id=bid)
        # When the window needs each row again (its step there), or never as far as it knows. A prefetched
        # batch's hits learn their next use too: after this batch they would look unneeded to the window.
        miss_next = rules.window_next_use(uniq, reuse, reuse_steps)
        reused = miss_next < rules.NEVER
        if reuse is not None:
            self.next_use.index_copy_(0, hit_or_trash, torch.where(reused, miss_next, 0).int())
        if count:  # policy scores of the hits, drift reset, sketch counts and their ageing
            rules.observe(self.policy, self.sketch, self.slot_score, self.hit_level, hit_or_trash, hit, uniq, counts,
                          step, L)
        prio = self.sketch.estimate(uniq) if self.policy != "lru" else torch.zeros_like(uniq)
        miss = ~hit
        # Rows a held batch spilled stay out of the cache until its backward.
        miss_ok = miss & ~layout.isin_sorted(uniq, list(self._spill_held.values())) if self._spill_held else miss
        # A lookup keeps its own rows. An eval lookup's rows are free for the prefetch once it read them (held
        # until then): as Belady may, the next batch's loads may evict them. A training step's rows are held
        # until its backward, which the prefetch overlaps: they stay whatever the timing, so it is reproducible.
        vkey = rules.victim_keys(self.slot_key[:C], self.slot_score[:C], self.pinned_until[:C], self.hold[:C],
                                 self.next_use[:C], step, count or self.step_trains)
        admit, victim = rules.choose_slots(self.policy, vkey, W, sets, miss, prio, miss_next, step, allowed=miss_ok)
        spill = miss & ~admit if count else torch.zeros_like(miss)
        # Compact loads then spills (order kept) and read them on the host with the evicted keys.
        ordr, na_d, ns_d = layout.compact(admit, spill)
        evict = torch.where(admit, self.slot_key.index_select(0, torch.where(admit, victim, C)), -1)
        packed = read_host(torch.cat([torch.stack([na_d, ns_d]), uniq.index_select(0, ordr),
                                      evict.index_select(0, ordr)]))  # sync 2 of 2
        na, ns = int(packed[0]), int(packed[1])
        load_keys_h, spill_keys_h = packed[2:2 + na], packed[2 + na:2 + na + ns]
        evict_h = packed[2 + U:2 + U + na]
        load_pos, spill_pos = ordr[:na], ordr[na:na + ns]
        victims = victim.index_select(0, load_pos)
        if na:
            self._evict_and_load(load_keys_h, evict_h, victims, uniq.index_select(0, load_pos),
                                 prio.index_select(0, load_pos), step, until)
            self.next_use.index_copy_(0, victims, torch.where(reused, miss_next, 0).index_select(0, load_pos).int())
        slots = hit_or_trash.index_copy(0, load_pos, victims) if na else hit_or_trash
        batch = Batch(uniq=uniq, inv=inv, slots=slots, key_bounds=kb, value_bounds=value_bounds,
                      spill_pos=spill_pos, spill_keys=spill_keys_h, step=step, id=bid)
        if hold:
            self.hold.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
            batch.held = True
            if ns and self.fused:
                self._spill_held[bid] = uniq.index_select(0, spill_pos)
            batch.finalizer = weakref.finalize(batch, self._released.append, (bid, slots))
        self.counters.account(count, kb, load_keys_h, spill_keys_h, evict_h if self.fused else evict_h[:0])
        if ns and count:
            layout.spill_notice(U, ns, self.num_slots)
        return batch

    def _evict_and_load(self, keys_h: torch.Tensor, evict_h: torch.Tensor, victims: torch.Tensor,
                        keys: torch.Tensor, prio: torch.Tensor, step: int, until: int) -> None:
        bounds = self._group_split(keys_h)
        for gi in range(len(self.groups)):
            a, b = bounds[gi], bounds[gi + 1]
            if a == b:
                continue
            ev, vs = evict_h[a:b], victims[a:b]
            if self.fused:
                occupied = ev >= 0
                if bool(occupied.all()):
                    self._copy_out(gi, ev, vs)
                elif bool(occupied.any()):
                    idx = torch.nonzero(occupied).squeeze(1)  # host tensor: no device read
                    self._copy_out(gi, ev.index_select(0, idx), vs.index_select(0, idx.to(self.device)))
            self._copy_in(gi, keys_h[a:b], vs)
        self.slot_key.index_copy_(0, victims, keys)
        self.slot_score.index_copy_(0, victims, torch.full_like(keys, step) if self.policy == "lru" else prio)
        self.pinned_until.index_fill_(0, victims, until)

    # ------------------------------------------------------------------ rows, gradients, release
    def rows(self, batch: Batch, gi: int) -> torch.Tensor:
        """The (U_g, dim) rows of group ``gi``'s unique keys: from slots, and from host memory for spilled rows."""
        g = self.groups[gi]
        a, b = self.group_range(batch, gi)
        local = self._local_slots(batch.slots[a:b], gi)
        out = self.weight(gi).index_select(0, local)
        sa, sb, spos = self._group_spills(batch, gi, a)
        if sb > sa:
            host = g.host.index_select(0, self._host_pos(g, batch.spill_keys[sa:sb]))
            out.index_copy_(0, spos, self.mover.to_device(host, self.device, "spill"))
        return out

    def group_range(self, batch: Batch, gi: int) -> tuple[int, int]:
        """Group ``gi``'s run in the batch's unique keys (its tables are contiguous in key order)."""
        g = self.groups[gi]
        return batch.key_bounds[self._kpos[g.tables[0]]], batch.key_bounds[self._kpos[g.tables[-1]] + 1]

    def table_range(self, batch: Batch, name: str) -> tuple[int, int]:
        """Table ``name``'s run in the batch's unique keys."""
        k = self._kpos[self.index[name]]
        return batch.key_bounds[k], batch.key_bounds[k + 1]

    def _local_slots(self, s: torch.Tensor, gi: int) -> torch.Tensor:
        """Slots ``s`` as rows of group ``gi``'s slot tensor (the trash slot C is its last row)."""
        g = self.groups[gi]
        if len(self.groups) == 1:
            return s  # slot_lo is 0 and the trash slot C is the last row of the only slot tensor
        return torch.where(s == self.num_slots, torch.full_like(s, g.slot_hi - g.slot_lo), s - g.slot_lo)

    def _group_spills(self, batch: Batch, gi: int, a: int) -> tuple[int, int, torch.Tensor]:
        if batch.spill_keys.numel() == 0:
            return 0, 0, batch.spill_pos
        bounds = self._group_split(batch.spill_keys)
        sa, sb = bounds[gi], bounds[gi + 1]
        return sa, sb, batch.spill_pos[sa:sb] - a

    def apply_grad(self, batch: Batch, gi: int, grad_rows: torch.Tensor) -> None:
        """Fused optimizer step on group ``gi``'s rows of the batch, where each row lives (slot or host)."""
        assert self.optimizer is not None
        with self.lock:
            g = self.groups[gi]
            g.opt_step += 1
            a, b = self.group_range(batch, gi)
            if b == a:
                return
            local = self._local_slots(batch.slots[a:b], gi)
            w, st = apply_update(self.optimizer, self.weight(gi).index_select(0, local),
                                 self.state(gi).index_select(0, local), grad_rows, g.opt_step)
            self.weight(gi).index_copy_(0, local, w)
            if st.shape[1]:
                self.state(gi).index_copy_(0, local, st)
            sa, sb, spos = self._group_spills(batch, gi, a)
            if sb > sa:  # spilled rows update in host memory, off the step's critical path on CUDA
                pos = self._host_pos(g, batch.spill_keys[sa:sb])
                opt, step = self.optimizer, g.opt_step

                def update(grad: torch.Tensor) -> None:
                    w, st = apply_update(opt, g.host.index_select(0, pos), g.host_state.index_select(0, pos),
                                         grad, step)
                    g.host.index_copy_(0, pos, w)
                    if st.shape[1]:
                        g.host_state.index_copy_(0, pos, st)

                self.mover.on_host(update, grad_rows.index_select(0, spos))

    def sparse_grads(self, batch: Batch, gi: int, grad_rows: torch.Tensor) -> list[torch.Tensor]:
        """Autograd mode: each table's sparse gradient in host position order (rows refreshed after the step)."""
        g = self.groups[gi]
        out = []
        grad_h = grad_rows if grad_rows.device.type == "cpu" else grad_rows.to("cpu")
        a0 = self.group_range(batch, gi)[0]
        for i in g.tables:
            a, b = self.table_range(batch, self.names[i])
            keys = batch.uniq[a:b]
            keys_h = keys if keys.device.type == "cpu" else keys.to("cpu")
            first = int(self._key_start[i]) - g.key_lo
            pos = self._host_pos(g, keys_h)
            g.dirty.append((keys, pos))
            spec = self.specs[i]
            out.append(torch.sparse_coo_tensor((pos - first).unsqueeze(0), grad_h[a - a0:b - a0].to(spec.dtype),
                                               (spec.rows, spec.dim), check_invariants=False))
        return out

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

    def _refresh_if_changed(self) -> None:
        """Autograd mode: copy rows an optimizer changed on the host back into their slots."""
        if self.fused:
            return
        for gi, g in enumerate(self.groups):
            version = g.host._version
            if version == g.seen_version:
                continue
            g.seen_version = version
            if not g.dirty:
                continue
            keys = torch.cat([k for k, _ in g.dirty])
            pos = torch.cat([p for _, p in g.dirty])
            g.dirty.clear()
            slots = self.find(keys)
            trash = torch.full_like(slots, self.num_slots)
            local = self._local_slots(torch.where(slots >= 0, slots, trash), gi)
            self.weight(gi).index_copy_(0, local, self.mover.to_device(g.host.index_select(0, pos), self.device, "w"))

    def mark_host_changed(self) -> None:
        for g in self.groups:
            g.seen_version = g.host._version

    # ------------------------------------------------------------------ whole-cache operations
    def _occupied(self, gi: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.groups[gi]
        keys = self.slot_key[g.slot_lo:g.slot_hi]
        slots = torch.nonzero(keys >= 0).squeeze(1)
        keys_h = keys.index_select(0, slots).cpu()
        return keys_h, slots + g.slot_lo

    def flush(self) -> None:
        """Write every resident row (weights and optimizer state) back to host memory; the slots stay valid."""
        with self.lock:
            self.mover.apply_pending()
            if not self.fused:
                return
            for gi in range(len(self.groups)):
                keys_h, slots = self._occupied(gi)
                if keys_h.numel():
                    self._copy_out(gi, keys_h, slots)
            self.mover.apply_pending()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
                self.mover.apply_pending()

    def reload(self) -> None:
        """Re-read every resident row (and its state) from host memory, after the host tables changed."""
        with self.lock:
            self.mover.apply_pending()
            for gi, g in enumerate(self.groups):
                keys_h, slots = self._occupied(gi)
                if keys_h.numel():
                    self._copy_in(gi, keys_h, slots)
                g.dirty.clear()
            self.mark_host_changed()

    def resident_rows(self, name: str) -> torch.Tensor:
        """Ids of table ``name`` now in the cache."""
        i = self.index[name]
        keys = self.slot_key[self.slot_key >= 0]
        k0 = int(self._key_start[i])
        return keys[(keys >= k0) & (keys < k0 + self.specs[i].rows)] - k0

    def stats_total(self) -> dict[str, int]:
        """Counters since construction (per table and last step: :attr:`counters`)."""
        return self.counters.total()

    def _raise_out_of_range(self, values: torch.Tensor, tab: torch.Tensor) -> None:
        bad = torch.nonzero((values < 0) | (values >= self._t_rows.index_select(0, tab))).squeeze(1)[0]
        t = int(tab[bad])
        raise layout.out_of_range(self.names[t], int(values[bad]), self.specs[t].rows)

    def pin_host_memory(self) -> bool:
        """Page-lock the host tables and state so host-to-device copies run asynchronously (CUDA only)."""
        if not torch.cuda.is_available():
            return False
        for g in self.groups:
            if g.host.device.type == "cpu" and not g.host.is_pinned():
                g.host = g.host.pin_memory()
            if g.host_state.device.type == "cpu" and not g.host_state.is_pinned():
                g.host_state = g.host_state.pin_memory()
        return True

    def extra_repr(self) -> str:
        return (f"tables={len(self.specs)}, slots={self.num_slots} in {self.num_sets} sets of {self.ways}, "
                f"groups={len(self.groups)}, policy={self.policy!r}, "
                f"optimizer={self.optimizer.kind if self.optimizer else None!r}")
