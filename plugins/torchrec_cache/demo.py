"""``tightfit demo`` part: TorchRec's DLRM on synthetic Criteo-like data with 1.5% of the rows cached.

The full-size script is ``examples/torchrec_cache/train_dlrm.py``; this is its short version.
"""

from __future__ import annotations

import logging
import time

import torch
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM

from torchrec_cache.config import CacheConfig, RowOptimizer
from torchrec_cache.data import SyntheticCriteo, criteo_like_tables
from torchrec_cache.frequency import collect_frequencies
from torchrec_cache.stats import model_cache_stats
from torchrec_cache.swap import prefetching, swap_in

__all__ = ["run_demo"]


def run_demo(quick: bool = True) -> str:
    # TorchRec's KeyedJaggedTensor calls torch.fx's deprecated ``is_fx_tracing``, whose one-off 285-column
    # warning is addressed to TorchRec, not to the demo's reader: quiet it for the demo only.
    fx_log = logging.getLogger("torch.fx._symbolic_trace")
    level = fx_log.level
    fx_log.setLevel(logging.ERROR)
    try:
        return _run(quick)
    finally:
        fx_log.setLevel(level)


def _run(quick: bool) -> str:
    torch.manual_seed(0)
    scale, steps, batch = (0.002, 60, 256) if quick else (0.02, 300, 1024)
    tables = criteo_like_tables(scale=scale, dim=16)
    rows = sum(t.num_embeddings for t in tables)
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=13,
                 dense_arch_layer_sizes=[32, 16], over_arch_layer_sizes=[32, 1])
    # Frequencies from a sample of the stream (a different seed than training), as one would from a log.
    freq = collect_frequencies((kjt for _, kjt, _ in SyntheticCriteo(tables, batch_size=batch, batches=10, seed=1)),
                               tables, progress=False)
    cache = CacheConfig(capacity=0.015, policy="lfu", prefetch=1, optimizer=RowOptimizer(kind="adagrad", lr=0.05))
    model = swap_in(model, cache=cache, frequencies=freq)
    dense_opt = torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    print(f"DLRM, 26 Criteo-like tables, {rows:,} rows, 1.5% cached (lfu, fused Adagrad), {steps} steps of {batch}")
    start = time.perf_counter()
    losses = []
    data = SyntheticCriteo(tables, batch_size=batch, batches=steps, seed=0)
    for i, (dense, kjt, labels) in enumerate(prefetching(data, model)):
        dense_opt.zero_grad()
        loss = loss_fn(model(dense, kjt).squeeze(1), labels)
        loss.backward()
        dense_opt.step()
        losses.append(loss.item())
        if (i + 1) % max(1, steps // 4) == 0:
            s = model_cache_stats(model)
            print(f"  step {i + 1:4d}  loss {sum(losses[-10:]) / len(losses[-10:]):.4f}  hit rate {s['hit_rate']:.1%}  "
                  f"rows loaded/step {s['last_rows_loaded']:.0f}", flush=True)
    s = model_cache_stats(model)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    return (f"DLRM {rows:,} rows, 1.5% cached: loss {first:.3f} -> {last:.3f}, hit rate {s['hit_rate']:.1%} "
            f"in {time.perf_counter() - start:.1f} s")
