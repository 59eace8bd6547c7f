"""What the cache policies do, not only what they compute: which rows stay resident, which misses spill.

The equivalence tests compare weights, which are right whatever the cache holds; a policy that keeps the
wrong rows passes them. These drive a 10-row table with 3 slots through short traces traced by hand
from the policy rules (``CacheConfig.policy``), through the public API only: the collection's forward,
``resident_rows`` and ``cache_stats``.

Rules used below (LFU and static admit a miss only into the slot of a colder row, hottest misses against
coldest victims; free slots are colder than anything; ties are not admitted; LRU always takes the
least recently used unpinned slot; rows the batch hits are pinned for that batch):
    * lfu: a row's score is its use count from the frequency sketch, which remembers rows that left the
      cache or spilled; every count halves once the sketch has taken ``AGE_EVERY`` (40) uses per slot
      (TinyLFU's reset: 120 with 3 slots, not reached here), and every count is shifted right by
      ``DRIFT_SHIFT`` (8) bits when a batch's traffic hit rate (hit uses / uses) falls below ``DRIFT_DROP``
      (0.7) of its recent level (an average that halves its weight per batch, starting at 0): the hot set
      moved;
    * lru: a row's score is the last step that used it;
    * static: a row's score is its dataset count.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_cache import (
    CacheConfig,
    CachedEmbeddingBagCollection,
    FrequencyStats,
    RowOptimizer,
    prefetching,
)

ROWS, SLOTS = 10, 3
TABLE = "t"


def _collection(policy: str, frequencies: FrequencyStats | None = None) -> CachedEmbeddingBagCollection:
    tables = [EmbeddingBagConfig(name=TABLE, embedding_dim=2, num_embeddings=ROWS, feature_names=["f"])]
    cache = CacheConfig(capacity=SLOTS, policy=policy, warmup=False, optimizer=RowOptimizer(kind="sgd", lr=0.1))
    return CachedEmbeddingBagCollection(tables, device="cpu", cache=cache, frequencies=frequencies)


def _run(ebc: CachedEmbeddingBagCollection, batch: list[int]) -> dict:
    """One forward of one bag holding ``batch``; the step's counters."""
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(batch), torch.tensor([len(batch)]))
    ebc(kjt)
    stats = ebc.cache_stats()
    return {k: stats[f"last_{k}"] for k in ("lookups", "hits", "misses", "rows_loaded", "rows_spilled")}


def _resident(ebc: CachedEmbeddingBagCollection) -> set[int]:
    return set(ebc.resident_rows(TABLE).tolist())


def _step(lookups: int, hits: int, loaded: int, spilled: int) -> dict:
    return {"lookups": lookups, "hits": hits, "misses": lookups - hits, "rows_loaded": loaded,
            "rows_spilled": spilled}


def test_lfu_keeps_the_hottest_rows_and_spills_a_colder_miss():
    ebc = _collection("lfu")
    # 1: rows 0, 1, 2 used 4, 3, 2 times; three free slots take them (scores 4, 3, 2). Hit level 0 -> 0.
    assert _run(ebc, [0, 0, 0, 0, 1, 1, 1, 2, 2]) == _step(3, 0, 3, 0)
    assert _resident(ebc) == {0, 1, 2}
    # 2: 0 and 1 hit (scores 5, 4, pinned); 3 misses with 1 use; the only victim is row 2 (score 2), which is
    #    warmer: row 3 spills (served from host memory, counted there: 1) and row 2 stays. Traffic hit rate
    #    2/3 is no drop (the level was 0); the level becomes 1/3.
    assert _run(ebc, [0, 1, 3]) == _step(3, 2, 0, 1)
    assert _resident(ebc) == {0, 1, 2}
    # 3: no use hits (0 < 0.7 * 1/3): the hot set moved, every count drops to 0 before this batch counts.
    #    Row 3 (3 uses, 1 remembered from step 2 is gone) and row 4 (1) are warmer than the resident rows
    #    (0): both replace one each, although rows 0 and 1 had 5 and 4 uses a batch ago.
    assert _run(ebc, [3, 3, 3, 4]) == _step(2, 0, 2, 0)
    resident = _resident(ebc)
    assert {3, 4} <= resident and len(resident & {0, 1, 2}) == 1
    # 4: 3 and 4 hit (3 of 4 uses, no drop; scores 5, 2); row 5, used once, is warmer than the coldest
    #    resident (0) and takes its slot.
    assert _run(ebc, [3, 3, 4, 5]) == _step(3, 2, 1, 0)
    assert _resident(ebc) == {3, 4, 5}
    # 5: all hit; row 6 (1 use) is not warmer than row 5 (1 + 1 = 2): it spills. Counts persist while the
    #    hit rate holds (3/4 >= 0.7 * its level).
    assert _run(ebc, [3, 4, 5, 6]) == _step(4, 3, 0, 1)
    assert _resident(ebc) == {3, 4, 5}
    totals = ebc.cache_stats()
    assert (totals["lookups"], totals["hits"], totals["rows_loaded"], totals["rows_spilled"]) == (15, 7, 6, 2)


