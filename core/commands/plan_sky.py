"""``tightfit plan sky``: a heterogeneous pipeline partition for devices of unequal speed and memory.

    tightfit plan sky --model gpt2-xl --speeds 1,0.33,1,0.5 --memory 40GiB,16GiB,40GiB,24GiB \
        --microbatches 8 --schedule 1f1b --link 10e9 --compare --json sky_plan.json
    tightfit plan sky --layers 24 --speeds 1,0.25,0.5,0.4 --memory 16GiB     # synthetic uniform layers

Layer costs come from a model profile (the profiled blocks' forward+backward FLOPs at ``--rate``
FLOP/s on a speed-1.0 device; their parameter, saved-activation and output bytes) or, with
``--layers``, from identical synthetic layers. The plan file is what ``SkyStrategy(partition=...)``
takes as boundaries (``plan.boundaries``).
"""

from __future__ import annotations

import argparse
import sys

from tightfit.units import format_table, parse_bytes

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a tightfit.models preset profiled on the meta device (gpt2, gpt2-xl, ...)")
    src.add_argument("--profile", metavar="PATH", help="a ModelProfile JSON file")
    src.add_argument("--layers", type=int, help="synthetic: this many identical layers")
    g.add_argument("--batch", type=int, default=8, help="microbatch size for --model (default 8)")
    g.add_argument("--seq", type=int, default=1024, help="sequence length for --model (default 1024)")
    g.add_argument("--layer-seconds", type=float, default=0.01, help="synthetic layer fwd+bwd seconds (0.01)")
    g.add_argument("--layer-bytes", default="256MiB", help="synthetic layer parameter bytes (256MiB)")
    d = parser.add_argument_group("devices")
    d.add_argument("--speeds", required=True, help="relative speed per device, comma separated ('1,0.33,1')")
    d.add_argument("--memory", default="80GiB", help="memory per device: one size or one per device")
    d.add_argument("--rate", type=float, default=100e12, help="FLOP/s of a speed-1.0 device for --model (1e14)")
    d.add_argument("--link", type=float, default=None, help="bytes/s between devices (default: free transfers)")
    p = parser.add_argument_group("plan")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b (default) or interleaved")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("--virtual-stages", type=int, default=2, help="chunks per device for interleaved (2)")
    p.add_argument("--optimizer-state", type=float, default=2.0, help="optimizer bytes per parameter byte (Adam 2)")
    p.add_argument("--compare", action="store_true", help="also price even, parameter-balanced and Sky's allocator")
    p.add_argument("--json", metavar="PATH", help="write the PartitionPlan JSON here")


def _layers(args: argparse.Namespace):
    from tightfit.planner.pipeline import LayerMemory

    if args.layers:
        size = parse_bytes(args.layer_bytes)
        return (args.layer_seconds,) * args.layers, (LayerMemory(param_bytes=size),) * args.layers
    from tightfit.commands.plan import load_model_profile

    prof = load_model_profile(args)
    costs = tuple((b.fwd_flops + b.bwd_flops) / args.rate for b in prof.blocks)
    mems = tuple(LayerMemory(param_bytes=b.param_bytes, activation_bytes=b.saved_bytes, output_bytes=b.output_bytes)
                 for b in prof.blocks)
    return costs, mems


def run(args: argparse.Namespace) -> int:
    from tightfit.planner.errors import PlanError, PlanInfeasibleError
    from tightfit.planner.pipeline import (
        DeviceSpec,
        PipelineProblem,
        balance,
        even,
        parameter_balanced,
        sky_allocator,
    )

    try:
        speeds = [float(s) for s in args.speeds.split(",")]
        sizes = [parse_bytes(m) for m in args.memory.split(",")]
    except ValueError as e:
        print(f"tightfit plan sky: {e}", file=sys.stderr)
        return 2
    if len(sizes) == 1:
        sizes *= len(speeds)
    if len(sizes) != len(speeds):
        print(f"tightfit plan sky: --memory has {len(sizes)} sizes for {len(speeds)} --speeds; give one or one per "
              "device", file=sys.stderr)
        return 2
    costs, mems = _layers(args)
    try:
        devices = tuple(DeviceSpec(name=f"dev{i}(x{s:g})", speed=s, memory_bytes=m)
                        for i, (s, m) in enumerate(zip(speeds, sizes)))
        problem = PipelineProblem(layer_costs=costs, layer_memory=mems, devices=devices,
                                  microbatches=args.microbatches, schedule=args.schedule, links=args.link,
                                  virtual_stages=args.virtual_stages, optimizer_state_factor=args.optimizer_state)
        plan = balance(problem)
    except PlanInfeasibleError as e:
        print(f"tightfit plan sky: {e}", file=sys.stderr)
        return 3
    except PlanError as e:
        print(f"tightfit plan sky: {e}", file=sys.stderr)
        return 2
    print(plan.explain())
    if args.compare:
        rows = []
        others = [("even", even), ("parameter-balanced", parameter_balanced)]
        if args.schedule != "interleaved":
            others.append(("sky (Sky Computing's allocator)", sky_allocator))
        for name, fn in others:
            try:
                other = fn(problem)
                rows.append((name, other.layer_counts(), f"{other.step_time_s * 1e3:.2f} ms",
                             "yes" if other.feasible else "no (OOM)", f"{other.step_time_s / plan.step_time_s:.2f}x"))
            except PlanInfeasibleError:
                rows.append((name, "-", "-", "no (OOM)", "-"))
        rows.append(("balanced (ours)", plan.layer_counts(), f"{plan.step_time_s * 1e3:.2f} ms", "yes", "1.00x"))
        print("\nsame cost model:")
        print(format_table(rows, ("partition", "layers per device", "step", "fits", "time vs ours"), align="llrlr"))
    if args.json:
        plan.to_json(args.json)
        print(f"\nwrote {args.json}: stage k runs on device {list(plan.order)}[k]; with the ranks in that order, "
              f"SkyStrategy(partition={list(plan.boundaries)}) applies these boundaries")
    return 0
