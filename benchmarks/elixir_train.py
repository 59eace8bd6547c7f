"""Elixir's plan vs the configurations users pick by hand: step time on 2 CPU processes, same model and data.

Two gloo ranks (1 thread each) train a GPT-2-shaped model (tightfit.models) with AdamW in fp32. The
memory budget is 60% of what DDP needs by the planner's own accounting, the situation Elixir is for:
the contenders a user would try are DDP, FSDP2 full shard (one unit per block), FSDP2 full shard +
CPU offload, DeepSpeed ZeRO-3 and ZeRO-3 + offload (when DeepSpeed is installed), and Elixir's plan
applied with ``apply_plan``. Each contender is built once; rounds alternate A B C ... after a warm-up
round, each timing ``steps`` training steps between barriers on the round's batches; the median of the repeats is
reported, and every ratio between contenders is paired round by round (``benchmarks/README.md``).

Also: the planner's predicted step time and peak memory for Elixir and the FSDP2 baselines (priced by
the same cost model), next to the measured step time and, for Elixir, the measured step peak
(torch.profiler allocator events plus the resident state). The plans are priced the way
``Trainer(strategy="elixir")`` prices them by default, from measurements: every distinct block timed on this
device (``time_blocks``), the collectives, FSDP2's per-unit overheads and the comm/compute overlap fitted here
(``calibrate_device``), on the wall clock the steps are timed on, re-measured in the run (``refresh=True``) so
the prediction sees the load the steps see. Calibrated, a CPU device is ``unified_memory``: the host *is* the
device, offloaded state counts in the device peak, and the budget bounds what the process really holds. DDP is
priced as one replicated unit without FSDP2's per-unit overheads (it runs plain tensors), as in
``benchmarks/cost_model.py``. The plans keep the strategy's default 10% fragmentation margin.
"""

from __future__ import annotations

import dataclasses
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
    summarize,
    write_result,
)

NAME = "elixir_train"


