"""Predicted vs measured: the Elixir cost model against real FSDP2 / DDP steps on 2 CPU gloo ranks.

For two GPT-2-shaped models (tightfit.models) and a Hugging Face causal LM, two gloo ranks (1 thread each) calibrate the cost model
(``profile_device`` + ``calibrate_device``: collective latency+bandwidth, FSDP2 per-unit overhead,
comm/compute overlap) and time every distinct block (``time_blocks``), then price seven contenders
with the Elixir cost model and run each: DDP (priced as one replicated unit: one bucketed
all-reduce), FSDP2 full shard, FSDP2 no-reshard (``reshard_after_forward=False``), FSDP2 + CPU
offload (the three as one unit per block, ``baseline()``), Elixir's plan under a budget of 60% of
DDP's predicted peak, and two other plans from the Pareto frontier (mixed where the frontier has
them). FSDP2 contenders are executed with ``apply_plan`` from the very plan that was priced.

Timing: rounds alternate A B C ... after a warm-up round; each repeat times ``steps`` steps between
barriers; the median is reported. The time is the wall time per step of the slower rank, what a user waits; blocks, collectives and overheads are calibrated on the same clock (``clock="wall"``, the
strategies' default), and each rank's process CPU time sits beside it as a diagnostic. The third model is a
Hugging Face ``LlamaForCausalLM`` (GQA) in a plain LightningModule, profiled and block-timed with the
strategy's own ``profile_module`` / ``time_module_blocks`` on a fresh cache, as ``Trainer(strategy="elixir")``
does on a first run. Memory: resident state plus the
highest the step's allocations rise (torch.profiler allocator events), against the predicted device
peak (on a CPU the host *is* the device: the calibrated profile says ``unified_memory`` and the model counts
offloaded state in the device peak). DDP is priced as one replicated unit without FSDP2's measured
overheads (it runs plain tensors). Blocks are re-timed and the device re-calibrated in the run
(``refresh=True``), so the prediction sees the load the steps see. The plans are priced with a 0%
fragmentation margin: glibc's allocator has no caching-allocator blocks to fragment; the default
10% is for CUDA.

Reported: per contender the errors; Spearman's rank correlation between predicted and measured
step times; whether Elixir's pick is within 5% of the measured-fastest contender that fits the
budget (fits: predicted device peak <= budget, what the planner guarantees). Targets:
every step time within 20%, rank correlation >= 0.8, pick within 5%, peak within 10% and never
under-predicted by more than 5%. Also compared: the uncalibrated model (FLOPs / rate, bandwidth-only
collectives) on the same contenders, to show what calibration buys.

The same table for Sky's planner (even / balanced / parameter-balanced on 2 ranks, one slowed 3x):
``benchmarks/sky_train.py`` (``results/sky_train.json``), which shares :func:`spearman` from here.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    format_paired,
    interleave,
    measure_peak,
    paired,
    parser,
    plot_path,
    run_two_ranks,
    write_result,
)

NAME = "cost_model"
SIZES: dict[str, dict] = {"small": dict(hidden=128, layers=4), "medium": dict(hidden=256, layers=6),
                          # The kind of model users bring: a Hugging Face causal LM (GQA) in a LightningModule,
                          # profiled and block-timed the way ElixirStrategy does by default (profile_module,
                          # time_module_blocks on a first run).
                          "hf-llama": dict(hf=True, hidden=256, layers=4, heads=8, kv_heads=2, intermediate=688)}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va > 0 and vb > 0 else 0.0


def _pick_others(frontier, chosen, budget):
    """Two frontier plans other than the pick: prefer mixed ones, spread in memory (one under, one over budget)."""
    others = [p for p in frontier if [(u.blocks, u.mode, u.offload, u.checkpoint) for u in p.units]
              != [(u.blocks, u.mode, u.offload, u.checkpoint) for u in chosen.units]]
    mixed = [p for p in others if p.variety > 0] or others
    under = [p for p in mixed if p.peak_bytes <= budget]
    over = [p for p in mixed if p.peak_bytes > budget]
    out = []
    if under:
        out.append(under[len(under) // 2])
    if over:
        out.append(over[len(over) // 3])
    for p in mixed:
        if len(out) >= 2:
            break
        if p not in out:
            out.append(p)
    return out[:2]


def _rank(rank: int, world: int, port: int, quick: bool, repeats: int, out: str, device_type: str = "cpu",
          sizes: dict | None = None) -> None:
    """One rank. ``device_type="cuda"`` (benchmarks/gpu/cost_model.py): NCCL, wall clock with CUDA
    synchronisation, ``max_memory_allocated`` peaks; ``"cpu"``: gloo, wall clock (process CPU time recorded beside
    it as a diagnostic), profiler peaks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import dataclasses

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_elixir.apply import apply_plan
    from tightfit.models import GPTConfig, build_gpt
    from tightfit.planner.elixir import ElixirConstraints, UnitPlan, baseline, estimate, frontier, search
    from tightfit.planner.errors import PlanInfeasibleError
    from tightfit.profiler import calibrate_device, profile_device, profile_model, time_blocks
    from tightfit.profiler.types import ClusterSpec

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    clock = "wall"  # what a user waits; calibrated on the clock the steps are measured on
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    say = (lambda m: print(f"[cost_model] {m}", file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    from tightfit.distributed import decide_on_rank0
    from tightfit.profiler.types import DeviceProfile, ModelProfile

    # Every rank must plan from the same numbers: rank 0's device profile for all.
    measured = profile_device(dev, quick=True, progress=rank == 0)  # every rank: collectives measured together
    raw_device = decide_on_rank0(lambda: measured, encode=lambda d: d.to_json(), decode=DeviceProfile.from_json)
    # refresh=True: the collectives and FSDP2 overheads measured now, under the load the steps see (a cached
    # calibration comes from another time and another load on this shared host).
    device = calibrate_device(raw_device, device=dev, quick=True, progress=rank == 0, clock=clock, refresh=True)
    calibrated = ClusterSpec.uniform(device, world)
    uncalibrated = ClusterSpec.uniform(raw_device, world)
    mesh = init_device_mesh(device_type, (world,))
    cons = ElixirConstraints(fragmentation=0.0, reserved_bytes=0)  # compared with allocated bytes

    def plain_cluster(cluster):
        """DDP is not FSDP2: plain tensors, no per-unit hooks, no DTensor dispatch in the optimizer (measured,
        1.3 M parameters: DDP's optimizer step 5 ms, FSDP2 replicate's overheads priced it at 19 ms). Priced as
        one replicated unit without FSDP2's measured overheads."""
        devs = [dataclasses.replace(d, unit_overhead_s={k: v for k, v in d.unit_overhead_s.items()
                                                        if not k.startswith("replicate")}) for d in cluster.devices]
        return dataclasses.replace(cluster, devices=tuple(devs))
    kw = dict(precision="32-true", optimizer="adamw")
    steps = 2
    results = {}
    def gpt_case(size: str, shape: dict):
        cfg = GPTConfig(vocab_size=4096, n_positions=128, heads=4, name=f"gpt-{size}", **shape)
        batch, seq = 4, 128
        g = torch.Generator().manual_seed(rank)
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        x, y = data[:, :-1].to(dev), data[:, 1:].to(dev)

        def loss_fn(out, y=y, v=cfg.vocab_size):
            return F.cross_entropy(out.reshape(-1, v), y.reshape(-1).to(out.device))

        ids = torch.zeros(batch, seq, dtype=torch.long)
        flops_profile = profile_model(build_gpt(cfg, device="meta"), ids, loss_fn=loss_fn)
        profile = time_blocks(build_gpt(cfg, device="meta"), ids, flops_profile, loss_fn=loss_fn, device=dev,
                              repeats=5, warmup=2, clock=clock, refresh=True)  # same load as the steps

        def model():
            torch.manual_seed(0)
            return build_gpt(cfg, device=dev)
        config = {"model": "tightfit GPT", "hidden": cfg.hidden, "layers": cfg.layers, "vocab": cfg.vocab_size,
                  "batch": batch, "seq": seq}
        return flops_profile, profile, model, (lambda module: loss_fn(module(x))), config

    def hf_case(size: str, shape: dict):
        """LlamaForCausalLM from a config inside a plain LightningModule, profiled and block-timed as
        ElixirStrategy does by default (its own profile_module / time_module_blocks, a fresh cache: a first run)."""
        import tempfile

        import lightning as L
        from transformers import LlamaConfig, LlamaForCausalLM

        from lightning_elixir.planning import profile_module, time_module_blocks

        hf = LlamaConfig(vocab_size=4096, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], max_position_embeddings=256)
        hf._attn_implementation = "sdpa"

        class CausalLM(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = LlamaForCausalLM(hf)

            def forward(self, ids):
                return self.model(input_ids=ids, labels=ids).loss

            def training_step(self, batch, batch_idx):
                return self(batch)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        batch, seq = 4, 128
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, hf.vocab_size, (batch, seq), generator=g).to(dev)

        def model():
            torch.manual_seed(0)
            return CausalLM().to(dev)
        probe = model()
        flops_profile = profile_module(probe, ids)
        saved = os.environ.get("TIGHTFIT_CACHE_DIR")
        with tempfile.TemporaryDirectory() as cache:  # the blocks measured now, under the steps' load
            os.environ["TIGHTFIT_CACHE_DIR"] = cache
            try:  # as the strategy does: rank 0 times, every rank plans from its profile
                profile = decide_on_rank0(lambda: time_module_blocks(probe, ids, flops_profile, device=dev),
                                          encode=lambda p: p.to_json(), decode=ModelProfile.from_json)
            finally:
                if saved is None:
                    os.environ.pop("TIGHTFIT_CACHE_DIR", None)
                else:
                    os.environ["TIGHTFIT_CACHE_DIR"] = saved
        config = {"model": "transformers LlamaForCausalLM in a LightningModule", "hidden": hf.hidden_size,
                  "layers": hf.num_hidden_layers, "heads": hf.num_attention_heads, "kv_heads": hf.num_key_value_heads,
                  "vocab": hf.vocab_size, "batch": batch, "seq": seq}
        return flops_profile, profile, model, (lambda module: module(ids)), config

    def one(size: str, shape: dict) -> None:  # a function, so closures bind this size's tensors
        t0 = time.perf_counter()
        flops_profile, profile, model, loss_of, config = (hf_case if shape.get("hf") else gpt_case)(size, shape)
        say(f"{size}: {profile.param_numel / 1e6:.1f} M parameters; profiled and blocks timed in "
            f"{time.perf_counter() - t0:.1f} s")

        def plans_for(cluster, prof):
            ddp = estimate(prof, plain_cluster(cluster), [UnitPlan(blocks=tuple(b.name for b in prof.blocks),
                                                                   mode="replicate")], constraints=cons, **kw)
            budget = int(0.6 * ddp.peak_bytes)
            priced = {"ddp": ddp}
            for name, base in (("fsdp2 full shard", "zero3"), ("fsdp2 no-reshard", "zero2"),
                               ("fsdp2 + offload", "zero3-offload")):
                priced[name] = baseline(prof, cluster, base, checkpoint=False, **kw)
            try:
                pick = search(prof, cluster, memory_budget=budget, constraints=cons, **kw)
            except PlanInfeasibleError as exc:  # activations and logits dominate: the least memory any plan needs
                budget = int(exc.needed_bytes * 1.1)
                pick = search(prof, cluster, memory_budget=budget, constraints=cons, **kw)
            priced["elixir"] = pick
            for i, p in enumerate(_pick_others(frontier(prof, cluster, constraints=cons, **kw), pick, budget)):
                priced[f"mixed {'ab'[i]}"] = p
            return budget, priced

        budget, priced = plans_for(calibrated, profile)
        # Baselines price with the default 10% margin; re-price every plan with the same constraints.
        for name, p in list(priced.items()):
            if name != "ddp":
                priced[name] = estimate(profile, calibrated, list(p.units), forward_prefetch=p.forward_prefetch,
                                        backward_prefetch=p.backward_prefetch, memory_budget=budget,
                                        constraints=cons, **kw)
        old = {name: estimate(flops_profile, uncalibrated, list(p.units), forward_prefetch=p.forward_prefetch,
                              backward_prefetch=p.backward_prefetch, memory_budget=budget, constraints=cons, **kw)
               for name, p in priced.items()}

        def trainer_of(module):
            opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

            def step():
                loss = loss_of(module)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step, lambda: [*module.parameters(), *(v for s in opt.state.values() for v in s.values()
                                                           if isinstance(v, torch.Tensor))]

        runners = {"ddp": trainer_of(DDP(model(), device_ids=[rank] if cuda else None))}
        for name, p in priced.items():
            if name == "ddp":
                continue
            m = model()
            apply_plan(m, dataclasses.replace(p, world_size=world), mesh, device=dev)
            runners[name] = trainer_of(m)

        cpu_times: dict[str, list[float]] = {n: [] for n in runners}

        def timed(name, step):
            def run() -> float:
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    step()
                if cuda:
                    torch.cuda.synchronize(dev)
                spent = torch.tensor([(time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps],
                                     device=dev, dtype=torch.float64)
                dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # the slower rank paces the step
                cpu_times[name].append(float(spent[1].item()))  # a diagnostic: what the ranks' CPUs spent
                return float(spent[0].item())  # wall time: what a user waits
            return run

        times = interleave({n: timed(n, s) for n, (s, _) in runners.items()}, repeats=repeats, warmup=1,
                           progress=rank == 0)
        cpu_times = {n: w[-repeats:] for n, w in cpu_times.items()}
        peaks = {}
        for name, (step, state) in runners.items():
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                step()
                torch.cuda.synchronize(dev)
                value = torch.cuda.max_memory_allocated(dev)
            else:
                value = measure_peak(step, state)
            t = torch.tensor([float(value)], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peaks[name] = int(t.item())
        results[size] = {
            "params": profile.param_numel, "budget": budget, "times": times, "cpu_times": cpu_times,
            "measured_peak": peaks, "load_average": os.getloadavg(), "device": device_type,
            "predicted": {n: {"step_s": p.step_time_s, "peak_bytes": p.peak_bytes, "host_bytes": p.host_bytes_per_rank,
                              "units": len(p.units), "offloaded": len(p.offloaded_units),
                              "checkpointed": len(p.checkpointed_blocks),
                              "modes": sorted({u.mode for u in p.units})} for n, p in priced.items()},
            "uncalibrated_step_s": {n: p.step_time_s for n, p in old.items()},
            "cost_model": priced["elixir"].cost_model, "uncalibrated_cost_model": old["elixir"].cost_model,
            "config": {**config, "world": world, "steps_per_repeat": steps},
        }
        del runners

    for size, shape in (sizes or SIZES).items():
        one(size, shape)
    if rank == 0:
        results["calibration"] = {"comm_overlap": device.comm_overlap, "collective_fit": device.collective_fit,
                                  "unit_overhead_s": device.unit_overhead_s}
        Path(out).write_text(json.dumps(results, default=str))
    dist.barrier()
    dist.destroy_process_group()


def analyse(res: dict) -> dict:
    """Errors, rank correlation and the pick's verdict for one model size."""
    times, pred, peaks, budget = res["times"], res["predicted"], res["measured_peak"], res["budget"]
    rows = {}
    for name in times:
        med = statistics.median(times[name])
        p = pred[name]
        # On a CPU host and device are one memory: the calibrated model (unified memory) already counts
        # offloaded state in the device peak; on a GPU the device peak is what max_memory_allocated measures.
        ppeak = p["peak_bytes"]
        rows[name] = {"measured_s": med, "min_s": min(times[name]), "max_s": max(times[name]),
                      "predicted_s": p["step_s"], "time_err": p["step_s"] / med - 1,
                      "uncalibrated_s": res["uncalibrated_step_s"][name],
                      "uncalibrated_err": res["uncalibrated_step_s"][name] / med - 1,
                      "cpu_s": statistics.median(res["cpu_times"][name]),
                      "predicted_peak": ppeak, "measured_peak": peaks[name], "peak_err": ppeak / peaks[name] - 1,
                      "fits": p["peak_bytes"] <= budget}
    names = list(rows)
    rho = spearman([rows[n]["predicted_s"] for n in names], [rows[n]["measured_s"] for n in names])
    rho_old = spearman([rows[n]["uncalibrated_s"] for n in names], [rows[n]["measured_s"] for n in names])
    fitting = [n for n in names if rows[n]["fits"]]
    fastest = min(fitting, key=lambda n: rows[n]["measured_s"])
    # Elixir's pick over the fastest fitting contender, paired per interleaved repeat (lower is better).
    pick = paired(times["elixir"], times[fastest], higher_is_better=False)
    pick_gap = float(pick["median"]) - 1  # type: ignore[arg-type]
    return {"rows": rows, "spearman": rho, "spearman_uncalibrated": rho_old, "fastest_fitting": fastest,
            "pick_gap": pick_gap, "pick_paired": pick,
            "targets": {"time_within_20pct": all(abs(r["time_err"]) <= 0.20 for r in rows.values()),
                        "spearman_ge_0.8": rho >= 0.8, "pick_within_5pct": pick_gap <= 0.05,
                        "peak_within_10pct": all(abs(r["peak_err"]) <= 0.10 for r in rows.values()),
                        "peak_never_under_5pct": all(r["peak_err"] >= -0.05 for r in rows.values())}}


def markdown_for(size: str, res: dict, a: dict) -> list[str]:
    cfg = res["config"]
    lines = [f"**{size}** ({cfg.get('model', 'tightfit GPT')}, {res['params'] / 1e6:.1f} M parameters, hidden "
             f"{cfg['hidden']}, {cfg['layers']} layers, batch {cfg['batch']}x{cfg['seq']} per rank; budget "
             f"{res['budget'] / 2**20:.1f} MiB = {res['budget'] / res['predicted']['ddp']['peak_bytes'] * 100:.0f}% of DDP's predicted "
             f"peak). Cost model: {res['cost_model']}.", "",
             "| contender | plan | measured wall ms median [min-max] | predicted ms | error | uncalibrated ms (error) "
             "| CPU ms median (diagnostic) | measured peak MiB | predicted MiB | error | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in a["rows"].items():
        p = res["predicted"][name]
        plan = f"{p['units']} units {'/'.join(p['modes'])}, {p['offloaded']} offl., {p['checkpointed']} ckpt"
        lines.append(f"| {name} | {plan} | {r['measured_s'] * 1e3:.0f} [{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}] "
                     f"| {r['predicted_s'] * 1e3:.0f} | {r['time_err'] * 100:+.0f}% | {r['uncalibrated_s'] * 1e3:.0f} "
                     f"({r['uncalibrated_err'] * 100:+.0f}%) | {r['cpu_s'] * 1e3:.0f} | {r['measured_peak'] / 2**20:.1f} | "
                     f"{r['predicted_peak'] / 2**20:.1f} | {r['peak_err'] * 100:+.0f}% | {'yes' if r['fits'] else 'no'} |")
    t = a["targets"]
    lines += ["", f"Spearman rank correlation predicted vs measured: **{a['spearman']:.2f}** (uncalibrated model: "
              f"{a['spearman_uncalibrated']:.2f}). Elixir's pick vs the measured-fastest fitting contender "
              f"({a['fastest_fitting']}): **{a['pick_gap'] * 100:+.1f}%**"
              + (f" (paired per repeat: {format_paired(a['pick_paired'])})" if "pick_paired" in a else "")
              + ". Targets: "
              + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in t.items()) + "."]
    return lines


def _overhead_text(mode: str, vals: list[float]) -> str:
    per_mib = mode.endswith("/byte")  # seconds per byte, shown per MiB
    return f"{mode} {'/'.join(f'{v * (2**20 if per_mib else 1) * 1e3:.2f}' for v in vals)}" + (" per MiB" if per_mib else "")


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    res = run_two_ranks(_rank, args.quick, repeats)
    calib = res.pop("calibration")
    analysis = {size: analyse(r) for size, r in res.items()}
    markdown = []
    for size, r in res.items():
        markdown += markdown_for(size, r, analysis[size]) + [""]
    fit = calib["collective_fit"]
    ag = next(iter(fit.get("all_gather", {}).values()), [0, 1])
    markdown.append(f"Calibration (2 gloo ranks x 1 thread): comm/compute overlap {calib['comm_overlap']:.2f}, "
                    f"all-gather alpha {ag[0] * 1e6:.0f} us + {ag[1] / 1e9:.2f} GB/s bus bandwidth, FSDP2 per-unit "
                    "overhead (fwd/bwd/opt ms): " + ", ".join(
                        _overhead_text(m, vals) for m, vals in calib["unit_overhead_s"].items())
                    + f". {repeats} interleaved repeats of 2 steps each; medians.")
    plots = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(analysis), figsize=(5 * len(analysis), 4))
        for ax, (size, a) in zip(axes if len(analysis) > 1 else [axes], analysis.items()):
            rows = a["rows"]
            m = [r["measured_s"] * 1e3 for r in rows.values()]
            ax.scatter(m, [r["predicted_s"] * 1e3 for r in rows.values()], label="calibrated")
            ax.scatter(m, [r["uncalibrated_s"] * 1e3 for r in rows.values()], marker="x", label="FLOPs / rate")
            for name, r in rows.items():
                ax.annotate(name, (r["measured_s"] * 1e3, r["predicted_s"] * 1e3), fontsize=7)
            lim = [0, max(m + [r["predicted_s"] * 1e3 for r in rows.values()]) * 1.1]
            ax.plot(lim, lim, "k--", lw=0.8)
            ax.set_xlabel("measured ms / step")
            ax.set_ylabel("predicted ms / step")
            ax.set_title(f"{size}: Spearman {a['spearman']:.2f}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = plot_path(NAME)
        fig.savefig(path)
        plots.append(path)
    except ImportError:
        pass
    write_result(NAME, title="Cost model: predicted vs measured step time and peak memory (2 CPU ranks)",
                 params={"quick": args.quick, "repeats": repeats},
                 results={"raw": res, "analysis": analysis, "calibration": calib},
                 markdown="\n".join(markdown), plots=plots)
    print("\n".join(markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