def test_lru_keeps_the_most_recent_rows_whatever_their_counts():
    ebc = _collection("lru")
    assert _run(ebc, [0, 0, 0]) == _step(1, 0, 1, 0)  # step 1: row 0
    assert _run(ebc, [1]) == _step(1, 0, 1, 0)  # step 2: row 1
    assert _run(ebc, [2, 2]) == _step(1, 0, 1, 0)  # step 3: row 2; the cache is full
    # step 4: 0 hits (last used 4); 3 misses and takes the least recently used slot: row 1 (2), used once.
    assert _run(ebc, [0, 3]) == _step(2, 1, 1, 0)
    assert _resident(ebc) == {0, 2, 3}
    # step 5: a one-off row 4 still evicts the least recent, row 2 (3) -- LRU spills only when every slot holds
    # a row of the batch -- and row 0, touched at step 4, stays.
    assert _run(ebc, [4]) == _step(1, 0, 1, 0)
    assert _resident(ebc) == {0, 3, 4}
    # step 6: a batch wider than the cache: 4 distinct rows, 1 hit (4, pinned); the 3 misses find 2 victims
    # (rows 0 and 3): the first two misses (ids in order: 5, 6) load, the third (7) spills.
    assert _run(ebc, [4, 5, 6, 7]) == _step(4, 1, 2, 1)
    assert _resident(ebc) == {4, 5, 6}


def test_static_ranks_by_dataset_counts_and_ends_with_the_top_rows():
    counts = torch.zeros(ROWS, dtype=torch.int64)
    counts[:5] = torch.tensor([50, 40, 30, 20, 10])
    ebc = _collection("static", FrequencyStats(counts={TABLE: counts}, batches=1))
    assert _run(ebc, [3, 4, 5]) == _step(3, 0, 3, 0)  # free slots take anything: scores 20, 10, 0
    assert _run(ebc, [0]) == _step(1, 0, 1, 0)  # 50 > 0: row 0 replaces row 5
    assert _resident(ebc) == {0, 3, 4}
    assert _run(ebc, [6, 6, 6, 6]) == _step(1, 0, 0, 1)  # 0 < 10: used 4 times now, still spills
    # 40 and 30 against the coldest 10 and 20: both admitted
    assert _run(ebc, [1, 2]) == _step(2, 0, 2, 0)
    assert _resident(ebc) == {0, 1, 2}
    assert _run(ebc, [3, 3]) == _step(1, 0, 0, 1)  # 20 < 30: spills
    assert _resident(ebc) == {0, 1, 2}


def test_warm_static_cache_holds_the_counted_top_rows_against_any_trace():
    counts = torch.tensor([1, 9, 0, 7, 0, 0, 8, 0, 0, 2])
    tables = [EmbeddingBagConfig(name=TABLE, embedding_dim=2, num_embeddings=ROWS, feature_names=["f"])]
    ebc = CachedEmbeddingBagCollection(tables, device="cpu", cache=CacheConfig(capacity=SLOTS, policy="static"),
                                       frequencies=FrequencyStats(counts={TABLE: counts}, batches=1))
    assert _resident(ebc) == {1, 3, 6}
    for batch in ([0, 2, 4], [9, 9, 9, 9, 9], [5, 7, 8, 0]):
        _run(ebc, batch)
        assert _resident(ebc) == {1, 3, 6}
    assert ebc.cache_stats()["rows_spilled"] == 3 + 1 + 4


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_hit_and_load_counts_on_a_repeating_trace(policy):
    # Rows 0, 1, 2 fit the cache exactly: the first batch loads them (3 misses, 3 loads) and every later
    # lookup hits, whatever the policy: 12 lookups, 9 hits, 3 rows loaded in all.
    ebc = _collection(policy)
    assert _run(ebc, [0, 1, 2]) == _step(3, 0, 3, 0)
    for _ in range(3):
        assert _run(ebc, [2, 1, 0, 0]) == _step(3, 3, 0, 0)
    totals = ebc.cache_stats()
    assert (totals["lookups"], totals["hits"], totals["misses"], totals["rows_loaded"]) == (12, 9, 3, 3)
    assert totals["hit_rate"] == pytest.approx(9 / 12)


def test_prefetch_takes_the_slots_of_the_previous_batch_once_its_lookup_has_read_them():
    # 3 slots, eval lookups, a window of 2: batch 0 loads rows 0, 1, 2 itself. While it is the current batch,
    # the prefetch of batch 1 waits for its lookup, then evicts those rows (no later batch needs them) for
    # rows 3, 4, 5, which batch 2 needs again: batch 1 finds them all on the device and batch 2 hits too.
    ebc = _collection("lfu")
    batches = [KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(b), torch.tensor([len(b)]))
               for b in ([0, 1, 2], [3, 4, 5], [3, 4, 5])]
    seen = []
    with torch.no_grad():
        for kjt in prefetching(batches, ebc, ahead=2):
            seen.append(_resident(ebc))
            ebc(kjt)
            stats = ebc.cache_stats()
            seen.append((stats["last_hits"], stats["last_rows_loaded"]))
    assert seen == [set(), (0, 3), {3, 4, 5}, (3, 3), {3, 4, 5}, (3, 0)]
