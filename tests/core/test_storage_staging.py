"""The streaming runtime (tightfit.storage.staging): staging buffers, read-ahead in a stated order, write-behind
and the counters, over orders and sizes hypothesis picks, with failures injected into reads and writes."""

from __future__ import annotations

import threading
from contextlib import nullcontext

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.storage import ALIGN, IOCounters, IOTotals, ReadAhead, StagingBuffers, TensorStore, WriteBehind
from tightfit.storage.staging import WriteBehindError


def test_staging_buffers_are_aligned_one_per_thread_and_reused():
    staging = StagingBuffers(10_000, pin=False)
    first = staging.get()
    assert first.numel() == 10_000 and first.data_ptr() % ALIGN == 0 and not first.is_pinned()
    assert staging.get().data_ptr() == first.data_ptr()  # reused, not grown
    seen = []
    t = threading.Thread(target=lambda: seen.append(staging.get().data_ptr()))
    t.start()
    t.join()
    assert seen[0] != first.data_ptr() and seen[0] % ALIGN == 0
    with pytest.raises(ValueError, match="nbytes=-1 must be >= 0"):
        StagingBuffers(-1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), depth=st.integers(0, 4), data=st.data())
def test_read_ahead_returns_each_key_in_any_taken_order_and_never_reuses_a_held_slot(n, depth, data):
    order = data.draw(st.permutations(list(range(n))))
    taken = data.draw(st.lists(st.sampled_from(order), min_size=1, max_size=3 * n))
    slots: dict[int, int] = {}  # slot -> key it holds
    held: list[int | None] = [None]
    lock = threading.Lock()

    def read(key: int, slot: int) -> tuple[int, int]:
        with lock:
            assert slot != held[0], "a read wrote into the slot the consumer holds"
            slots[slot] = key
        return key * 100, slot

    with ReadAhead(order, read, depth=depth) as ahead:
        assert ahead.depth == min(depth, n - 1)
        for key in taken:
            value, slot = ahead.take(key)
            with lock:
                held[0] = slot
                assert value == key * 100 and slots[slot] == key and 0 <= slot <= ahead.depth
            with lock:
                held[0] = None


def test_read_ahead_reads_ahead_in_the_stated_order_and_a_failed_read_raises_at_its_take():
    started: list[str] = []
    gate = threading.Event()

    def read(key: str, slot: int) -> str:
        started.append(key)
        if key == "c":
            gate.wait(5)
            raise OSError(5, "Input/output error", key)
        return key

    ahead = ReadAhead(["a", "b", "c", "d"], read, depth=2)
    assert ahead.take("a") == "a"
    assert ahead.take("b") == "b"
    gate.set()
    with pytest.raises(OSError, match="Input/output error"):
        ahead.take("c")
    ahead.close()
    assert started[:3] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="repeats keys"):
        ReadAhead([1, 1], lambda k, s: k)
    with pytest.raises(KeyError, match="not in the order"):
        ReadAhead([1], lambda k, s: k).take(2)


def test_a_failed_read_is_retried_when_its_key_is_taken_again():
    fails = {"b": 1}

    def read(key: str, slot: int) -> str:
        if fails.get(key):
            fails[key] -= 1
            raise OSError(5, "Input/output error")
        return key

    with ReadAhead(["a", "b", "c"], read, depth=1) as ahead:
        assert ahead.take("a") == "a"
        with pytest.raises(OSError):
            ahead.take("b")
        assert ahead.take("b") == "b" and ahead.take("c") == "c"


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * ALIGN + 5), min_size=1, max_size=8), fail_at=st.integers(0, 8),
       max_pending=st.integers(1, 4))
