"""swap_in / swap_out on TorchRec's DLRM, prefetching, stats (and their Lightning logging), discovery, the docs' quick start."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM

from tests.helpers.runif import RunIf
from tests.torchrec_cache.common import TOL, make_kjt, tables
from torchrec_cache import (
    CacheConfig,
    CachedEmbeddingBagCollection,
    RowOptimizer,
    model_cache_stats,
    prefetching,
    swap_in,
    swap_out,
)

pytestmark = RunIf(torchrec=True)


def _dlrm_tables():
    cfgs = tables()
    for c in cfgs:
        c.embedding_dim = 8  # DLRM needs one embedding dim
    return cfgs


def _dlrm():
    torch.manual_seed(0)
    return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=_dlrm_tables()), dense_in_features=5,
                dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])


def test_swap_in_dlrm_keeps_outputs_and_swap_out_keeps_trained_weights():
    plain, model = _dlrm(), _dlrm()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 5, generator=gen), make_kjt(_dlrm_tables(), 16, gen)) for _ in range(4)]
    model = swap_in(model, cache=CacheConfig(capacity=0.05, optimizer=RowOptimizer(kind="adagrad", lr=0.1)))
    ebc = model.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, CachedEmbeddingBagCollection)
    assert list(model.state_dict()) == list(plain.state_dict())
    for dense, kjt in batches:
        torch.testing.assert_close(model(dense, kjt), plain(dense, kjt), atol=TOL, rtol=TOL)
    for dense, kjt in batches:  # train the cached model a little
        model(dense, kjt).sum().backward()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(trained["sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"],
                           plain.state_dict()["sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"])
    dense, kjt = batches[0]
    want = model(dense, kjt)
    restored = swap_out(model)
    assert type(restored.sparse_arch.embedding_bag_collection) is EmbeddingBagCollection
    for k, v in restored.state_dict().items():
        torch.testing.assert_close(v, trained[k])
    torch.testing.assert_close(restored(dense, kjt), want, atol=TOL, rtol=TOL)


def test_swap_in_without_collections_says_what_it_needs():
    with pytest.raises(ValueError, match="found no EmbeddingBagCollection or EmbeddingCollection in Linear"):
        swap_in(torch.nn.Linear(2, 2))


def test_prefetching_loads_rows_before_their_batch_and_changes_nothing():
    gen = torch.Generator().manual_seed(3)
    batches = [make_kjt(tables(), 8, gen, max_len=3) for _ in range(6)]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables())
    cache = CacheConfig(capacity=0.6, policy="lru", optimizer=RowOptimizer(kind="sgd", lr=0.1))
    cached = swap_in(ref, cache=cache)
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    per_step = []
    for kjt in prefetching(batches, cached, ahead=1):
        out = cached(kjt)
        per_step.append((cached.cache_stats()["last_hits"], cached.cache_stats()["last_lookups"]))
        out.values().sum().backward()
        ref_opt.zero_grad()
        ref(kjt).values().sum().backward()
        ref_opt.step()
    # every batch after the first found all its rows already loaded
    assert all(h == n for h, n in per_step[1:]), per_step
    assert per_step[0][0] < per_step[0][1]
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[k], v, atol=TOL, rtol=TOL)


def test_prefetching_pins_each_batch_until_its_own_forward():
    """With ahead=1 the look-ahead buffer is empty whenever a batch is yielded; the next batch must still be
    numbered by its place in the stream, so its prefetch waits for the current lookup and pins its rows
    until its own forward (numbered 0 again, it raced that lookup and its pins had expired: a flaky miss)."""
    gen = torch.Generator().manual_seed(3)
    batches = [make_kjt(tables(), 8, gen, max_len=3) for _ in range(6)]
    cached = swap_in(EmbeddingBagCollection(tables=tables()),
                     cache=CacheConfig(capacity=0.6, policy="lru", optimizer=RowOptimizer(kind="sgd", lr=0.1)))
    c = cached.fused_cache
    owner = {f: cfg.name for cfg in tables() for f in cfg.feature_names}
    for j, kjt in enumerate(prefetching(batches, cached, ahead=1)):
        if j > 0:  # its rows were prefetched while batch j - 1 ran: resident, pinned until forward j + 1
            keys = torch.cat([v.values() + c.key_start(owner[f]) for f, v in kjt.to_dict().items()])
            slots = c.find(keys)
            assert bool((slots >= 0).all()), j
            assert int(c.pinned_until.index_select(0, slots).min()) >= c.step + 1 == j + 1, j
        cached(kjt).values().sum().backward()


def test_model_stats_count_lookups_and_traffic():
    model = swap_in(_dlrm(), cache=CacheConfig(capacity=10, optimizer=RowOptimizer(kind="sgd")))
    gen = torch.Generator().manual_seed(1)
    kjt = make_kjt(_dlrm_tables(), 16, gen)
    model(torch.randn(16, 5), kjt).sum().backward()
    stats = model_cache_stats(model)
    unique = sum(torch.cat([kjt[f].values() for f in c.feature_names]).unique().numel() for c in _dlrm_tables())
    assert stats["lookups"] == unique == stats["hits"] + stats["misses"]
    assert stats["rows_loaded"] == 30 and stats["bytes_to_device"] == 30 * 8 * 4  # 10 slots x 3 tables, fp32 dim 8
    assert 0.0 <= stats["hit_rate"] <= 1.0


@RunIf(torchrec=True, lightning=True)
def test_lightning_callback_logs_hit_rate(tmp_path):
    import lightning.pytorch as pl

    from torchrec_cache import CacheStatsCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = swap_in(_dlrm(), cache=CacheConfig(capacity=0.2, optimizer=RowOptimizer(kind="sgd")))

        def training_step(self, batch, _):
            dense, kjt, labels = batch
            return torch.nn.functional.binary_cross_entropy_with_logits(self.model(dense, kjt).squeeze(1), labels)

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 5, generator=gen), make_kjt(_dlrm_tables(), 8, gen), torch.ones(8)) for _ in range(3)]
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[CacheStatsCallback()],
                         default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(data, batch_size=None, collate_fn=lambda b: b)
    trainer.fit(Module(), train_dataloaders=loader)
    metrics = trainer.callback_metrics
    assert "cache/hit_rate" in metrics and "cache/last_rows_loaded" in metrics
    assert 0.0 < float(metrics["cache/hit_rate"]) <= 1.0


def test_plugin_is_discovered_and_available():
    from tightfit.plugins import PluginRegistry, discover

    found = {r.name: r for r in discover(into=PluginRegistry())}
    assert found["torchrec_cache"].ok and found["torchrec_cache"].plugin.status() == "available"
    assert found["torchrec_cache"].plugin.demo is not None


def test_docs_quick_start_runs():
    """docs/embedding-cache.md, section "Quick start", as written (the generic docs test runs it too; this one
    checks that it trained through the cache)."""
    from tests.helpers.docs import python_block

    code = python_block("docs/embedding-cache.md", "Quick start")
    namespace: dict = {}
    exec(compile(code, "docs/embedding-cache.md: Quick start", "exec"), namespace)
    assert namespace["stats"]["lookups"] > 0
