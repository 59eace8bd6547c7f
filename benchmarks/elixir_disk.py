"""Elixir with its optimizer state, master weights and gradients on disk, under a hard memory limit, vs DeepSpeed
ZeRO-Infinity.

Question: can ``ElixirStrategy(memory_budget=, host_budget=, disk_dir=)`` train a GPT whose fp32 AdamW
state (parameters, gradients and two moments: 16 bytes per parameter) is larger than the memory the process
may use, as fast as its plan predicts, with the disk busy during the optimizer phase, and faster than ZeRO-3
with both offloads on NVMe under the same limit, without being killed?

Setup, all on this machine's disk (``--dir``, default a temporary directory under /tmp: a real SSD here):
    * the plan, priced as ``ElixirStrategy``'s default (``calibrate=True``) prices it: the model is profiled on
      the meta device and its blocks timed on this CPU one at a time (``time_module_blocks``), the CPU measured
      and FSDP2's per-unit overheads fitted (``profile_device`` + ``calibrate_device``, cached), the disk
      measured at the start of the run with the share of its reads hidden behind compute (``profile_disk``,
      quick, refreshed), and Elixir's search given a device budget ``M`` and a host
      budget ``H``: ``H`` is what leaves the limit at a third of the state, ``state / 3.06 - M - B - margin``
      (raised to what the search says a plan needs where that is too little). The group's limit is
      ``L = M + H + B + margin``: on a CPU the "device" is this same RAM, ``B`` is the measured resident size of
      an interpreter with torch and Lightning imported (no model), which no budget covers, and the margin
      (``--margin``) what Lightning's loop and the allocator add beyond the budgets.
    * contenders, each a fresh process per repeat (``benchmarks/_elixir_disk_child.py``), the page cache dropped
      before each, the order rotated every repeat; every repeat draws fresh tokens (the same for all three):
        - ``elixir disk``: ``ElixirStrategy(plan=, host_budget=H, disk_dir=)`` under the hard limit ``L``;
        - ``deepspeed nvme``: ZeRO-3, ``offload_optimizer`` and ``offload_param`` on ``device: nvme`` under ``L``
          (one process, ``torch_adam``, ``pin_memory: false``, its shared-memory comm op disabled, ``aio`` block
          size and queue depth from the same disk profile, ``sub_group_size`` and buffers sized to fit ``L``);
          skipped, saying why, where DeepSpeed's ``async_io`` op cannot build (``apt-get install libaio-dev``);
        - ``ram``: the same plan with every unit's state in RAM (no disk tier), no limit: the speed reference
          and the exactness reference (losses and final weights bit for bit, per repeat).
      A repeat's contenders train on the same tokens, so their step times pair up: DeepSpeed's step over Elixir's
      is paired repeat by repeat (``benchmarks/README.md``); where DeepSpeed is killed by the limit, it runs once
      more without one, paired with that repeat's Elixir run.
Measured per step (the first step of each process is warm-up, not counted): wall time, the optimizer phase
(end of backward to end of step), bytes read and written by the process (``/proc/self/io``), and per process
the group's peak (``memory.max_usage_in_bytes``) and whether the OOM killer fired.
Disk bandwidth in the optimizer phase, as a fraction of the profile: the time the profiled disk needs for the
bytes the phase moved (``DiskProfile.read_seconds + write_seconds``) over the phase's measured wall time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._child_sources import collect
from benchmarks._elixir_disk_report import (
    CONTENDERS,
    DS_UNCAPPED,
    NAME,
    TARGETS,
    _plot,
    _timed,
    analyse,
    exactness,
    markdown,
)
from benchmarks.common import parser, write_result

MiB, GiB = 2**20, 2**30
HERE = Path(__file__).resolve().parent


def param_buffers(cfg: dict) -> int:
    """Buffers for DeepSpeed's parameter swapper: half the model's parameter tensors, plus 16.

    It takes one buffer (of the largest parameter's size) per parameter it swaps in and returns them late: on the
    24-block benchmark GPT (293 parameter tensors) 14, 28 and 80 buffers all failed in the first forward ("Not
    enough buffers 0 for swapping 1"); 160 ran (uncapped: peak 10.3 GB, 5.7 s a step), as did 400 (18.1 GB). So
    the uncapped peer can be timed; no count fits the limit."""
    tensors = 12 * cfg["layers"] + 4 + (0 if cfg.get("tie_embeddings", True) else 1)  # blocks, wte, wpe, ln_f, head
    return tensors // 2 + 16


def model_config(quick: bool) -> dict:
    """The GPT: big embeddings and few tokens per step, so the optimizer state, not the FLOPs, sets the pace."""
    # Untied embeddings of a large vocabulary (as Llama-3's 128K): the token table is state without FLOPs.
    if quick:
        return {"vocab_size": 16384, "n_positions": 64, "hidden": 768, "layers": 2, "heads": 8,
                "tie_embeddings": False, "name": "gpt-disk-quick"}
    # Many mid-sized blocks: with master weights on disk (tier 3) a rank keeps the gradients (4 of 16 B/param) and
    # the working set of the largest unit, so the state-to-limit ratio grows with the model until the fixed costs
    # (interpreter, staging area) stop mattering; 24 blocks of 12.6 M parameters, 8.4 M-parameter embeddings (a
    # small largest unit: its gathered parameters and gradients are part of the fixed cost).
    return {"vocab_size": 8192, "n_positions": 64, "hidden": 1024, "layers": 24, "heads": 8, "tie_embeddings": False,
            "name": "gpt-disk"}


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=HERE).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "core", "plugins", "benchmarks"],
                               capture_output=True, text=True, timeout=10, cwd=HERE).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.strip() + (" (uncommitted changes)" if dirty else "")


def interpreter_baseline() -> int:
    """Resident bytes of a fresh interpreter with torch, Lightning and the plugin imported, before any model."""
    code = ("import torch, lightning, lightning_elixir, tightfit.models;"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=HERE.parent)
    return int(out.stdout.strip().splitlines()[-1]) * 1024


def deepspeed_unavailable(say) -> str | None:
    """Why the DeepSpeed NVMe peer cannot run here, or None; builds its ``async_io`` op first (outside the limit:
    a one-time JIT build of about 4 minutes on 2 cores, cached under ``~/.cache/torch_extensions``)."""
    code = ("import json, importlib; importlib.import_module('deepspeed.comm.torch').build_shm_op = lambda: None\n"
            "from benchmarks._elixir_disk_child import aio_unavailable\nprint(json.dumps(aio_unavailable()))")
    say("checking DeepSpeed's async_io op (JIT-builds once, ~4 min on 2 cores, then cached) ...")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=HERE.parent,
                             env=dict(os.environ, DS_ACCELERATOR="cpu"))
    except subprocess.TimeoutExpired:
        return "DeepSpeed's async_io op did not build within 15 minutes"
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return f"DeepSpeed's async_io check failed (exit {out.returncode}): {out.stderr.strip()[-300:]}"
    return json.loads(lines[-1])


@contextlib.contextmanager
def _one_rank_group():
    """A gloo process group of one rank (the strategy's own on one CPU device), for the calibration."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rendezvous", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def make_plans(cfg: dict, batch: int, seq: int, disk_dir: Path, say, fixed: int = 0) -> dict:
    """The disk plan at the host budget that puts the limit at a third of the state (``fixed``: the bytes the
    limit adds beside the budgets, baseline and margin), or the smallest one a plan fits in if that is too
    little; its all-in-RAM twin; and the budgets."""
    import dataclasses

    import lightning as L
    import torch

    from lightning_elixir.planning import profile_module, time_module_blocks
    from tightfit.models import GPTConfig, build_gpt
    from tightfit.planner.elixir import Tier, estimate, search
    from tightfit.planner.errors import PlanInfeasibleError
    from tightfit.profiler import calibrate_device, profile_device, profile_disk
    from tightfit.profiler.disk_presets import with_disk
    from tightfit.profiler.types import ClusterSpec

    class Meta(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_gpt(GPTConfig(**cfg), device="meta")

        def training_step(self, b, i):
            x, y = b
            return torch.nn.functional.cross_entropy(self.model(x).reshape(-1, cfg["vocab_size"]), y.reshape(-1))

    tokens = torch.zeros(batch, seq, dtype=torch.long)
    module = Meta()
    profile = profile_module(module, (tokens, tokens))
    # Priced as ElixirStrategy's default (calibrate=True) prices it: each block timed on this CPU, one at a time
    # (the model stays on meta), and FSDP2's per-unit overheads fitted in a process group of this run's one rank.
    profile = time_module_blocks(module, (tokens, tokens), profile, device=torch.device("cpu"))
    device = profile_device("cpu", quick=True, progress=False)
    with _one_rank_group():
        device = calibrate_device(device, device="cpu", quick=True, progress=False)
    # Measured now (refresh), on the machine as the contenders find it: a profile cached while something else ran
    # (a build, another benchmark) prices the disk at what it did then. With its overlap of reads and compute.
    disk = profile_disk(disk_dir, quick=True, refresh=True, progress=False)
    cluster = with_disk(ClusterSpec.uniform(device, 1), disk)
    state = 16 * profile.param_numel
    kw = dict(precision="32-true", optimizer="adamw")
    device_budget = 256 * MiB  # raised to what the search says the device needs (one unit's working set here)
    # The target: state 3x the limit (2% of headroom); raised to what the search says a plan needs. The child builds
    # the model on meta (configure_model): the strategy allocates and initialises it one tier-3 unit at a time into
    # the store, and after fit leaves those weights there when they do not fit, so neither setup nor teardown holds
    # the fp32 model in RAM (the setup peak is in the samples).
    target = int(state / (TARGETS["state_over_limit"] * 1.02)) - fixed
    host = max(64 * MiB, target - device_budget)
    target_host_infeasible = None
    for _ in range(4):
        try:
            plan = search(profile, cluster, memory_budget=device_budget, host_budget=host, **kw)
            break
        except PlanInfeasibleError as exc:
            say(f"no plan at device {device_budget / MiB:.0f} MiB, host {host / MiB:.0f} MiB ({exc.tier} short): "
                f"{str(exc)[:160]}")
            if exc.tier == "host" and target_host_infeasible is None:
                target_host_infeasible = str(exc)
            if exc.tier == "device":
                device_budget = int(exc.needed_bytes * 1.05)
                host = max(64 * MiB, min(host, target - device_budget))
            else:
                host = int(max(exc.needed_bytes, host) * 1.03)
    else:
        raise RuntimeError("the search found no disk plan for the benchmark model in 4 tries")
    units = tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0) for u in plan.units)
    ram = dataclasses.replace(plan, units=units, disk_bytes_per_rank=0, disk_path="")
    # The same units all in RAM, priced by the same model: its error against the RAM run is the compute model's
    # share of the disk plan's error.
    ram_priced = estimate(profile, cluster, units, forward_prefetch=plan.forward_prefetch,
                          backward_prefetch=plan.backward_prefetch, **kw)
    return {"plan": plan, "ram_plan": ram, "disk": disk, "device": device, "state_bytes": state,
            "device_budget": device_budget, "host_budget": host, "params": profile.param_numel,
            "target_host_infeasible": target_host_infeasible, "ram_predicted_step_s": ram_priced.step_time_s}


def deepspeed_config(cfg: dict, disk: object, disk_dir: Path, lr: float, limit: int) -> dict:
    """ZeRO-Infinity as its docs tell a user with a small host: both offloads on NVMe, buffers sized to fit."""
    largest = cfg["vocab_size"] * cfg["hidden"]  # the (tied) embedding: the largest parameter
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": 3, "contiguous_gradients": True, "overlap_comm": False,
            "sub_group_size": int(largest),
            "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": int(2 * largest),
            "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": int(largest),
            "offload_optimizer": {"device": "nvme", "nvme_path": str(disk_dir), "pin_memory": False,
                                  "pipeline_read": False, "pipeline_write": False, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": str(disk_dir), "pin_memory": False,
                              "buffer_count": param_buffers(cfg), "buffer_size": int(largest), "max_in_cpu": 0},
        },
        "aio": {"block_size": int(disk.request_bytes), "queue_depth": int(disk.queue_depth),  # type: ignore[attr-defined]
                "intra_op_parallelism": 1, "single_submit": False, "overlap_events": True},
    }


