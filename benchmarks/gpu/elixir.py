"""Elixir on one GPU under emulated memory budgets: its plan vs FSDP2 full offload vs the best FSDP2 found by trying.

    python -m benchmarks.gpu.elixir [--quick] [--smoke]

GPT-2 1.5B (``gpt2-xl``) and GPT-2 4B (``gpt2-4b``) shapes (``--quick``: GPT-2 medium under 4 GiB), bf16
compute with fp32 master weights and AdamW, sequence 1024. A budget (24 GiB, 40 GiB) is enforced with
``torch.cuda.set_per_process_memory_fraction``, as if the GPU had only that much. Contenders, all
applied by ``lightning_elixir.apply.apply_plan`` (one FSDP2 unit per block) so only the choices differ:

* ``elixir``: the searched plan for the budget (device profiled with ``profile_device``);
* ``fsdp2 full offload``: every unit offloaded, every block recomputed (the safe hand-picked choice);
* ``best fsdp2 (tried)``: of {resident, resident + recompute all, offload all}, the fastest that runs
  without running out of memory, found by trying each (what a user does by hand, one OOM at a time).

Contenders are built one at a time (two 1.5B models do not fit a 24 GiB budget together), so rounds
cannot interleave; each reports the median of its timed steps after a warm-up step. Predicted step
time and peak (the planner's cost model) sit beside the measured ones (``max_memory_allocated``).
Runs on torch + Lightning only (no DeepSpeed on that machine). ``--smoke``: tiny sizes on the CPU.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

from benchmarks.gpu.common import ROOT, ensure_tightfit, parser, skip, summarize, write_result

NAME, TITLE = "elixir", "Elixir plan vs FSDP2 under memory budgets on one GPU (GPT-2 1.5B / 4B shapes)"
GiB = 2**30


def _setup_paths() -> None:
    ensure_tightfit()
    if str(ROOT / "plugins") not in sys.path:
        sys.path.insert(0, str(ROOT / "plugins"))


def _units(profile, offload: bool, checkpoint: bool):
    from tightfit.planner.elixir import Tier, UnitPlan

    return [UnitPlan(blocks=(b.name,), mode="reshard", tier=Tier.HOST if offload and b.param_numel > 0 else Tier.DEVICE,
                     checkpoint=(b.name,) if checkpoint and b.checkpointable else ()) for b in profile.blocks]


def _run(cfg, plan, device, batch: int, seq: int, steps: int) -> dict:
    """Build on meta, apply ``plan``, train ``steps`` timed steps; OOM is reported, not raised."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_elixir.apply import apply_plan
    from lightning_elixir.optim import mesh_step
    from tightfit.models import build_gpt

    cuda = device.type == "cuda"
    model = opt = None
    try:
        model = build_gpt(cfg, device="meta")
        apply_plan(model, plan, init_device_mesh(device.type, (1,)), device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)
        x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 1):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
            loss.backward()
            mesh_step(opt)  # what ElixirStrategy does: one fused launch per (mesh, device), never across meshes
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return {"ok": True, "step_s": statistics.median(times), "steps": times, "peak_bytes": peak,
                "loss": float(loss)}
    except torch.OutOfMemoryError as exc:
        return {"ok": False, "why": f"OOM: {str(exc).splitlines()[0][:160]}"}
    finally:
        del model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        return skip(NAME, TITLE, "torch is not installed")
    if not torch.cuda.is_available() and not args.smoke:
        return skip(NAME, TITLE, "no CUDA device (use --smoke to check the script on a CPU)")
    _setup_paths()
    import torch.distributed as dist

    from tightfit.models import gpt_config
    from tightfit.planner.elixir import PlanInfeasibleError, estimate, search
    from tightfit.profiler import profile_device, profile_model
    from tightfit.profiler.types import ClusterSpec

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    device = torch.device("cuda", 0) if not args.smoke else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    if args.smoke:
        cases = [("gpt2-tiny", 2, 64, (48 * 2**20,))]
    elif args.quick:
        # Fits a share of a 15-minute loan: GPT-2 medium's AdamW state alone (355 M x 16 B = 5.7 GB) exceeds
        # the 4 GiB budget, so every contender must offload or fail; each builds and steps in seconds.
        cases = [("gpt2-medium", 4, 1024, (4 * GiB,))]
    else:
        cases = [("gpt2-xl", 4, 1024, (24 * GiB, 40 * GiB)), ("gpt2-4b", 2, 1024, (40 * GiB,))]
    steps = 2 if args.smoke else 3
    dev_profile = profile_device(device, quick=True, progress=False)
    total = dev_profile.memory_bytes
    results: list[dict] = []
    lines = []
    for preset, batch, seq, budgets in cases:
        cfg = gpt_config(preset)
        profile = profile_model(lambda cfg=cfg: __import__("tightfit.models", fromlist=["GPT"]).GPT(cfg),
                                torch.zeros(batch, seq, dtype=torch.long, device="meta"), name=preset)
        cluster = ClusterSpec.uniform(dev_profile, 1)
        for budget in budgets:
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
            kw = dict(precision=precision, optimizer="adamw", memory_budget=budget)
            case = {"model": preset, "params": profile.param_numel, "batch": batch, "seq": seq,
                    "budget_gib": budget / GiB, "contenders": {}}
            try:
                plan = search(profile, cluster, **kw)
            except PlanInfeasibleError as exc:
                case["contenders"]["elixir"] = {"ok": False, "why": str(exc)[:300]}
                plan = None
            plans = {"elixir": plan,
                     "fsdp2 full offload": estimate(profile, cluster, _units(profile, True, True), **kw),
                     "fsdp2 resident": estimate(profile, cluster, _units(profile, False, False), **kw),
                     "fsdp2 resident + recompute": estimate(profile, cluster, _units(profile, False, True), **kw),
                     "fsdp2 offload": estimate(profile, cluster, _units(profile, True, False), **kw)}
            for name, pl in plans.items():
                if pl is None:
                    continue
                print(f"[elixir gpu] {preset} budget {budget / GiB:.0f} GiB: {name} ...", file=sys.stderr, flush=True)
                r = _run(cfg, pl, device, batch, seq, steps)
                r.update(predicted_step_s=pl.step_time_s, predicted_peak_bytes=pl.peak_bytes,
                         offloaded_units=len(pl.offloaded_units), checkpointed=len(pl.checkpointed_blocks))
                case["contenders"][name] = r
            tried = {n: r for n, r in case["contenders"].items() if n.startswith("fsdp2 ") and n != "fsdp2 full offload"
                     and r.get("ok")}
            best = min(tried, key=lambda n: tried[n]["step_s"]) if tried else None
            case["best_tried"] = best
            el, off = case["contenders"].get("elixir", {}), case["contenders"]["fsdp2 full offload"]
            if el.get("ok"):
                vs_off = off["step_s"] / el["step_s"] if off.get("ok") else float("nan")
                vs_best = tried[best]["step_s"] / el["step_s"] if best else float("nan")
                lines.append(f"{preset} @ {budget / GiB:.0f} GiB: elixir {el['step_s']:.2f} s/step "
                             f"(predicted {el['predicted_step_s']:.2f}, peak {el['peak_bytes'] / GiB:.1f} GiB vs "
                             f"predicted {el['predicted_peak_bytes'] / GiB:.1f}; {vs_off:.2f}x vs full offload, "
                             f"{vs_best:.2f}x vs best tried: {best})")
            results.append(case)
    dist.destroy_process_group()
    summary = "; ".join(lines) or "elixir found no plan"
    for case in results:
        for name, r in case["contenders"].items():
            if r.get("ok"):
                print(f"{case['model']:8s} {case['budget_gib']:4.0f} GiB  {name:28s} {r['step_s']:7.3f} s "
                      f"(pred {r['predicted_step_s']:.3f})  peak {r['peak_bytes'] / GiB:6.2f} GiB "
                      f"(pred {r['predicted_peak_bytes'] / GiB:.2f})")
            else:
                print(f"{case['model']:8s} {case['budget_gib']:4.0f} GiB  {name:28s} {r.get('why', '')}")
    write_result(NAME, title=TITLE, results={"cases": results, "device": dev_profile.name,
                                             "medians": {c["model"]: {n: summarize(r["steps"]) for n, r in
                                                                      c["contenders"].items() if r.get("ok")}
                                                         for c in results}},
                 summary=summary)
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
