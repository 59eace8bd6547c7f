"""The store's reader of foreign files (tightfit.storage.external): any byte range, into a buffer at any address,
direct where it can be, equal to the file's bytes either way; a file shorter than the range raises."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tightfit.storage import ALIGN, ChecksumError
from tightfit.storage.external import ExternalFile, direct_buffer_bytes

SIZE = 5 * ALIGN + 123  # the last block is partial


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    path = tmp_path_factory.mktemp("ext") / "data.bin"
    path.write_bytes(os.urandom(SIZE))
    return path


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, SIZE), length=st.integers(0, SIZE), skew=st.integers(0, 64), room=st.booleans(),
       direct=st.booleans(), drop=st.booleans())
@example(start=0, length=0, skew=0, room=False, direct=True, drop=False)  # an empty buffer (its address is 0)
def test_any_range_reads_the_files_bytes_in_place(foreign, start, length, skew, room, direct, drop):
    path, data = foreign, foreign.read_bytes()
    nbytes = min(length, SIZE - start)
    file = ExternalFile(path, direct=direct, drop_page_cache=drop)
    buf = torch.empty(skew + (direct_buffer_bytes(nbytes) if room else nbytes), dtype=torch.uint8)[skew:]
    got = file.read(start, nbytes, buf)
    assert bytes(got.numpy()) == data[start:start + nbytes]
    if nbytes:
        assert got.data_ptr() >= buf.data_ptr() and got.data_ptr() + nbytes <= buf.data_ptr() + buf.numel()
    if file.direct and room:  # the direct read lands in place: the range keeps its place in its block
        assert file.direct_reads == 1 and (not nbytes or (got.data_ptr() - start) % ALIGN == 0)
    else:
        assert file.buffered_reads == 1
    file.close()


def test_a_range_past_the_files_end_raises_naming_the_file(foreign):
    path = foreign
    for direct in (True, False):
        file = ExternalFile(path, direct=direct)
        with pytest.raises(ChecksumError, match="data.bin is truncated") as err:
            file.read(SIZE - 10, 20, torch.empty(direct_buffer_bytes(20), dtype=torch.uint8))
        assert err.value.path == str(path)
        file.close()


def test_a_dtype_misaligned_range_is_read_buffered(foreign):
    path, data = foreign, foreign.read_bytes()
    file = ExternalFile(path, direct=True)
    got = file.read(2, 8, torch.empty(direct_buffer_bytes(8), dtype=torch.uint8), itemsize=4)
    assert bytes(got.numpy()) == data[2:10] and file.direct_reads == 0 and file.buffered_reads == 1
    file.close()