def test_write_behind_loses_nothing_when_a_write_fails(tmp_path_factory, sizes, fail_at, max_pending):
    """Payloads are tensors written to a store; one write fails (a disk full, injected). Every payload not
    written comes back in the error, oldest first; written again, the store holds every tensor exactly."""
    store = TensorStore(tmp_path_factory.mktemp("wb"), extent_bytes=2 * ALIGN)
    values = [(f"t{i}", torch.randint(0, 255, (n,), dtype=torch.uint8)) for i, n in enumerate(sizes)]
    counters = IOCounters()
    failing = {values[fail_at][0]} if fail_at < len(values) else set()
    done: list[int] = []  # bytes of each write that completed (one behind a failure may run, and run again)

    def write(item: tuple[str, torch.Tensor]) -> None:
        name, t = item
        if name in failing:
            failing.discard(name)
            raise OSError(28, "No space left on device")
        with counters.writing() as tally:
            store.put(name, t)
            tally.bytes += t.numel()
        done.append(t.numel())

    wb: WriteBehind[tuple[str, torch.Tensor]] = WriteBehind(write, max_pending=max_pending)
    retry: list[tuple[str, torch.Tensor]] = []
    for item in values:
        try:
            wb.submit(item)
        except WriteBehindError as err:
            retry += err.payloads
            wb.submit(item)
    try:
        wb.flush()
    except WriteBehindError as err:
        retry += err.payloads
    assert [n for n, _ in retry] == sorted({n for n, _ in retry}, key=lambda n: int(n[1:]))  # oldest first
    for item in retry:
        wb.submit(item)
    wb.flush()
    wb.close()
    assert wb.pending() == []
    for name, t in values:
        assert torch.equal(store.get(name), t)
    written = counters.totals
    assert written.writes == len(done) >= len(values) and written.bytes_written == sum(done) and written.reads == 0
    store.close()


def test_write_behind_holds_at_most_max_pending_and_flush_waits_for_all():
    gate = threading.Event()
    done: list[int] = []

    def write(i: int) -> None:
        gate.wait(5)
        done.append(i)

    wb: WriteBehind[int] = WriteBehind(write, max_pending=2)
    wb.submit(0)
    wb.submit(1)
    assert wb.pending() == [0, 1]
    threading.Timer(0.05, gate.set).start()
    wb.submit(2)  # waits for the oldest
    assert done[:1] == [0] and len(wb.pending()) <= 2
    wb.flush()
    assert done == [0, 1, 2] and wb.pending() == []
    wb.close()
    with pytest.raises(ValueError, match="max_pending=0 must be >= 1"):
        WriteBehind(write, max_pending=0)


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 20), st.booleans()), max_size=20))
def test_counters_add_up_over_threads_and_count_only_completed_operations(ops):
    counters = IOCounters()

    def run(is_read: bool, nbytes: int, fail: bool) -> None:
        with pytest.raises(RuntimeError) if fail else nullcontext():
            with counters.reading() if is_read else counters.writing() as tally:
                tally.bytes += nbytes
                if fail:
                    raise RuntimeError("failed")

    threads = [threading.Thread(target=run, args=op) for op in ops]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [op for op in ops if not op[2]]
    got = counters.totals
    assert (got.reads, got.bytes_read) == (sum(r for r, _, _ in ok), sum(n for r, n, _ in ok if r))
    assert (got.writes, got.bytes_written) == (sum(not r for r, _, _ in ok), sum(n for r, n, _ in ok if not r))
    assert got.read_s >= 0 and got.write_s >= 0
    assert IOTotals(1, 2, 0.5) + IOTotals(writes=3) == IOTotals(1, 2, 0.5, 3, 0, 0.0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), depth=st.integers(0, 4), data=st.data())
def test_read_ahead_with_keys_added_as_they_become_known_skips_keys_not_taken(n, depth, data):
    """An open order (a training loop's steps): keys added one by one, some never taken; each key taken gets its
    own item, a skipped key's read is dropped, and reads never run further than depth + 1 ahead of the consumer."""
    taken = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
    started: list[int] = []

    def read(key: int, slot: int) -> int:
        started.append(key)
        return key * 7

    ahead: ReadAhead[int, int] = ReadAhead([], read, depth=depth)
    added = 0
    for key in taken:
        while added <= key:  # the producer runs ahead of the consumer by whatever it likes
            ahead.add(added)
            added += 1
        assert ahead.take(key) == key * 7
        assert max(started) <= key + depth + 1
    with pytest.raises(ValueError, match="already in the order"):
        ahead.add(0)
    ahead.close()
    assert started == sorted(set(started))  # in order, each at most once: skipping re-reads nothing


def test_an_open_read_ahead_forgets_keys_long_passed():
    from tightfit.storage.staging import KEEP_PASSED

    ahead: ReadAhead[int, int] = ReadAhead([], lambda key, slot: key, depth=2)
    for key in range(3 * KEEP_PASSED):
        ahead.add(key)
        assert ahead.take(key) == key
    assert len(ahead.order) <= 2 * KEEP_PASSED + 3
    assert ahead.take(3 * KEEP_PASSED - 5) == 3 * KEEP_PASSED - 5  # a recent key: the order restarts there
    with pytest.raises(KeyError, match="not in the order"):
        ahead.take(0)
    ahead.close()
