"""The cache index kernels: Triton (under TRITON_INTERPRET=1 on CPU) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runif import RunIf
from tightfit.cuda import get_kernel
from tightfit.cuda.cache_lookup import EMPTY_SCORE, LFU, LRU, STATIC, cache_lookup, select_victims
from tightfit.cuda.testing import assert_matches_reference


def _index(rows: int, slots: int, seed: int, index_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    row_slot = torch.full((rows,), -1, dtype=index_dtype)
    held = torch.randperm(rows, generator=gen)[:slots]
    row_slot[held] = torch.arange(slots, dtype=index_dtype)
    score = torch.randint(0, 100, (slots,), generator=gen)
    pinned = torch.randint(0, 4, (slots,), generator=gen)
    ids = torch.randperm(rows, generator=gen)[: max(1, rows // 3)]
    counts = torch.randint(1, 5, ids.shape, generator=gen)
    return row_slot, ids, counts, score, pinned


@RunIf(triton=True)
@pytest.mark.parametrize("rows,slots", [(1, 1), (7, 3), (1030, 129), (4099, 2050)])
@pytest.mark.parametrize("mode", [STATIC, LFU, LRU])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cache_lookup_triton_matches_reference(rows, slots, mode, index_dtype):
    row_slot, ids, counts, score, pinned = _index(rows, slots, rows + mode, index_dtype)
    assert_matches_reference(get_kernel("cache_lookup"), row_slot, ids, counts, score, pinned, 3, mode)


@RunIf(triton=True)
@pytest.mark.parametrize("slots", [1, 5, 1025, 3000])
def test_victim_keys_triton_matches_reference(slots):
    _, _, _, score, pinned = _index(slots * 2, slots, slots, torch.int32)
    assert_matches_reference(get_kernel("victim_keys"), score, pinned, 2)


def test_lookup_reports_misses_and_touches_only_hits():
    row_slot = torch.tensor([2, -1, 0, -1, 1], dtype=torch.int32)
    score = torch.tensor([10, 20, 30])
    pinned = torch.zeros(3, dtype=torch.int64)
    slots = cache_lookup(row_slot, torch.tensor([0, 1, 4]), torch.tensor([5, 7, 1]), score, pinned, 9, LFU)
    assert slots.tolist() == [2, -1, 1]
    assert score.tolist() == [10, 21, 35]  # row 0 (slot 2) +5, row 4 (slot 1) +1, the miss adds nothing
    assert pinned.tolist() == [0, 9, 9]
    cache_lookup(row_slot, torch.tensor([2]), torch.tensor([1]), score, pinned, 11, LRU)
    assert score.tolist() == [11, 21, 35]


def test_select_victims_takes_free_slots_first_and_never_pinned_ones():
    score = torch.tensor([5, EMPTY_SCORE, 1, 3, EMPTY_SCORE])
    pinned = torch.tensor([0, 0, 7, 0, 0])
    victims = select_victims(score, pinned, 7, 3)
    assert sorted(victims.tolist()) == [1, 3, 4]  # two free slots, then the coldest unpinned (slot 2 is pinned)
    assert sorted(select_victims(score, torch.full((5,), 7), 7, 3).tolist()) == []  # all pinned: nothing to give


def test_lookup_rejects_mismatched_index_state():
    with pytest.raises(ValueError, match="slot_score and pinned_until must be int64 tensors of one shape"):
        cache_lookup(torch.zeros(3, dtype=torch.int32), torch.tensor([0]), torch.tensor([1]),
                     torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 1, LFU)
