"""The runtime that streams tensors between tiers: staging buffers, read-ahead in a stated order, write-behind,
and one set of byte/time counters.

The store (:class:`~tightfit.storage.TensorStore`) moves bytes between files and host buffers; every plugin that
streams through it needs the same four pieces around it, and they live here so each plugin says only *what* it
moves and *in which order*:

* :class:`StagingBuffers`: one host buffer per I/O thread (aligned for ``O_DIRECT``, pinned when CUDA is present,
  so a copy to the device can run on a stream), allocated on the thread's first use and reused for every read.
* :class:`ReadAhead`: reads of items by key, in an order the caller states (all at once, or key by key as they
  become known: :meth:`~ReadAhead.add`), kept ``depth`` items ahead of the consumer on a ring of ``depth + 1``
  slots, on one background thread; a slot is reused only after the consumer moved past its item.
* :class:`WriteBehind`: writes queued on one background thread, in order, at most ``max_pending`` at once; a
  failed write raises on the next :meth:`~WriteBehind.submit` or :meth:`~WriteBehind.flush` and hands back the
  payloads of the failed write and of every write behind it, so nothing is lost.
* :class:`IOCounters`: reads, writes, bytes and seconds, counted once an operation completes, so a report taken
  while a read is in flight never holds its bytes without its read.

Example:
    >>> import torch
    >>> counters = IOCounters()
    >>> with counters.reading() as tally:
    ...     tally.bytes += 4096
    >>> counters.totals.reads, counters.totals.bytes_read
    (1, 4096)
    >>> with ReadAhead([3, 1, 2], lambda key, slot: key * 10, depth=1) as ahead:
    ...     [ahead.take(k) for k in (3, 1, 2)]
    [30, 10, 20]
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from tightfit.storage.buffers import aligned_empty

__all__ = ["IOTotals", "IOCounters", "Tally", "StagingBuffers", "ReadAhead", "WriteBehind", "WriteBehindError",
           "KEEP_PASSED"]

KEEP_PASSED = 1024
"""Keys an open :class:`ReadAhead` remembers behind its consumer (to restart at)."""

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class IOTotals:
    """What a user of the runtime moved: completed reads and writes, their bytes and seconds."""

    reads: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    writes: int = 0
    bytes_written: int = 0
    write_s: float = 0.0

    def __add__(self, other: IOTotals) -> IOTotals:
        return IOTotals(self.reads + other.reads, self.bytes_read + other.bytes_read, self.read_s + other.read_s,
                        self.writes + other.writes, self.bytes_written + other.bytes_written,
                        self.write_s + other.write_s)


@dataclass(slots=True)
class Tally:
    """The bytes one timed operation moved (add to ``bytes`` while it runs)."""

    bytes: int = 0


class IOCounters:
    """Counters of one user of the runtime (a layer, a unit, a table group), safe to update from any thread.

    :meth:`reading` / :meth:`writing` time an operation and count it, with the bytes its :class:`Tally` collected,
    only when it completes: an operation that raises counts nothing, and :attr:`totals` is replaced whole.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals = IOTotals()

    def add(self, totals: IOTotals) -> None:
        with self._lock:
            self.totals = self.totals + totals

    @contextmanager
    def reading(self) -> Iterator[Tally]:
        tally, start = Tally(), time.perf_counter()
        yield tally
        self.add(IOTotals(reads=1, bytes_read=tally.bytes, read_s=time.perf_counter() - start))

    @contextmanager
    def writing(self) -> Iterator[Tally]:
        tally, start = Tally(), time.perf_counter()
        yield tally
        self.add(IOTotals(writes=1, bytes_written=tally.bytes, write_s=time.perf_counter() - start))


