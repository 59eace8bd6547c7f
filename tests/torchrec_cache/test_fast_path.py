"""The fused cache's fast path: host reads per batch, prefetch equivalence, memory sized by the cache,
the collection-wide capacity split, and TorchRec parity (meta device, fx, KeyedOptimizer, float ids)."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from tests.helpers.runif import RunIf
from tests.torchrec_cache.common import TOL, make_kjt, reference_optimizer, reference_state, tables
from torchrec_cache import CacheConfig, CachedEmbeddingBagCollection, RowOptimizer, prefetching
from torchrec_cache.sync import SYNCS

pytestmark = RunIf(torchrec=True)


def _pair(cache: CacheConfig, cfgs=tables, device: str = "cpu"):
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=cfgs())
    cached = CachedEmbeddingBagCollection(tables=cfgs(), cache=cache, device=device)
    cached.load_state_dict(ref.state_dict())
    return ref, cached


def _same_dim_tables():
    # One embedding dim: every table shares one slot tensor (the DLRM case).
    cfgs = tables()
    for c in cfgs:
        c.embedding_dim = 8
    return cfgs


@pytest.mark.parametrize("cfgs", [_same_dim_tables, tables], ids=["one_dim", "three_dims"])
@pytest.mark.parametrize("ahead", [0, 2])
def test_forward_and_backward_read_the_device_at_most_twice(cfgs, ahead):
    # 12 slots per table for ~100 ids per table: misses, evictions, write-backs and spills every batch.
    _, cached = _pair(CacheConfig(capacity=12, optimizer=RowOptimizer(kind="adam", lr=0.01)), cfgs)
    gen = torch.Generator().manual_seed(1)
    batches = [make_kjt(cfgs(), 24, gen) for _ in range(5)]
    counts = []
    for kjt in prefetching(batches, cached, ahead=ahead):
        SYNCS.reset()  # counts this thread only: the prefetch thread's reads overlap the step
        cached(kjt).values().square().sum().backward()
        counts.append(SYNCS.count)
    stats = cached.cache_stats()
    assert stats["rows_spilled"] > 0 and stats["rows_written_back"] > 0, stats
    assert counts == [2] * len(batches), counts


@RunIf(cuda=True)
def test_cuda_step_makes_no_implicit_synchronisation():
    _, cached = _pair(CacheConfig(capacity=12, optimizer=RowOptimizer(kind="adam", lr=0.01)), _same_dim_tables,
                      device="cuda")
    gen = torch.Generator().manual_seed(1)
    batches = [make_kjt(_same_dim_tables(), 24, gen).to(torch.device("cuda")) for _ in range(4)]
    cached(batches[0]).values().sum().backward()  # warm-up: allocations, staging buffers
    torch.cuda.synchronize()
    for kjt in batches[1:]:
        SYNCS.reset()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning) as record:
                cached(kjt).values().sum().backward()
                torch.cuda.synchronize()  # one warning of our own, so the block always warns
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in record if "synchroniz" in str(w.message)]
        assert SYNCS.count == 2 and len(syncs) <= 2 + 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_training_with_prefetch_matches_ebc_under_heavy_eviction(kind):
    opt = RowOptimizer(kind=kind, lr=0.01, eps=1e-8, initial_accumulator_value=0.1 if kind == "adagrad" else 0.0)
    ref, cached = _pair(CacheConfig(capacity=12, optimizer=opt, prefetch=3))
    ref_opt = reference_optimizer(ref, opt)
    gen = torch.Generator().manual_seed(3)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables())
    data = [(make_kjt(tables(), 24, gen), torch.randn(24, width, generator=gen)) for _ in range(8)]
    for (kjt, target), (kjt2, _) in zip(prefetching(data, cached), data):
        assert kjt is kjt2  # batches come through unchanged and in order
        ref_opt.zero_grad()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        ref_opt.step()
        ((cached(kjt).values() - target) ** 2).sum().backward()
    want, got = ref.state_dict(), cached.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=TOL, rtol=TOL)
    state = cached.fused_optimizer_state()
    for table, entries in reference_state(ref_opt, ref).items():
        for key, value in entries.items():
            torch.testing.assert_close(state[table][key], value.reshape(state[table][key].shape), atol=TOL, rtol=TOL)
    stats = cached.cache_stats()
    assert stats["rows_written_back"] > 20 and stats["rows_spilled"] > 0, stats


def test_gradient_accumulation_holds_rows_until_backward():
    # Three forwards, one backward: the rows of the first batches must not move before their gradients land.
    # (SGD: three fused updates with the three gradients equal one step with their sum.)
    opt = RowOptimizer(kind="sgd", lr=0.05)
    ref, cached = _pair(CacheConfig(capacity=12, optimizer=opt))
    ref_opt = reference_optimizer(ref, opt)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        kjts = [make_kjt(tables(), 16, gen) for _ in range(3)]
        ref_opt.zero_grad()
        sum((ref(k).values() ** 2).sum() for k in kjts).backward()
        ref_opt.step()
        sum((cached(k).values() ** 2).sum() for k in kjts).backward()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[k], v, atol=TOL, rtol=TOL)


def test_device_memory_follows_the_cache_not_the_tables():
    # A billion-row table with 1% cached, built on the meta device: no buffer scales with the table's rows.
    rows = 1_000_000_000
    cfg = [EmbeddingBagConfig(name="huge", embedding_dim=16, num_embeddings=rows, feature_names=["f"])]
    ebc = CachedEmbeddingBagCollection(tables=cfg, device="meta",
                                       cache=CacheConfig(capacity=0.01, optimizer=RowOptimizer(kind="rowwise_adagrad")))
    slots = ebc.cache_capacity()["huge"]
    assert slots == rows // 100
    device_bytes = sum(b.numel() * b.element_size() for b in ebc.fused_cache.buffers())
    per_slot = 16 * 4 + 4 + 28 + 128  # weights, row-wise state, key/score/pin/hold/next use, sketch (bound)
    assert device_bytes <= 1.01 * slots * per_slot, device_bytes / slots
    assert max(max(b.shape) for b in ebc.fused_cache.buffers()) < rows // 4  # no entry per table row


def test_ratio_capacity_is_the_collections_and_keeps_small_tables_whole():
    cfgs = [EmbeddingBagConfig(name="small", embedding_dim=8, num_embeddings=31, feature_names=["a"]),
            EmbeddingBagConfig(name="big", embedding_dim=8, num_embeddings=20_000, feature_names=["b"])]
    ebc = CachedEmbeddingBagCollection(tables=cfgs, cache=CacheConfig(capacity=0.015,
                                                                      optimizer=RowOptimizer(kind="sgd")))
    cap = ebc.cache_capacity()
    assert cap["small"] == 31 and sum(cap.values()) == round(20_031 * 0.015)
    gen = torch.Generator().manual_seed(0)
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.cat([torch.randint(0, 31, (64,), generator=gen),
                                                                     torch.randint(0, 20_000, (64,), generator=gen)]),
                                              torch.ones(128, dtype=torch.int64))
    ebc(kjt)
    small = ebc.cache_stats(per_table=True)["tables"]["small"]
    assert small["hits"] == small["lookups"] > 0  # wholly resident from construction: never a miss


def test_float_ids_are_refused_like_the_plain_collection():
    _, cached = _pair(CacheConfig(capacity=0.1))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], torch.tensor([1.7, 2.0, 3.0, 4.0]),
                                              torch.tensor([1, 1, 1, 1, 0, 0, 0, 0]))
    with pytest.raises(TypeError, match="must be integer ids, got dtype torch.float32; a float id such as 1.7"):
        cached(kjt)


def test_meta_construction_materialises_on_the_host():
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables())
    opt = RowOptimizer(kind="adagrad", lr=0.1)
    meta = CachedEmbeddingBagCollection(tables=tables(), device="meta", cache=CacheConfig(capacity=0.2, optimizer=opt))
    assert meta.embedding_bags["t0"].weight.device.type == "meta"
    kjt = make_kjt(tables(), 8, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="built on the meta device; materialise it first"):
        meta.prefetch(kjt)
    shape = meta(kjt).values()  # the forward on the meta device propagates shapes (see test_torchrec_parity.py)
    assert shape.device.type == "meta" and shape.shape == ref(kjt).values().shape
    meta.to_empty(device="cpu")
    meta.load_state_dict(ref.state_dict())
    assert meta.embedding_bags["t0"].weight.device.type == "cpu"
    torch.testing.assert_close(meta(kjt).values(), ref(kjt).values(), atol=TOL, rtol=TOL)
    fresh = CachedEmbeddingBagCollection(tables=tables(), device="meta", cache=CacheConfig(capacity=0.2))
    fresh.to_empty(device="cpu")
    fresh.init_parameters()  # the tables' init_fn, as TorchRec's collections do
    bound = (1.0 / 211) ** 0.5
    w = fresh.embedding_bags["t0"].weight
    assert float(w.abs().max()) <= bound * (1 + 1e-6) and float(w.std()) > bound / 4


def test_moving_a_materialised_cache_copies_its_slots_only_when_the_move_drops_values():
    from torch.profiler import ProfilerActivity, profile

    _, cached = _pair(CacheConfig(capacity=0.2))
    kjt = make_kjt(tables(), 8, torch.Generator().manual_seed(1))
    before = cached(kjt).values()

    def cloned(move) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            move()
        return sum(e.count for e in prof.key_averages() if e.key == "aten::clone")

    assert cloned(lambda: cached.to("cpu")) == 0 and cloned(lambda: cached.float()) == 0
    assert cloned(lambda: cached.to_empty(device="cpu")) >= len(list(cached.fused_cache.buffers())) > 0
    torch.testing.assert_close(cached(kjt).values(), before, atol=0, rtol=0)  # slots and index kept


@pytest.mark.parametrize("tracer", ["torch.fx", "torchrec.fx"])
def test_fx_tracing_keeps_the_lookup_as_one_leaf_call(tracer):
    import torchrec.fx
    from torchrec.models.dlrm import DLRM

    from torchrec_cache import swap_in
    from torchrec_cache.modules import cached_collection_forward

    torch.manual_seed(0)
    model = swap_in(DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=_same_dim_tables()),
                         dense_in_features=5, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]),
                    cache=CacheConfig(capacity=0.1, optimizer=RowOptimizer(kind="sgd", lr=0.1)))
    traced = (torch.fx.symbolic_trace if tracer == "torch.fx" else torchrec.fx.symbolic_trace)(model)
    calls = [n for n in traced.graph.nodes if n.target is cached_collection_forward]
    assert len(calls) == 1
    gen = torch.Generator().manual_seed(2)
    dense, kjt = torch.randn(8, 5, generator=gen), make_kjt(_same_dim_tables(), 8, gen)
    want = model(dense, kjt)
    torch.testing.assert_close(traced(dense, kjt), want)
    traced(dense, kjt).sum().backward()  # the traced model trains the same cache
    assert model.sparse_arch.embedding_bag_collection.fused_optimizer_state()["t0"]["step"] == 1


def test_fused_optimizer_state_is_a_keyed_optimizer_that_round_trips():
    opt = RowOptimizer(kind="adam", lr=0.01, eps=1e-8)
    ref, cached = _pair(CacheConfig(capacity=12, optimizer=opt))
    ref_opt = reference_optimizer(ref, opt)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        kjt = make_kjt(tables(), 16, gen)
        ref_opt.zero_grad()
        (ref(kjt).values() ** 2).sum().backward()
        ref_opt.step()
        (cached(kjt).values() ** 2).sum().backward()
    saved = cached.fused_optimizer.state_dict()
    assert set(saved["state"]) == {f"embedding_bags.{t.name}.weight" for t in tables()}
    for table, entries in reference_state(ref_opt, ref).items():
        for key, value in entries.items():
            got = saved["state"][f"embedding_bags.{table}.weight"][key]
            torch.testing.assert_close(got, value.reshape(got.shape), atol=TOL, rtol=TOL)
    # A fresh collection loads weights and optimizer state, then trains on exactly like the original.
    other = CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(capacity=12, optimizer=opt))
    other.load_state_dict(cached.state_dict())
    other.fused_optimizer.load_state_dict(saved)
    kjt = make_kjt(tables(), 16, gen)
    for model in (cached, other):
        (model(kjt).values() ** 2).sum().backward()
    for k, v in cached.state_dict().items():
        torch.testing.assert_close(other.state_dict()[k], v, atol=TOL, rtol=TOL)
