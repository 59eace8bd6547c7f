"""Train TorchRec's DLRM on synthetic Criteo-like data with 1.5% of the embedding rows cached.

    python examples/torchrec_cache/train_dlrm.py                    # scale 0.01: 338K rows, 100 steps
    python examples/torchrec_cache/train_dlrm.py --scale 1          # Criteo Kaggle's 33.8M rows (~2.2 GB at dim 16)
    python examples/torchrec_cache/train_dlrm.py --device cuda      # the cache on the GPU, tables in pinned host memory
    python examples/torchrec_cache/train_dlrm.py --scale 0.001 --steps 10 --batch-size 128   # seconds (the tests)

Nothing is downloaded: 26 sparse features with Criteo Kaggle's cardinalities (times --scale), ids
from a Zipf-like law, 13 dense features and a learnable click label (plugins/torchrec_cache/data.py).
The script collects frequency statistics on a separate sample, swaps the cache into the model,
trains with the fused row-wise optimizer, and prints loss and hit rate as it goes. Outputs in ``--out``
(default ``runs/torchrec_dlrm``): ``frequencies.safetensors`` (the statistics, ``FrequencyStats.load`` reads
them back), ``model.pt`` (the trained model's ``state_dict``, the same keys as the plain TorchRec model) and
``summary.json`` (losses, hit rate, traffic).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

print("[train_dlrm] importing PyTorch ...", flush=True)  # each takes seconds to import: say so first
import torch

print("[train_dlrm] importing TorchRec ...", flush=True)
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM

from torchrec_cache import (
    CacheConfig,
    RowOptimizer,
    collect_frequencies,
    model_cache_stats,
    prefetching,
    swap_in,
)
from torchrec_cache.data import SyntheticCriteo, criteo_like_tables


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=0.01, help="fraction of Criteo Kaggle's table sizes (1 = full)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cache", type=float, default=0.015, help="fraction of the collection's rows on the device")
    p.add_argument("--policy", choices=("lfu", "lru", "static"), default="lfu")
    p.add_argument("--optimizer", choices=("sgd", "adagrad", "rowwise_adagrad", "adam"), default="rowwise_adagrad")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--stats-batches", type=int, default=20, help="batches counted for the frequency statistics")
    p.add_argument("--prefetch", type=int, default=1, help="batches whose rows are loaded ahead")
    p.add_argument("--device", default="cpu", help="where the cache lives (cpu or cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/torchrec_dlrm", help="frequencies, weights and summary (default %(default)s)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    tables = criteo_like_tables(scale=args.scale, dim=args.dim)
    rows = sum(t.num_embeddings for t in tables)
    print(f"26 tables, {rows:,} rows x {args.dim} = {rows * args.dim * 4 / 2**30:.2f} GiB of fp32 weights in host memory")
    t0 = time.perf_counter()
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=13,
                 dense_arch_layer_sizes=[128, args.dim], over_arch_layer_sizes=[128, 64, 1])
    print(f"built DLRM in {time.perf_counter() - t0:.1f} s")

    # 1. Frequency statistics from a sample of the data (another seed: what a log of yesterday would give).
    sample = (kjt for _, kjt, _ in SyntheticCriteo(tables, batch_size=args.batch_size, batches=args.stats_batches,
                                                   seed=args.seed + 1))
    freq = collect_frequencies(sample, tables)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    freq.save(out / "frequencies.safetensors")

    # 2. The swap: every EmbeddingBagCollection becomes a cached one holding the same weights.
    cache = CacheConfig(capacity=args.cache, policy=args.policy, prefetch=args.prefetch,
                        optimizer=RowOptimizer(kind=args.optimizer, lr=args.lr))
    t0 = time.perf_counter()
    model = swap_in(model, cache=cache, frequencies=freq, device=device)
    model.to(device)  # the dense layers and the cache; the full tables stay in host memory
    print(f"swapped in the cache ({args.cache:.1%} of rows, {args.policy}, fused {args.optimizer}) "
          f"in {time.perf_counter() - t0:.1f} s")

    # 3. Train: a standard optimizer for the dense layers, the fused one for the rows (inside backward).
    dense_opt = torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = SyntheticCriteo(tables, batch_size=args.batch_size, batches=args.steps, seed=args.seed)
    losses: list[float] = []
    t0 = last_print = time.perf_counter()
    for step, (dense, kjt, labels) in enumerate(prefetching(data, model), start=1):
        dense, kjt, labels = dense.to(device), kjt.to(device), labels.to(device)
        dense_opt.zero_grad()
        loss = loss_fn(model(dense, kjt).squeeze(1), labels)
        loss.backward()
        dense_opt.step()
        losses.append(loss.item())
        now = time.perf_counter()
        # The first step, then at least every 3 s (and every tenth of the run), so a slow machine still talks.
        if step == 1 or now - last_print >= 3.0 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            last_print = now
            s = model_cache_stats(model)
            recent = losses[-20:]
            print(f"step {step:5d}  loss {sum(recent) / len(recent):.4f}  hit rate {s['hit_rate']:.1%} "
                  f"(last step {s['last_hit_rate']:.1%})  rows in {s['last_rows_loaded']:.0f} "
                  f"out {s['last_rows_written_back']:.0f}  from host {s['last_rows_spilled']:.0f}  "
                  f"{(time.perf_counter() - t0) / step * 1e3:.0f} ms/step", flush=True)
    s = model_cache_stats(model)
    first = sum(losses[:20]) / min(20, len(losses))
    last = sum(losses[-20:]) / min(20, len(losses))
    torch.save(model.state_dict(), out / "model.pt")  # the rows the cache still holds are flushed into it
    summary = {"losses": losses, "seconds": time.perf_counter() - t0, "tables": len(tables), "rows": rows,
               "cache": args.cache, "policy": args.policy, "optimizer": args.optimizer,
               "stats": {k: float(v) for k, v in s.items() if isinstance(v, (int, float))}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"done: loss {first:.4f} -> {last:.4f}, hit rate {s['hit_rate']:.1%}, "
          f"{s['bytes_to_device'] / 2**20:.1f} MiB to the cache, {s['bytes_to_host'] / 2**20:.1f} MiB back")
    print(f"artifacts in {out}/: frequencies.safetensors, model.pt (state_dict), summary.json")


if __name__ == "__main__":
    main()
