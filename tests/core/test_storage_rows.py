"""Row records (``TensorStore.write_rows``, tightfit.storage.rowlog): rows written as their own bytes into the
row log, read back through it, folded into the extents at ``sync()`` or when the log is full; against a plain
in-RAM table, under kill -9, and with the log's bytes corrupted on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.storage import ALIGN, ChecksumError, StorageError, TensorStore
from tightfit.storage.rowlog import ROW_LOG

R = 40  # a row of 40 bytes: rows straddle the 4 KiB blocks and the extents


def _read(store: TensorStore, rows: np.ndarray) -> np.ndarray:
    out = np.empty(rows.size * R, dtype=np.uint8)
    store.read_ranges("t", rows * R, R, out).result()
    return out.reshape(rows.size, R)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 700), log_blocks=st.integers(1, 6), direct=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["rows", "rows", "rows", "read", "sync", "range", "write", "fold"]),
                              st.integers(0, 2**31 - 1)), min_size=1, max_size=30))
def test_row_writes_reads_and_folds_equal_a_plain_table(tmp_path_factory, n, log_blocks, direct, ops):
    """Any sequence of row writes (the log filling and folding on its own), reads of scattered rows, syncs,
    whole-range reads, byte-range writes over logged rows and explicit folds reads back as a numpy table would."""
    path = tmp_path_factory.mktemp("rows")
    ref = np.random.default_rng(n).integers(0, 256, (n, R), dtype=np.uint8)
    store = TensorStore(path, extent_bytes=2 * ALIGN, checksum_block=ALIGN, row_log_bytes=log_blocks * ALIGN,
                        direct=direct)
    store.put("t", torch.from_numpy(ref.reshape(-1).copy()))
    for op, seed in ops:
        rng = np.random.default_rng(seed)
        rows = rng.choice(n, size=int(rng.integers(1, min(n, 150) + 1)), replace=False)
        if op == "rows":
            recs = rng.integers(0, 256, (rows.size, R), dtype=np.uint8)
            assert store.write_rows("t", rows * R, R, recs) % ALIGN == 0
            ref[rows] = recs
        elif op == "read":
            assert np.array_equal(_read(store, np.concatenate([rows, rows[:3]])), ref[np.concatenate([rows, rows[:3]])])
        elif op == "sync":
            store.sync()
        elif op == "fold":
            store.fold()
        elif op == "range":
            lo = int(rng.integers(0, n))
            got = torch.empty((n - lo) * R, dtype=torch.uint8)
            store.read_into("t", got, offset=lo * R).result()
            assert np.array_equal(got.numpy().reshape(-1, R), ref[lo:])
        else:  # a byte-range write across logged rows: it wins over them
            lo = int(rng.integers(0, n))
            hi = int(rng.integers(lo, n)) + 1
            recs = rng.integers(0, 256, (hi - lo, R), dtype=np.uint8)
            store.write("t", torch.from_numpy(recs.reshape(-1).copy()), offset=lo * R).result()
            ref[lo:hi] = recs
        assert np.array_equal(_read(store, np.arange(n)), ref)
    store.close()
    with TensorStore(path) as again:  # closed = synced: every row durable, read from the extents
        assert np.array_equal(_read(again, np.arange(n)), ref)


def test_rows_are_written_as_their_own_bytes_not_their_extents(tmp_path):
    with TensorStore(tmp_path, extent_bytes=16 * ALIGN, checksum_block=ALIGN) as store:
        store.put("t", torch.zeros(100_000 * R, dtype=torch.uint8))
        size = os.path.getsize(tmp_path / "data.bin")
        rows = np.arange(0, 100_000, 997)  # 101 rows, each in an extent of its own
        written = store.write_rows("t", rows * R, R, np.full((rows.size, R), 7, dtype=np.uint8))
        assert written == -(-rows.size * R // ALIGN) * ALIGN  # 4 KiB, not 101 extents of 64 KiB
        assert os.path.getsize(tmp_path / "data.bin") == size  # no extent was rewritten
        assert (_read(store, rows) == 7).all() and (_read(store, rows + 1) == 0).all()


def test_bad_row_writes_are_refused_before_any_work(tmp_path):
    with TensorStore(tmp_path, extent_bytes=ALIGN) as store:
        store.put("t", torch.zeros(10 * R, dtype=torch.uint8))
        with pytest.raises(StorageError, match=r"multiples of it need 80 bytes of data, got 40"):
            store.write_rows("t", [0, R], R, np.zeros(R, dtype=np.uint8))
        with pytest.raises(StorageError, match=r"multiples of it"):
            store.write_rows("t", [3], R, np.zeros(R, dtype=np.uint8))
        with pytest.raises(StorageError, match=r"reach outside its 400 bytes"):
            store.write_rows("t", [10 * R], R, np.zeros(R, dtype=np.uint8))
        with pytest.raises(StorageError, match=r"row 2 is given twice"):
            store.write_rows("t", [2 * R, 2 * R], R, np.zeros(2 * R, dtype=np.uint8))
        with pytest.raises(KeyError, match=r"no tensor named 'u'"):
            store.write_rows("u", [0], R, np.zeros(R, dtype=np.uint8))
        assert not (tmp_path / ROW_LOG).stat().st_size  # nothing was appended
    with pytest.raises(StorageError, match=r"row_log_bytes=100 must be a whole number >= 4096"):
        TensorStore(tmp_path, row_log_bytes=100)


def test_a_corrupted_row_record_is_detected_on_read(tmp_path):
    with TensorStore(tmp_path, extent_bytes=ALIGN, checksum_block=ALIGN, direct=False) as store:
        store.put("t", torch.zeros(1000 * R, dtype=torch.uint8))
        store.write_rows("t", np.array([5, 900]) * R, R, np.full((2, R), 9, dtype=np.uint8))
        with open(tmp_path / ROW_LOG, "r+b") as f:  # the second logged row's last byte, in the log's first block
            f.seek(2 * R - 1)
            f.write(b"\x00")
        with pytest.raises(ChecksumError, match=rf"{ROW_LOG}: checksum mismatch in the 4096-byte row-log block at "
                                                r"byte offset 0") as err:
            _read(store, np.array([900]))
        assert err.value.offset == 0 and err.value.path == str(tmp_path / ROW_LOG)
        assert (_read(store, np.array([4, 6])) == 0).all()  # rows not logged still read from the extents
        store.delete("t")  # the damaged rows go with their name; the store stays usable


WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    from tightfit.storage import TensorStore
    R, N = 40, 3000
    store = TensorStore(sys.argv[1], extent_bytes=8192, checksum_block=4096, row_log_bytes=16 * 4096)
    store.put("t", torch.zeros(N * R, dtype=torch.uint8))
    store.sync()
    rng = np.random.default_rng(0)
    for gen in range(1, 10**6):
        rows = rng.choice(N, 200, replace=False)
        store.write_rows("t", rows * R, R, np.full((rows.size, R), gen % 250 + 1, dtype=np.uint8))
        if gen % 5 == 0:
            store.sync()
            print("synced", gen, flush=True)
""")


