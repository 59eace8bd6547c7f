"""``tightfit profile model|device|disk``: print (and optionally save) a model, device or disk profile.

    tightfit profile model --model gpt2-xl --batch 8 --seq 1024 [--json out.json] [--checkpointing all]
    tightfit profile model --model path/to/config.json      # ours, or a Hugging Face config.json
    tightfit profile device [--quick] [--refresh] [--json out.json]
    tightfit profile device --preset a100-40g               # a datasheet preset, nothing measured
    tightfit profile disk /mnt/nvme [--quick] [--refresh] [--json [out.json]]   # the disk tier (cached)
    tightfit profile disk /mnt/nvme --preset nvme-gen4      # typical speed, that directory's free space
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from tightfit.commands.args import UsageError, nonnegative_int, positive_int
from tightfit.console import fit_text, log, terminal_width
from tightfit.units import format_bytes, format_table

__all__ = ["add_arguments", "run", "format_device", "format_disk"]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="WHAT")
    m = sub.add_parser("model", help="profile one training step of a model on the meta device (nothing allocated)",
                       description="Profile one training (or forward) step of a model under fake tensors on the "
                                   "meta device: parameters, blocks, FLOPs, the activation-memory timeline and "
                                   "its peak, with and without activation checkpointing. Nothing is allocated.")
    m.add_argument("--model", required=True,
                   help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-4b, gpt2-10b, gpt2-15b, gpt2-20b) "
                        "or a config.json (tightfit GPTConfig fields, or a Hugging Face config)")
    m.add_argument("--batch", type=positive_int, default=8, help="sequences per step (default 8)")
    m.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default: min(1024, context))")
    m.add_argument("--step", choices=("train", "forward"), default="train",
                   help="profile a training step (forward + backward) or a forward only (default train)")
    m.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="parameter dtype (default fp32)")
    m.add_argument("--checkpointing", default=None, type=_checkpointing,
                   help="also report the peak with these blocks checkpointed: 'all' or comma-separated block "
                        "names (checked against the model before profiling)")
    m.add_argument("--blocks", type=nonnegative_int, default=12,
                   help="block rows to print (default 12; long runs elided)")
    m.add_argument("--json", default=None, metavar="PATH", help="write the ModelProfile as JSON")
    m.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the activation-memory timeline and the level by block, plain and checkpointed, "
                        "into this PNG/SVG/PDF (needs matplotlib)")
    m.add_argument("--quiet", action="store_true", help="no progress lines")
    d = sub.add_parser("device", help="measure this machine's device (cached) or show a datasheet preset",
                       description="Measure this machine's device (memory, matmul rate, host<->device bandwidth, "
                                   "AdamW throughput; cached under ~/.cache/tightfit) or show a datasheet preset.")
    d.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA if present, else CPU)")
    d.add_argument("--quick", action="store_true", help="smaller measurements (under 10 s on a CPU)")
    d.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    d.add_argument("--preset", default=None, help="show a datasheet preset instead of measuring")
    d.add_argument("--list-presets", action="store_true", help="list the datasheet presets")
    d.add_argument("--json", default=None, metavar="PATH", help="write the DeviceProfile as JSON")
    k = sub.add_parser("disk", help="measure a directory's disk for the disk tier (cached) or show a disk preset",
                       description="Measure sequential read and write bandwidth of the disk under a directory over "
                                   "request sizes and queue depths, fit latency + bandwidth, and choose the request "
                                   "size, queue depth and O_DIRECT or buffered I/O the store will use (cached under "
                                   "~/.cache/tightfit). It writes temporary files there (deleted after).")
    k.add_argument("path", nargs="?", default=None, metavar="PATH", help="a directory on the disk to measure")
    k.add_argument("--quick", action="store_true", help="fewer sizes and smaller files (a few seconds)")
    k.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    k.add_argument("--preset", default=None, metavar="NAME",
                   help="show a datasheet disk preset with PATH's free space instead of measuring")
    k.add_argument("--list-presets", action="store_true", help="list the datasheet disk presets")
    k.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the DiskProfile as JSON to PATH; --json alone prints it instead of the table")


def _checkpointing(text: str) -> str | list[str]:
    """'all' or comma-separated block names (checked against the model before profiling)."""
    if text.strip() == "all":
        return "all"
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no block; give 'all' or block names such as "
                                         "'blocks.0,blocks.1'")
    return names


def _check_blocks(factory: Any, names: list[str], model: str) -> None:
    """Every name in ``--checkpointing`` is a module of the model (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        modules = {n for n, _ in factory().named_modules() if n}
    unknown = [n for n in names if n not in modules]
    if unknown:
        sample = ", ".join(sorted(modules, key=lambda n: (n.count("."), n))[:8])
        raise UsageError(f"tightfit profile model: --checkpointing {','.join(unknown)}: no such module in {model}; "
                         f"give 'all' or module names such as {sample}")


def _load_model(spec: str) -> tuple[Any, Any, int, str]:
    """(factory, loss target vocab, context length, name) for a preset or a config file."""
    from tightfit.models import PRESETS, GPTConfig, build_gpt, gpt_config

    path = Path(spec)
    if spec in PRESETS or spec == "gpt2-small":
        cfg = gpt_config(spec)
        return (lambda: build_gpt(cfg)), cfg.vocab_size, cfg.n_positions, cfg.name
    if not path.is_file():
        raise UsageError(f"tightfit profile model: --model {spec!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor a config.json file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"tightfit profile model: --model {spec}: not a readable JSON config ({e}); give a "
                         "config.json or a preset name") from None
    if not isinstance(data, dict):
        raise UsageError(f"tightfit profile model: --model {spec}: holds a {type(data).__name__}, not a JSON object "
                         "of config fields")
    model_type = data.get("model_type", "gpt2")
    if model_type == "gpt2" or "hidden" in data:
        cfg = GPTConfig.from_dict({**data, "name": data.get("name", path.stem)})
        return (lambda: build_gpt(cfg)), cfg.vocab_size, cfg.n_positions, cfg.name
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UsageError(f"tightfit profile model: {path} is a {model_type!r} config: profiling it needs "
                         "transformers (pip install transformers)") from None
    hf = AutoConfig.for_model(**data)
    context = int(getattr(hf, "max_position_embeddings", 0) or getattr(hf, "n_positions", 0) or 2048)
    return (lambda: AutoModelForCausalLM.from_config(hf)), hf.vocab_size, context, model_type


def _run_model(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from tightfit.profiler import profile_model

    dtype = getattr(torch, _DTYPES[args.dtype])
    factory, vocab, context, name = _load_model(args.model)
    seq = args.seq or min(1024, context)
    if seq > context:
        raise UsageError(f"tightfit profile model: --seq {seq} exceeds the model's context of {context} tokens; "
                         f"use --seq {context} or less")
    ids = torch.zeros(args.batch, seq, dtype=torch.long, device="meta")

    def loss(out: Any) -> torch.Tensor:  # next-token cross-entropy, as training computes it
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long))

    ckpt = args.checkpointing
    if isinstance(ckpt, list):
        _check_blocks(factory, ckpt, name)
    prof = profile_model(factory, ids, step=args.step, loss_fn=loss, checkpointing=ckpt, name=name,
                         param_dtype=None if dtype == torch.float32 else dtype, progress=not args.quiet and log.isEnabledFor(logging.INFO))
    print(fit_text(prof.summary(max_blocks=args.blocks)))
    if args.json:
        prof.to_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from tightfit.commands.plots import plot_model_profile

        plot_model_profile(prof, args.plot)
        print(f"wrote {args.plot} (activation memory: the traced step, then by block, plain and checkpointed)")
    return 0


