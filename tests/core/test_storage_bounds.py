"""Bounds and one-line refusals of the storage helpers: how far ``ReadAhead`` reads ahead and on how many threads,
what its refusals name, ``TensorStore.for_rank``'s checks, reopening and options, and the storage errors' fields
across a process boundary."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from tightfit.storage import (
    ChecksumError,
    DiskFullError,
    ReadAhead,
    StorageError,
    StoreLockedError,
    TensorStore,
)


@pytest.mark.parametrize("depth", [None, 0, 2])
def test_read_ahead_starts_exactly_depth_reads_beyond_the_item_taken(depth):
    started: list[int] = []
    order = list(range(6))
    kwargs = {} if depth is None else {"depth": depth}
    want_depth = 1 if depth is None else depth  # the default reads one item ahead
    with ReadAhead(order, lambda key, slot: started.append(key) or key, **kwargs) as ahead:
        for i in order:
            assert ahead.take(i) == i
            # The reads after the one taken run in the background: wait for them, then for any stray one.
            want = order[: min(i + 1 + want_depth, len(order))]
            deadline = time.monotonic() + 5
            while started != want and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.02)
            assert started == want, (i, started)


def test_read_ahead_reads_one_item_at_a_time_and_close_stops_its_thread():
    lock, running, most, threads = threading.Lock(), [0], [0], set()

    def read(key: int, slot: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            threads.add(threading.current_thread())
        time.sleep(0.005)
        with lock:
            running[0] -= 1
        return key

    ahead = ReadAhead(list(range(8)), read, depth=4)
    assert [ahead.take(k) for k in range(8)] == list(range(8))
    ahead.close()
    assert most[0] == 1 and len(threads) == 1
    assert not next(iter(threads)).is_alive()  # close waits for the thread to end


def test_read_ahead_refusals_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"^ReadAhead: depth=-1 must be >= 0 \(items read ahead of the one in use\)$"):
        ReadAhead([1, 2], lambda k, s: k, depth=-1)
    # Only the repeated keys, each once, in repr order (keys of mixed types sort too).
    with pytest.raises(ValueError, match=r"^ReadAhead: the order repeats keys \['b', 1\]; give each key once$"):
        ReadAhead([1, "b", 1, "c", "b"], lambda k, s: k)


def test_for_rank_refuses_a_bad_rank_reopens_its_directory_and_passes_the_options(tmp_path):
    for rank in (-1, 1.0, "0"):
        with pytest.raises(StorageError, match=rf"^for_rank: rank={rank!r} must be a whole number >= 0; pass"):
            TensorStore.for_rank(tmp_path, rank)
    assert not any(tmp_path.iterdir())  # refused before anything was created
    with TensorStore.for_rank(tmp_path, 2, checksum="crc32", extent_bytes=8192) as store:
        store.put("x", torch.arange(5.0))
        assert (store.checksum, store.extent_bytes) == ("crc32", 8192)
    with TensorStore.for_rank(tmp_path, 2) as store:  # the same rank again: its directory and its data
        assert torch.equal(store.get("x"), torch.arange(5.0)) and store.checksum == "crc32"


@pytest.mark.parametrize("error", [
    ChecksumError("checksum mismatch in data.bin at byte 4096", path="/d/data.bin", offset=4096, span=(10, 20)),
    DiskFullError("no space for 1 MiB in /d", path="/d", needed_bytes=1 << 20, free_bytes=512),
    StoreLockedError("/d is held by process 7", path="/d", pid=7),
], ids=lambda e: type(e).__name__)
def test_storage_errors_cross_a_process_boundary_with_their_fields(error):
    # A rank's or a worker's error reaches its parent pickled (multiprocessing, torch.distributed's object calls).
    got = pickle.loads(pickle.dumps(error))
    assert type(got) is type(error) and str(got) == str(error) and vars(got) == vars(error)


def test_a_failed_read_gives_its_slot_back_to_the_ring():
    slots: list[object] = []
    fails = {"b": 1}

    def read(key: str, slot: int) -> str:
        slots.append(slot)
        if fails.get(key):
            fails[key] -= 1
            raise OSError(5, "Input/output error")
        return key

    with ReadAhead(["a", "b", "c", "d", "e"], read, depth=1) as ahead:
        assert ahead.take("a") == "a"
        with pytest.raises(OSError):
            ahead.take("b")
        assert [ahead.take(k) for k in "bcde"] == list("bcde")
    assert set(slots) <= {0, 1}, slots  # the ring's two slots, reused: never a slot that is not one