def _rank(rank: int, world: int, port: int, quick: bool, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_elixir.apply import apply_plan
    from tightfit.distributed import decide_on_rank0
    from tightfit.models import GPTConfig, build_gpt
    from tightfit.planner.elixir import UnitPlan, baseline, estimate, search
    from tightfit.planner.errors import PlanInfeasibleError
    from tightfit.profiler import calibrate_device, profile_device, profile_model, time_blocks
    from tightfit.profiler.types import ClusterSpec, DeviceProfile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = GPTConfig(vocab_size=4096, n_positions=128, hidden=192 if quick else 256, layers=4 if quick else 6,
                    heads=4, name="gpt-bench")
    batch, seq = 4, 128
    steps = 2 if quick else 4
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    say = (lambda m: print(f"[elixir_train] {m}", file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)

    def loss_fn(out, y=y):
        return F.cross_entropy(out.reshape(-1, cfg.vocab_size), y.reshape(-1))

    ids = torch.zeros(batch, seq, dtype=torch.long)
    t0 = time.perf_counter()
    # The default measured path (what ElixirStrategy does at fit start): blocks timed, device calibrated, both on
    # the wall clock; every rank plans from rank 0's numbers.
    flops_profile = profile_model(build_gpt(cfg, device="meta"), ids, loss_fn=loss_fn)
    profile = time_blocks(build_gpt(cfg, device="meta"), ids, flops_profile, loss_fn=loss_fn, device=torch.device("cpu"),
                          clock="wall", refresh=True)
    measured = profile_device("cpu", quick=True, progress=False)  # every rank: the collectives are measured together
    raw = decide_on_rank0(lambda: measured, encode=lambda d: d.to_json(), decode=DeviceProfile.from_json)
    device = calibrate_device(raw, device="cpu", quick=True, progress=False, clock="wall", refresh=True)
    calibration_s = time.perf_counter() - t0
    cluster = ClusterSpec.uniform(device, world)
    # DDP runs plain tensors: one replicated unit without FSDP2's measured per-unit overheads (cost_model.py).
    plain = ClusterSpec.uniform(dataclasses.replace(device, unit_overhead_s={
        k: v for k, v in device.unit_overhead_s.items() if not k.startswith("replicate")}), world)
    kw = dict(precision="32-true", optimizer="adamw")
    ddp_pred = estimate(profile, plain, [UnitPlan(blocks=tuple(b.name for b in profile.blocks), mode="replicate")],
                        **kw)
    budget = int(0.6 * ddp_pred.peak_bytes)
    budget_note = "60% of DDP's predicted peak"
    try:
        plan = search(profile, cluster, memory_budget=budget, **kw)
    except PlanInfeasibleError as exc:  # on one memory only sharding and recomputation save: the least any plan needs
        budget = int(exc.needed_bytes * 1.1)
        budget_note = f"110% of the least any plan needs ({exc.needed_bytes / 2**20:.1f} MiB); 60% of DDP's fits none"
        plan = search(profile, cluster, memory_budget=budget, **kw)
    predicted = {"elixir": plan, "ddp": ddp_pred,
                 "fsdp2 full shard": baseline(profile, cluster, "zero3", checkpoint=False, **kw),
                 "fsdp2 + offload": baseline(profile, cluster, "zero3-offload", checkpoint=False, **kw)}
    say(f"{profile.param_numel / 1e6:.1f} M parameters; calibrated in {calibration_s:.1f} s; budget "
        f"{budget / 2**20:.1f} MiB ({budget_note}; DDP {ddp_pred.peak_bytes / 2**20:.1f} MiB); plan: {len(plan.units)} "
        f"units, {len(plan.offloaded_units)} offloaded, {len(plan.checkpointed_blocks)} blocks recomputed")
    mesh = init_device_mesh("cpu", (world,))

    def model():
        torch.manual_seed(0)
        return build_gpt(cfg)

    def trainer_of(module, params=None):
        opt = torch.optim.AdamW(params if params is not None else module.parameters(), lr=1e-3)

        def step():
            loss = F.cross_entropy(module(x).reshape(-1, cfg.vocab_size), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, lambda: [*module.parameters(), *(v for s in opt.state.values() for v in s.values()
                                                       if isinstance(v, torch.Tensor))]

    def fsdp(offload: bool):
        m = model()
        for block in m.blocks:
            fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy())
        fully_shard([m.wte, m.lm_head], mesh=mesh)
        fully_shard(m, mesh=mesh)
        return trainer_of(m)

    steps_of = {"ddp": trainer_of(DDP(model())), "fsdp2 full shard": fsdp(False), "fsdp2 + offload": fsdp(True)}
    el = model()
    apply_plan(el, plan, mesh)
    steps_of["elixir"] = trainer_of(el)
    try:
        import importlib

        import deepspeed

        # import_module, not `import deepspeed.comm.torch as`: that binds deepspeed.comm's attribute `torch`, PyTorch
        ds_torch = importlib.import_module("deepspeed.comm.torch")

        ds_torch.build_shm_op = lambda: None  # its CPU shared-memory op crashes on these machines (SETUP_NOTES)
        deepspeed.init_distributed("gloo")
        for name, extra in (("deepspeed zero3", {}), ("deepspeed zero3 + offload", {
                "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})):
            m = model()
            cfg_ds = {"train_micro_batch_size_per_gpu": batch, "zero_force_ds_cpu_optimizer": False,
                      "zero_optimization": {"stage": 3, **extra}}
            engine, opt, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                                                     config=cfg_ds, dist_init_required=False)

            def ds_step(engine=engine):
                loss = F.cross_entropy(engine(x).reshape(-1, cfg.vocab_size), y.reshape(-1))
                engine.backward(loss)
                engine.step()
            steps_of[name] = (ds_step, lambda: [])
    except ImportError:
        say("DeepSpeed not installed: its contenders are skipped")

    def timed(step):
        def run() -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            dist.barrier()
            return (time.perf_counter() - start) / steps
        return run

    times = interleave({n: timed(s) for n, (s, _) in steps_of.items()}, repeats=repeats, warmup=1,
                       progress=rank == 0)
    peak = measure_peak(*steps_of["elixir"])
    if rank == 0:
        Path(out).write_text(json.dumps({
            "times": times, "elixir_measured_peak": peak, "budget": budget, "budget_note": budget_note,
            "params": profile.param_numel, "calibration_s": calibration_s, "cost_model": plan.cost_model,
            "predicted": {n: {"step_s": p.step_time_s, "peak_bytes": p.peak_bytes, "host_bytes": p.host_bytes_per_rank,
                              } for n, p in predicted.items()},
            "plan": {"units": len(plan.units), "offloaded": len(plan.offloaded_units),
                     "checkpointed": len(plan.checkpointed_blocks), "explain": plan.explain()},
            "config": {"hidden": cfg.hidden, "layers": cfg.layers, "vocab": cfg.vocab_size, "batch": batch,
                       "seq": seq, "world": world, "steps_per_repeat": steps},
        }))
    dist.barrier()
    dist.destroy_process_group()


def _none_fits(times: dict, pred: dict) -> str:
    """The headline when no hand-picked FSDP2 configuration fits: say so, and how the fastest of them compares."""
    priced = [n for n in times if n in pred and n not in ("elixir", "ddp")]
    if not priced:
        return "no hand-picked FSDP2 configuration fits the budget"
    fastest = min(priced, key=lambda n: statistics.median(times[n]))
    return (f"no hand-picked FSDP2 configuration fits the budget (on a CPU offloading saves no memory: host and device "
            f"are one); the fastest, {fastest}, takes "
            f"{format_paired(paired(times[fastest], times['elixir'], higher_is_better=False))} Elixir's time "
            f"(paired per repeat) and needs {pred[fastest]['peak_bytes'] / 2**20:.1f} MiB")


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    res = run_two_ranks(_rank, args.quick, repeats)
    times, pred = res["times"], res["predicted"]
    el = statistics.median(times["elixir"])
    rows = []
    for name, samples in times.items():
        s = summarize(samples)
        p = pred.get(name)
        fits = "" if p is None else ("yes" if p["peak_bytes"] <= res["budget"] else "no (over budget)")
        rows.append(f"| {name} | {s['median'] * 1e3:.0f} [{s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f}] | "
                    f"{'-' if name == 'elixir' else format_paired(paired(samples, times['elixir'], higher_is_better=False))} | "
                    + (f"{p['step_s'] * 1e3:.0f} | {p['peak_bytes'] / 2**20:.1f} | {fits} |" if p else "- | - | - |"))
    fitting = [n for n in times if n != "elixir" and n in pred and pred[n]["peak_bytes"] <= res["budget"]]
    best_fit = min(fitting, key=lambda n: statistics.median(times[n])) if fitting else None
    p_el = pred["elixir"]
    # Said as it is: Elixir's speed over the peer's, paired per repeat (peer time / Elixir time: > 1 is faster),
    # with the repeats Elixir won; "mixed" when each won some (then the median alone is no clear verdict).
    if best_fit:
        speed = paired(times[best_fit], times["elixir"])
        wins, rounds = speed["wins"], speed["rounds"]
        verdict = "faster in every repeat" if wins == rounds else "slower in every repeat" if wins == 0 else (
            f"mixed: faster in {wins} of {rounds} repeats")
        el_m, peer_m = statistics.median(times["elixir"]), statistics.median(times[best_fit])
        headline = (f"Elixir's plan runs at **{format_paired(speed)}** the speed of {best_fit} ({verdict}; "
                    f"{el_m * 1e3:.0f} vs {peer_m * 1e3:.0f} ms median wall step); {best_fit} is the fastest "
                    f"hand-picked FSDP2 configuration that fits the budget ({repeats} interleaved repeats, paired)")
    else:
        headline = _none_fits(times, pred)
    markdown = "\n".join([
        f"Headline: {headline}. Budget {res['budget'] / 2**20:.1f} MiB per rank ({res['budget_note']}); "
        f"{res['params'] / 1e6:.1f} M parameters, 2 gloo ranks x 1 thread, fp32 AdamW. Priced by: {res['cost_model']} "
        f"(blocks timed and device calibrated in {res['calibration_s']:.1f} s, in the run).",
        "", "| contender | step ms median [min-max] | time / Elixir (paired) | predicted ms | predicted peak MiB | "
        "fits budget |",
        "|---|---|---|---|---|---|", *rows, "",
        f"Elixir plan: {res['plan']['units']} units, {res['plan']['offloaded']} offloaded, "
        f"{res['plan']['checkpointed']} blocks recomputed. Predicted step {p_el['step_s'] * 1e3:.0f} ms vs measured "
        f"{el * 1e3:.0f} ms ({(p_el['step_s'] / el - 1) * 100:+.0f}%); predicted peak {p_el['peak_bytes'] / 2**20:.1f} "
        f"MiB (10% margin included; on a CPU host and device are one memory, offloaded state counted) vs measured "
        f"{res['elixir_measured_peak'] / 2**20:.1f} MiB, "
        + ("within" if res['elixir_measured_peak'] <= res['budget'] else "OVER")
        + f" the {res['budget'] / 2**20:.1f} MiB budget.",
        "DeepSpeed contenders have no prediction (the cost model prices FSDP2 plans).",
    ])
    plots = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3))
        names = list(times)
        ax.barh(names, [statistics.median(times[n]) * 1e3 for n in names])
        ax.set_xlabel("ms per step (median)")
        ax.set_title("2 CPU ranks, fp32 AdamW")
        fig.tight_layout()
        path = plot_path(NAME)
        fig.savefig(path)
        plots.append(path)
    except ImportError:
        pass
    write_result(NAME, title="Elixir plan vs DDP / FSDP2 / DeepSpeed ZeRO-3 (2 CPU ranks)",
                 params={"quick": args.quick, "repeats": repeats, **res["config"]},
                 results={k: v for k, v in res.items() if k != "config"}, markdown=markdown, plots=plots)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
