"""``tightfit plan <planner> ...``: compute a plan from profiles, print it, write the plan file.

    tightfit plan elixir --model gpt2-10b --devices 4 --device-memory 40GiB --preset a100-40g --json plan.json

Each planner is one entry of :data:`PLANNERS`: ``name -> (help, add_arguments, run)``; a planner's
``add_arguments(parser)`` adds its flags to its own sub-parser and ``run(args) -> int`` does the work.
Shared flags (the model, the devices) come from :func:`add_model_arguments` / :func:`add_device_arguments`
so every planner reads them the same way.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tightfit.commands.args import (
    UsageError,
    add_disk_arguments,
    budget,
    byte_size,
    exit_codes_help,
    json_file,
    positive_int,
)
from tightfit.console import Progress, fit_text, log, terminal_width
from tightfit.planner.optimizers import OPTIMIZERS as _OPTIMIZER_TABLE
from tightfit.planner.optimizers import PRECISIONS as _PRECISION_TABLE
from tightfit.units import format_bytes, format_table

__all__ = ["PLANNERS", "PLUGIN_PLANNERS", "add_arguments", "run", "add_model_arguments", "add_device_arguments",
           "load_model_profile", "load_cluster", "progress_bar", "check_devices", "model_config", "PRECISIONS", "OPTIMIZERS"]


# The planner's cost model knows these: read from the one optimizer/precision table (a torch-free module,
# so parsing stays fast; tests/core/test_cli_errors.py checks the lists agree with tightfit.planner.cost).
PRECISIONS = tuple(_PRECISION_TABLE)
OPTIMIZERS = tuple(_OPTIMIZER_TABLE)


# ---- shared arguments ----------------------------------------------------------------------------------
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a tightfit.models preset (gpt2, gpt2-xl, gpt2-4b, gpt2-10b, gpt2-15b, "
                                     "gpt2-20b, ...) profiled on the meta device")
    src.add_argument("--profile", metavar="PATH", type=json_file,
                     help="a ModelProfile JSON file (`tightfit profile model --json`)")
    g.add_argument("--batch", type=positive_int, default=8, help="per-device micro-batch (default 8)")
    g.add_argument("--seq", type=positive_int, default=1024, help="sequence length (default 1024)")


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("devices")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--preset", help="datasheet device preset (a100-40g, a100-80g, h100-80g, ...)")
    src.add_argument("--device-profile", metavar="PATH", help="a DeviceProfile JSON file")
    src.add_argument("--cluster", metavar="PATH", help="a ClusterSpec JSON file (one profile per rank)")
    g.add_argument("--devices", type=positive_int, default=1, help="number of devices (ranks); default 1")
    g.add_argument("--nodes", type=positive_int, default=1, help="hosts the devices span, dividing --devices "
                                                                 "(default 1)")
    g.add_argument("--device-memory", metavar="SIZE", type=byte_size,
                   help="memory per device, overriding the profile ('40GiB')")
    g.add_argument("--host-memory", metavar="SIZE", type=byte_size,
                   help="memory per host, overriding the profile ('512GiB'): plan a cluster's offload from a laptop")


def load_model_profile(args: argparse.Namespace):
    """The ModelProfile named by ``--profile`` or ``--model`` (+ ``--batch``/``--seq``)."""
    from tightfit.profiler.types import ModelProfile

    if args.profile:
        try:
            return ModelProfile.from_json(args.profile)
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--profile {args.profile}: not a ModelProfile ({type(e).__name__}: {e}); write one "
                             "with `tightfit profile model --model NAME --json PATH`") from None
    try:
        import torch

        from tightfit.models import build_gpt
        from tightfit.profiler import profile_model  # type: ignore[attr-defined]
    except ImportError as e:
        raise UsageError(f"tightfit plan: cannot profile --model here ({e}); pass --profile PATH instead") from None
    cfg = model_config(args.model)
    if args.seq > cfg.n_positions:
        raise UsageError(f"tightfit plan: --seq {args.seq} exceeds {args.model}'s context of {cfg.n_positions}; "
                         f"use --seq {cfg.n_positions} or less")
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    log.info("[plan] profiling %s (batch %d, seq %d) on the meta device ...", args.model, args.batch, args.seq)
    return profile_model(lambda: build_gpt(cfg), ids, name=args.model)


def model_config(name: str):
    """The GPT preset ``--model NAME`` (a UsageError listing the presets otherwise)."""
    from tightfit.models import gpt_config

    try:
        return gpt_config(name)
    except KeyError as e:
        raise UsageError(f"tightfit plan: --model {name!r}: {e.args[0]}") from None


def load_cluster(args: argparse.Namespace):
    """The ClusterSpec named by ``--cluster``, ``--device-profile`` or ``--preset`` (``--devices``, ``--nodes``,
    ``--device-memory`` applied); without any of them, the local device's measured profile."""
    import dataclasses

    from tightfit.profiler.types import ClusterSpec, DeviceProfile

    if args.cluster:
        try:
            cluster = ClusterSpec.from_json(args.cluster)
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--cluster {args.cluster}: not a ClusterSpec ({type(e).__name__}: {e}); write one "
                             "with tightfit.profiler.device.cluster_spec(...).to_json(PATH)") from None
        if args.device_memory:
            mem = args.device_memory
            cluster = dataclasses.replace(cluster, devices=tuple(
                dataclasses.replace(d, memory_bytes=mem, free_bytes=mem) for d in cluster.devices))
        if getattr(args, "host_memory", None):
            hm = args.host_memory
            cluster = dataclasses.replace(cluster, devices=tuple(
                dataclasses.replace(d, host_memory_bytes=hm) for d in cluster.devices))
        return _with_disk_tier(cluster, args)
    if args.device_profile:
        try:
            device = DeviceProfile.from_json(args.device_profile)
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--device-profile {args.device_profile}: not a DeviceProfile ({type(e).__name__}: "
                             f"{e}); write one with `tightfit profile device --json PATH`") from None
    elif args.preset:
        device = _preset(args.preset)
    else:
        from tightfit.profiler import profile_device  # type: ignore[attr-defined]

        log.info("[plan] no --preset/--device-profile: profiling this machine's device (cached) ...")
        device = profile_device(quick=True)
        if device.kind == "cpu" and args.device_memory and args.device_memory < device.memory_bytes:
            # A CPU's matmul rate prices a GPT-2 XL step on "4 x 24GiB" at about a day: the memory says
            # accelerator, the rates say laptop. Planning a CPU for less memory than it has is that case.
            raise UsageError(
                f"tightfit plan: no --preset or --device-profile, so this machine's CPU profile ({device.name}) would "
                f"price the step, but --device-memory {args.device_memory} describes another device; pass "
                "--preset (one of: " + ", ".join(_preset_names()) + ") for accelerators you do not have, or "
                "--device-profile PATH with a profile saved on the target machine (`tightfit profile device --json`)")
    if args.device_memory:
        mem = args.device_memory
        device = dataclasses.replace(device, memory_bytes=mem, free_bytes=mem)
    if getattr(args, "host_memory", None):
        device = dataclasses.replace(device, host_memory_bytes=args.host_memory)
    return _with_disk_tier(ClusterSpec.uniform(device, args.devices, nodes=args.nodes), args)


