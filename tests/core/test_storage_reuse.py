"""tightfit.storage: overwrites reuse freed slots with their blocks allocated, and the per-extent checksum
(CRC-32C where PyPI's crc32c is installed, else zlib's CRC-32) is recorded in the index and checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch

from tightfit.storage import DEFAULT_CHECKSUM, ChecksumError, StorageError, TensorStore
from tightfit.storage import checksums as registry

E = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _index(d: Path) -> dict:
    return json.loads((d / "index.json").read_text())


def test_overwrite_after_sync_reuses_a_freed_slot_and_keeps_its_blocks(tmp_path):
    """An overwrite-heavy workload (optimizer state written every step) settles at two copies' slots: the file
    neither grows nor loses its blocks, so no overwrite allocates."""
    n = 8 * E // 4  # 8 extents
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("m", _rand(n, 0))
        store.sync()
        store.put("m", _rand(n, 1))  # the synced copy's slots are kept until the next sync: fresh slots 8..15
        store.sync()
        size, blocks = os.path.getsize(tmp_path / "data.bin"), os.stat(tmp_path / "data.bin").st_blocks
        assert size == 16 * E and blocks * 512 >= 16 * E
        for step in range(2, 8):
            before = {x[0] for x in _index(tmp_path)["entries"]["m"]["extents"]}
            new = _rand(n, step)
            store.put("m", new)
            store.sync()
            after = {x[0] for x in _index(tmp_path)["entries"]["m"]["extents"]}
            assert after.isdisjoint(before) and after <= set(range(16))  # the slots freed at the last sync
            assert os.path.getsize(tmp_path / "data.bin") == size
            assert os.stat(tmp_path / "data.bin").st_blocks == blocks  # nothing punched, nothing allocated
            assert torch.equal(store.get("m"), new)


def test_a_slot_the_synced_index_references_is_not_reused_before_sync(tmp_path):
    """Slot reuse keeps the crash-safety rule: until the next sync, the synced copy's bytes stay on disk."""
    first = _rand(E // 4, 0)
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("m", first)
        store.put("spare", _rand(E // 4, 9))
        store.delete("spare")  # never synced: free at once, reused first
        store.sync()
        slot = _index(tmp_path)["entries"]["m"]["extents"][0][0]
        for seed in range(1, 6):  # overwrites and new names without a sync
            store.put("m", _rand(E // 4, seed))
            store.put(f"other{seed}", _rand(E // 4, seed + 10))
        store.wait()
        with open(tmp_path / "data.bin", "rb") as f:
            f.seek(slot * E)
            assert f.read(E) == first.numpy().tobytes()  # what a crash now would reopen
    with TensorStore(tmp_path) as again:
        assert torch.equal(again.get("m"), _rand(E // 4, 5))


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_the_checksum_is_recorded_and_is_of_the_extent_bytes(tmp_path, algorithm):
    if algorithm not in registry.CHECKSUMS:
        pytest.skip(f"{algorithm} is not installed here")
    t = _rand(E // 4 + 100, 5)  # one whole extent and a 400-byte tail
    with TensorStore(tmp_path, extent_bytes=E, checksum=algorithm) as store:
        assert store.checksum == algorithm
        store.put("w", t)
    index = _index(tmp_path)
    raw = t.numpy().tobytes()
    want = zlib.crc32 if algorithm == "crc32" else registry.CHECKSUMS["crc32c"]
    assert index["checksum"] == algorithm
    assert [x[2] for x in index["entries"]["w"]["extents"]] == [want(raw[:E]), want(raw[E:])]


def test_the_default_is_crc32c_where_installed():
    assert DEFAULT_CHECKSUM == ("crc32c" if "crc32c" in registry.CHECKSUMS else "crc32")


def test_a_crc32_store_keeps_reading_and_writing_with_crc32_and_catches_a_flipped_bit(tmp_path):
    a, b = _rand(3 * E // 4, 1), _rand(E // 4, 2)
    with TensorStore(tmp_path, extent_bytes=E, checksum="crc32") as store:
        store.put("a", a)
    with TensorStore(tmp_path, checksum=DEFAULT_CHECKSUM) as store:  # a new store's choice does not apply
        assert store.checksum == "crc32"
        assert torch.equal(store.get("a"), a)
        store.put("b", b)
    assert _index(tmp_path)["checksum"] == "crc32"
    slot = _index(tmp_path)["entries"]["b"]["extents"][0][0]
    with open(tmp_path / "data.bin", "r+b") as f:
        f.seek(slot * E + 77)
        byte = f.read(1)
        f.seek(slot * E + 77)
        f.write(bytes([byte[0] ^ 1]))
    with TensorStore(tmp_path) as store:
        assert torch.equal(store.get("a"), a)
        with pytest.raises(ChecksumError, match=rf"byte offset {slot * E} .*crc32 [0-9a-f]{{8}}.*'b'"):
            store.get("b")


def test_an_index_without_the_field_is_read_as_crc32(tmp_path):
    """Stores written before the checksum became a choice have no "checksum" field: zlib's CRC-32."""
    t = _rand(2 * E // 4, 3)
    with TensorStore(tmp_path, extent_bytes=E, checksum="crc32") as store:
        store.put("w", t)
    index = _index(tmp_path)
    del index["checksum"]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with TensorStore(tmp_path) as store:
        assert store.checksum == "crc32" and torch.equal(store.get("w"), t)


def test_a_crc32c_store_without_crc32c_is_refused_naming_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("crc32c")
    with TensorStore(tmp_path, extent_bytes=E, checksum="crc32c") as store:
        store.put("w", torch.ones(10))
    monkeypatch.delitem(registry.CHECKSUMS, "crc32c")  # what an environment without the package has
    with pytest.raises(StorageError, match=r"index\.json: the store is checksummed with crc32c, which is not "
                                           r"installed here: pip install crc32c$"):
        TensorStore(tmp_path)
    other = tmp_path / "new"
    other.mkdir()
    with pytest.raises(StorageError, match="pip install crc32c"):
        TensorStore(other, checksum="crc32c")
    with pytest.raises(StorageError, match="checksum 'md5' is not 'crc32' or 'crc32c'"):
        TensorStore(other, checksum="md5")
    assert not (other / "index.json").exists()


def test_without_crc32c_installed_core_falls_back_to_zlib(tmp_path):
    """With the crc32c package blocked, a new store is CRC-32 and round-trips; with it back, that store reads."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["crc32c"] = None  # import crc32c now raises ImportError
        import torch
        from tightfit.storage import DEFAULT_CHECKSUM, TensorStore
        assert DEFAULT_CHECKSUM == "crc32", DEFAULT_CHECKSUM
        with TensorStore({str(tmp_path)!r}, extent_bytes={E}) as store:
            store.put("w", torch.arange(50000, dtype=torch.float32))
            assert torch.equal(store.get("w"), torch.arange(50000, dtype=torch.float32))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert _index(tmp_path)["checksum"] == "crc32"
    with TensorStore(tmp_path) as store:
        assert torch.equal(store.get("w"), torch.arange(50000, dtype=torch.float32))