class StagingBuffers(threading.local):
    """One host buffer of ``nbytes`` per thread, 4 KiB-aligned (``O_DIRECT`` reads land in it with no bounce),
    allocated on the thread's first :meth:`get` and reused for every later one (no growth while serving).

    Args:
        nbytes: each buffer's size.
        pin: pin it (a copy to the device then runs asynchronously on a stream); ``None``: when CUDA is present.
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None) -> None:
        if nbytes < 0:
            raise ValueError(f"StagingBuffers: nbytes={nbytes} must be >= 0 (the largest item a thread stages)")
        self.nbytes = nbytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buf: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.buf is None:
            self.buf = aligned_empty(self.nbytes, pin_memory=self.pin)
        return self.buf


class ReadAhead(Generic[K, V]):
    """Reads of items by key in a stated ``order``, ``depth`` items ahead of the consumer.

    ``read(key, slot)`` runs on a background thread, one read at a time in order, and fills slot ``slot``
    (``0 .. depth``, a ring the caller owns) with the item; :meth:`take` waits for the next item of the order and
    returns what ``read`` returned, raising what it raised. The slot of item ``i`` is reused for item ``i + depth + 1``, which starts
    only when the consumer takes item ``i + 1``: while the consumer uses item ``i``, its slot is untouched.
    Taking a key further along the order skips the keys before it (their reads in flight are waited for and
    dropped); taking a key already passed restarts the order at that key (every read in flight is dropped).
    :meth:`add` appends a key to the order (a stream whose keys become known as it runs, like a training loop's
    steps); keys more than :data:`KEEP_PASSED` behind the consumer are then forgotten (a restart cannot reach
    them). The methods may be called from several threads.

    Args:
        order: the keys, in the order they will be taken (more may be added).
        read: fills a slot with one item.
        depth: items read ahead of the one in use (slots = depth + 1).
    """

    def __init__(self, order: Sequence[K], read: Callable[[K, int], V], *, depth: int = 1) -> None:
        if depth < 0:
            raise ValueError(f"ReadAhead: depth={depth} must be >= 0 (items read ahead of the one in use)")
        if len(set(order)) != len(order):
            raise ValueError(f"ReadAhead: the order repeats keys {sorted({k for k in order if order.count(k) > 1}, key=repr)}; "
                             "give each key once")
        self.order, self.read = list(order), read
        self.depth = min(depth, max(len(self.order) - 1, 0)) if self.order else depth  # never more slots than keys
        self._lock = threading.RLock()
        self._at = {k: i for i, k in enumerate(self.order)}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tightfit-readahead")
        self._ahead: deque[tuple[K, int, Future[V]]] = deque()
        self._free = deque(range(self.depth + 1))
        self._held: int | None = None  # the slot of the item the consumer holds
        self._next = 0  # position in the order of the next read to start

    def _start(self) -> None:
        while self._free and len(self._ahead) <= self.depth - (self._held is not None) and self._next < len(self.order):
            key, slot = self.order[self._next], self._free.popleft()
            self._next += 1
            self._ahead.append((key, slot, self._pool.submit(self.read, key, slot)))

    def add(self, key: K) -> None:
        """Append ``key`` to the order (a key already in it is refused) and start its read if it is within
        ``depth`` of the consumer."""
        with self._lock:
            if key in self._at:
                raise ValueError(f"ReadAhead.add({key!r}): the key is already in the order; give each key once")
            self._at[key] = len(self.order)
            self.order.append(key)
            self._start()
            if self._next > 2 * KEEP_PASSED:  # forget keys long passed: the order does not grow with the stream
                cut = self._next - KEEP_PASSED - len(self._ahead)
                for k in self.order[:cut]:
                    del self._at[k]
                del self.order[:cut]
                self._at = {k: i - cut for k, i in self._at.items()}
                self._next -= cut

    def _drop(self, until: K | None = None) -> None:
        """Wait for the reads in flight (``until``: only those before that key's) and give their slots back
        (their results and errors are discarded)."""
        while self._ahead and (until is None or self._ahead[0][0] != until):
            _, slot, fut = self._ahead.popleft()
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - a dropped read's failure: the item is read again when taken
                pass
            self._free.append(slot)

    def take(self, key: K) -> V:
        """The item ``key`` (the next of the order, else the order restarts at it), read into its slot; the slot
        of the item taken before is released."""
        with self._lock:
            fut = self._claim(key)
        try:
            value = fut.result()
        except BaseException:
            with self._lock:
                if self._held is not None:
                    self._free.append(self._held)
                    self._held = None
            raise
        with self._lock:
            self._start()
        return value

    def _claim(self, key: K) -> Future[V]:
        """Make ``key``'s read the held one (skipping or restarting as :meth:`take` says); its future."""
        if key not in self._at:
            raise KeyError(f"ReadAhead.take({key!r}): the key is not in the order; keys: {self.order[:8]}")
        if self._held is not None:
            self._free.append(self._held)
            self._held = None
        if any(k == key for k, _, _ in self._ahead):
            self._drop(until=key)  # skipped keys: their reads are dropped
        elif not self._ahead or self._ahead[0][0] != key:
            self._drop()
            self._next = self._at[key]
        self._start()
        _, slot, fut = self._ahead.popleft()
        self._held = slot
        return fut

    def close(self) -> None:
        """Wait for the reads in flight (their slots stay valid until they finish) and stop the thread."""
        with self._lock:
            self._drop()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ReadAhead[K, V]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class WriteBehindError(RuntimeError):
    """A queued write failed. ``payloads``: the failed write's payload and every later one's, oldest first (none
    of them is known to be on disk: queue them again); ``error``: the failure (also the ``__cause__``)."""

    def __init__(self, message: str, payloads: list[Any], error: BaseException) -> None:
        super().__init__(message)
        self.payloads, self.error = payloads, error


class WriteBehind(Generic[P]):
    """Writes run in submission order on one background thread, at most ``max_pending`` queued or running.

    :meth:`submit` waits for the oldest write when ``max_pending`` are queued (backpressure) and raises a
    finished write's failure; :meth:`flush` waits for every write. A failure is raised once, as
    :class:`WriteBehindError` holding the payloads of the failed write and of every write behind it (all of
    them waited for first), so the caller queues them again and nothing is lost or left half-written.

    Args:
        write: writes one payload (on the background thread).
        max_pending: writes queued or running at once.
    """

    def __init__(self, write: Callable[[P], Any], *, max_pending: int = 4, name: str = "tightfit-writebehind") -> None:
        if max_pending < 1:
            raise ValueError(f"WriteBehind: max_pending={max_pending} must be >= 1 (writes queued at once)")
        self.write, self.max_pending = write, max_pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.jobs: deque[tuple[P, Future[Any]]] = deque()  # oldest first

    def pending(self) -> list[P]:
        """Payloads not yet known to be written, oldest first (readers overlay them on the disk's data)."""
        return [p for p, _ in self.jobs]

    def submit(self, payload: P) -> None:
        self.settle()
        while len(self.jobs) >= self.max_pending:
            self.jobs[0][1].exception()  # waits
            self.settle()
        self.jobs.append((payload, self._pool.submit(self.write, payload)))

    def settle(self, *, wait: bool = False) -> None:
        """Drop the finished writes at the head of the queue (``wait``: every write, waiting for it); raise
        :class:`WriteBehindError` where one failed."""
        while self.jobs and (wait or self.jobs[0][1].done()):
            err = self.jobs[0][1].exception()
            if err is None:
                self.jobs.popleft()
                continue
            jobs, self.jobs = list(self.jobs), deque()
            for _, fut in jobs:
                fut.exception()  # waits: nothing is still writing over a payload the caller gets back
            raise WriteBehindError(f"a write-behind write failed ({type(err).__name__}: {err}); its payload and the "
                                   f"{len(jobs) - 1} queued after it are returned for a retry",
                                   [p for p, _ in jobs], err) from err

    def flush(self) -> None:
        """Wait for every queued write; raise :class:`WriteBehindError` where one failed."""
        self.settle(wait=True)

    def close(self) -> None:
        """Stop the thread after the queued writes (their failures are not raised: :meth:`flush` first)."""
        self._pool.shutdown(wait=True)
