"""One flipped byte in a later checksum block of a many-block batched read raises, on every read path of the store.

A batch of ranges spanning several extents and blocks, with exactly one byte changed on disk in a block that is
neither the batch's first block nor its extent's first: ``read_ranges`` must raise :class:`ChecksumError` naming
that block, whichever way it reads (kernel AIO in one submission, or the worker threads; O_DIRECT or buffered;
per-block checksums or a whole extent as the block). A check of the first block alone passes every test that reads
one short range or flips every byte of the file; this one fails it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tightfit.storage import ChecksumError, TensorStore

E, B = 16384, 4096  # 4 checksum blocks per extent
EXTENTS = 4




def _flip(directory, name: str, extent: int, byte: int) -> int:
    """Flip the low bit of byte ``byte`` of extent ``extent`` of ``name`` in the data file; its file offset."""
    index = json.loads((directory / "index.json").read_text())
    slot = index["entries"][name]["extents"][extent][0]
    at = slot * E + byte
    with open(directory / "data.bin", "r+b") as f:
        f.seek(at)
        old = f.read(1)[0]
        f.seek(at)
        f.write(bytes([old ^ 0x01]))
    return at


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("block", [B, None])
def test_one_flipped_byte_in_a_later_block_of_a_batched_read_raises(tmp_path, io_path, direct, block):
    data = torch.randint(0, 256, (EXTENTS * E,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    with TensorStore(tmp_path, extent_bytes=E, checksum_block=block, direct=direct) as store:
        store.put("rows", data)
    # 64-byte rows every 512 bytes: 512 ranges over all 16 blocks of the 4 extents, in one batch.
    offsets = np.arange(0, EXTENTS * E, 512, dtype=np.int64)
    out = torch.empty(offsets.size, 64, dtype=torch.uint8)
    want = data.view(-1, 512)[:, :64]
    with TensorStore(tmp_path) as store:  # intact: the batch reads what was written
        store.read_ranges("rows", offsets, 64, out).result()
        assert torch.equal(out, want)
    bad = _flip(tmp_path, "rows", 2, 3 * B + 300)  # extent 2's last block: the batch's 12th of 16
    unit = block or E  # what one checksum covers: a block, or the whole extent without block checksums
    first = bad - (3 * B + 300) % unit  # the file offset of the checksummed unit holding the flipped byte
    with TensorStore(tmp_path) as store:
        with pytest.raises(ChecksumError, match=rf"data\.bin: checksum mismatch in the {unit}-byte block at byte "
                                                rf"offset {first} ") as err:
            store.read_ranges("rows", offsets, 64, out).result()
        assert err.value.offset == first
        assert err.value.span == (2 * E + (3 * B if block else 0), 2 * E + (4 * B if block else E))
        # The ranges outside the damaged unit still read, in a batch of their own (neighbours are spared).
        lo, hi = err.value.span
        spared = offsets[(offsets + 64 <= lo) | (offsets >= hi)]
        part = torch.empty(spared.size, 64, dtype=torch.uint8)
        store.read_ranges("rows", spared, 64, part).result()
        assert torch.equal(part, data.view(-1, 512)[torch.from_numpy(spared // 512), :64])
        with pytest.raises(ChecksumError):  # a whole read of the name verifies every extent too
            store.get("rows")