def format_device(p: Any, reading: Any = None) -> str:
    """A device profile as a two-column table; ``reading`` (a :class:`tightfit.memory_limit.MemoryReading`) adds
    the memory limit this process runs under, where there is one."""
    rows: list[tuple[str, str]] = [("device", f"{p.name} ({p.kind})"), ("source", p.source),
                                   ("memory", f"{format_bytes(p.memory_bytes)} ({format_bytes(p.free_bytes)} free)")]
    if reading is not None and reading.limited:
        rows.append(("memory limit", f"{format_bytes(reading.capacity)} from {reading.limit_file} "
                                     f"({format_bytes(reading.usage)} in use; the machine has "
                                     f"{format_bytes(reading.total)}): "
                                     + ("device and host memory are bounded by it" if p.kind == "cpu"
                                        else "host memory is bounded by it")))
    for dt, rate in p.matmul_flops.items():
        rows.append((f"matmul {dt}", f"{rate / 1e12:.3f} TFLOP/s"))
    for label, table in (("host->device", p.h2d_bytes_per_s), ("device->host", p.d2h_bytes_per_s)):
        for kind, bw in table.items():
            rows.append((f"{label} {kind}", f"{bw / 1e9:.1f} GB/s"))
    rows.append(("host AdamW", f"{p.host_adam_elems_per_s / 1e6:,.0f} M elements/s"))
    if p.device_adam_elems_per_s:
        rows.append(("device AdamW", f"{p.device_adam_elems_per_s / 1e6:,.0f} M elements/s"))
    for coll, per_size in p.collective_bytes_per_s.items():
        for size, bw in sorted(per_size.items()):
            rows.append((f"{coll} {format_bytes(size)}", f"{bw / 1e9:.2f} GB/s bus (world {p.world_size})"))
    if p.host_memory_bytes:
        rows.append(("host memory", format_bytes(p.host_memory_bytes)))
    if p.key and p.source == "measured":
        rows.append(("cache key", p.key))
    return format_table(rows, ("what", "value"))


