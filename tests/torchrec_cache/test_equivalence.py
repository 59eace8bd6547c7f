"""The cached collections against TorchRec's plain ones: outputs, gradients, training, checkpoints."""

from __future__ import annotations

import pytest
import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from tests.helpers.runif import RunIf
from tests.torchrec_cache.common import TOL, make_kjt, reference_optimizer, reference_state, tables
from torchrec_cache import (
    CacheConfig,
    CachedEmbeddingBagCollection,
    CachedEmbeddingCollection,
    FrequencyStats,
    RowOptimizer,
    collect_frequencies,
)

pytestmark = RunIf(torchrec=True)


def _pair(cache: CacheConfig, *, weighted: bool = False, frequencies: FrequencyStats | None = None, seed: int = 0):
    torch.manual_seed(seed)
    # per-id weights need sum pooling (nn.EmbeddingBag refuses weighted means, and so does the cache)
    cfgs = (lambda: tables(PoolingType.SUM)) if weighted else tables
    ref = EmbeddingBagCollection(tables=cfgs(), is_weighted=weighted)
    cached = CachedEmbeddingBagCollection(tables=cfgs(), is_weighted=weighted, cache=cache, frequencies=frequencies)
    cached.load_state_dict(ref.state_dict())
    return ref, cached


@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_ebc_with_tiny_cache(weighted):
    ref, cached = _pair(CacheConfig(capacity=5, policy="lru"), weighted=weighted)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        kjt = make_kjt(tables(), 16, gen, weighted=weighted)
        want, got = ref(kjt), cached(kjt)
        assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values(), atol=TOL, rtol=TOL)
    stats = cached.cache_stats()
    assert stats["rows_spilled"] > 0 and stats["misses"] > 0  # batches exceeded 5 slots: handled, not asserted


def test_autograd_mode_gradients_match_ebc():
    ref, cached = _pair(CacheConfig(capacity=0.1, optimizer=None), weighted=True)
    gen = torch.Generator().manual_seed(2)
    kjt = make_kjt(tables(), 12, gen, weighted=True)
    target = torch.randn(12, sum(t.embedding_dim * len(t.feature_names) for t in tables()), generator=gen)
    for model in (ref, cached):
        ((model(kjt).values() - target) ** 2).sum().backward()
    for name, bag in ref.embedding_bags.items():
        grad = cached.embedding_bags[name].weight.grad
        assert grad is not None and grad.is_sparse
        # gradients are O(1) here: compare relative to size (1-ulp summation-order differences)
        torch.testing.assert_close(grad.to_dense(), bag.weight.grad, atol=TOL, rtol=TOL)


def _train(ref, cached, ref_opt, steps: int, *, weighted: bool = False, cached_opt=None, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables())
    for _ in range(steps):
        kjt = make_kjt(tables(), 24, gen, weighted=weighted)
        target = torch.randn(24, width, generator=gen)
        for model, opt in ((ref, ref_opt), (cached, cached_opt)):
            if opt is not None:
                opt.zero_grad()
            # A summed loss: with a mean over ~1000 outputs the gradients are so small that Adam's
            # eps dominates, and 1-ulp differences in gradient summation order (TorchRec's sparse
            # backward sorts ids, the cache sums them in batch order) show up at ~1e-6 in the weights.
            loss = ((model(kjt).values() - target) ** 2).sum()
            loss.backward()
            if opt is not None:
                opt.step()


def _assert_same_weights(ref, cached):
    want, got = ref.state_dict(), cached.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=TOL, rtol=TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_fused_training_matches_ebc_under_heavy_eviction(kind):
    opt = RowOptimizer(kind=kind, lr=0.01, eps=1e-8, initial_accumulator_value=0.1 if kind == "adagrad" else 0.0)
    # 12 slots per table for batches of ~100 ids per table: most rows are evicted and come back, some spill.
    ref, cached = _pair(CacheConfig(capacity=12, policy="lfu", optimizer=opt))
    ref_opt = reference_optimizer(ref, opt)
    _train(ref, cached, ref_opt, steps=8)
    _assert_same_weights(ref, cached)
    stats = cached.cache_stats()
    assert stats["rows_written_back"] > 50 and stats["rows_spilled"] > 0, stats
    want = reference_state(ref_opt, ref)
    got = cached.fused_optimizer_state()
    for table, state in want.items():
        assert got[table]["step"] == 8
        for key, value in state.items():
            torch.testing.assert_close(got[table][key], value.reshape(got[table][key].shape), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("policy", ["lru", "static"])
def test_fused_adam_every_policy_and_reordered_rows(policy):
    opt = RowOptimizer(kind="adam", lr=0.01, eps=1e-8)
    gen = torch.Generator().manual_seed(9)
    freq = collect_frequencies([make_kjt(tables(), 24, gen) for _ in range(4)], tables(), progress=False)
    ref, cached = _pair(CacheConfig(capacity=0.15, policy=policy, reorder=True, optimizer=opt), frequencies=freq)
    assert cached.is_reordered("t0")  # rows are stored in frequency order on the host
    ref_opt = reference_optimizer(ref, opt)
    _train(ref, cached, ref_opt, steps=6, seed=9)
    _assert_same_weights(ref, cached)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_autograd_mode_trains_like_ebc_with_a_standard_optimizer(kind):
    ref, cached = _pair(CacheConfig(capacity=10, policy="lru", optimizer=None))
    for bag in ref.embedding_bags.values():
        bag.sparse = True  # the cached collection's host tables get sparse gradients; compare like with like
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01), "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
            "adam": lambda p: torch.optim.SparseAdam(p, lr=0.01)}[kind]
    _train(ref, cached, make(list(ref.parameters())), steps=6, cached_opt=make(list(cached.parameters())))
    _assert_same_weights(ref, cached)
    # and the cache serves the updated rows, not stale copies
    kjt = make_kjt(tables(), 8, torch.Generator().manual_seed(5))
    torch.testing.assert_close(cached(kjt).values(), ref(kjt).values(), atol=TOL, rtol=TOL)


