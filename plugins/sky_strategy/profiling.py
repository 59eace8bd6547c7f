"""Per-rank profiling: each rank measures the model's own layers, its usable memory and its links.

Results are gathered on every rank (small: a few numbers per layer) and turned into the planner's
inputs by :func:`planner_inputs`. Heterogeneity can be injected (``speed_factors``, ``memory_caps``,
``link_bandwidth``) so one homogeneous machine can play a heterogeneous cluster.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sky_strategy.layers import Layer, LayerMeasurement, measure_layers
from tightfit.planner.pipeline import DeviceSpec, LayerMemory

__all__ = ["RankProfile", "profile_rank", "measure_links", "planner_inputs", "usable_memory"]


@dataclass(frozen=True)
class RankProfile:
    """What one rank measured.

    Args:
        rank: global rank; device: its device name; speed_factor: the injected factor (1.0: none).
        layers: one measurement per layer; memory_bytes: memory usable for a stage.
    """

    rank: int
    device: str
    speed_factor: float
    layers: tuple[LayerMeasurement, ...]
    memory_bytes: int

    @property
    def total_s(self) -> float:
        return sum(m.seconds for m in self.layers)


def usable_memory(device: torch.device, resident_bytes: int, local_world_size: int) -> int:
    """Memory a stage may use: free device memory (CUDA) or this rank's share of available host
    memory (CPU), plus what the full model already occupies there (it is released when partitioned)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + resident_bytes)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        avail = 8 * 2**30  # unknown platform: assume 8 GiB
    return int(avail // max(1, local_world_size) + resident_bytes)


def profile_rank(layers: list[Layer], sample, *, rank: int, device: torch.device, speed_factor: float,
                 memory_cap: int | None, local_world_size: int, repeats: int = 3, progress=None) -> RankProfile:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    measured = measure_layers(layers, sample, device=device, repeats=repeats, speed_factor=speed_factor, sync=sync,
                              progress=progress, offload=device.type != "cpu")
    resident = sum(m.param_bytes for m in measured)
    mem = usable_memory(device, resident, local_world_size)
    if memory_cap is not None:
        mem = min(mem, int(memory_cap))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return RankProfile(rank=rank, device=name, speed_factor=speed_factor, layers=tuple(measured), memory_bytes=mem)


def _rounds(world: int) -> list[list[tuple[int, int]]]:
    """Round-robin tournament (circle method): every pair meets once, each rank in <= 1 pair per round."""
    ids = list(range(world)) + ([-1] if world % 2 else [])
    n = len(ids)
    out = []
    for _ in range(n - 1):
        out.append([(min(ids[i], ids[n - 1 - i]), max(ids[i], ids[n - 1 - i])) for i in range(n // 2)
                    if ids[i] >= 0 and ids[n - 1 - i] >= 0])
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return out


def measure_links(nbytes: int, *, device: torch.device, repeats: int = 3,
                  sync: Callable[[], None] | None = None) -> list[list[float]]:
    """Bytes/s between every pair of ranks, measured by ping-pong of an ``nbytes`` message.

    Pairs are measured in ``world - 1`` rounds of disjoint pairs so that no link is shared while it is
    timed. Every rank returns the same matrix (diagonal: inf). ``sync`` waits until the exchange has
    really happened (default: ``torch.cuda.synchronize`` on a GPU): NCCL's send/recv return once the
    transfer is queued, so a clock read without it times the queueing, overstates the bandwidth by
    orders of magnitude and makes communication vanish from the plan.
    """
    if sync is None:
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = max(1, nbytes // 4)
    buf = torch.zeros(numel, dtype=torch.float32, device=device)
    mine: dict[int, float] = {}
    for pairs in _rounds(world):
        for a, b in pairs:
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            times = []
            for rep in range(repeats + 1):
                sync()  # nothing earlier may still be in flight when the clock starts
                start = time.perf_counter()
                if rank == a:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                sync()  # the bytes have arrived, not merely been queued
                if rep:
                    times.append(time.perf_counter() - start)
            mine[peer] = numel * 4 / (statistics.median(times) / 2)
        dist.barrier()
    rows: list = [None] * world
    dist.all_gather_object(rows, mine)
    return [[float("inf") if a == b else float(rows[a].get(b, rows[b].get(a, float("inf")))) for b in range(world)]
            for a in range(world)]


def planner_inputs(profiles: list[RankProfile]) -> tuple[list[float], list[LayerMemory], list[DeviceSpec]]:
    """Layer costs on the reference device (rank 0's speed = 1.0), per-layer memory, one device per rank.

    A rank's speed is rank 0's total time over its own; a layer's cost is the mean over ranks of its
    time scaled to the reference, which averages out timing noise of any one rank.
    """
    ref = profiles[0].total_s
    speeds = [ref / p.total_s if p.total_s > 0 else 1.0 for p in profiles]
    n = len(profiles[0].layers)
    costs = [statistics.fmean(p.layers[i].seconds * s for p, s in zip(profiles, speeds)) for i in range(n)]
    first = profiles[0].layers
    mems = [LayerMemory(param_bytes=m.param_bytes, activation_bytes=m.activation_bytes, output_bytes=m.output_bytes)
            for m in first]
    devices = [DeviceSpec(name=f"rank{p.rank}:{p.device}" + (f"x{p.speed_factor:g}" if p.speed_factor != 1 else ""),
                          speed=s, memory_bytes=max(1, p.memory_bytes)) for p, s in zip(profiles, speeds)]
    return costs, mems, devices
