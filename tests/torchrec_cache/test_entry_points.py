"""The cache's entry points and its key space, without TorchRec (issue 28).

``FusedCache.lookup`` / ``prefetch`` / ``enter_window`` are a batch's entry points: a lookup counts and holds,
a prefetch loads and pins without counting, a batch entering the window loads nothing. The key space
(``layout.KeySpace``, built once) must give every table exactly its planned slots, disjoint key and set
runs, and keep each key in its own table's sets.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_cache.cache import FusedCache
from torchrec_cache.config import RowOptimizer
from torchrec_cache.layout import KeyIndex, KeySpace, TableSpec
from torchrec_cache.lookup import cached_pooled_lookup
from torchrec_cache.window import Window

FAST = settings(max_examples=60, deadline=None)
TABLES = [TableSpec(name="a", rows=300, dim=4, capacity=40), TableSpec(name="b", rows=20, dim=8, capacity=20),
          TableSpec(name="c", rows=500, dim=4, capacity=33)]


def _cache() -> FusedCache:
    cache = FusedCache(TABLES, policy="lfu", optimizer=RowOptimizer(kind="adagrad", lr=0.1), device="cpu", ways=4)
    gen = torch.Generator().manual_seed(0)
    for g in cache.groups:
        g.host.copy_(torch.randn(g.host.shape, generator=gen))
    cache.finish_setup()
    return cache


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """(values, lengths, value_bounds) with features in key order: a (dim 4), c (dim 4), then b (dim 8)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = [torch.randint(0, r, (24,), generator=gen) ** 2 % r for r in (300, 500, 20)]
        out.append((torch.cat(ids), torch.full((3 * 6,), 4, dtype=torch.int64), [0, 48, 72]))
    return out


FEATURE_TABLE = torch.tensor([0, 2, 1])  # the feature of each table, in key order (a, c: one group; b)


def _state(cache: FusedCache) -> dict[str, torch.Tensor]:
    return {name: buf.clone() for name, buf in cache.named_buffers()}


def test_prefetch_loads_and_pins_without_counting_and_enter_window_loads_nothing():
    cache = _cache()
    (values, lengths, vb), = _batches(1)
    keys_before = cache.slot_key.clone()
    cache.enter_window(values, lengths, FEATURE_TABLE, step=3, value_bounds=vb)
    assert torch.equal(cache.slot_key, keys_before) and cache.stats_total()["rows_loaded"] == 0
    batch = cache.prefetch(values, lengths, FEATURE_TABLE, until=2, value_bounds=vb)
    stats = cache.stats_total()
    assert stats["lookups"] == 0 and stats["steps"] == 0 and stats["rows_loaded"] > 0
    loaded = batch.slots[batch.slots < cache.num_slots]
    assert bool((cache.pinned_until.index_select(0, loaded) == 2).all())
    assert cache.step == 0  # a prefetch is not a step


def test_a_lookup_is_held_until_its_backward_and_its_rows_train():
    cache = _cache()
    (values, lengths, vb), = _batches(1)
    batch = cache.lookup(values, lengths, FEATURE_TABLE, value_bounds=vb, train=True)
    assert batch.held and int(cache.hold.sum()) == batch.slots.numel() and batch.groups_left == 2
    before = [g.host.clone() for g in cache.groups]
    out = cached_pooled_lookup(cache, batch, lengths, batch_size=6, group_features=[(0, 2), (2, 3)])
    sum(o.square().sum() for o in out).backward()
    assert not batch.held and int(cache.hold.sum()) == 0
    cache.flush()
    assert all(not torch.equal(b, g.host) for b, g in zip(before, cache.groups))


tables = st.lists(st.builds(lambda rows, cap, dim: TableSpec(name="t", rows=rows, dim=dim, capacity=cap),
                            st.integers(1, 400), st.integers(1, 500), st.sampled_from([2, 4, 8])),
                  min_size=1, max_size=6).map(lambda ts: [TableSpec(name=f"t{i}", rows=t.rows, dim=t.dim,
                                                                    capacity=t.capacity) for i, t in enumerate(ts)])


@FAST
@given(tables, st.sampled_from([1, 4, 32]))
def test_every_table_gets_its_slots_and_keeps_its_keys_in_its_own_sets(specs, ways):
    space = KeySpace.of(specs, ways)
    assert space.num_keys == sum(t.rows for t in specs) and space.num_slots == space.num_sets * ways
    starts = [space.key_start[i] for i in space.order]
    assert starts == sorted(starts) and space.key_bounds[-1] == space.num_keys
    for i, t in enumerate(specs):
        assert sum(space.enabled[i]) == min(t.capacity, t.rows) == space.capacity[i]
        assert all(0 <= e <= ways for e in space.enabled[i])
        g = space.groups[space.group_index[i]]
        assert (g.dim, g.dtype) == (t.dim, t.dtype) and g.key_lo <= space.key_start[i] < g.key_hi
    index = KeyIndex(space, torch.device("cpu"))
    keys = torch.arange(space.num_keys)
    tab = index.tables_of(keys)
    sets = index.sets_of(keys)
    for i, t in enumerate(specs):
        mine = tab == i
        assert int(mine.sum()) == t.rows
        s = sets[mine]
        assert bool(((s >= space.set_start[i]) & (s < space.set_start[i] + space.sets[i])).all())
        if space.direct[i]:  # direct-mapped: row r in set r // ways
            assert torch.equal(s - space.set_start[i], torch.arange(t.rows) // ways)


@FAST
@given(st.lists(st.tuples(st.integers(0, 50), st.lists(st.integers(0, 30), max_size=8)), min_size=1, max_size=5))
def test_a_window_knows_each_keys_first_use(batches):
    window = Window.of([(s, torch.tensor(sorted(ks), dtype=torch.int64)) for s, ks in batches])
    probe = torch.arange(32)
    got = window.next_use(probe).tolist()
    for k, step in zip(probe.tolist(), got):
        uses = [s for s, ks in batches if k in ks]
        assert step == (min(uses) if uses else 2**40)
