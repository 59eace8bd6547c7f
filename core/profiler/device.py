"""``profile_device``: measure this machine's device; datasheet presets and ``ClusterSpec`` for others.

Measured (``source="measured"``), cached per machine under ``$TIGHTFIT_CACHE_DIR`` or
``~/.cache/tightfit/`` keyed on device name, driver and torch version (and the process-group size
when collectives were measured), so a second call is instant; ``refresh=True`` re-measures:

* memory capacity and free memory;
* matmul rate at fp32 and bf16 (and fp16 on GPU), square matmuls, best of a few repeats;
* host<->device copy bandwidth, pinned and pageable (GPU only);
* AdamW elements per second on the host CPU (``fused=True`` where torch has it, else ``foreach``)
  and on the device;
* with an initialised process group: all-gather and reduce-scatter bus bandwidth per message size
  (``(world-1)/world * bytes / time``, the nccl-tests convention).

Presets (:data:`DATASHEETS`, ``source="datasheet:<name>"``) are vendor datasheet numbers (dense
tensor-core rates, theoretical link bandwidth) for planning hardware you do not have; the host
numbers in them are typical-server assumptions, stated next to each. Disk presets (typical NVMe/SATA
figures) and the disk tier of a cluster are in :mod:`tightfit.profiler.disk_presets`.

Example:
    >>> spec = cluster_spec(devices=4, preset="a100-40g")
    >>> spec.world_size, spec.devices[0].source
    (4, 'datasheet:a100-40g')
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import platform
import re
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from tightfit.console import reporter
from tightfit.distributed import slowest
from tightfit.memory_limit import read_memory
from tightfit.profiler.disk_presets import add_disk_arguments, disk_tier, with_disk
from tightfit.profiler.types import ClusterSpec, DeviceProfile, DiskProfile
from tightfit.units import parse_bytes

_log = logging.getLogger(__name__)

__all__ = ["DATASHEETS", "device_preset", "profile_device", "cluster_spec", "cache_dir", "cache_file",
           "add_cluster_arguments", "cluster_from_args", "with_memory_now"]

GiB = 2**30
GB = 10**9
# Host assumptions for presets: a vectorised CPU AdamW on a two-socket server updates ~2e9
# elements/s (ZeRO-Offload reports ~0.3 s per 1B parameters with its CPU-Adam); pageable copies
# run at about half the pinned rate.
_HOST_ADAM = 2.0e9
_PAGEABLE = 0.5


def _sheet(name: str, *, memory: int, fp32: float, bf16: float | None, fp16: float, pcie: float, link: float,
           host_memory: int, label: str) -> DeviceProfile:
    flops = {"float32": fp32 * 1e12, "float16": fp16 * 1e12}
    if bf16 is not None:
        flops["bfloat16"] = bf16 * 1e12
    coll = {c: {64 * 2**20: link * GB} for c in ("all_gather", "reduce_scatter")}
    return DeviceProfile(
        name=label, kind="cuda", memory_bytes=memory, free_bytes=memory, matmul_flops=flops,
        h2d_bytes_per_s={"pinned": pcie * GB, "pageable": pcie * GB * _PAGEABLE},
        d2h_bytes_per_s={"pinned": pcie * GB, "pageable": pcie * GB * _PAGEABLE},
        host_adam_elems_per_s=_HOST_ADAM, device_adam_elems_per_s=0.0, collective_bytes_per_s=coll,
        world_size=1, host_memory_bytes=host_memory, source=f"datasheet:{name}", key=f"datasheet:{name}",
    )


# TFLOPS dense (no sparsity); pcie / link: GB/s per direction (PCIe 4.0 x16 = 32, 5.0 = 64;
# NVLink 3 = 300, NVLink 4 = 450 per direction); host memory: typical server per GPU node.
DATASHEETS: dict[str, DeviceProfile] = {
    "a100-40g": _sheet("a100-40g", memory=40 * GiB, fp32=19.5, bf16=312, fp16=312, pcie=32, link=300,
                       host_memory=1024 * GiB, label="NVIDIA A100-SXM4-40GB"),
    "a100-80g": _sheet("a100-80g", memory=80 * GiB, fp32=19.5, bf16=312, fp16=312, pcie=32, link=300,
                       host_memory=1024 * GiB, label="NVIDIA A100-SXM4-80GB"),
    "h100-80g": _sheet("h100-80g", memory=80 * GiB, fp32=67, bf16=989, fp16=989, pcie=64, link=450,
                       host_memory=2048 * GiB, label="NVIDIA H100 80GB HBM3"),
    "h200-141g": _sheet("h200-141g", memory=141 * GB, fp32=67, bf16=989, fp16=989, pcie=64, link=450,
                        host_memory=2048 * GiB, label="NVIDIA H200"),
    "rtx4090-24g": _sheet("rtx4090-24g", memory=24 * GiB, fp32=82.6, bf16=165.2, fp16=165.2, pcie=32, link=32,
                          host_memory=128 * GiB, label="NVIDIA GeForce RTX 4090"),
    "l4-24g": _sheet("l4-24g", memory=24 * GiB, fp32=30.3, bf16=121, fp16=121, pcie=32, link=32,
                     host_memory=192 * GiB, label="NVIDIA L4"),
    "a10g-24g": _sheet("a10g-24g", memory=24 * GiB, fp32=31.2, bf16=125, fp16=125, pcie=32, link=32,
                       host_memory=192 * GiB, label="NVIDIA A10G"),
    "v100-32g": _sheet("v100-32g", memory=32 * GiB, fp32=15.7, bf16=None, fp16=125, pcie=16, link=150,
                       host_memory=512 * GiB, label="Tesla V100-SXM2-32GB"),
}
"""Datasheet profiles by preset name (``"a100-40g"``): what :func:`device_preset` returns, for planning a
device this machine does not have."""


def device_preset(name: str) -> DeviceProfile:
    """The datasheet profile ``name`` (``"a100-40g"``); an unknown name raises listing the presets."""
    try:
        return DATASHEETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown device preset {name!r}; presets: {', '.join(DATASHEETS)}") from None


def cache_dir() -> Path:
    """``$TIGHTFIT_CACHE_DIR`` if set, else ``~/.cache/tightfit``."""
    env = os.environ.get("TIGHTFIT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tightfit"


# ---------------------------------------------------------------------------- facts


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _host_memory() -> tuple[int, int]:
    """(capacity, free) of host memory for this process: core's one reading (:mod:`tightfit.memory_limit`), so a
    memory cgroup limit bounds both; the machine's page count where ``/proc/meminfo`` cannot be read."""
    reading = read_memory()
    if reading.capacity:
        known = reading.available or reading.limit is not None  # a kernel without MemAvailable: say all is free
        return reading.capacity, reading.free if known else reading.capacity
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(total), int(total)


