"""Which blocks a batch of byte ranges touches, and where each range lands among them (pure numpy).

:meth:`tightfit.storage.TensorStore.read_ranges` reads the rows a cache misses: many short ranges
scattered over one flat buffer. It reads each block (the store's ``checksum_block``, else its extent)
holding a range once, neighbours in one request, and copies the ranges out of those blocks.

Example:
    >>> import numpy as np
    >>> blocks, at = cover(np.array([40968, 10, 4090]), 16, 4096)  # the last range crosses into block 1
    >>> blocks.tolist(), at.tolist()
    ([0, 1, 10], [8200, 10, 4090])
    >>> runs(np.array([0, 1, 3, 4, 5]), 4).tolist()  # 4 blocks per extent: a run also stops at an extent's end
    [[0, 2], [2, 1], [3, 2]]
"""

from __future__ import annotations

import numpy as np

__all__ = ["cover", "runs", "gather"]


def cover(offsets: np.ndarray, length: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ids of the ``block``-byte blocks that ranges ``[o, o + length)`` touch, and the byte of
    each range in the blocks' concatenation (a range's blocks are consecutive there)."""
    first = offsets // block
    last = (offsets + (length - 1)) // block
    if length <= block:  # a range spans at most two blocks
        ids = np.unique(np.concatenate([first, last]))
    else:
        counts = last - first + 1
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        ids = np.unique(np.repeat(first, counts) + (np.arange(int(counts.sum())) - starts))
    return ids, np.searchsorted(ids, first) * block + offsets % block


def runs(ids: np.ndarray, per_extent: int) -> np.ndarray:
    """``(start, count)`` rows of the runs of consecutive block ``ids`` (sorted) inside one extent each."""
    if ids.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    brk = np.ones(ids.size, dtype=bool)
    brk[1:] = (ids[1:] != ids[:-1] + 1) | (ids[1:] // per_extent != ids[:-1] // per_extent)
    starts = np.flatnonzero(brk)
    return np.stack([starts, np.diff(np.append(starts, ids.size))], axis=1)


def gather(out: np.ndarray, staged: np.ndarray, at: np.ndarray, length: int) -> None:
    """``out[i*length:(i+1)*length] = staged[at[i]:at[i]+length]`` for every range ``i`` (uint8 arrays)."""
    if length >= 4096:  # long ranges: one slice copy each beats an index of length bytes per range
        for i, a in enumerate(at.tolist()):
            out[i * length:(i + 1) * length] = staged[a:a + length]
        return
    if at.size and staged.size % length == 0 and not (at % length).any():  # rows on a grid (a table's records)
        out.reshape(at.size, length)[:] = staged.reshape(-1, length)[at // length]
        return
    out.reshape(at.size, length)[:] = staged[at[:, None] + np.arange(length)]
