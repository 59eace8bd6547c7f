"""``TensorStore.sync()`` is the store's one durability point: the file and directory ``fsync`` calls it makes.

A kill -9 test cannot see a missing ``fsync`` (the page cache survives the process), so these tests record every
``os.fsync`` the store makes (the real call still happens) and what it was made on: the descriptor's path from
``/proc/self/fd`` and whether it is a directory (``S_ISDIR`` of its ``fstat``). A ``sync()`` after writes must
``fsync`` the data file, then the new index's temporary file, then (after the rename) the directory holding
``index.json``; a write, a read or a put without ``sync()`` makes none.
"""

from __future__ import annotations

import os
import stat
import sys

import pytest
import torch

from tightfit.storage import TensorStore

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd (Linux)")
E = 16384


@pytest.fixture
def fsyncs(monkeypatch):
    """Every ``os.fsync`` made while the test runs: (kind "file"/"dir", path, index.json's text at that moment)."""
    calls: list[tuple[str, str, str | None]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        path = os.readlink(f"/proc/self/fd/{fd}")
        index = os.path.join(path if kind == "dir" else os.path.dirname(path), "index.json")
        text = open(index).read() if os.path.exists(index) else None
        calls.append((kind, path, text))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


@pytest.mark.parametrize("direct", [True, False])
def test_sync_fsyncs_the_data_file_the_new_index_and_the_directory_in_that_order(tmp_path, fsyncs, direct):
    store = TensorStore(tmp_path, extent_bytes=E, direct=direct)
    try:
        store.write("a", bytes(range(256)) * 100).result()
        store.put("b", torch.arange(5000, dtype=torch.float32))
        store.read_ranges("a", [0, 9000], 64, torch.empty(128, dtype=torch.uint8)).result()
        store.get("b")
        assert fsyncs == []  # writes, reads and puts are not durable by themselves: no fsync yet
        store.sync()
        assert [(kind, os.path.basename(path)) for kind, path, _ in fsyncs] == [
            ("file", "data.bin"), ("file", ".index.json.tmp"), ("dir", os.path.basename(tmp_path))]
        assert fsyncs[2][1] == str(tmp_path)  # the directory holding index.json: the rename itself is durable
        # The data is on disk before any index points at it: no index.json existed at either file fsync, and the
        # directory fsync came after the rename (the new index, naming both, was already in place).
        assert fsyncs[0][2] is None and fsyncs[1][2] is None
        assert fsyncs[2][2] is not None and '"a"' in fsyncs[2][2] and '"b"' in fsyncs[2][2]
        fsyncs.clear()
        store.write("a", b"x" * 10, offset=3).result()
        assert fsyncs == []
    finally:
        store.close()  # close syncs: the same three calls again
    assert [(kind, os.path.basename(path)) for kind, path, _ in fsyncs] == [
        ("file", "data.bin"), ("file", ".index.json.tmp"), ("dir", os.path.basename(tmp_path))]
    with TensorStore(tmp_path) as again:
        assert bytes(again.get("a")[:16].numpy()) == (bytes(range(256)) * 100)[:3] + b"x" * 10 + bytes([13, 14, 15])


def test_a_delete_is_made_durable_the_same_way(tmp_path, fsyncs):
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("x", torch.ones(100))
        store.sync()
        fsyncs.clear()
        store.delete("x")
        assert fsyncs == []
        store.sync()
        assert [kind for kind, _, _ in fsyncs] == ["file", "file", "dir"]
        assert '"x"' not in fsyncs[2][2]