def with_memory_now(profile: DeviceProfile) -> DeviceProfile:
    """``profile`` (measured, perhaps cached under another limit) with its memory read now where the memory this
    process lives in differs from the profile's (a memory limit, or another one than when it was cached): on a CPU
    the device's memory and free bytes, and on any device the host's memory. Rates stay as measured; a profile
    cached under the same memory comes back unchanged."""
    if not profile.source.startswith("measured"):
        return profile
    capacity, free = _host_memory()
    if not capacity or capacity == (profile.memory_bytes if profile.kind == "cpu" else profile.host_memory_bytes):
        return profile
    if profile.kind == "cpu":
        return dataclasses.replace(profile, memory_bytes=capacity, free_bytes=min(free, capacity),
                                   host_memory_bytes=capacity)
    return dataclasses.replace(profile, host_memory_bytes=capacity)


def _driver(device: torch.device) -> str:
    if device.type != "cuda":
        return f"kernel {platform.release()}"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return f"driver {out.stdout.split()[0]}"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"cuda {torch.version.cuda}"


def _key(device: torch.device, world: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return f"{name} | {_driver(device)} | torch {torch.__version__} | world {world}"


def cache_file(key: str, quick: bool) -> Path:
    """The cache file of a measurement keyed ``key`` (device profile, calibration) under :func:`cache_dir`."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", key).strip("-").lower()
    return cache_dir() / f"device-{slug}{'-quick' if quick else ''}.json"


# ---------------------------------------------------------------------------- measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best(lambda: torch.mm(a, b), device, repeats)


def _copies(device: torch.device, nbytes: int, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    h2d, d2h = {}, {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        h2d[kind] = nbytes / _best(functools.partial(dev.copy_, host, non_blocking=True), device, repeats)
        d2h[kind] = nbytes / _best(functools.partial(host.copy_, dev, non_blocking=True), device, repeats)
    return h2d, d2h


def _adam(device: torch.device, numel: int, repeats: int) -> float:
    best = 0.0
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn_like(p)
    for fused in (True, False):
        try:
            opt = torch.optim.AdamW([p], lr=1e-3, fused=fused or None, foreach=not fused or None)
            best = max(best, numel / _best(opt.step, device, repeats))
        except (RuntimeError, ValueError, TypeError):  # fused not built for this device/torch
            continue
    return best


def _collectives(device: torch.device, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    import torch.distributed as dist

    world = dist.get_world_size()
    out: dict[str, dict[int, float]] = {"all_gather": {}, "reduce_scatter": {}}
    for size in sizes:
        numel = max(world, size // 4 // world * world)
        full = torch.zeros(numel, device=device)
        shard = torch.zeros(numel // world, device=device)
        for name, fn in (("all_gather", lambda f=full, s=shard: dist.all_gather_into_tensor(f, s)),
                         ("reduce_scatter", lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f))):
            dist.barrier()
            with warnings.catch_warnings():  # torch 2.13 renames these (*_single); 2.11 has only these names
                warnings.simplefilter("ignore", FutureWarning)
                seconds = slowest(_best(fn, device, repeats))  # every rank reports the slowest rank's time
            out[name][numel * 4] = (world - 1) / world * numel * 4 / seconds
    return out


def profile_device(device: str | torch.device | None = None, *, quick: bool = False, refresh: bool = False,
                   progress: bool = True) -> DeviceProfile:
    """Measure (or load from the cache) the profile of ``device`` (default: the current CUDA device, else the CPU).

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        quick: smaller problems and fewer repeats (under 10 s on a CPU).
        refresh: ignore the cache and measure again.
        progress: log each step at INFO (on stderr unless logging is configured: :func:`tightfit.console.reporter`).

    With an initialised ``torch.distributed`` process group every rank must call this (the
    collectives are measured together); rank 0 writes the cache.
    """
    import torch.distributed as dist

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    grouped = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if grouped else 1
    key = _key(dev, world)
    files = [cache_file(key, False)] + ([cache_file(key, True)] if quick else [])
    say = reporter(_log, "profile_device", enabled=progress)
    cached = None
    if not refresh:
        for f in files:
            if f.is_file():
                try:
                    cached = DeviceProfile.from_json(f)
                    break
                except (ValueError, TypeError, KeyError):
                    say(f"ignoring unreadable cache file {f}")
    if grouped:  # measure collectives together or not at all
        flag = torch.tensor([1 if cached is not None else 0], device=dev if dev.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not int(flag.item()):
            cached = None
    if cached is not None:
        say(f"cached: {f}")
        return with_memory_now(cached)  # the rates are the machine's; its memory is what this process's limit leaves
    start = time.perf_counter()
    repeats = 3 if quick else 10
    steps = 4 + (dev.type == "cuda") + grouped
    step = iter(range(1, steps + 1))
    say(f"{next(step)}/{steps} memory of {key.split(' | ')[0]}")
    host_total, host_free = _host_memory()
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        name = torch.cuda.get_device_name(dev)
    else:
        free, total, name = host_free, host_total, _cpu_name()
    n = (512 if quick else 1024) if dev.type == "cpu" else (4096 if quick else 8192)
    say(f"{next(step)}/{steps} matmul rate ({n}x{n})")
    flops = {"float32": _matmul(dev, torch.float32, n, repeats), "bfloat16": _matmul(dev, torch.bfloat16, n, repeats)}
    if dev.type == "cuda":
        flops["float16"] = _matmul(dev, torch.float16, n, repeats)
    h2d: dict[str, float] = {}
    d2h: dict[str, float] = {}
    if dev.type == "cuda":
        say(f"{next(step)}/{steps} host<->device copies (pinned, pageable)")
        h2d, d2h = _copies(dev, (64 if quick else 256) * 2**20, repeats)
    numel = 2**22 if quick else 2**24  # beyond a last-level cache: 4M fp32 elements x 4 tensors = 64 MiB
    say(f"{next(step)}/{steps} AdamW on the host ({numel / 1e6:.0f} M elements)")
    host_adam = _adam(torch.device("cpu"), numel, repeats)
    say(f"{next(step)}/{steps} AdamW on the device")
    dev_adam = host_adam if dev.type == "cpu" else _adam(dev, numel * 8, repeats)
    coll: dict[str, dict[int, float]] = {}
    if grouped and world > 1:  # a 1-rank group moves nothing: (W-1)/W = 0 would record 0 B/s rates
        sizes = [2**20, 2**24] if quick else [2**20, 2**24, 2**26]
        say(f"{next(step)}/{steps} all-gather and reduce-scatter on {world} ranks ({dist.get_backend()})")
        coll = _collectives(dev, sizes, repeats)
    profile = DeviceProfile(
        name=name, kind="cuda" if dev.type == "cuda" else "cpu", memory_bytes=int(total), free_bytes=int(free),
        matmul_flops=flops, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, host_adam_elems_per_s=host_adam,
        device_adam_elems_per_s=dev_adam, collective_bytes_per_s=coll, world_size=world,
        host_memory_bytes=host_total, source="measured", key=key,
    )
    if not grouped or dist.get_rank() == 0:
        profile.to_json(files[-1])
    if grouped:
        dist.barrier()  # the file exists for every rank's next call
    say(f"done in {time.perf_counter() - start:.1f} s; cached in {files[-1]}")
    return profile


# ---------------------------------------------------------------------------- clusters


def _parse_presets(text: str, devices: int | None) -> list[DeviceProfile]:
    out: list[DeviceProfile] = []
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for part in parts:
        name, _, count = part.partition(":")
        if count and not count.isdigit():
            raise ValueError(f"preset {part!r}: write NAME or NAME:COUNT, e.g. 'a100-40g:2,rtx4090-24g:2'")
        out += [device_preset(name)] * (int(count) if count else (devices if len(parts) == 1 and devices else 1))
    return out


def cluster_spec(*, devices: int | None = None, device_memory: str | int | None = None, preset: str | None = None,
                 profile: str | Path | DeviceProfile | ClusterSpec | None = None, nodes: int | None = None,
                 host_memory: str | int | None = None, inter_node_bytes_per_s: float = 0.0,
                 disk: DiskProfile | None = None, disk_dir: str | Path | None = None, disk_preset: str | None = None,
                 disk_space: str | int | None = None) -> ClusterSpec:
    """Describe the devices to plan for.

    Args:
        devices: how many ranks (default: 1, or the preset list's length).
        device_memory: override each device's memory (``"24GiB"``), e.g. to plan under a budget.
        preset: datasheet name (``"a100-40g"``), or a mix ``"a100-40g:2,rtx4090-24g:2"`` (rank order).
        profile: a :class:`DeviceProfile`/:class:`ClusterSpec` or a JSON file of either (from
            ``tightfit profile device --json``); default when no preset: this machine's cached profile.
        nodes: hosts the ranks span (default: the profile file's, else 1). host_memory: override each host's memory. inter_node_bytes_per_s:
            bandwidth between nodes.
        disk: the disk tier of every host (:class:`DiskProfile`); or ``disk_dir`` (measured with
            :func:`~tightfit.profiler.profile_disk`, cached) and/or ``disk_preset`` (typical speed) with
            ``disk_space`` (the budget, overriding the free space): see :func:`~tightfit.profiler.disk_presets.disk_tier`.
            None of them: the profile's own disk tier (a profile file's), else none. ``disk_space`` alone
            resizes the profile's disk tier.
    """
    if devices is not None and devices < 1:
        raise ValueError(f"devices={devices} must be >= 1")
    if preset is not None and profile is not None:
        raise ValueError("give either preset= or profile=, not both (a profile file already names its devices)")
    if isinstance(profile, (str, Path)):
        text = Path(profile).read_text() if Path(profile).is_file() else str(profile)
        loaded: DeviceProfile | ClusterSpec = ClusterSpec.from_json(text) if '"ClusterSpec"' in text \
            else DeviceProfile.from_json(text)
        profile = loaded
    if isinstance(profile, ClusterSpec):
        base = list(profile.devices)
        if devices is not None and devices != len(base):
            raise ValueError(f"the profile file describes {len(base)} devices but devices={devices}; drop --devices "
                             "or use a single-device profile")
    elif isinstance(profile, DeviceProfile):
        base = [profile] * (devices or 1)
    elif preset is not None:
        base = _parse_presets(preset, devices)
        if devices is not None and len(base) != devices:
            raise ValueError(f"preset {preset!r} lists {len(base)} devices but devices={devices}")
    else:
        base = [profile_device(quick=True, progress=False)] * (devices or 1)
    if device_memory is not None:
        mem = parse_bytes(device_memory)
        base = [dataclasses.replace(d, memory_bytes=mem, free_bytes=min(d.free_bytes, mem) if d.source == "measured"
                                    else mem) for d in base]
    if host_memory is not None:
        hm = parse_bytes(host_memory)
        base = [dataclasses.replace(d, host_memory_bytes=hm) for d in base]
    base = _apply_disk(base, disk, disk_dir, disk_preset, disk_space)
    if isinstance(profile, ClusterSpec):
        nodes = profile.nodes if nodes is None else nodes
        inter_node_bytes_per_s = inter_node_bytes_per_s or profile.inter_node_bytes_per_s
    return ClusterSpec(devices=tuple(base), nodes=nodes or 1, inter_node_bytes_per_s=inter_node_bytes_per_s)


def _apply_disk(base: list[DeviceProfile], disk: DiskProfile | None, path: str | Path | None, preset: str | None,
                space: str | int | None) -> list[DeviceProfile]:
    if disk is not None and (path is not None or preset is not None):
        raise ValueError("give either disk= (a DiskProfile) or disk_dir=/disk_preset=, not both")
    if disk is None and path is None and preset is None:
        if space is None:
            return base
        budget, out = parse_bytes(space), []
        for d in base:
            if d.disk is None:
                raise ValueError(f"disk space {space!r} without a disk tier: name the directory (--disk-dir DIR) or "
                                 "a disk preset (--disk-preset NAME) with it")
            out.append(dataclasses.replace(d, disk=dataclasses.replace(d.disk, free_bytes=budget)))
        return out
    if disk is None:
        disk = disk_tier(path=path, preset=preset, space=space)
    elif space is not None:
        disk = dataclasses.replace(disk, free_bytes=parse_bytes(space))
    return list(with_disk(ClusterSpec(devices=tuple(base)), disk).devices)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--devices/--device-memory/--preset/--cluster/--nodes/--host-memory`` options planners' CLIs share,
    and the disk tier's ``--disk-dir/--disk-preset/--disk-space`` (:func:`~tightfit.profiler.disk_presets.add_disk_arguments`)."""
    g = parser.add_argument_group("devices to plan for")
    g.add_argument("--devices", type=int, default=None, help="number of ranks (default 1)")
    g.add_argument("--device-memory", default=None, help="memory per device, e.g. 24GiB (overrides the preset)")
    g.add_argument("--preset", default=None,
                   help=f"datasheet device(s): one of {', '.join(DATASHEETS)}, or a mix like a100-40g:2,rtx4090-24g:2")
    g.add_argument("--cluster", default=None, help="a DeviceProfile or ClusterSpec JSON file")
    g.add_argument("--nodes", type=int, default=None, help="hosts the ranks span (default 1)")
    g.add_argument("--host-memory", default=None, help="memory per host, e.g. 512GiB")
    add_disk_arguments(parser)


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    """A :class:`ClusterSpec` from :func:`add_cluster_arguments`' options."""
    return cluster_spec(devices=args.devices, device_memory=args.device_memory, preset=args.preset,
                        profile=args.cluster, nodes=args.nodes, host_memory=args.host_memory,
                        disk_dir=getattr(args, "disk_dir", None), disk_preset=getattr(args, "disk_preset", None),
                        disk_space=getattr(args, "disk_space", None))
