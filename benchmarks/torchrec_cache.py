"""Embedding cache: hit rate against cache size (vs Belady's optimum and a 32-way set-associative LRU),
and DLRM step time of the cached collection against TorchRec's plain ``EmbeddingBagCollection``.

    python -m benchmarks.torchrec_cache --quick

Hit rate counts each batch's unique ids (the cache's unit of work) and charges every row brought to
the device, on demand or by prefetch, and every row read from host memory instead (a spill) as a
miss: ``1 - (rows loaded + rows spilled) / lookups``, the same count Belady's optimum minimises. Two
traces: a stationary Zipf(1.05) one and a drifting one (the hot set moves every 5 batches). Every
contender starts from the hottest rows of frequency statistics collected on another sample:

* ``lfu`` / ``lru`` / ``static``: tightfit's cache itself (``CachedEmbeddingBagCollection``, one table).
* ``lfu+prefetch8``: the same with ``prefetching(loader, model, ahead=8)`` (lookahead eviction).
* ``belady``: the offline farthest-next-use rule (admit a miss only into the slot of a row used later,
  never evicting the batch's own rows) on the whole trace. With batches it is not exactly the optimum
  (the rows a batch hits are held for that batch, so equal next uses are not symmetric: an exhaustive
  search on small random traces finds better schedules in about 4% of them), so a cache that knows the
  next 8 batches can come out a hair above it.
* ``setassoc32``: LRU within 32-way sets chosen by a hash of the id, admitting a batch's rows together
  (a batch never evicts its own rows; rows that find no way are read from host), as FBGEMM's GPU cache.
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
import time
from collections import OrderedDict

import torch

from benchmarks.common import format_paired, interleave, paired, parser, plot_path, summarize, write_result

RATIOS = (0.005, 0.01, 0.015, 0.03, 0.05, 0.10)
QUICK_RATIOS = (0.005, 0.015, 0.05)
DRIFT_EVERY = 5  # batches between moves of the hot set in the drifting trace


def _trace(rows: int, batches: int, batch: int, seed: int, drift: bool = False) -> list[torch.Tensor]:
    from torchrec_cache.data import zipf_ids

    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(batches):
        ids = zipf_ids(batch, rows, generator=gen)
        if drift:  # the whole popularity ranking shifts by 1/40 of the table every DRIFT_EVERY batches
            ids = (ids + (t // DRIFT_EVERY) * (rows // 40)) % rows
        out.append(torch.unique(ids))
    return out


def _warm_set(rows: int, capacity: int, sample: list[torch.Tensor]) -> list[int]:
    counts = torch.bincount(torch.cat(sample), minlength=rows)
    return torch.topk(counts, capacity).indices.tolist()


def belady(trace: list[torch.Tensor], capacity: int, warm: list[int]) -> float:
    """Hit rate of the farthest-next-use rule on batched accesses (rows of the current batch stay), fully
    associative, at the same capacity and from the same warm set as the caches."""
    lists = [t.tolist() for t in trace]
    nxt: list[dict[int, float]] = [dict() for _ in lists]
    seen: dict[int, float] = {}
    for t in range(len(lists) - 1, -1, -1):
        for i in lists[t]:
            nxt[t][i] = seen.get(i, math.inf)
        for i in lists[t]:
            seen[i] = t
    resident: dict[int, float] = {}
    heap: list[tuple[float, int]] = []  # (-next use, id), lazily invalidated
    for i in warm[:capacity]:
        resident[i] = seen.get(i, math.inf)
        heapq.heappush(heap, (-resident[i], i))
    hits = total = 0
    for t, ids in enumerate(lists):
        current = set(ids)
        misses = [i for i in ids if i not in resident]
        hits += len(ids) - len(misses)
        total += len(ids)
        for i in ids:
            if i in resident:
                resident[i] = nxt[t][i]
                heapq.heappush(heap, (-resident[i], i))
        # Admit the misses used soonest again; evict the resident rows used latest (never this batch's).
        misses.sort(key=lambda i: nxt[t][i])
        kept: list[tuple[float, int]] = []
        for i in misses:
            if len(resident) >= capacity:
                while heap:
                    neg, j = heapq.heappop(heap)
                    if resident.get(j) != -neg:
                        continue
                    if j in current:
                        kept.append((neg, j))
                        continue
                    if -neg <= nxt[t][i]:  # the candidate is needed sooner than the miss: do not admit
                        kept.append((neg, j))
                        j = -1
                    break
                else:
                    j = -1
                if j < 0:
                    break
                del resident[j]
            resident[i] = nxt[t][i]
            heapq.heappush(heap, (-resident[i], i))
        for item in kept:
            heapq.heappush(heap, item)
    return hits / total


def set_associative_lru(trace: list[torch.Tensor], capacity: int, warm: list[int], ways: int = 32) -> float:
    """FBGEMM's layout: LRU inside 32-way sets; a batch's rows are admitted together (they evict older rows,
    never each other; a row whose set holds only rows of this batch is read from host memory)."""
    sets = max(1, capacity // ways)
    cache = [OrderedDict() for _ in range(sets)]
    for i in warm[: sets * ways]:
        s = cache[(i * 2654435761) % sets]
        if len(s) < ways:
            s[i] = True
    hits = total = 0
    for ids in trace:
        batch = ids.tolist()
        current = set(batch)
        misses = []
        for i in batch:
            s = cache[(i * 2654435761) % sets]
            total += 1
            if i in s:
                hits += 1
                s.move_to_end(i)  # this batch's hits are now the newest: never victims of its misses
            else:
                misses.append(i)
        for i in misses:
            s = cache[(i * 2654435761) % sets]
            if len(s) >= ways:
                oldest = next(iter(s))
                if oldest in current:
                    continue  # the set holds only this batch's rows: read from host this time
                s.popitem(last=False)
            s[i] = True
    return hits / total


def tightfit_policy(policy: str, rows: int, capacity: int, trace: list[torch.Tensor], sample: list[torch.Tensor],
                    ahead: int = 0) -> float:
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from torchrec_cache import CacheConfig, CachedEmbeddingBagCollection, FrequencyStats, prefetching

    cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=rows, feature_names=["f"])
    freq = FrequencyStats(counts={"t": torch.bincount(torch.cat(sample), minlength=rows)})
    ebc = CachedEmbeddingBagCollection(tables=[cfg], cache=CacheConfig(capacity=capacity, policy=policy),
                                       frequencies=freq)
    kjts = [KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(ids.numel(), dtype=torch.int64))
            for ids in trace]
    with torch.no_grad():
        for kjt in prefetching(kjts, ebc, ahead=ahead):
            ebc(kjt)
    s = ebc.cache_stats()
    return 1.0 - (s["rows_loaded"] + s["rows_spilled"]) / s["lookups"]


CONTENDERS = ("lfu", "lru", "static", "lfu+prefetch8", "belady", "setassoc32")


def hit_rates(rows: int, batches: int, batch: int, ratios: tuple[float, ...],
              drift: bool) -> dict[str, dict[str, float]]:
    trace = _trace(rows, batches, batch, seed=0, drift=drift)
    sample = _trace(rows, max(4, batches // 4), batch, seed=1)
    out: dict[str, dict[str, float]] = {}
    for ratio in ratios:
        cap = max(1, int(rows * ratio))
        warm = _warm_set(rows, cap, sample)
        row = {p: tightfit_policy(p, rows, cap, trace, sample) for p in ("lfu", "lru", "static")}
        row["lfu+prefetch8"] = tightfit_policy("lfu", rows, cap, trace, sample, ahead=8)
        row["belady"] = belady(trace, cap, warm)
        row["setassoc32"] = set_associative_lru(trace, cap, warm)
        out[f"{ratio:.3f}"] = row
        print(f"  {'drifting' if drift else 'stationary'} cache {ratio:.1%}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), file=sys.stderr, flush=True)
    return out


def step_times(scale: float, batch: int, steps: int, repeats: int) -> dict[str, object]:
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM

    from torchrec_cache import CacheConfig, RowOptimizer, swap_in
    from torchrec_cache.data import SyntheticCriteo, criteo_like_tables

    tables = criteo_like_tables(scale=scale, dim=16)
    # Fresh batches for every round (the warm-up's and each timed repeat's; both contenders see the same ones in a
    # round): no repeat replays the batches the cache was warmed on (``benchmarks/README.md``).
    rounds = [list(SyntheticCriteo(tables, batch_size=batch, batches=steps, seed=1000 + r)) for r in range(1 + repeats)]
    served: dict[int, int] = {}

    def dlrm() -> torch.nn.Module:
        torch.manual_seed(0)
        return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=13,
                    dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 1])

    # The peer: TorchRec's EmbeddingBagCollection with sparse gradients and SparseAdam, the same lazy
    # Adam the fused optimizer runs, so both do the same arithmetic per step.
    plain = dlrm()
    for bag in plain.sparse_arch.embedding_bag_collection.embedding_bags.values():
        bag.sparse = True
    emb = list(plain.sparse_arch.embedding_bag_collection.parameters())
    plain_opts = [torch.optim.SparseAdam(emb, lr=1e-3),
                  torch.optim.Adam([p for n, p in plain.named_parameters() if "embedding_bags" not in n], lr=1e-3)]
    cached = swap_in(dlrm(), cache=CacheConfig(capacity=0.015, policy="lfu", optimizer=RowOptimizer(kind="adam", lr=1e-3)))
    cached_opts = [torch.optim.Adam([p for p in cached.parameters() if p.requires_grad], lr=1e-3)]
    loss_fn = torch.nn.BCEWithLogitsLoss()

    from torchrec_cache.sync import SYNCS

    syncs: list[int] = []

    def run(model: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> float:
        times = []
        r = served[id(model)] = served.get(id(model), -1) + 1  # this contender's round: warm-up 0, then 1, 2 ...
        for dense, kjt, labels in rounds[r]:
            SYNCS.reset()
            start = time.perf_counter()
            for o in opts:
                o.zero_grad()
            loss_fn(model(dense, kjt).squeeze(1), labels).backward()
            for o in opts:
                o.step()
            times.append(time.perf_counter() - start)
            if model is cached:
                syncs.append(SYNCS.count)
        times.sort()
        return times[len(times) // 2]  # median step of this repeat

    samples = interleave({"ebc_sparse_adam": lambda: run(plain, plain_opts),
                          "cached_1.5pct_fused_adam": lambda: run(cached, cached_opts)}, repeats=repeats)
    from torchrec_cache import model_cache_stats

    return {"rows": sum(t.num_embeddings for t in tables), "batch": batch, "steps_per_repeat": steps,
            "samples": samples, "summary": {k: summarize(v) for k, v in samples.items()},
            # cached / plain step time, paired per repeat (both ran the repeat's batches): lower is better
            "ratio": paired(samples["cached_1.5pct_fused_adam"], samples["ebc_sparse_adam"], higher_is_better=False),
            "hit_rate": model_cache_stats(cached)["hit_rate"], "syncs_per_step": sum(syncs) / max(1, len(syncs))}


def plot(rates: dict[str, dict[str, dict[str, float]]]) -> object:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    styles = {"belady": "k--", "lfu+prefetch8": "D-", "static": "o-", "lfu": "s-", "lru": "^-", "setassoc32": "x:"}
    for ax, (trace, table) in zip(axes, rates.items()):
        xs = [float(r) * 100 for r in table]
        for name, style in styles.items():
            ax.plot(xs, [table[r][name] for r in table], style, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("cache size (% of rows)")
        ax.set_title(f"{trace} Zipf(1.05) trace")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("hit rate: 1 - (loaded + spilled) / lookups")
    axes[0].legend()
    path = plot_path("torchrec_cache", "hit_rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _table(rates: dict[str, dict[str, float]]) -> str:
    lines = ["| cache | lfu | lru | static | lfu + prefetch 8 | Belady (farthest next use) | prefetch / Belady | "
             "32-way set-assoc. LRU |", "|---|---|---|---|---|---|---|---|"]
    for r, row in rates.items():
        lines.append(f"| {float(r):.1%} | {row['lfu']:.3f} | {row['lru']:.3f} | {row['static']:.3f} | "
                     f"{row['lfu+prefetch8']:.3f} | {row['belady']:.3f} | "
                     f"{row['lfu+prefetch8'] / row['belady']:.2f} | {row['setassoc32']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None, help="rows of the hit-rate table")
    args = p.parse_args(argv)
    logging.getLogger("torchrec_cache").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    batches, batch = (40, 4096) if args.quick else (200, 16384)
    ratios = QUICK_RATIOS if args.quick else RATIOS
    repeats = args.repeats or (5 if args.quick else 9)
    print(f"hit rate: {rows:,} rows, {batches} batches of {batch} ids", file=sys.stderr, flush=True)
    rates = {"stationary": hit_rates(rows, batches, batch, ratios, drift=False),
             "drifting": hit_rates(rows, batches, batch, ratios, drift=True)}
    scale, steps = (0.005, 6) if args.quick else (0.05, 20)
    print(f"step time: DLRM, Criteo-like tables at scale {scale}, interleaved", file=sys.stderr, flush=True)
    steps_result = step_times(scale, batch=1024, steps=steps, repeats=repeats)
    png = plot(rates)
    s = steps_result["summary"]
    md = (f"Hit rate over {batches} batches of {batch} Zipf(1.05) ids on a {rows:,}-row table (unique ids per batch; a "
          "row loaded on demand or by prefetch, or read from host memory, is a miss; all contenders start from the "
          "same warm set). Stationary trace:\n\n" + _table(rates["stationary"]) +
          f"\n\nDrifting trace (the hot set moves by 1/40 of the table every {DRIFT_EVERY} batches):\n\n"
          + _table(rates["drifting"]) +
          f"\n\nDLRM step time, 26 Criteo-like tables ({steps_result['rows']:,} rows, dim 16), batch 1024, "
          f"interleaved, median of {repeats} repeats (each the median of {steps} steps, fresh batches every repeat, "
          "the same for both): cached (1.5% of the "
          f"collection's rows, fused lazy Adam) {s['cached_1.5pct_fused_adam']['median'] * 1e3:.1f} ms "
          f"[{s['cached_1.5pct_fused_adam']['min'] * 1e3:.1f}-{s['cached_1.5pct_fused_adam']['max'] * 1e3:.1f}] vs "
          f"TorchRec EBC + SparseAdam {s['ebc_sparse_adam']['median'] * 1e3:.1f} ms "
          f"[{s['ebc_sparse_adam']['min'] * 1e3:.1f}-{s['ebc_sparse_adam']['max'] * 1e3:.1f}]: "
          f"cached / plain **{format_paired(steps_result['ratio'])}** (paired per repeat: the median ratio, the "
          f"repeats the cache was faster, the range), hit rate {steps_result['hit_rate']:.1%}, "
          f"{steps_result['syncs_per_step']:.1f} device-to-host reads per step. On a CPU host and device are the "
          "same memory, so this is the cache's bookkeeping cost; the gain is on a GPU "
          "(benchmarks/gpu/torchrec_cache.py).")
    write_result("torchrec_cache", title="Embedding cache (torchrec_cache)",
                 params={"rows": rows, "batches": batches, "batch": batch, "ratios": ratios, "quick": args.quick,
                         "dlrm_scale": scale, "repeats": repeats, "drift_every": DRIFT_EVERY},
                 results={"hit_rate": rates, "step_time": steps_result}, markdown=md, plots=[png])
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