@pytest.mark.parametrize("delay", [0.0, 0.013, 0.041])
def test_kill_9_between_row_writes_leaves_every_row_old_or_new_never_torn(tmp_path, delay):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for _ in range(3):  # a few syncs in: rows in the extents, rows in the log, a fold under way
            assert proc.stdout.readline().startswith("synced")
        time.sleep(delay)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with TensorStore(tmp_path) as store:
        got = _read(store, np.arange(3000))
    assert (got == got[:, :1]).all(), "a row holds bytes of two generations: torn"
    assert got.max() > 0  # at least the syncs it reported are there


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=40, unique=True), min_size=1, max_size=12))
def test_row_map_finds_the_newest_log_byte_of_each_row(batches):
    """The map's levels (merged as in a binary LSM) answer as a dict updated batch by batch would."""
    from tightfit.storage.rowlog import RowMap

    m, ref, at = RowMap(length=8), {}, 0
    for rows in batches:
        keys = np.array(sorted(rows), dtype=np.int64)
        m.add(keys, at + np.arange(keys.size) * 8)
        ref.update({int(k): at + i * 8 for i, k in enumerate(keys)})
        at += 4096
        assert m.find(np.arange(62)).tolist() == [ref.get(k, -1) for k in range(62)]
    rows, pos = m.items()
    assert rows.tolist() == sorted(ref) and pos.tolist() == [ref[k] for k in sorted(ref)] and len(m) >= len(ref)
