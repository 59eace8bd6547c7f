"""The second cache level: rows in host memory over the full tables on disk (:mod:`torchrec_cache.disk`).

Per slot-tensor group, ``slots`` host rows (records: weights and optimizer state) in sets of ``WAYS``
found by a hash of the row's position, like the device cache. The level is *exclusive* of the device:
a row the device loads leaves the host level (the device slot is now its only current copy, written
back when the device evicts it), and a row the device evicts is offered to the host level. The policy
is the device cache's: the frequency sketch ranks rows (TinyLFU admission: an offered row takes the
coldest way of its set only when the sketch counts it as used more; a free way takes any row); a row
that is not admitted, and a dirty row its admission displaces, go to the *outbox*.

Write-back, behind the step: in the step that evicts rows (:meth:`HostLevel.issue`, once its rows are placed) the
outbox becomes one write job on a background thread (rows sorted by offset, extents read, patched, written whole)
while the step computes; jobs run in order, at most :data:`WRITES_IN_FLIGHT` queued. A row leaves host memory once
its write is done (until then reads find it in the outbox or a job in flight). A failed job (disk full) raises at the
next :meth:`issue` or :meth:`persist`; its rows and every later job's go back to the outbox, newer over older, so
nothing is lost and the next call retries.

Example:
    >>> import tempfile
    >>> from tightfit.storage import TensorStore
    >>> from torchrec_cache.disk import DiskRows, RowRead
    >>> store = TensorStore(tempfile.mkdtemp(), extent_bytes=4096)
    >>> disk = DiskRows(store, "g0", rows=1000, record_bytes=8, tables=[("t", 0, 1000)])
    >>> disk.fill(0, torch.zeros(1000, 8, dtype=torch.uint8))
    >>> level = HostLevel(disk, slots=16, key_lo=0, sketch=None)
    >>> level.put(torch.tensor([5, 7]), torch.ones(2, 8, dtype=torch.uint8))
    >>> level.fetch(torch.tensor([7, 9]), take=True)[:, 0].tolist(), level.counts["host_hits"]
    [1, 0]
    >>> level.close(); store.close()
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tightfit.profiler.types import DiskProfile
from tightfit.storage import TensorStore, WriteBehind, WriteBehindError, check_disk_dir
from torchrec_cache.disk import DiskRows, RowRead
from torchrec_cache.layout import KeySpace, mix_hash
from torchrec_cache.sketch import FrequencySketch

__all__ = ["HostLevel", "DiskTier", "DiskSpec", "WAYS", "WRITES_IN_FLIGHT", "CHECKSUM_BLOCK", "READ_WORKERS",
           "extent_bytes_for"]

WAYS = 8
# Write jobs queued before issue() waits for the oldest: two steps' worth (prefetch's evictions and the step's own).
WRITES_IN_FLIGHT = 4
_FREE, _OFF = -1, -2
_NEVER = 2**62  # the score of a disabled way: never a victim


@dataclass
class _Reading:
    """A read-ahead in flight: sorted positions ``pos`` for the batch at ``step``, and the rows the step changed
    since it started (their copies in the read are stale)."""

    step: int
    pos: torch.Tensor
    read: RowRead
    changed: list[torch.Tensor] = field(default_factory=list)


class HostLevel:
    """One group's host rows over its :class:`~torchrec_cache.disk.DiskRows`.

    Args:
        disk: the group's rows on disk.
        slots: host rows of the level (0: every device miss reads the disk).
        key_lo: the group's first key (the sketch counts keys, the level positions).
        sketch: the device cache's frequency sketch (``None``: a free way or nothing, LRU-free).
        lock: shared with the cache (the prefetch thread and the step both reach the level).
    """

    def __init__(self, disk: DiskRows, slots: int, key_lo: int, sketch: FrequencySketch | None,
                 lock: threading.RLock | None = None) -> None:
        self.disk, self.key_lo, self.sketch = disk, key_lo, sketch
        self.lock = lock if lock is not None else threading.RLock()
        self.num_sets = -(-slots // WAYS) if slots > 0 else 0
        S = self.num_sets * WAYS
        self.slot_pos = torch.full((S,), _FREE, dtype=torch.int64)
        if S > slots:
            self.slot_pos[slots:] = _OFF
        self.score = torch.zeros(S, dtype=torch.int64)
        self.dirty = torch.zeros(S, dtype=torch.bool)
        self.buf = torch.empty(S, disk.record_bytes, dtype=torch.uint8)
        self.capacity = slots
        R = disk.record_bytes
        self.out_pos, self.out_rec = torch.empty(0, dtype=torch.int64), torch.empty(0, R, dtype=torch.uint8)
        self.writes: WriteBehind[tuple[torch.Tensor, torch.Tensor]] = WriteBehind(
            lambda job: disk.write(*job), max_pending=WRITES_IN_FLIGHT, name="torchrec_cache-writeback")
        self.staged: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, sorted positions, records)
        self._used = False  # whether any row entered the level, the outbox or the read-ahead
        self.reading: list[_Reading] = []  # read-aheads in flight
        self.counts = {"host_hits": 0, "host_misses": 0, "host_admitted": 0, "host_rejected": 0,
                       "rows_staged": 0, "staged_hits": 0}

    # ------------------------------------------------------------------ index
    def _sets(self, pos: torch.Tensor) -> torch.Tensor:
        return mix_hash(pos) % self.num_sets

    def find(self, pos: torch.Tensor) -> torch.Tensor:
        """Host slot of each position, -1 where the level does not hold it."""
        if self.num_sets == 0 or pos.numel() == 0:
            return torch.full_like(pos, -1)
        sets = self._sets(pos)
        ways = self.slot_pos.view(self.num_sets, WAYS).index_select(0, sets)
        match = ways == pos.unsqueeze(1)
        way = match.to(torch.uint8).argmax(1)
        return torch.where(match.any(1), sets * WAYS + way, torch.full_like(sets, -1))

    def _prio(self, pos: torch.Tensor) -> torch.Tensor:
        if self.sketch is None:
            return torch.zeros_like(pos)
        dev = self.sketch.table.device
        return self.sketch.estimate((pos + self.key_lo).to(dev)).cpu()

    def _pending(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows written but not yet on disk, newest first: the outbox, then the jobs in flight."""
        return [(self.out_pos, self.out_rec), *reversed(self.writes.pending())]

    # ------------------------------------------------------------------ the lookahead window on disk
    def stage(self, pos: torch.Tensor, step: int) -> None:
        """Read ahead: rows ``pos`` (unique) that the batch running at ``step`` needs and neither the level nor
        a pending write holds start reading from disk now, without waiting (the prefetch thread calls this as
        a batch enters the window, ``ahead`` batches before it runs). A finished read's rows are kept until
        that batch ran; :meth:`fetch` waits only for reads holding rows it needs."""
        with self.lock:
            self._collect()
            rest = pos[self.find(pos) < 0]
            held = self._pending() + [(p, r) for _, p, r in self.staged] + [(r.pos, r.read.out) for r in self.reading]
            for ppos, _ in held:
                if rest.numel() and ppos.numel():
                    rest = rest[~_isin(rest, ppos)]
            if rest.numel() == 0:
                return
            rest = torch.sort(rest).values
            self._used = True
            # The read runs without the lock, so the step goes on meanwhile: rows it changes in the meantime are
            # dropped from what was read when the read is collected (their new value is in the level or the outbox).
            self.reading.append(_Reading(step=step, pos=rest, read=self.disk.read_start(rest)))

    def _collect(self, need: torch.Tensor | None = None, *, wait: bool = False) -> None:
        """Move finished read-aheads to ``staged`` (``wait``: all of them; ``need``: also those holding any of
        the positions ``need``, waiting for them). A failed read raises here (:class:`RowFileError`)."""
        keep = []
        for r in self.reading:
            if not (wait or r.read.future.done() or (need is not None and bool(_isin(need, r.pos).any()))):
                keep.append(r)
                continue
            try:
                recs = self.disk.read_finish(r.read)
            except BaseException:
                self.reading = [x for x in self.reading if x is not r]
                raise
            pos = r.pos
            if r.changed:
                ok = ~_isin(pos, torch.sort(torch.cat(r.changed)).values)
                pos, recs = pos[ok], recs[ok]
            self.staged.append((r.step, pos, recs))
            self.counts["rows_staged"] += pos.numel()
        self.reading = keep

    def wait_staged(self, until: int) -> None:
        """Wait for the read-aheads of batches up to step ``until``, without the lock: a load then finds their
        rows read instead of waiting for them while holding the cache (and the step) up."""
        with self.lock:
            futures = [r.read.future for r in self.reading if r.step <= until]
        for fut in futures:
            cf.wait([fut])  # errors are raised where the rows are collected

    def forget_staged(self, before: int) -> None:
        """Drop the rows read ahead for batches that ran before step ``before``."""
        with self.lock:
            self._collect()
            self.staged = [s for s in self.staged if s[0] >= before]
            self.reading = [r for r in self.reading if r.step >= before]  # unused: their reads finish unobserved

    def _unstage(self, pos: torch.Tensor) -> None:
        """Rows ``pos`` changed: their read-ahead copies are stale."""
        if self.staged:
            ref = torch.sort(pos).values
            self.staged = [(s, p[keep], r[keep]) for s, p, r in self.staged for keep in [~_isin(p, ref)]]

    def fetch(self, pos: torch.Tensor, *, take: bool) -> torch.Tensor:
        """Records of rows ``pos`` (unique) from the host level, the pending writes, else the disk (in offset
        order). ``take``: the device loads them, so they leave the host level."""
        with self.lock:
            if self.reading:
                self._collect(torch.sort(pos).values)
            out = torch.empty(pos.numel(), self.disk.record_bytes, dtype=torch.uint8)
            slot = self.find(pos)
            hit = torch.nonzero(slot >= 0).squeeze(1)
            if hit.numel():
                hs = slot.index_select(0, hit)
                out.index_copy_(0, hit, self.buf.index_select(0, hs))
                if take:
                    self.slot_pos.index_fill_(0, hs, _FREE)
                    self.dirty.index_fill_(0, hs, False)
            self.counts["host_hits"] += hit.numel()
            rest = torch.nonzero(slot < 0).squeeze(1)
            for j, (ppos, prec) in enumerate(self._pending() + [(p, r) for _, p, r in reversed(self.staged)]):
                if rest.numel() == 0 or ppos.numel() == 0:
                    continue
                want = pos.index_select(0, rest)
                idx = torch.searchsorted(ppos, want).clamp_(max=ppos.numel() - 1)
                found = ppos.index_select(0, idx) == want
                out.index_copy_(0, rest[found], prec.index_select(0, idx[found]))
                if j >= 2:
                    self.counts["staged_hits"] += int(found.sum())
                rest = rest[~found]
            if rest.numel():
                want = pos.index_select(0, rest)
                order = torch.argsort(want)
                out.index_copy_(0, rest.index_select(0, order), self.disk.read(want.index_select(0, order)))
            self.counts["host_misses"] += rest.numel()
            return out

    # ------------------------------------------------------------------ writes
    def put(self, pos: torch.Tensor, recs: torch.Tensor) -> None:
        """Rows ``pos`` (unique) changed (device evictions, spilled rows' updates): kept in the level if the
        policy admits them, else queued for disk."""
        with self.lock:
            self._used = True
            for r in self.reading:
                r.changed.append(pos.clone())
            self._unstage(pos)
            slot = self.find(pos)
            hit = torch.nonzero(slot >= 0).squeeze(1)
            if hit.numel():
                hs = slot.index_select(0, hit)
                self.buf.index_copy_(0, hs, recs.index_select(0, hit))
                self.dirty.index_fill_(0, hs, True)
            miss = torch.nonzero(slot < 0).squeeze(1)
            if miss.numel() == 0:
                return
            (self._to_outbox if self.num_sets == 0 else self._admit)(pos.index_select(0, miss), recs.index_select(0, miss))

    def _admit(self, pos: torch.Tensor, recs: torch.Tensor) -> None:
        """TinyLFU admission per set: the k-th most used offered row of a set against its k-th coldest way."""
        prio = self._prio(pos)
        sets = self._sets(pos)
        order = torch.argsort(prio, descending=True, stable=True)
        order = order.index_select(0, torch.argsort(sets.index_select(0, order), stable=True))
        s_sorted = sets.index_select(0, order)
        n = s_sorted.numel()
        head = torch.ones(n, dtype=torch.bool)
        head[1:] = s_sorted[1:] != s_sorted[:-1]
        first = torch.cummax(torch.where(head, torch.arange(n), 0), 0).values
        rank = torch.arange(n) - first
        way_score = torch.where(self.slot_pos == _FREE, -1, torch.where(self.slot_pos == _OFF, _NEVER, self.score))
        per_set = way_score.view(self.num_sets, WAYS).index_select(0, s_sorted)
        coldest, col = torch.sort(per_set, dim=1, stable=True)
        r = rank.clamp(max=WAYS - 1).unsqueeze(1)
        v_score = coldest.gather(1, r).squeeze(1)
        victim = s_sorted * WAYS + col.gather(1, r).squeeze(1)
        p_sorted = prio.index_select(0, order)
        admit = (rank < WAYS) & (v_score < _NEVER) & (p_sorted > v_score)
        a, na, vs = order[admit], order[~admit], victim[admit]
        gone = self.slot_pos.index_select(0, vs)
        drop = (gone >= 0) & self.dirty.index_select(0, vs)
        if bool(drop.any()):
            self._to_outbox(gone[drop], self.buf.index_select(0, vs[drop]))
        self.slot_pos.index_copy_(0, vs, pos.index_select(0, a))
        self.buf.index_copy_(0, vs, recs.index_select(0, a))
        self.score.index_copy_(0, vs, p_sorted[admit])
        self.dirty.index_fill_(0, vs, True)
        self.counts["host_admitted"] += a.numel()
        self.counts["host_rejected"] += na.numel()
        if na.numel():
            self._to_outbox(pos.index_select(0, na), recs.index_select(0, na))

    def _to_outbox(self, pos: torch.Tensor, recs: torch.Tensor) -> None:
        """Queue rows for disk; a newer record of a row replaces an older one."""
        self.out_pos, self.out_rec = _merge(self.out_pos, self.out_rec, pos, recs)

    def issue(self) -> None:
        """Start writing the outbox as one job behind those in flight (waiting for the oldest when
        :data:`WRITES_IN_FLIGHT` are queued); raises a finished job's error."""
        with self.lock:
            self._settle_inflight(wait=False)
            if self.out_pos.numel() == 0:
                return
            job = (self.out_pos, self.out_rec)
            try:
                self.writes.submit(job)
            except WriteBehindError as err:
                self._requeue(err)
            self.out_pos, self.out_rec = job[0][:0], job[1][:0]

    def _settle_inflight(self, *, wait: bool = True) -> None:
        """Drop the finished jobs at the head of the queue (``wait``: every job, waiting for them). A failed job:
        every job is waited for and their rows are pending again, oldest first, under the outbox; then it raises."""
        try:
            self.writes.settle(wait=wait)
        except WriteBehindError as err:
            self._requeue(err)

    def _requeue(self, err: WriteBehindError) -> None:
        pos, rec = self.out_pos, self.out_rec
        for p, r in reversed(err.payloads):  # newest first: each merges under what is newer than it
            pos, rec = _merge(p, r, pos, rec)
        self.out_pos, self.out_rec = pos, rec
        raise err.error from None

    def persist(self) -> None:
        """Write every dirty host row and the outbox to disk and wait (a checkpoint's durability point)."""
        with self.lock:
            self._settle_inflight()
            d = torch.nonzero(self.dirty & (self.slot_pos >= 0)).squeeze(1)
            if d.numel():
                self._to_outbox(self.slot_pos.index_select(0, d), self.buf.index_select(0, d))
            self.dirty.index_fill_(0, d, False)
            self.issue()
            self._settle_inflight()

    # ------------------------------------------------------------------ contiguous rows (checkpoints)
    def read_range(self, lo: int, n: int) -> torch.Tensor:
        """Records of rows ``[lo, lo + n)``: the disk's, overlaid by pending writes and host rows."""
        with self.lock:
            recs = self.disk.read_range(lo, n).clone()
            for ppos, prec in reversed(self._pending()):  # oldest first, so newer ones win
                m = (ppos >= lo) & (ppos < lo + n)
                if bool(m.any()):
                    recs.index_copy_(0, ppos[m] - lo, prec[m])
            s = torch.nonzero((self.slot_pos >= lo) & (self.slot_pos < lo + n)).squeeze(1)
            if s.numel():
                recs.index_copy_(0, self.slot_pos.index_select(0, s) - lo, self.buf.index_select(0, s))
            return recs

    def write_range(self, lo: int, recs: torch.Tensor) -> None:
        """Replace rows ``[lo, lo + n)`` on disk (checkpoint loading): host and pending copies are dropped."""
        with self.lock:
            n = recs.shape[0]
            self._settle_inflight()
            self._collect(wait=True)
            if not self._used:  # a level nothing went through yet (set-up): only the disk holds rows
                self.disk.fill(lo, recs)
                return
            keep = (self.out_pos < lo) | (self.out_pos >= lo + n)
            self.out_pos, self.out_rec = self.out_pos[keep], self.out_rec[keep]
            self.staged = [(st, p[keep], r[keep]) for st, p, r in self.staged for keep in [(p < lo) | (p >= lo + n)]]
            s = torch.nonzero((self.slot_pos >= lo) & (self.slot_pos < lo + n)).squeeze(1)
            self.slot_pos.index_fill_(0, s, _FREE)
            self.dirty.index_fill_(0, s, False)
            self.disk.fill(lo, recs)

    def host_rows(self) -> int:
        return int((self.slot_pos >= 0).sum())

    def close(self) -> None:
        self.writes.close()


