"""``TensorStore.read_ranges`` and per-block checksums: scattered short reads that read and verify only the
blocks they touch, on random data and layouts (hypothesis), through kernel AIO and through the worker threads."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit.storage import ChecksumError, StorageError, TensorStore

E, B = 16384, 4096  # 4 checksum blocks per extent




@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writes=st.lists(st.tuples(st.integers(0, 5 * E), st.binary(min_size=1, max_size=2 * E)), min_size=1,
                       max_size=6),
       length=st.integers(1, 2 * B + 10), picks=st.lists(st.floats(0, 1), min_size=1, max_size=40),
       block=st.sampled_from([None, B]), direct=st.booleans())
def test_ranges_read_what_was_written_and_survive_a_reopen(tmp_path_factory, io_path, writes, length, picks, block,
                                                           direct):
    """Byte-range writes (partial extents, gaps that read as zeros), then ranges at random offsets, any order and
    repeated: each equals the model, in this store and after reopening it (the block checksums round-trip)."""
    d = tmp_path_factory.mktemp("ranges")
    model = bytearray()
    with TensorStore(d, extent_bytes=E, checksum_block=block, direct=direct, workers=3) as store:
        for offset, data in writes:
            store.write("x", data, offset=offset).result()
            model.extend(bytes(max(0, offset + len(data) - len(model))))
            model[offset:offset + len(data)] = data
    if len(model) < length:
        return
    offsets = np.array([int(p * (len(model) - length)) for p in picks], dtype=np.int64)
    want = b"".join(bytes(model[o:o + length]) for o in offsets)
    with TensorStore(d) as store:
        assert store.checksum_block == block
        out = torch.empty(len(want), dtype=torch.uint8)
        moved = store.read_ranges("x", offsets, length, out).result()
        assert bytes(out.numpy()) == want
        assert 0 <= moved <= len(model) + E  # never more than the name's bytes (rounded to a block)


def test_a_few_rows_read_only_their_blocks(tmp_path, io_path):
    """128-byte rows scattered over 1 MiB: the store reads one 4 KiB block per row, not the 16 KiB extent."""
    data = torch.randint(0, 256, (2**20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with TensorStore(tmp_path, extent_bytes=E, checksum_block=B) as store:
        store.put("rows", data)
        rows = np.array([3, 1000, 4000, 7000])  # four rows in four different extents
        out = torch.empty(4, 128, dtype=torch.uint8)
        moved = store.read_ranges("rows", rows * 128, 128, out).result()
        assert moved == 4 * B
        assert torch.equal(out, data.view(-1, 128)[torch.from_numpy(rows)])


def test_a_corrupted_block_raises_naming_file_offset_and_span_and_spares_its_neighbours(tmp_path, io_path):
    data = torch.randint(0, 256, (3 * E,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with TensorStore(tmp_path, extent_bytes=E, checksum_block=B) as store:
        store.put("w", data)
    index = json.loads((tmp_path / "index.json").read_text())
    slot = index["entries"]["w"]["extents"][1][0]
    bad = slot * E + 2 * B + 7  # extent 1, block 2
    with open(tmp_path / "data.bin", "r+b") as f:
        f.seek(bad)
        byte = f.read(1)[0]
        f.seek(bad)
        f.write(bytes([byte ^ 0x01]))
    with TensorStore(tmp_path) as store:
        out = torch.empty(64, dtype=torch.uint8)
        ok = np.array([E + B + 5])  # same extent, another block: still verified and read
        store.read_ranges("w", ok, 64, out).result()
        assert torch.equal(out, data[E + B + 5:E + B + 69])
        with pytest.raises(ChecksumError, match=rf"data\.bin: checksum mismatch in the 4096-byte block at byte "
                                                rf"offset {slot * E + 2 * B} .*bytes \[{E + 2 * B}, {E + 3 * B}\) "
                                                r"of 'w'") as err:
            store.read_ranges("w", np.array([E + 2 * B + 100]), 64, out).result()
        assert err.value.offset == slot * E + 2 * B and err.value.span == (E + 2 * B, E + 3 * B)
        with pytest.raises(ChecksumError):  # a whole read verifies the blocks too
            store.get("w")


def test_bad_block_sizes_and_arguments_are_refused(tmp_path):
    with pytest.raises(StorageError, match=r"checksum_block=5000 must be a multiple of 4096 that divides the extent"):
        TensorStore(tmp_path, extent_bytes=E, checksum_block=5000)
    with TensorStore(tmp_path, extent_bytes=E, checksum_block=B) as store:
        store.put("x", torch.zeros(100, dtype=torch.uint8))
        with pytest.raises(StorageError, match=r"out holds 10 bytes, 2 ranges of length=8 need 16"):
            store.read_ranges("x", [0, 8], 8, torch.empty(10, dtype=torch.uint8))
        with pytest.raises(StorageError, match=r"reach outside its 100 bytes"):
            store.read_ranges("x", [96], 8, torch.empty(8, dtype=torch.uint8))


@pytest.mark.parametrize("edit, match", [
    (lambda raw: raw.update(checksum_block=1000), r"checksum_block=1000 must be a multiple of 4096"),
    (lambda raw: raw["entries"]["x"]["extents"][0].__setitem__(3, "AAAA"), r"block checksums 'AAAA' must be the "
                                                                           r"base64 of 1 32-bit checksums"),
    (lambda raw: raw["entries"]["x"]["extents"][0].pop(), r"must be \[slot, 1\.\.100, checksum, block checksums\]"),
])
def test_a_damaged_block_index_is_refused_naming_the_field(tmp_path, edit, match):
    with TensorStore(tmp_path, extent_bytes=E, checksum_block=B) as store:
        store.put("x", torch.zeros(100, dtype=torch.uint8))
    raw = json.loads((tmp_path / "index.json").read_text())
    edit(raw)
    (tmp_path / "index.json").write_text(json.dumps(raw))
    with pytest.raises(StorageError, match=match):
        TensorStore(tmp_path)


def test_a_store_without_block_checksums_keeps_its_index_format(tmp_path):
    """Energon's and Elixir's stores (no checksum_block) write the index they always wrote."""
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("x", torch.ones(10))
    raw = json.loads((tmp_path / "index.json").read_text())
    assert "checksum_block" not in raw and len(raw["entries"]["x"]["extents"][0]) == 3
    assert os.path.getsize(tmp_path / "data.bin") >= 40
