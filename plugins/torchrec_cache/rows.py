"""The rows behind a :class:`~torchrec_cache.cache.FusedCache`'s slots, and every move of them.

Per slot-tensor group (tables of one (dim, dtype), :class:`~torchrec_cache.layout.SlotGroup`): one
slot tensor of weights and one of optimizer state on the device (one row per slot, plus a trash row
that absorbs writes for rows without a slot), and the full tables with their state in one flat host
tensor. The cache decides which key sits in which slot; :class:`RowStore` copies rows between host and
slots (through :class:`~torchrec_cache.transfer.RowMover`), gathers a batch's rows, and applies their
gradients where each row lives. With a disk tier (:class:`~torchrec_cache.tier.DiskTier`) the full
tables are on disk and host memory holds a second cache level per group
(:class:`~torchrec_cache.hostlevel.HostLevel`): :meth:`RowStore.copy_in`, :meth:`RowStore.copy_out` and
the reads and updates of spilled rows go through it instead of the flat host tensors.

Example:
    >>> from torchrec_cache.layout import KeySpace, TableSpec
    >>> store = RowStore(KeySpace.of([TableSpec(name="t", rows=10, dim=2, capacity=4)], ways=4), None,
    ...                  torch.device("cpu"))
    >>> store.host_view("t").shape, tuple(store.weight(0).shape)
    (torch.Size([10, 2]), (5, 2))
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch
from torch import nn

from torchrec_cache.config import RowOptimizer
from torchrec_cache.disk import records, split_records
from torchrec_cache.layout import Batch, KeySpace, SlotGroup
from torchrec_cache.optim import apply_update, initial_state
from torchrec_cache.tier import DiskTier
from torchrec_cache.transfer import RowMover

__all__ = ["RowStore"]


class RowStore(nn.Module):
    """Slot tensors on the device and the full tables in host memory, per group of a :class:`KeySpace`.

    Args:
        space: the cache's key space.
        optimizer: the fused :class:`RowOptimizer` (its state has columns), or ``None``.
        device: where the slot tensors live (``"meta"``: host tables too, until :meth:`materialize`).
        lock: the cache's lock, held while a backward updates rows (a prefetch thread shares the cache).
        tier: the disk tier (full tables on disk, a host cache level per group), or ``None``.
    """

    def __init__(self, space: KeySpace, optimizer: RowOptimizer | None, device: torch.device,
                 lock: threading.RLock | None = None, tier: DiskTier | None = None) -> None:
        super().__init__()
        self.space, self.optimizer = space, optimizer
        self.lock = lock if lock is not None else threading.RLock()
        self.index = {t.name: i for i, t in enumerate(space.tables)}
        self.mover = RowMover()
        self.groups: list[SlotGroup] = []
        host_dev = "meta" if device.type == "meta" else "cpu"
        self.tier = tier
        for gi, span in enumerate(space.groups):
            rows, dim = span.key_hi - span.key_lo, span.dim
            if tier is not None:
                rows = 0  # the rows are on disk
            cols = optimizer.state_columns(dim) if optimizer is not None else 0
            self.groups.append(SlotGroup(
                dim=dim, dtype=span.dtype, tables=list(span.tables), key_lo=span.key_lo, key_hi=span.key_hi,
                slot_lo=span.slot_lo, slot_hi=span.slot_hi, host=torch.empty(rows, dim, dtype=span.dtype, device=host_dev),
                host_state=(initial_state(optimizer, rows, dim) if host_dev == "cpu"
                            else torch.empty(rows, cols, device="meta"))))
            n = span.slot_hi - span.slot_lo + 1
            self.register_buffer(f"weight_{gi}", torch.zeros(n, dim, dtype=span.dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"state_{gi}", torch.zeros(n, cols, dtype=torch.float32, device=device),
                                 persistent=False)

    @property
    def device(self) -> torch.device:
        return self.weight(0).device

    def weight(self, gi: int) -> torch.Tensor:
        return getattr(self, f"weight_{gi}")

    def state(self, gi: int) -> torch.Tensor:
        return getattr(self, f"state_{gi}")

    # ------------------------------------------------------------------ host tables
    def _table(self, name: str) -> tuple[SlotGroup, int, int]:
        """Table ``name``'s group, its first row in the group's host tensor, and its rows."""
        i = self.index[name]
        return self.groups[self.space.group_index[i]], self.space.host_offset(i), self.space.tables[i].rows

    def host_view(self, name: str) -> torch.Tensor:
        """Table ``name``'s rows in host memory (a view of its group's flat tensor, in position order); with a
        disk tier, a meta tensor of the table's shape (its rows: :meth:`table_chunks`)."""
        g, a, n = self._table(name)
        if self.tier is not None:
            return torch.empty(n, g.dim, dtype=g.dtype, device="meta")
        return g.host[a:a + n]

    def host_state_view(self, name: str) -> torch.Tensor:
        g, a, n = self._table(name)
        return g.host_state[a:a + n]

    def set_reorder(self, name: str, order: torch.Tensor) -> None:
        """Store table ``name``'s rows in host memory in ``order`` (position -> id); ids keep their meaning."""
        g, a, n = self._table(name)
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
        return self._table(name)[0].remap is not None

    # ------------------------------------------------------------------ whole tables in chunks (any tier)
    def table_chunks(self, name: str, chunk_rows: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(first row, weights, state)`` of table ``name`` in position order, ``chunk_rows`` at a time: with a
        disk tier read from disk (overlaid by the host level), so no more than one chunk is in memory."""
        g, a, n = self._table(name)
        for lo in range(0, n, chunk_rows):
            k = min(chunk_rows, n - lo)
            if self.tier is None:
                yield lo, g.host[a + lo:a + lo + k], g.host_state[a + lo:a + lo + k]
            else:
                yield (lo, *split_records(self.tier.levels[self.space.group_index[self.index[name]]].read_range(
                    a + lo, k), g.dim, g.dtype))

    def write_table_chunk(self, name: str, lo: int, w: torch.Tensor, st: torch.Tensor | None) -> None:
        """Rows ``[lo, lo + len(w))`` of table ``name`` (position order) and their state (``None``: keep it)."""
        g, a, n = self._table(name)
        if lo < 0 or lo + w.shape[0] > n or w.shape[1:] != (g.dim,):
            raise ValueError(f"table {name!r}: rows [{lo}, {lo + w.shape[0]}) of width {tuple(w.shape[1:])} do not "
                             f"fit its {n} rows of dim {g.dim}")
        with torch.no_grad():
            if self.tier is None:
                g.host[a + lo:a + lo + w.shape[0]] = w
                if st is not None and st.shape[1]:
                    g.host_state[a + lo:a + lo + w.shape[0]] = st
                return
            level = self.tier.levels[self.space.group_index[self.index[name]]]
            if st is None:
                st = split_records(level.read_range(a + lo, w.shape[0]), g.dim, g.dtype)[1]
            level.write_range(a + lo, records(w.to(g.dtype), st.float()))

    def init_tier(self, init_fns: dict[str, Callable[[torch.Tensor], object] | None], chunk_rows: int = 65536) -> None:
        """Disk tier: write every table's initial rows and the optimizer's initial state, chunk by chunk.

        Tables are initialised in ``init_fns``' order (the configs' order, as TorchRec's ``init_parameters``
        runs them) and each ``init_fn`` runs on consecutive chunks of its table, so one RNG stream fills the rows
        in the same order as one call on the whole table would (zeros without an ``init_fn``). Chunks hold a
        multiple of 16 elements and the last one at least 16, so ``normal_``'s 16-element blocks fall where
        they fall on the whole table. An ``init_fn`` whose result depends on the tensor's shape (``xavier_*``,
        ``kaiming_*``, ``orthogonal_``) cannot run in chunks: refused, naming the table.
        """
        assert self.tier is not None
        chunk_rows = max(16, chunk_rows // 16 * 16)
        inflight: list[tuple[Future[int], torch.Tensor]] = []  # a few chunks in flight while the next is made
        for name in list(init_fns) + [n for n in self.index if n not in init_fns]:
            g, a, n = self._table(name)
            disk = self.tier.levels[self.space.group_index[self.index[name]]].disk
            fn = init_fns.get(name)
            if fn is not None and n > chunk_rows:
                _check_chunkable(name, fn, g.dim, g.dtype)
            for lo, k in _chunks(n, chunk_rows, g.dim):
                w = torch.zeros(k, g.dim, dtype=g.dtype)
                if fn is not None:
                    fn(w)
                recs = records(w, initial_state(self.optimizer, k, g.dim))
                fut = disk.fill(a + lo, recs, wait=False)
                if fut is not None:
                    inflight.append((fut, recs))  # the buffer lives until its write is done
                while len(inflight) > 4:
                    inflight.pop(0)[0].result()
        for fut, _ in inflight:
            fut.result()

    def write_back(self) -> None:
        """Disk tier: start writing what earlier batches evicted (raises a failed write's error)."""
        if self.tier is not None:
            self.tier.issue()

    def stage(self, keys_h: torch.Tensor, step: int) -> None:
        """Disk tier: read ahead the rows of sorted host keys ``keys_h`` for the batch at ``step``."""
        if self.tier is not None:
            self.tier.stage(keys_h, step, self.space.group_split(keys_h))

    def wait_staged(self, until: int) -> None:
        """Disk tier: wait, without the cache's lock, for the read-aheads of batches up to step ``until``."""
        if self.tier is not None:
            self.tier.wait_staged(until)

    def forget_staged(self, step: int) -> None:
        if self.tier is not None:
            self.tier.forget_staged(step)

    def materialize(self) -> None:
        """Allocate the host tables of a store built on the meta device (uninitialised, like ``to_empty``)."""
        if self.tier is not None:
            return
        for g in self.groups:
            if g.host.device.type == "meta":
                g.host = torch.empty(g.host.shape, dtype=g.host.dtype)
                g.host_state = initial_state(self.optimizer, g.host.shape[0], g.dim)

    def pin(self) -> bool:
        """Page-lock the host tables and state so host-to-device copies run asynchronously (CUDA only)."""
        if not torch.cuda.is_available() or self.tier is not None:
            return False
        for g in self.groups:
            if g.host.device.type == "cpu" and not g.host.is_pinned():
                g.host = g.host.pin_memory()
            if g.host_state.device.type == "cpu" and not g.host_state.is_pinned():
                g.host_state = g.host_state.pin_memory()
        return True

    def mark_host_changed(self) -> None:
        for g in self.groups:
            g.seen_version = g.host._version

    # ------------------------------------------------------------------ host <-> slot copies
    def host_pos(self, g: SlotGroup, keys_h: torch.Tensor) -> torch.Tensor:
        pos = keys_h - g.key_lo
        return pos if g.remap is None else g.remap.index_select(0, pos)

    def _host_rows(self, gi: int, pos: torch.Tensor, *, take: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``pos`` (unique) and their state from host memory, or through the host level (``take``: the
        device loads them, so they leave it)."""
        g = self.groups[gi]
        if self.tier is None:
            return g.host.index_select(0, pos), g.host_state.index_select(0, pos)
        return split_records(self.tier.levels[gi].fetch(pos, take=take), g.dim, g.dtype)

    def _put_rows(self, gi: int, pos: torch.Tensor, w: torch.Tensor, st: torch.Tensor) -> None:
        """Rows ``pos`` changed off the device (spilled rows' updates): into the host tables or level."""
        g = self.groups[gi]
        if self.tier is None:
            g.host.index_copy_(0, pos, w)
            if st.shape[1]:
                g.host_state.index_copy_(0, pos, st)
        else:
            self.tier.levels[gi].put(pos, records(w.to(g.dtype), st))

    def copy_in(self, gi: int, keys_h: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``keys_h`` (host keys of group ``gi``) into ``slots``, with their optimizer state."""
        g = self.groups[gi]
        pos = self.host_pos(g, keys_h)
        local = slots - g.slot_lo
        w, st = self._host_rows(gi, pos, take=True)
        self.weight(gi).index_copy_(0, local, self.mover.to_device(w, self.device, "w"))
        if st.shape[1]:
            self.state(gi).index_copy_(0, local, self.mover.to_device(st, self.device, "s"))

    def copy_out(self, gi: int, keys_h: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the rows in ``slots`` (keys ``keys_h``) back to host memory (asynchronously on CUDA)."""
        g = self.groups[gi]
        pos = self.host_pos(g, keys_h)
        local = slots - g.slot_lo
        if self.tier is not None:
            level = self.tier.levels[gi]
            recs = records(self.weight(gi).index_select(0, local), self.state(gi).index_select(0, local))
            self.mover.on_host(lambda r: level.put(pos, r), recs)
            return
        self.mover.to_host_later(self.weight(gi).index_select(0, local), g.host, pos)
        if g.host_state.shape[1]:
            self.mover.to_host_later(self.state(gi).index_select(0, local), g.host_state, pos)

    def load(self, keys_h: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``keys_h`` (host, any groups) into free ``slots`` outside any batch (set-up)."""
        for gi, g in enumerate(self.groups):
            m = (keys_h >= g.key_lo) & (keys_h < g.key_hi)
            if bool(m.any()):
                self.copy_in(gi, keys_h[m], slots[m.to(self.device)])

    def exchange(self, keys_h: torch.Tensor, evict_h: torch.Tensor, victims: torch.Tensor) -> None:
        """A batch's loads (sorted host keys ``keys_h`` into ``victims``): with a fused optimizer the rows
        evicted from those slots (host keys ``evict_h``, -1 where the slot was free) are written back first."""
        bounds = self.space.group_split(keys_h)
        for gi in range(len(self.groups)):
            a, b = bounds[gi], bounds[gi + 1]
            if a == b:
                continue
            ev, vs = evict_h[a:b], victims[a:b]
            if self.optimizer is not None:
                occupied = ev >= 0
                if bool(occupied.all()):
                    self.copy_out(gi, ev, vs)
                elif bool(occupied.any()):
                    idx = torch.nonzero(occupied).squeeze(1)  # host tensor: no device read
                    self.copy_out(gi, ev.index_select(0, idx), vs.index_select(0, idx.to(self.device)))
            self.copy_in(gi, keys_h[a:b], vs)

    # ------------------------------------------------------------------ a batch's rows and gradients
    def local_slots(self, s: torch.Tensor, gi: int) -> torch.Tensor:
        """Slots ``s`` as rows of group ``gi``'s slot tensor (the trash slot C is its last row)."""
        g = self.groups[gi]
        if len(self.groups) == 1:
            return s  # slot_lo is 0 and the trash slot C is the last row of the only slot tensor
        return torch.where(s == self.space.num_slots, torch.full_like(s, g.slot_hi - g.slot_lo), s - g.slot_lo)

    def _group_spills(self, batch: Batch, gi: int, a: int) -> tuple[int, int, torch.Tensor]:
        if batch.spill_keys.numel() == 0:
            return 0, 0, batch.spill_pos
        bounds = self.space.group_split(batch.spill_keys)
        sa, sb = bounds[gi], bounds[gi + 1]
        return sa, sb, batch.spill_pos[sa:sb] - a

    def gather(self, batch: Batch, gi: int) -> torch.Tensor:
        """The (U_g, dim) rows of group ``gi``'s unique keys: from slots, and from host memory for spilled rows."""
        g = self.groups[gi]
        a, b = self.space.group_run(batch.key_bounds, gi)
        out = self.weight(gi).index_select(0, self.local_slots(batch.slots[a:b], gi))
        sa, sb, spos = self._group_spills(batch, gi, a)
        if sb > sa:
            host = self._host_rows(gi, self.host_pos(g, batch.spill_keys[sa:sb]), take=False)[0]
            out.index_copy_(0, spos, self.mover.to_device(host, self.device, "spill"))
        return out

    def apply_grad(self, batch: Batch, gi: int, grad_rows: torch.Tensor) -> None:
        """Fused optimizer step on group ``gi``'s rows of the batch, where each row lives (slot or host)."""
        assert self.optimizer is not None
        with self.lock:
            g = self.groups[gi]
            g.opt_step += 1
            a, b = self.space.group_run(batch.key_bounds, gi)
            if b == a:
                return
            local = self.local_slots(batch.slots[a:b], gi)
            w, st = apply_update(self.optimizer, self.weight(gi).index_select(0, local),
                                 self.state(gi).index_select(0, local), grad_rows, g.opt_step)
            self.weight(gi).index_copy_(0, local, w)
            if st.shape[1]:
                self.state(gi).index_copy_(0, local, st)
            sa, sb, spos = self._group_spills(batch, gi, a)
            if sb > sa:  # spilled rows update in host memory, off the step's critical path on CUDA
                pos = self.host_pos(g, batch.spill_keys[sa:sb])
                opt, step = self.optimizer, g.opt_step

                def update(grad: torch.Tensor) -> None:
                    w, st = apply_update(opt, *self._host_rows(gi, pos, take=False), grad, step)
                    self._put_rows(gi, pos, w, st)

                self.mover.on_host(update, grad_rows.index_select(0, spos))

    def sparse_grads(self, batch: Batch, gi: int, grad_rows: torch.Tensor) -> list[torch.Tensor]:
        """Autograd mode: each table's sparse gradient in host position order (rows refreshed after the step)."""
        g = self.groups[gi]
        out = []
        grad_h = grad_rows if grad_rows.device.type == "cpu" else grad_rows.to("cpu")
        a0 = self.space.group_run(batch.key_bounds, gi)[0]
        for i in g.tables:
            a, b = self.space.table_run(batch.key_bounds, i)
            keys = batch.uniq[a:b]
            keys_h = keys if keys.device.type == "cpu" else keys.to("cpu")
            first = self.space.host_offset(i)
            pos = self.host_pos(g, keys_h)
            g.dirty.append((keys, pos))
            spec = self.space.tables[i]
            out.append(torch.sparse_coo_tensor((pos - first).unsqueeze(0), grad_h[a - a0:b - a0].to(spec.dtype),
                                               (spec.rows, spec.dim), check_invariants=False))
        return out

    def refresh_if_changed(self, find: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Autograd mode: copy rows an optimizer changed on the host back into their slots (``find``: the
        slot of each key, -1 where it is not cached)."""
        if self.optimizer is not None:
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
            slots = find(keys)
            trash = torch.full_like(slots, self.space.num_slots)
            local = self.local_slots(torch.where(slots >= 0, slots, trash), gi)
            self.weight(gi).index_copy_(0, local, self.mover.to_device(g.host.index_select(0, pos), self.device, "w"))

    # ------------------------------------------------------------------ every resident row
    def _occupied(self, gi: int, slot_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.groups[gi]
        keys = slot_key[g.slot_lo:g.slot_hi]
        slots = torch.nonzero(keys >= 0).squeeze(1)
        keys_h = keys.index_select(0, slots).cpu()
        return keys_h, slots + g.slot_lo

    def flush(self, slot_key: torch.Tensor) -> None:
        """Write every resident row (``slot_key``: the key in each slot) back to host memory."""
        self.mover.apply_pending()
        if self.optimizer is None:
            return
        for gi in range(len(self.groups)):
            keys_h, slots = self._occupied(gi, slot_key)
            if keys_h.numel():
                self.copy_out(gi, keys_h, slots)
        self.mover.apply_pending()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            self.mover.apply_pending()

    def reload(self, slot_key: torch.Tensor) -> None:
        """Re-read every resident row (and its state) from host memory, after the host tables changed."""
        self.mover.apply_pending()
        for gi, g in enumerate(self.groups):
            keys_h, slots = self._occupied(gi, slot_key)
            if keys_h.numel():
                self.copy_in(gi, keys_h, slots)
            g.dirty.clear()
        self.mark_host_changed()


def _chunks(rows: int, chunk_rows: int, dim: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of a table's init chunks: ``chunk_rows`` (a multiple of 16) each, the last one
    merged into the one before when it would hold fewer than 16 elements."""
    out = [(lo, min(chunk_rows, rows - lo)) for lo in range(0, rows, chunk_rows)]
    if len(out) > 1 and out[-1][1] * dim < 16:
        (lo, k), (_, tail) = out[-2], out[-1]
        out[-2:] = [(lo, k + tail)]
    return out


def _check_chunkable(name: str, fn: Callable[[torch.Tensor], object], dim: int, dtype: torch.dtype) -> None:
    """Refuse an ``init_fn`` whose rows depend on the tensor's shape: on a private RNG state it fills 64 rows
    at once and in two halves; the two must agree (the caller's RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0x5EED)
        whole = torch.zeros(64, dim, dtype=dtype)
        fn(whole)
        torch.manual_seed(0x5EED)
        halves = torch.zeros(64, dim, dtype=dtype)
        fn(halves[:32])
        fn(halves[32:])
    if not torch.equal(whole, halves):
        raise ValueError(f"table {name!r}: its init_fn {fn!r} gives rows that depend on the tensor's shape "
                         "(xavier_/kaiming_/orthogonal_ do), so it cannot initialise the table on disk chunk by "
                         "chunk; give an elementwise init_fn (e.g. functools.partial(torch.nn.init.uniform_, "
                         "a=-0.01, b=0.01), TorchRec's default) or build on 'cpu' and load_state_dict the rows")