def _run_device(args: argparse.Namespace) -> int:
    from tightfit.profiler.device import DATASHEETS, device_preset, profile_device

    if args.list_presets:
        print(format_table([(n, p.name, format_bytes(p.memory_bytes), f"{p.matmul_flops.get('bfloat16', 0) / 1e12:.0f}")
                            for n, p in DATASHEETS.items()], ("preset", "device", "memory", "bf16 TFLOP/s"),
                           align="llrr", max_width=terminal_width()))
        return 0
    try:
        prof = device_preset(args.preset) if args.preset else profile_device(args.device, quick=args.quick,
                                                                             refresh=args.refresh)
    except KeyError as exc:
        raise UsageError(f"tightfit profile device: {exc.args[0]}") from None
    from tightfit.memory_limit import read_memory

    print(format_device(prof, None if args.preset else read_memory()))
    if args.json:
        prof.to_json(args.json)
        print(f"wrote {args.json}")
    return 0


def format_disk(d: Any) -> str:
    """A disk profile as a two-column table, then its bandwidth by request size and queue depth."""
    fs = d.filesystem or "unknown"
    if d.in_memory:
        fs += " (RAM: a disk tier here saves no memory)"
    free = format_bytes(d.free_bytes) + (f" of {format_bytes(d.total_bytes)}" if d.total_bytes else "")
    rows: list[tuple[str, str]] = [
        ("path", d.path or "(not a local directory)"), ("source", d.source), ("filesystem", fs), ("free", free)]
    for what, fit in (("read", d.read_fit), ("write", d.write_fit)):
        rows.append((f"{what} fit", f"{fit[0] * 1e6:.0f} us + bytes / {fit[1] / 1e9:.2f} GB/s"))
    rows += [("request size", format_bytes(d.request_bytes)), ("queue depth", str(d.queue_depth)),
             ("I/O", "O_DIRECT" if d.direct else "buffered (page cache)")]
    if d.key and d.source == "measured":
        rows.append(("cache key", d.key))
    text = format_table(rows, ("what", "value"))
    cells = sorted({(size, depth) for table in (d.read_bytes_per_s, d.write_bytes_per_s)
                    for size, per_depth in table.items() for depth in per_depth})
    if cells:
        def rate(table: dict, size: int, depth: int) -> str:
            value = table.get(size, {}).get(depth)
            return "-" if value is None else f"{value / 1e9:.2f}"

        chosen = (d.request_bytes, d.queue_depth)
        bw = [(format_bytes(size), str(depth), rate(d.read_bytes_per_s, size, depth),
               rate(d.write_bytes_per_s, size, depth), "<- chosen" if (size, depth) == chosen else "")
              for size, depth in cells]
        text += "\n" + format_table(bw, ("request", "depth", "read GB/s", "write GB/s", ""), align="rrrrl")
    return text


def _run_disk(args: argparse.Namespace) -> int:
    import warnings

    from tightfit.profiler.disk_presets import DISK_DATASHEETS, disk_tier, preset_label

    if args.list_presets:
        print(format_table([(n, preset_label(n), f"{p.read_fit[1] / 1e9:.2f}", f"{p.write_fit[1] / 1e9:.2f}",
                             f"{p.read_fit[0] * 1e6:.0f}") for n, p in DISK_DATASHEETS.items()],
                           ("preset", "disk", "read GB/s", "write GB/s", "latency us"), align="llrrr",
                           max_width=terminal_width()))
        return 0
    if args.path is None:
        raise UsageError("tightfit profile disk: give the directory to measure, e.g. `tightfit profile disk "
                         "/mnt/nvme --quick` (or --list-presets)")
    from tightfit.storage import StorageError

    with warnings.catch_warnings(record=True) as caught:  # the tmpfs warning as one log line, not a warnings dump
        warnings.simplefilter("always")
        try:
            prof = disk_tier(path=args.path, preset=args.preset, quick=args.quick, refresh=args.refresh,
                             progress=log.isEnabledFor(logging.INFO))
        except KeyError as exc:
            raise UsageError(f"tightfit profile disk: --preset: {exc.args[0]}") from None
        except (StorageError, OSError) as exc:
            raise UsageError(f"tightfit profile disk: {exc}") from None
    for w in caught:
        log.warning("tightfit profile disk: %s", w.message)
    assert prof is not None
    if args.json == "-":
        print(prof.to_json())
        return 0
    print(format_disk(prof))
    if args.json:
        prof.to_json(args.json)
        print(f"wrote {args.json}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.what == "model":
        return _run_model(args)
    if args.what == "device":
        return _run_device(args)
    if args.what == "disk":
        return _run_disk(args)
    raise UsageError("tightfit profile: say what to profile: `tightfit profile model --model gpt2-xl`, "
                     "`tightfit profile device` or `tightfit profile disk PATH`")