def _with_disk_tier(cluster, args: argparse.Namespace):
    """``cluster`` with the disk tier ``--disk-dir/--disk-preset/--disk-space`` name (unchanged without them)."""
    from tightfit.profiler.disk_presets import disk_from_args, with_disk

    if not hasattr(args, "disk_dir"):
        return cluster
    try:
        return with_disk(cluster, disk_from_args(args))
    except (ValueError, KeyError, OSError) as e:  # a missing or read-only directory, an unknown preset, a bad size
        raise UsageError(f"tightfit plan: {e.args[0] if isinstance(e, KeyError) else e}") from None


def _preset_names() -> list[str]:
    from tightfit.profiler.device import DATASHEETS

    return list(DATASHEETS)


def _preset(name: str):
    """A datasheet DeviceProfile preset from the device profiler (``tightfit.profiler.device``)."""
    from tightfit.profiler.device import device_preset

    try:
        return device_preset(name)
    except KeyError as e:
        raise UsageError(f"tightfit plan: --preset {name!r}: {e.args[0]}") from None


def check_devices(args: argparse.Namespace) -> None:
    """Flag combinations that argparse cannot see one at a time (before any profiling)."""
    if args.devices % args.nodes:
        raise UsageError(f"tightfit plan: --devices {args.devices} cannot be split evenly over --nodes {args.nodes}; "
                         "give a --nodes that divides --devices")


def progress_bar(label: str) -> Progress:
    """A ``progress(done, total, what)`` callback: a bar on a terminal, a log line per stage otherwise."""
    return Progress(label)


# ---- elixir ----------------------------------------------------------------------------------------------
def _elixir_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_device_arguments(parser)
    g = parser.add_argument_group("plan")
    g.add_argument("--budget", metavar="SIZE|FRACTION", type=budget,
                   help="memory budget per device: a size with a unit ('38GiB') or a bare fraction of the device's "
                        "memory in (0, 1] (0.9); default: all of it")
    g.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS, help="training precision (default "
                                                                                 "bf16-mixed)")
    g.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="optimizer whose state is planned "
                                                                            "(default adamw)")
    g.add_argument("--host-budget", metavar="SIZE", type=byte_size,
                   help="host memory offloaded state may use per rank ('4GiB'); default: the host's memory x 0.8 "
                        "/ ranks per node")
    g.add_argument("--no-offload", action="store_true", help="never offload units to host memory")
    g.add_argument("--no-checkpointing", action="store_true", help="never recompute activations")
    g.add_argument("--exhaustive", action="store_true", help="exact search (small models only)")
    g.add_argument("--full", action="store_true", help="one table row per unit (default: identical runs folded)")
    g.add_argument("--baselines", action="store_true",
                   help="also price ZeRO-2/ZeRO-3 (+offload) configurations with the same cost model")
    g.add_argument("--json", metavar="PATH", help="write the plan file ElixirStrategy(plan=PATH) accepts")
    g.add_argument("--plot", metavar="FILE", help="draw the units (where their state lives, recompute, predicted "
                                                  "time and memory) into this PNG/SVG/PDF (needs matplotlib)")
    add_disk_arguments(parser)  # units may keep their optimizer state on that disk