def test_state_dict_moves_both_ways_after_training():
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.1)
    ref, cached = _pair(CacheConfig(capacity=0.05, optimizer=opt))
    _train(ref, cached, reference_optimizer(ref, opt), steps=3)
    # cached -> plain: the plain collection reproduces the cached one's outputs
    plain = EmbeddingBagCollection(tables=tables())
    plain.load_state_dict(cached.state_dict())
    kjt = make_kjt(tables(), 8, torch.Generator().manual_seed(4))
    torch.testing.assert_close(plain(kjt).values(), cached(kjt).values(), atol=TOL, rtol=TOL)
    # plain -> cached, including rows that are resident in the cache right now
    fresh = EmbeddingBagCollection(tables=tables())
    cached.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(cached(kjt).values(), fresh(kjt).values(), atol=TOL, rtol=TOL)


def test_reordered_host_table_keeps_checkpoints_in_id_order():
    gen = torch.Generator().manual_seed(6)
    freq = collect_frequencies([make_kjt(tables(), 16, gen) for _ in range(3)], tables(), progress=False)
    ref, cached = _pair(CacheConfig(capacity=0.1, reorder=True), frequencies=freq)
    host = cached.embedding_bags["t0"].weight
    order = freq.order("t0")
    # The host rows are permuted (hottest first) ...
    torch.testing.assert_close(host.detach(), ref.embedding_bags["t0"].weight.detach()[order])
    assert not torch.equal(order, torch.arange(order.numel()))
    # ... yet the state dict is in id order, and outputs are unchanged.
    torch.testing.assert_close(cached.state_dict()["embedding_bags.t0.weight"], ref.state_dict()["embedding_bags.t0.weight"])
    kjt = make_kjt(tables(), 8, gen)
    torch.testing.assert_close(cached(kjt).values(), ref(kjt).values(), atol=TOL, rtol=TOL)


def test_frequency_file_round_trip_and_warmup(tmp_path):
    gen = torch.Generator().manual_seed(7)
    batches = [make_kjt(tables(), 32, gen) for _ in range(5)]
    freq = collect_frequencies(batches, tables(), progress=False)
    assert int(freq.counts["t0"].sum()) == sum(int(b["f0"].values().numel() + b["f1"].values().numel()) for b in batches)
    loaded = FrequencyStats.load(freq.save(tmp_path / "freq.safetensors"))
    assert loaded.batches == 5 and all(torch.equal(loaded.counts[k], v) for k, v in freq.counts.items())
    cached = CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(capacity=10), frequencies=loaded)
    resident = set(cached.resident_rows("t0").tolist())
    assert resident == set(freq.hottest("t0", 10).tolist())  # warmed with the 10 hottest rows


def test_out_of_range_id_names_table_id_and_range():
    _, cached = _pair(CacheConfig(capacity=0.1))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], torch.tensor([1, 3, 97, 4]),
                                              torch.tensor([1, 0, 1, 0, 1, 0, 1, 0]))
    with pytest.raises(IndexError, match=r"table 't1': id 97 is outside its range \[0, 97\)"):
        cached(kjt)


def test_policy_static_without_statistics_says_how_to_fix():
    with pytest.raises(ValueError, match="needs frequency statistics: pass frequencies=collect_frequencies"):
        CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(policy="static"))


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"capacity=1.5 is a ratio outside \(0, 1\]"):
        CacheConfig(capacity=1.5)
    with pytest.raises(ValueError, match="policy 'fifo' is unknown; choose one of lfu, lru, static"):
        CacheConfig(policy="fifo")
    with pytest.raises(ValueError, match="kind 'lamb' is unknown"):
        RowOptimizer(kind="lamb")


def test_byte_budget_splits_slots_by_frequency():
    gen = torch.Generator().manual_seed(8)
    freq = collect_frequencies([make_kjt(tables(), 32, gen) for _ in range(4)], tables(), progress=False)
    cached = CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(capacity="8KiB"), frequencies=freq)
    slots = cached.cache_capacity()
    index = sum(t.num_embeddings * 4 for t in tables())
    assert sum(slots[t.name] * (t.embedding_dim * 4 + 24) for t in tables()) + index <= 8 * 1024
    assert all(s >= 1 for s in slots.values())


def test_embedding_collection_matches_torchrec():
    cfgs = [EmbeddingConfig(name="e0", embedding_dim=8, num_embeddings=120, feature_names=["a", "b"]),
            EmbeddingConfig(name="e1", embedding_dim=8, num_embeddings=60, feature_names=["c"])]
    torch.manual_seed(0)
    ref = EmbeddingCollection(tables=cfgs, need_indices=True)
    opt = RowOptimizer(kind="adagrad", lr=0.1)
    cached = CachedEmbeddingCollection(tables=cfgs, need_indices=True, cache=CacheConfig(capacity=7, optimizer=opt))
    cached.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["a", "b", "c"], torch.randint(0, 60, (30,), generator=gen), torch.tensor([5, 5, 5, 5, 5, 5]))
        want, got = ref(kjt), cached(kjt)
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k].values(), want[k].values(), atol=TOL, rtol=TOL)
            assert torch.equal(got[k].lengths(), want[k].lengths()) and torch.equal(got[k].weights(), want[k].weights())
        ref_opt.zero_grad()
        sum((v.values() ** 2).sum() for v in want.values()).backward()
        ref_opt.step()
        sum((v.values() ** 2).sum() for v in got.values()).backward()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[k], v, atol=TOL, rtol=TOL)
