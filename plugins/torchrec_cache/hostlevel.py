"""The second cache level: rows in host memory over the full tables on disk (:mod:`torchrec_cache.disk`).

Per slot-tensor group, ``slots`` host rows (records: weights and optimizer state) in sets of ``WAYS``
found by a hash of the row's position, like the device cache. The level is *exclusive* of the device:
a row the device loads leaves the host level (the device slot is now its only current copy, written
back when the device evicts it), and a row the device evicts is offered to the host level. The policy
is the device cache's: the frequency sketch ranks rows (TinyLFU admission: an offered row takes the
coldest way of its set only when the sketch counts it as used more; a free way takes any row); a row
that is not admitted, and a dirty row its admission displaces, go to the *outbox*.

Write-back, behind the step: in the step that evicts rows (:meth:`HostLevel.issue`, once its rows are placed) the
outbox becomes one write job on a background thread (rows sorted by offset, written as row records: one append)
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

import threading
from dataclasses import dataclass, field

import torch

from tightfit.storage import ReadAhead, WriteBehind, WriteBehindError
from torchrec_cache.disk import DiskRows, RowRead
from torchrec_cache.layout import mix_hash
from torchrec_cache.sketch import FrequencySketch

__all__ = ["HostLevel", "WAYS", "WRITES_IN_FLIGHT", "READ_AHEAD"]

WAYS = 8
# Write jobs queued before issue() waits for the oldest: two steps' worth (prefetch's evictions and the step's own).
WRITES_IN_FLIGHT = 4
_FREE, _OFF = -1, -2
_NEVER = 2**62  # the score of a disabled way: never a victim


# Reads of batches the lookahead window holds, started ahead of their use (core's ReadAhead: a batch's read is
# started when it is added within this many of the oldest not yet collected).
READ_AHEAD = 8


@dataclass
class _Queued:
    """A batch's read-ahead: sorted positions ``pos`` for the batch at ``step``, and the rows the step changed
    since it was queued (their copies in the read are stale)."""

    step: int
    pos: torch.Tensor
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
        self.queued: dict[int, _Queued] = {}  # read-aheads not yet collected, by key (added in increasing order)
        self._keys = 0
        self.ahead: ReadAhead[int, RowRead | None] = ReadAhead([], self._start_read, depth=READ_AHEAD)
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
        a pending write holds are queued on the read-ahead (core's :class:`~tightfit.storage.ReadAhead`, which
        starts the read on its thread without waiting; the prefetch thread calls this as a batch enters the
        window, ``ahead`` batches before it runs). A collected read's rows are kept until that batch ran;
        :meth:`fetch` waits only for reads holding rows it needs."""
        with self.lock:
            rest = pos[self.find(pos) < 0]
            held = [p for p, _ in self._pending()] + [p for _, p, _ in self.staged] + [q.pos for q in self.queued.values()]
            for ppos in held:
                if rest.numel() and ppos.numel():
                    rest = rest[~_isin(rest, ppos)]
            if rest.numel() == 0:
                return
            self._used = True
            # The read runs without the lock, so the step goes on meanwhile: rows it changes in the meantime are
            # dropped from what was read when the read is collected (their new value is in the level or the outbox).
            key, self._keys = self._keys, self._keys + 1
            self.queued[key] = _Queued(step=step, pos=torch.sort(rest).values)
            self.ahead.add(key)

    def _start_read(self, key: int, _slot: int) -> RowRead | None:
        """The read-ahead's read (on its thread): start reading a queued batch's rows (``None``: forgotten)."""
        q = self.queued.get(key)
        return None if q is None else self.disk.read_start(q.pos)

    def _collect(self, need: torch.Tensor | None = None, *, wait: bool = False, until: int | None = None) -> None:
        """Move read-aheads to ``staged``, in order, up to the last one that is ``wait`` (all), for a batch up
        to step ``until``, or holds any of the positions ``need``, waiting for them. A failed read raises here
        (:class:`RowFileError`)."""
        keys = sorted(self.queued)
        last = -1
        for i, k in enumerate(keys):
            q = self.queued[k]
            if wait or (until is not None and q.step <= until) or (need is not None and bool(_isin(need, q.pos).any())):
                last = i
        for k in keys[:last + 1]:
            read = self.ahead.take(k)  # before the pop: a read not started yet looks its batch up in ``queued``
            q = self.queued.pop(k)
            if read is None:
                continue
            recs, pos = self.disk.read_finish(read), q.pos
            if q.changed:
                ok = ~_isin(pos, torch.sort(torch.cat(q.changed)).values)
                pos, recs = pos[ok], recs[ok]
            self.staged.append((q.step, pos, recs))
            self.counts["rows_staged"] += pos.numel()

    def wait_staged(self, until: int) -> None:
        """Collect the read-aheads of batches up to step ``until``: a load then finds their rows read."""
        with self.lock:
            self._collect(until=until)

    def forget_staged(self, before: int) -> None:
        """Drop the rows read ahead for batches that ran before step ``before``."""
        with self.lock:
            self.staged = [s for s in self.staged if s[0] >= before]
            for k in [k for k, q in self.queued.items() if q.step < before]:
                del self.queued[k]  # unused: the read-ahead skips them; reads in flight finish unobserved

    def _unstage(self, pos: torch.Tensor) -> None:
        """Rows ``pos`` changed: their read-ahead copies are stale."""
        if self.staged:
            ref = torch.sort(pos).values
            self.staged = [(s, p[keep], r[keep]) for s, p, r in self.staged for keep in [~_isin(p, ref)]]

    def fetch(self, pos: torch.Tensor, *, take: bool) -> torch.Tensor:
        """Records of rows ``pos`` (unique) from the host level, the pending writes, else the disk (in offset
        order). ``take``: the device loads them, so they leave the host level."""
        with self.lock:
            if self.queued:
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
            for q in self.queued.values():
                q.changed.append(pos.clone())
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
        self.ahead.close()
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