def _elixir_run(args: argparse.Namespace) -> int:
    from tightfit.planner.elixir import BASELINES, ElixirConstraints, PlanInfeasibleError, baseline, search

    check_devices(args)
    if args.model:
        model_config(args.model)
    cluster = load_cluster(args)  # before the model: a bad preset or file stops here, not after profiling
    profile = load_model_profile(args)
    here = _planned_here(args, cluster)
    constraints = ElixirConstraints(allow_offload=not args.no_offload, allow_checkpointing=not args.no_checkpointing,
                                    exhaustive=True if args.exhaustive else None,
                                    # this machine's CPU: device and host are the memory this interpreter lives in
                                    reserved_bytes=here.resident if here is not None else None)
    try:
        plan = search(profile, cluster, optimizer=args.optimizer, precision=args.precision, memory_budget=args.budget,
                      host_budget=args.host_budget, constraints=constraints, progress=progress_bar("plan elixir"))
    except PlanInfeasibleError as e:
        limit = (f"under the memory limit of {format_bytes(here.capacity)} ({here.limit_file}): "
                 if here is not None and here.limited else "")
        log.error("tightfit plan elixir: %s%s", limit, e)
        return 3
    print(fit_text(plan.explain(full=args.full)))
    if args.baselines:
        rows = [("elixir", f"{plan.step_time_s:.3f} s", format_bytes(plan.peak_bytes), "yes", "1.00x")]
        for name in BASELINES:
            b = baseline(profile, cluster, name, optimizer=args.optimizer, precision=args.precision,
                         memory_budget=plan.budget_bytes)
            rows.append((name + (" +ckpt" if b.checkpointed_blocks else ""), f"{b.step_time_s:.3f} s",
                         format_bytes(b.peak_bytes), "yes" if b.fits else "no (OOM)",
                         f"{b.step_time_s / plan.step_time_s:.2f}x"))
        print("\nfixed configurations, same cost model:")
        print(format_table(rows, ("config", "step", "peak", "fits", "time vs elixir"), align="lrrlr",
                           max_width=terminal_width()))
    if args.json:
        plan.to_json(args.json)
        print(f"\nwrote {args.json} (ElixirStrategy(plan={args.json!r}) applies it)")
    if args.plot:
        from tightfit.commands.plots import plot_elixir_plan

        plot_elixir_plan(plan, args.plot)
        print(f"wrote {args.plot} (units: where their state lives, recompute, predicted time and memory)")
    return 0


def _planned_here(args: argparse.Namespace, cluster):
    """Core's reading of memory (:mod:`tightfit.memory_limit`) where the plan is for this machine's CPU (nothing
    given but perhaps --device-memory): its device memory is the memory limit this process runs under, and the
    interpreter's resident set is part of the process the plan must fit; ``None`` otherwise."""
    if args.cluster or args.device_profile or args.preset or args.device_memory:
        return None
    if any(d.kind != "cpu" for d in cluster.devices):
        return None
    from tightfit.memory_limit import read_memory

    return read_memory()


# name -> (help, add_arguments(parser), run(args) -> int). Add a row for another planner.
PLANNERS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "elixir": ("search the fastest FSDP2 sharding x offload x recompute plan that fits (Elixir)",
               _elixir_arguments, _elixir_run),
    "sky": ("partition a pipeline over devices of unequal speed and memory (Sky)",
            lambda p: _plan_sky().add_arguments(p), lambda a: _plan_sky().run(a)),
}


# `tightfit plan` planners that come from plugins, listed in `tightfit plan --help` (run by the plugin's plan_cli).
PLUGIN_PLANNERS: dict[str, str] = {
    "serve": "the serving process of a model directory under this machine's memory, and an MoE model's expert "
             "placement, before anything loads (plugin energon; `tightfit plan serve --help`)",
}


def _plan_sky():
    import importlib

    return importlib.import_module("tightfit.commands.plan_sky")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("plugin planners:\n" + "\n".join(f"  {n:<9} {h}" for n, h in PLUGIN_PLANNERS.items())
                     + ("\n\n" + parser.epilog if parser.epilog else ""))
    sub = parser.add_subparsers(dest="planner", metavar="PLANNER")
    for name, (help_text, add, _) in PLANNERS.items():
        add(sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                           epilog=exit_codes_help()))


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "planner", None):
        raise UsageError(f"tightfit plan: name a planner: {', '.join([*PLANNERS, *PLUGIN_PLANNERS])} (e.g. "
                         "`tightfit plan elixir --help`)")
    return PLANNERS[args.planner][2](args)