def run_child(role: str, spec: dict, limit: int | None, work: Path) -> dict:
    """One contender process under ``limit`` (``None``: no limit; the group then only measures the peak)."""
    from benchmarks.memlimit import drop_page_cache, last_json_line, run_limited

    spec_path = work / f"spec-{role.replace(' ', '_')}-{spec['seed']}.json"
    spec_path.write_text(json.dumps(spec))
    drop_page_cache()
    cap = limit if limit is not None else 1 << 50
    env = dict(os.environ, PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    run = run_limited([sys.executable, "-m", "benchmarks._elixir_disk_child", str(spec_path)], cap,
                      name=f"elixir-disk-bench-{role.split()[0]}", env=env, cwd=HERE.parent, timeout=420)
    try:
        out = last_json_line(run.stdout)
    except ValueError:
        out = {"ok": False, "error": f"exit {run.returncode}, no result line", "stderr_tail": run.stderr[-1500:]}
    out["limit"] = run.summary()
    out["limit"]["capped"] = limit is not None
    return out


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through ``finally``: the child is killed, the work directory removed


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to use (default: a temporary directory in /tmp)")
    ap.add_argument("--skip", action="append", default=[], choices=CONTENDERS, help="leave a contender out")
    ap.add_argument("--margin", type=int, default=256, help="MiB the limit adds for what no budget covers beyond the "
                                                           "interpreter (Lightning's loop, allocator slack); default 256")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 2)
    steps, batch, seq, lr = 3, 1, 64, 1e-3
    from benchmarks.memlimit import limit_unavailable
    from tightfit.storage import mount_of

    base = Path(args.dir or tempfile.gettempdir())
    # A SIGTERM (kill, a job scheduler, a timeout) ends the run through the cleanup below, not around it: the run's
    # stores and swap files are several GiB (one killed run left 9.7 GiB in /tmp, and the next found its disk short).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="tightfit-elixir-disk-", dir=base))
    say = lambda m: print(f"[elixir_disk] {m}", file=sys.stderr, flush=True)  # noqa: E731
    load_before = os.getloadavg()
    cfg = model_config(args.quick)
    try:
        t0 = time.perf_counter()
        baseline = interpreter_baseline()
        plans = make_plans(cfg, batch, seq, root, say, fixed=baseline + args.margin * MiB)
        plan, disk = plans["plan"], plans["disk"]
        limit = plans["device_budget"] + plans["host_budget"] + baseline + args.margin * MiB
        plan_path, ram_path = root / "plan.json", root / "ram_plan.json"
        plan.to_json(plan_path)
        plans["ram_plan"].to_json(ram_path)
        say(f"{plans['params'] / 1e6:.1f} M params, state {plans['state_bytes'] / GiB:.2f} GiB, limit {limit / GiB:.2f} GiB "
            f"(device {plans['device_budget'] / GiB:.2f} + host {plans['host_budget'] / GiB:.2f} + baseline "
            f"{baseline / GiB:.2f}); plan: {len(plan.disk_units)}/{len(plan.units)} units on disk, predicted "
            f"{plan.step_time_s:.2f} s/step; set up in {time.perf_counter() - t0:.0f} s")
        skip = list(args.skip)
        ds_reason = None if "deepspeed nvme" in skip else deepspeed_unavailable(say)
        if ds_reason is not None:
            say(f"DeepSpeed NVMe peer skipped: {ds_reason}")
            skip.append("deepspeed nvme")
        runs: dict[str, list[dict]] = {n: [] for n in CONTENDERS if n not in skip}
        names = list(runs)
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                work = root / f"{name.replace(' ', '_')}-{rep}"
                work.mkdir()
                spec = {"role": {"elixir disk": "elixir", "deepspeed nvme": "deepspeed", "ram": "ram"}[name],
                        "config": cfg, "batch": batch, "seq": seq, "steps": steps, "seed": rep, "lr": lr,
                        "work_dir": str(work), "disk_dir": str(work / "disk"), "host_budget": plans["host_budget"],
                        "plan": str(ram_path if name == "ram" else plan_path),
                        "ds_config": deepspeed_config(cfg, disk, work / "disk", lr, limit)}
                (work / "disk").mkdir()
                start = time.perf_counter()
                out = run_child(name, spec, None if name == "ram" else limit, root)
                shutil.rmtree(work, ignore_errors=True)  # fresh swap files and stores every repeat
                runs[name].append(out)
                if name == "deepspeed nvme" and out["limit"].get("oom_killed") and DS_UNCAPPED not in runs:
                    # Killed by the limit: run it once (first such repeat) without one, for its speed and its need.
                    (work / "disk").mkdir(parents=True)
                    runs.setdefault(DS_UNCAPPED, []).append({**run_child(DS_UNCAPPED, spec, None, root),
                                                             "repeat": rep})
                    shutil.rmtree(work, ignore_errors=True)
                step = statistics.median(s["wall_s"] for s in _timed(out["steps"])) if out.get("ok") else None
                say(f"repeat {rep + 1}/{repeats} {name}: " + (f"{step:.2f} s/step" if step else
                    f"failed: {out.get('error') or out.get('unavailable')}") + f" (process {time.perf_counter() - start:.0f} s"
                    f", peak {(out['limit']['peak_bytes'] or 0) / GiB:.2f} GiB, oom_kill {out['limit']['oom_killed']})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    stats = analyse(runs, disk, plan)
    exact = exactness(runs) if {"elixir disk", "ram"} <= set(runs) else {"per_repeat": [], "exact": False}
    reason = limit_unavailable()
    params = {"quick": args.quick, "repeats": repeats, "steps": steps, "batch": batch, "seq": seq, "lr": lr,
              "config": cfg, "params": plans["params"], "state_bytes": plans["state_bytes"], "limit": limit,
              "limit_enforced": reason is None, "limit_reason": reason, "baseline": baseline, "margin": args.margin * MiB,
              "deepspeed_unavailable": ds_reason,
              "device_budget": plans["device_budget"], "host_budget": plans["host_budget"],
              "target_host_infeasible": plans["target_host_infeasible"], "disk_dir_fs": mount_of(base).filesystem,
              "ram_predicted_step_s": plans["ram_predicted_step_s"],
              "disk_read_gb_s": disk.read_fit[1] / 1e9, "disk_write_gb_s": disk.write_fit[1] / 1e9,
              "disk_request_mib": disk.request_bytes / MiB, "disk_queue_depth": disk.queue_depth,
              "disk_compute_overlap": disk.compute_overlap,
              "disk_units": len(plan.disk_units), "units": len(plan.units), "plan_disk_bytes": plan.disk_bytes_per_rank,
              "param_disk_units": len(plan.param_disk_units), "predicted_param_io_s": plan.breakdown.param_io_s,
              "grad_disk_units": len(plan.grad_disk_units), "plan_host_bytes": plan.host_bytes_per_rank,
              "predicted_step_s": plan.step_time_s, "predicted_disk_io_s": plan.breakdown.disk_io_s,
              "commit": _commit(), "load_before": load_before, "load_after": os.getloadavg(),
              "disk_profile": disk.to_json(), "plan_explain": plan.explain(), "targets": TARGETS}
    text, head = markdown(stats, exact, params)
    write_result(NAME, title="Elixir with optimizer state and master weights on disk under a hard memory limit vs DeepSpeed ZeRO-Infinity",
                 params=params, results={"headline": head, "stats": stats, "exactness": exact, "runs": runs},
                 markdown=text, plots=_plot(stats),
                 measures=collect([runs.get("elixir disk", []), runs.get("ram", []),  # the children's own files
                                   runs.get("deepspeed nvme", []) + runs.get(DS_UNCAPPED, [])],
                                  fallback=("benchmarks/_elixir_disk_child.py", "core", "plugins/lightning_elixir")))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