def _isin(x: torch.Tensor, sorted_ref: torch.Tensor) -> torch.Tensor:
    """Whether each of ``x`` is in ``sorted_ref`` (sorted, non-empty)."""
    if sorted_ref.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    idx = torch.searchsorted(sorted_ref, x).clamp_(max=sorted_ref.numel() - 1)
    return sorted_ref.index_select(0, idx) == x


def _merge(old_pos: torch.Tensor, old_rec: torch.Tensor, new_pos: torch.Tensor,
           new_rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique positions of both, the newer record where a position is in both."""
    if old_pos.numel() == 0:
        order = torch.argsort(new_pos)
        return new_pos.index_select(0, order), new_rec.index_select(0, order)
    p = torch.cat([old_pos, new_pos])
    order = torch.argsort(p, stable=True)
    ps = p.index_select(0, order)
    last = torch.ones_like(ps, dtype=torch.bool)
    last[:-1] = ps[1:] != ps[:-1]
    return ps[last], torch.cat([old_rec, new_rec]).index_select(0, order[last])


# The store's extent is the unit a missed row costs on disk: small, so a scattered miss reads little, but not
# so small that writing the tables and the store's index (~180 bytes of Python per extent) cost too much:
# at most 2**18 extents (16 KiB for 4 GiB of tables). On the DLRM benchmark 4 KiB extents made writing the
# tables take minutes; the requests' count, not their size, bounds the reads.
_MIN_EXTENT, _MAX_EXTENTS = 4096, 2**18


# A missed row is read as the 4 KiB checksum block holding it (TensorStore.read_ranges), not its extent. Those
# reads are short and scattered: the disk answers them by queue depth, not bandwidth (random 4 KiB O_DIRECT
# reads, one thread each, scale with the threads well past 16 on a virtio disk).
CHECKSUM_BLOCK, READ_WORKERS = 4096, 16


def extent_bytes_for(total_bytes: int) -> int:
    """The smallest power-of-two extent >= 4 KiB that keeps ``total_bytes`` within 2**18 extents."""
    e = _MIN_EXTENT
    while total_bytes > e * _MAX_EXTENTS:
        e *= 2
    return e


@dataclass(frozen=True)
class DiskSpec:
    """What a cache needs to open its disk tier: the directory, each table's host-level rows, the disk's profile."""

    disk_dir: str
    host_rows: dict[str, int]
    profile: DiskProfile | None = None

    def open(self, space: KeySpace, row_bytes: list[int], sketch: FrequencySketch | None, lock: threading.RLock,
             device: torch.device) -> DiskTier:
        """The tier of a cache over ``space`` (``row_bytes``: per table, a row and its state)."""
        if device.type == "meta":
            raise ValueError("a cache with a disk_dir cannot be built on the meta device; build it on 'cpu' or "
                             "'cuda' (its rows are written to disk at construction)")
        groups = []
        for span in space.groups:
            tables = [(space.tables[i].name, space.host_offset(i), space.tables[i].rows) for i in span.tables]
            groups.append((span.key_hi - span.key_lo, row_bytes[span.tables[0]], span.key_lo,
                           sum(self.host_rows.get(space.tables[i].name, 0) for i in span.tables), tables))
        return DiskTier(self.disk_dir, groups, sketch, lock, self.profile)


class DiskTier:
    """The disk tier of one cache: a :class:`~tightfit.storage.TensorStore` in a fresh directory under
    ``disk_dir`` (removed when the cache goes), one :class:`DiskRows` and one :class:`HostLevel` per group.

    Args:
        disk_dir: an existing directory on a local SSD; refused (one line) if it cannot hold ``need_bytes``.
        groups: per group ``(rows, record_bytes, key_lo, host slots, [(table, first row, rows)])``.
        sketch: the cache's frequency sketch (the host level's admission).
        lock: the cache's lock.
        profile: the disk's profile (I/O workers), or ``None``.
    """

    def __init__(self, disk_dir: str, groups: list[tuple[int, int, int, int, list[tuple[str, int, int]]]],
                 sketch: FrequencySketch | None, lock: threading.RLock, profile: DiskProfile | None = None) -> None:
        need = sum(rows * rec for rows, rec, _, _, _ in groups)
        base = check_disk_dir(disk_dir, need_bytes=need)
        self.path = Path(tempfile.mkdtemp(prefix="torchrec_cache-", dir=base))
        workers = max(READ_WORKERS, profile.queue_depth) if profile is not None else READ_WORKERS
        self.store = TensorStore(self.path, extent_bytes=extent_bytes_for(need), workers=workers,
                                 checksum_block=CHECKSUM_BLOCK)
        self.levels: list[HostLevel] = []
        for gi, (rows, rec, key_lo, slots, tables) in enumerate(groups):
            disk = DiskRows(self.store, f"group{gi}", rows=rows, record_bytes=rec, tables=tables)
            self.levels.append(HostLevel(disk, slots, key_lo, sketch, lock))
        self._finalizer = weakref.finalize(self, _close, self.store, list(self.levels), self.path)

    def issue(self) -> None:
        """Start the write-back of every group's outbox (after a placement); raises a failed write's error."""
        for level in self.levels:
            level.issue()

    def stage(self, keys: torch.Tensor, step: int, group_split: list[int]) -> None:
        """Read ahead the rows of sorted host ``keys`` (groups' runs: ``group_split``) for the batch at ``step``."""
        for gi, level in enumerate(self.levels):
            a, b = group_split[gi], group_split[gi + 1]
            if b > a:
                level.stage(keys[a:b] - level.key_lo, step)

    def wait_staged(self, until: int) -> None:
        for level in self.levels:
            level.wait_staged(until)

    def forget_staged(self, before: int) -> None:
        for level in self.levels:
            level.forget_staged(before)

    def persist(self) -> None:
        """Every changed row on disk, durable (:meth:`TensorStore.sync`)."""
        for level in self.levels:
            level.persist()
        self.store.sync()

    def stats(self) -> dict[str, int]:
        """Host-level and disk counters summed over the groups, and the host rows held now."""
        out: dict[str, int] = {}
        for level in self.levels:
            for k, v in list(level.counts.items()) + list(level.disk.counts.items()):
                out[k] = out.get(k, 0) + v
        out["host_rows"] = sum(level.host_rows() for level in self.levels)
        out["host_capacity"] = sum(level.capacity for level in self.levels)
        return out

    def close(self) -> None:
        self._finalizer()


def _close(store: TensorStore, levels: list[HostLevel], path: Path) -> None:
    for level in levels:
        level.close()
    try:
        store.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
