"""DistributedModelParallel with the cached collection, table-wise on 2 gloo ranks, against the unsharded model."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

pytestmark = RunIf(torchrec=True, min_world=2)

STEPS, BATCH = 5, 8


def _tables():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=120, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=80, feature_names=["f2"]),
            EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=200, feature_names=["f3"])]


def _concat(kjts):
    """One KJT holding the samples of ``kjts`` one after the other (the global batch)."""
    from torchrec import KeyedJaggedTensor

    keys = kjts[0].keys()
    values = torch.cat([k[key].values() for key in keys for k in kjts])
    lengths = torch.cat([k[key].lengths() for key in keys for k in kjts])
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)


def _model(cache):
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM

    from torchrec_cache import swap_in

    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=_tables()), dense_in_features=4,
                 dense_arch_layer_sizes=[8, 8], over_arch_layer_sizes=[8, 1])
    return swap_in(model, cache=cache)


def _dmp_rank(rank: int, world: int, kind: str, policy: str, sharding: str = "table_wise",
              disk_dir: str | None = None) -> dict:
    import logging
    import os

    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from tests.torchrec_cache.common import make_kjt
    from torchrec_cache import (
        CacheConfig,
        CachedEmbeddingBagCollectionSharder,
        RowOptimizer,
        cached_sharding_plan,
    )
    from torchrec_cache.sharder import ShardedCachedEmbeddingBagCollection

    logging.disable(logging.WARNING)
    cache = CacheConfig(capacity=6, policy=policy, optimizer=RowOptimizer(kind=kind, lr=0.05, eps=1e-8))
    reference = _model(cache)
    if disk_dir is not None:  # the sharded model's tables on disk (a directory per rank), a tiny host level
        os.makedirs(f"{disk_dir}/rank{rank}", exist_ok=True)
        cache = CacheConfig(capacity=6, policy=policy, optimizer=cache.optimizer, disk_dir=f"{disk_dir}/rank{rank}",
                            host_budget=400)
    model = _model(cache)
    plan = cached_sharding_plan(model, world, sharding=sharding,
                                placement={"t0": 0, "t1": 1, "t2": 1} if sharding == "table_wise" else None)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan,
                                   sharders=[CachedEmbeddingBagCollectionSharder()])
    sharded = [m for m in dmp.modules() if isinstance(m, ShardedCachedEmbeddingBagCollection)]
    assert len(sharded) == 1
    dense_opt = torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.05)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(1)
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    worst_pred = 0.0
    for _ in range(STEPS):
        kjts = [make_kjt(_tables(), BATCH, gen, max_len=4) for _ in range(world)]
        dense = [torch.randn(BATCH, 4, generator=gen) for _ in range(world)]
        labels = [torch.randint(0, 2, (BATCH,), generator=gen).float() for _ in range(world)]
        dense_opt.zero_grad()
        pred = dmp(dense[rank], kjts[rank]).squeeze(1)
        loss_fn(pred, labels[rank]).backward()
        dense_opt.step()
        # The unsharded model sees the global batch. DDP averages the dense gradients over ranks and
        # TorchRec's pooled all-to-all divides the embedding gradients by the world size in backward
        # (comm_ops gradient division, on by default), so the matching loss is the mean of the ranks' losses.
        ref_opt.zero_grad()
        ref_pred = reference(torch.cat(dense), _concat(kjts)).squeeze(1)
        (loss_fn(ref_pred, torch.cat(labels)) / world).backward()
        ref_opt.step()
        worst_pred = max(worst_pred, float((pred - ref_pred[rank * BATCH:(rank + 1) * BATCH]).abs().max()))
    local = sharded[0].state_dict()
    ref_sd = reference.state_dict()
    worst_weight = 0.0
    for key, value in local.items():
        first = sharded[0].row_offset(key.split(".")[1])  # row-wise: this rank's block of the table
        want = ref_sd[f"sparse_arch.embedding_bag_collection.{key}"][first:first + value.shape[0]]
        worst_weight = max(worst_weight, float((value - want).abs().max() / (1 + want.abs().max())))
    # The fused optimizer's state is in the DMP checkpoint (TorchRec's KeyedOptimizer), equal to the reference's,
    # and loading it back restores it after more training.
    saved = dmp.fused_optimizer.state_dict()["state"]
    ref_state = reference.sparse_arch.embedding_bag_collection.fused_optimizer_state()
    worst_state = 0.0
    for key, entry in saved.items():
        table = key.split(".")[-2]
        for name, value in entry.items():
            first = sharded[0].row_offset(table)
            want = (torch.tensor(float(ref_state[table][name])) if name == "step"
                    else ref_state[table][name][first:first + value.shape[0]])
            worst_state = max(worst_state, float((value - want).abs().max()))
    snapshot = {k: {n: v.clone() for n, v in e.items()} for k, e in saved.items()}
    kjt = make_kjt(_tables(), BATCH, gen, max_len=4)
    loss_fn(dmp(torch.randn(BATCH, 4, generator=gen), kjt).squeeze(1), torch.ones(BATCH)).backward()
    dmp.fused_optimizer.load_state_dict({"state": snapshot})
    restored = dmp.fused_optimizer.state_dict()["state"]
    worst_restore = max(float((restored[k][n] - v).abs().max()) for k, e in snapshot.items() for n, v in e.items())
    disk = sharded[0]._local.disk_stats()
    return {"tables": sharded[0].local_tables(), "pred": worst_pred, "weight": worst_weight, "disk": disk,
            "misses": sharded[0].cache_stats()["misses"], "keys": sorted(local), "state_keys": sorted(saved),
            "state": worst_state, "restore": worst_restore}


@pytest.mark.parametrize("kind,policy", [("adam", "lru"), ("sgd", "lfu")])
def test_dmp_table_wise_matches_unsharded_model(kind, policy):
    out = run_distributed(_dmp_rank, world_size=2, args=(kind, policy), timeout=400)
    assert out[0]["tables"] == ["t0"] and out[1]["tables"] == ["t1", "t2"]
    assert out[0]["keys"] == ["embedding_bags.t0.weight"]  # unsharded names, local tables only
    assert out[0]["state_keys"] == ["sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"]
    for r in out:
        assert r["pred"] <= 1e-6 and r["weight"] <= 1e-6, out
        assert r["misses"] > 0  # 6 slots per table: the ranks evicted and reloaded rows
        assert r["state"] <= 1e-6 and r["restore"] == 0.0, out


def test_dmp_row_wise_matches_unsharded_model():
    out = run_distributed(_dmp_rank, world_size=2, args=("rowwise_adagrad", "lfu", "row_wise"), timeout=400)
    for r in out:
        assert r["tables"] == ["t0", "t1", "t2"]  # every rank holds a block of rows of every table
        assert r["keys"] == ["embedding_bags.t0.weight", "embedding_bags.t1.weight", "embedding_bags.t2.weight"]
        assert r["pred"] <= 1e-6 and r["weight"] <= 1e-6, out
        assert r["misses"] > 0
        assert r["state"] <= 1e-6 and r["restore"] == 0.0, out


@pytest.mark.parametrize("sharding,kind", [("table_wise", "adam"),
                                           ("row_wise", "rowwise_adagrad")])
def test_dmp_with_tables_on_disk_matches_unsharded_model(sharding, kind, tmp_path):
    out = run_distributed(_dmp_rank, world_size=2, args=(kind, "lfu", sharding, str(tmp_path)), timeout=400)
    for r in out:
        assert r["pred"] <= 1e-6 and r["weight"] <= 1e-6, out
        assert r["state"] <= 1e-6 and r["restore"] == 0.0, out
        assert r["disk"]["rows_read"] > 0 and r["disk"]["rows_written"] > 0, r["disk"]  # the rows went through disk
