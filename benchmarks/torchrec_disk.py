"""Embedding tables larger than memory: DLRM with its 26 Criteo-like tables on disk under a hard memory limit.

    python -m benchmarks.torchrec_disk [--quick]

Three contenders train the same DLRM (26 tables of Criteo Kaggle's cardinalities, dim 16, fused / sparse
Adagrad) on the same Zipf(1.05) batches, each in its own process (the tables do not fit twice in this
machine's memory beside the other sessions, so repeats interleave inside a process, not across them):

* ``disk``: ``CacheConfig(capacity=0.005, host_budget=limit / 6, disk_dir=...)``, ``prefetching(ahead=4)``, under
  a cgroup v1 memory limit (``benchmarks/memlimit.py``) of a quarter of the tables' bytes;
* ``ram_cached``: the same cache with the tables in host memory (no limit), ``prefetching(ahead=4)``;
* ``ebc``: TorchRec's ``EmbeddingBagCollection`` (sparse gradients, ``torch.optim.Adagrad``), no limit.

Every timed repeat trains on fresh batches (a new seed; none of the warm-up's), repeat ``r`` on the same batches in
every contender. Per repeat: the median step; the step-time ratios pair repeat ``r`` of one contender with repeat
``r`` of the other (the same batches, though not interleaved in time: ``benchmarks/README.md``).
Exact: the per-step losses of the first repeat agree across the three. The host level's hit rate (the
device and host levels together: rows served without a disk read, over the batch's unique rows) is set
against Belady's farthest-next-use rule at the same capacity (device slots + host rows) on the same trace.

In the run above the two levels hold more rows than the batches touch, so every policy only pays the cold
misses and that comparison cannot tell policies apart. A fourth run, ``disk_evicting``, makes it
meaningful: the same model and limit with a host level of ``EVICT_HOST_BYTES`` (a few percent of the rows
the batches touch), so both levels evict and write back dirty rows; its hit rate (with lookahead) is set
against Belady at its capacity on its own trace, and its losses against the other runs' first steps (every run
warms up on the same batches from the same weights).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks._child_sources import collect, tag
from benchmarks.common import format_paired, paired, parser, summarize, write_result
from benchmarks.memlimit import run_limited

NAME = "torchrec_disk"
# 0.5% of the rows on the device and a sixth of the limit for host rows: the run's ~60 batches touch fewer rows
# than the two levels hold, so what is measured is the cold misses' disk reads and the lookahead, not
# write-back. Smaller levels (0.2% and 4 MiB, 0.1% and 16 MiB), which would evict from both, ran past the
# child's timeout (480 s, 600 s): every evicted row then costs a read-patch-write of a 16 KiB extent.
BATCH, AHEAD, LR, CAPACITY = 512, 4, 0.05, 0.005
# The evicting run: 0.05% of the rows on the device (16K slots) and 2 MiB of host rows (16K rows of 128 bytes):
# the 30 batches touch ~100K distinct rows, so both levels evict; 1 timed repeat of 15 batches (each evicted
# dirty row costs a read-patch-write of its 16 KiB extent, behind the step).
EVICT_HOST_BYTES, EVICT_CAPACITY, EVICT_STEPS, EVICT_REPEATS = 2 * 2**20, 0.0005, 15, 1


def _tables(scale: float) -> list:
    from torchrec import EmbeddingBagConfig

    from torchrec_cache.data import criteo_like_tables

    # A constant per table: the three contenders start from the same weights without copying 4 GB between them.
    return [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                               feature_names=t.feature_names,
                               init_fn=partial(torch.nn.init.constant_, val=0.01 * (1 + i % 7)))
            for i, t in enumerate(criteo_like_tables(scale=scale, dim=16))]


def _model(kind: str, scale: float, disk_dir: str | None, host_budget: int,
           capacity: float = CAPACITY) -> tuple[torch.nn.Module, list]:
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM

    from torchrec_cache import CacheConfig, CachedEmbeddingBagCollection, RowOptimizer

    torch.manual_seed(0)
    tables = _tables(scale)
    if kind == "ebc":
        ebc = EmbeddingBagCollection(tables=tables)
        for bag in ebc.embedding_bags.values():
            bag.sparse = True
    else:
        cache = CacheConfig(capacity=capacity, optimizer=RowOptimizer(kind="adagrad", lr=LR), prefetch=AHEAD,
                            disk_dir=disk_dir, host_budget=host_budget if disk_dir else None)
        ebc = CachedEmbeddingBagCollection(tables=tables, cache=cache)  # type: ignore[assignment]
    torch.manual_seed(0)  # EmbeddingBagCollection drew random weights before init_fn: the dense layers start equal
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[64, 16],
                 over_arch_layer_sizes=[64, 1])
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n and p.requires_grad]
    opts: list = [torch.optim.Adagrad(dense, lr=LR)]
    if kind == "ebc":
        opts.append(torch.optim.Adagrad(list(ebc.parameters()), lr=LR))
    return model, opts


def child(kind: str, scale: float, disk_dir: str | None, host_budget: int, steps: int, repeats: int,
          trace_file: str | None, capacity: float = CAPACITY) -> dict:
    """One contender: build, warm up, ``repeats`` timed repeats of ``steps`` fresh batches; one JSON line out."""
    from torchrec_cache import model_cache_stats, prefetching
    from torchrec_cache.data import SyntheticCriteo

    t0 = time.perf_counter()
    model, opts = _model(kind, scale, disk_dir, host_budget, capacity)
    build = time.perf_counter() - t0
    built = _stats(model) if kind != "ebc" else {}
    warm = torch.empty(0, dtype=torch.int64)
    if kind != "ebc":  # what the cache holds before the first batch (tables small enough to be wholly cached)
        keys = model.sparse_arch.embedding_bag_collection.fused_cache.slot_key  # type: ignore[union-attr]
        warm = keys[keys >= 0].clone()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    tables = _tables(scale)
    starts = torch.tensor([0] + [t.num_embeddings for t in tables]).cumsum(0)[:-1]
    trace: list[torch.Tensor] = []
    medians, losses, first_stats = [], [], None
    for r in range(repeats + 1):  # repeat 0 warms up, on batches of its own seed
        data = list(SyntheticCriteo(tables, batch_size=BATCH, batches=steps, seed=1000 + r))
        loader = prefetching(data, model) if kind != "ebc" else data
        times = []
        start = time.perf_counter()
        for dense, kjt, labels in loader:  # a step's time includes waiting for the lookahead's next batch
            for o in opts:
                o.zero_grad()
            loss = loss_fn(model(dense, kjt).squeeze(1), labels)
            loss.backward()
            for o in opts:
                o.step()
            times.append(time.perf_counter() - start)
            if r == 0:
                losses.append(float(loss.detach()))
            if trace_file is not None:
                keys = kjt.values() + torch.repeat_interleave(starts, torch.tensor(kjt.length_per_key()))
                trace.append(torch.unique(keys))
            start = time.perf_counter()  # the bookkeeping above is not the step's
        times.sort()
        if r > 0:
            medians.append(times[len(times) // 2])
        if r == 0 and kind != "ebc":
            first_stats = _stats(model)
    out: dict = {"kind": kind, "build_seconds": build, "medians": medians, "losses": losses}
    if kind != "ebc":
        out["cache"] = model_cache_stats(model)
        out["disk"] = {k: v - built.get(k, 0) if k not in ("host_rows", "host_capacity") else v
                       for k, v in _stats(model).items()}  # training only: the tables' first write is not counted
        out["build_disk"] = built
        out["warmup_disk"] = first_stats
        emb = model.sparse_arch.embedding_bag_collection  # type: ignore[union-attr]
        out["device_slots"] = emb.fused_cache.num_slots
    if trace_file is not None:
        torch.save({"trace": trace, "warm": warm}, trace_file)
    return out


def _stats(model: torch.nn.Module) -> dict:
    return dict(model.sparse_arch.embedding_bag_collection.disk_stats())  # type: ignore[union-attr, operator]


def _run_child(kind: str, args: list[str], limit: int | None, timeout: float) -> dict:
    cmd = [sys.executable, "-m", f"benchmarks.{NAME}", "--child", kind, *args]
    if limit is None:
        import subprocess

        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        res = {"returncode": proc.returncode, "enforced": False, "peak_bytes": None, "oom_killed": False,
               "wall_seconds": time.perf_counter() - start, "stderr_tail": proc.stderr[-2000:]}
        stdout = proc.stdout
    else:
        run = run_limited(cmd, limit, name=f"cache-disk-{kind}", timeout=timeout)
        res, stdout = run.summary(), run.stdout
    if res["returncode"] != 0:
        print(res.get("stderr_tail", ""), file=sys.stderr)
        return {"run": res}
    from benchmarks.memlimit import last_json_line

    out = last_json_line(stdout)
    out["run"] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or NAME)
    p.add_argument("--child", default=None)
    p.add_argument("--scale", type=float, default=None)
    p.add_argument("--disk-dir", default="/tmp/cache-disk/bench")
    p.add_argument("--host-budget", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--trace", default=None)
    p.add_argument("--capacity", type=float, default=CAPACITY)
    p.add_argument("--limit", type=int, default=None, help="memory limit in bytes (default: a quarter of the tables)")
    args = p.parse_args(argv)
    steps = args.steps or (10 if args.quick else 20)
    repeats = args.repeats or (2 if args.quick else 4)
    # 0.95 of Criteo's rows: 4.1 GB with state, which the store holds in 16 KiB extents (a missed row reads one).
    scale = args.scale or (0.8 if args.quick else 0.95)
    if args.child is not None:
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(tag(child(args.child, scale, args.disk_dir if args.child == "disk" else None,
                                   args.host_budget or 0, steps, repeats, args.trace, args.capacity))))
        return 0
    from benchmarks.torchrec_cache import belady

    tables = _tables(scale)
    table_bytes = sum(t.num_embeddings * t.embedding_dim * 4 * 2 for t in tables)  # weights + Adagrad state
    limit = args.limit or table_bytes // 4
    host_budget = args.host_budget or limit // 6
    base = Path(args.disk_dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    trace_file = str(base / "trace.pt")
    common = ["--scale", str(scale), "--steps", str(steps), "--repeats", str(repeats)]
    print(f"{NAME}: {len(tables)} tables, {table_bytes / 2**30:.2f} GiB with state, limit {limit / 2**30:.2f} GiB",
          file=sys.stderr, flush=True)
    results = {}
    (base / "tier").mkdir()
    results["disk"] = _run_child("disk", common + ["--disk-dir", str(base / "tier"), "--host-budget",
                                                   str(host_budget), "--trace", trace_file], limit, 480)
    results["ram_cached"] = _run_child("ram_cached", common, None, 600)
    results["ebc"] = _run_child("ebc", common, None, 600)
    shutil.rmtree(base / "tier", ignore_errors=True)
    (base / "tier").mkdir()
    evict_trace = str(base / "trace_evicting.pt")
    results["disk_evicting"] = _run_child(
        "disk", ["--scale", str(scale), "--steps", str(EVICT_STEPS), "--repeats", str(EVICT_REPEATS),
                 "--disk-dir", str(base / "tier"), "--host-budget", str(EVICT_HOST_BYTES), "--trace", evict_trace,
                 "--capacity", str(EVICT_CAPACITY)],
        limit, 480)
    ok = all("medians" in r for r in results.values())
    summary: dict = {}
    if ok:
        t = time.perf_counter()
        saved = torch.load(trace_file)
        d = results["disk"]["disk"]
        capacity = results["disk"]["device_slots"] + d["host_capacity"]
        # Belady starts from what the cache starts with (the wholly cached small tables), at the same capacity.
        summary["belady"] = belady(saved["trace"], capacity, saved["warm"].tolist())
        summary["belady_seconds"] = time.perf_counter() - t
        lookups = results["disk"]["cache"]["lookups"]
        from_disk = d["host_misses"] + d["rows_staged"]
        summary["hierarchy_hit_rate"] = 1 - from_disk / lookups
        summary["vs_belady"] = summary["hierarchy_hit_rate"] / summary["belady"]
        summary["evicting"] = _versus_belady(results["disk_evicting"], evict_trace, belady)
        summary["evicting"].update(_evicting_exact(results))
        med = {k: summarize(r["medians"]) for k, r in results.items()}
        summary["step"] = med
        # disk / peer step time, repeat by repeat (lower is better)
        summary["ratio_vs_ram_cached"] = paired(results["disk"]["medians"], results["ram_cached"]["medians"],
                                                higher_is_better=False)
        summary["ratio_vs_ebc"] = paired(results["disk"]["medians"], results["ebc"]["medians"], higher_is_better=False)
        la, lb, lc = (torch.tensor(results[k]["losses"]) for k in ("disk", "ram_cached", "ebc"))
        summary["loss_diff_vs_ram_cached"] = float((la - lb).abs().max())
        summary["loss_diff_vs_ebc"] = float((la - lc).abs().max())
        summary["read_GBps"] = d["bytes_read"] / max(1, d["read_ns"]) if d["read_ns"] else 0.0
    shutil.rmtree(base, ignore_errors=True)
    params = {"capacity": CAPACITY, "scale": scale, "tables": len(tables), "rows": sum(t.num_embeddings for t in tables), "dim": 16,
              "table_bytes": table_bytes, "limit_bytes": limit, "host_budget": host_budget, "batch": BATCH,
              "steps_per_repeat": steps, "repeats": repeats, "ahead": AHEAD, "quick": args.quick,
              "disk_dir_fs": os.popen(f"df -T {base.parent} | tail -1").read().split()[1:2]}
    md = _markdown(params, results, summary) if ok else f"a contender failed: {json.dumps({k: r.get('run') for k, r in results.items()})}"
    write_result(NAME, title="Embedding tables larger than memory: DLRM with its tables on disk",
                 params=params, results={"contenders": results, "summary": summary}, markdown=md,
                 measures=collect(([r] for r in results.values()), fallback=("core", "plugins")))
    print(md)
    return 0 if ok else 1


def _versus_belady(res: dict, trace_file: str, belady: object) -> dict:
    """The hierarchy's hit rate without a disk read against Belady at the same capacity on the run's own trace."""
    saved = torch.load(trace_file)
    d = res["disk"]
    capacity = res["device_slots"] + d["host_capacity"]
    distinct = int(torch.unique(torch.cat(saved["trace"])).numel())
    opt = belady(saved["trace"], capacity, saved["warm"].tolist())  # type: ignore[operator]
    rate = 1 - (d["host_misses"] + d["rows_staged"]) / res["cache"]["lookups"]
    return {"capacity": capacity, "distinct_rows": distinct, "belady": opt, "hierarchy_hit_rate": rate,
            "vs_belady": rate / opt, "step": summarize(res["medians"]), "rows_written": d["rows_written"],
            "rows_read": d["rows_read"], "peak_bytes": res["run"]["peak_bytes"], "killed": res["run"]["oom_killed"]}


def _evicting_exact(results: dict) -> dict:
    """The evicting run's losses against the first steps of the RAM-cached and EBC runs.

    Every run warms up on the batches of the same seed, and the stream's first batches do not depend on its length,
    so the evicting run's warm-up steps are the other runs' first steps, from the same weights.
    """
    losses = {k: torch.tensor(results[k]["losses"]) for k in ("disk_evicting", "ram_cached", "ebc")}
    n = min(len(v) for v in losses.values())
    ev = losses["disk_evicting"][:n]
    out: dict = {"exact_steps": n}
    for peer in ("ram_cached", "ebc"):
        out[f"loss_diff_vs_{peer}"] = float((ev - losses[peer][:n]).abs().max()) if n else float("nan")
    return out


def _markdown(params: dict, results: dict, s: dict) -> str:
    run = results["disk"]["run"]
    d = results["disk"]["disk"]
    st = s["step"]
    ev = s["evicting"]

    def ms(k: str) -> str:
        return f"{st[k]['median'] * 1e3:.1f} ms [{st[k]['min'] * 1e3:.1f}-{st[k]['max'] * 1e3:.1f}]"

    lines = [
        f"DLRM, {params['tables']} Criteo-like tables ({params['rows']:,} rows, dim 16, Adagrad state: "
        f"{params['table_bytes'] / 2**30:.2f} GiB), batch {params['batch']}, Zipf(1.05) ids, "
        f"{params['repeats']} timed repeats of {params['steps_per_repeat']} fresh batches each (median step per "
        "repeat; median [min-max] over repeats).",
        "",
        "| contender | memory limit | peak memory | killed | step |",
        "|---|---|---|---|---|",
        f"| tables on disk, host level {params['host_budget'] / 2**20:.0f} MiB, device cache {CAPACITY:.1%}, lookahead "
        f"{params['ahead']} | {params['limit_bytes'] / 2**30:.2f} GiB (cgroup v1{'' if run['enforced'] else ', NOT enforced'}) | "
        f"{(run['peak_bytes'] or 0) / 2**30:.2f} GiB | {'yes' if run['oom_killed'] else 'no'} | {ms('disk')} |",
        f"| same cache, tables in RAM, lookahead {params['ahead']} | none | - | - | {ms('ram_cached')} |",
        f"| TorchRec EmbeddingBagCollection (sparse grads, Adagrad), in RAM | none | - | - | {ms('ebc')} |",
        "",
        f"- step time, paired by repeat (the median ratio, the repeats disk was faster, the range): disk / "
        f"all-in-RAM cached = **{format_paired(s['ratio_vs_ram_cached'])}** (target: a median <= 1.5x), "
        f"disk / plain EBC = {format_paired(s['ratio_vs_ebc'])}.",
        f"- exact: largest per-step loss difference over the first repeat, disk vs RAM cached "
        f"{s['loss_diff_vs_ram_cached']:.2e}, vs plain EBC {s['loss_diff_vs_ebc']:.2e}.",
        f"- hit rate without a disk read (device + host levels, {results['disk']['device_slots']:,} + "
        f"{d['host_capacity']:,} rows): {s['hierarchy_hit_rate']:.3f}; Belady at the same capacity on the same "
        f"trace {s['belady']:.3f} ({s['vs_belady']:.2f}x; the levels hold more rows than the run touches, so "
        "this only counts cold misses).",
        f"- evicting run (device cache {EVICT_CAPACITY:.2%}, host level {EVICT_HOST_BYTES / 2**20:.0f} MiB = {ev['capacity'] - results['disk_evicting']['device_slots']:,} "
        f"rows, {ev['capacity']:,} rows in both levels for {ev['distinct_rows']:,} distinct rows touched, lookahead "
        f"{params['ahead']}, same limit: peak {(ev['peak_bytes'] or 0) / 2**30:.2f} GiB, "
        f"{'killed' if ev['killed'] else 'not killed'}): hit rate without a disk read {ev['hierarchy_hit_rate']:.3f}, "
        f"Belady at the same capacity on its trace {ev['belady']:.3f}: **{ev['vs_belady']:.2f}x** (target >= 0.9x); "
        f"step {ev['step']['median'] * 1e3:.0f} ms, {ev['rows_written']:,} rows written back; exact: largest loss "
        f"difference over its first {ev['exact_steps']} steps vs RAM cached {ev['loss_diff_vs_ram_cached']:.2e}, "
        f"vs plain EBC {ev['loss_diff_vs_ebc']:.2e}.",
        f"- disk: {d['rows_read']:,} rows read ({d['bytes_read'] / 2**30:.2f} GiB in {d['disk_reads']:,} requests, "
        f"{s['read_GBps']:.2f} GB/s while reading), {d['rows_written']:,} rows written "
        f"({d['bytes_written'] / 2**30:.2f} GiB in {d['disk_writes']:,} requests); rows read ahead by the window: "
        f"{d['rows_staged']:,}, used from there: {d['staged_hits']:,}.",
        f"- build: disk {results['disk']['build_seconds']:.0f} s (tables written), RAM cached "
        f"{results['ram_cached']['build_seconds']:.0f} s, EBC {results['ebc']['build_seconds']:.0f} s.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
