"""Per-rank profiling: each rank measures the model's own layers, its usable memory and its links.

Results are gathered on every rank (small: a few numbers per layer) and turned into the planner's
inputs by :func:`planner_inputs`. Heterogeneity can be injected (``speed_factors``, ``memory_caps``,
``link_bandwidth``) so one homogeneous machine can play a heterogeneous cluster.

What the step model gets from here (``tightfit.planner.pipeline.problem`` prices it):

* per device, per layer *kind* (type, parameter and input shapes): layers of one kind are timed
  together and share the median of all their repeats (6 identical blocks x 5 repeats = 30 samples:
  one preempted sample no longer moves a layer's cost; with 3 repeats per layer identical blocks
  could read several-fold apart on a loaded host);
* links as latency + bandwidth: ping-pongs at several sizes fitted by
  :func:`tightfit.profiler.calibrate.fit_alpha_beta` (a small activation on gloo over loopback costs
  mostly latency, which one bandwidth number cannot express);
* the optimizer step's rate on this rank (the user's optimizer class and settings on a scratch tensor),
  the data-parallel all-reduce's alpha-beta (replicas only), and the per-step collectives every step
  pays whatever the partition (:func:`step_overhead`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sky_strategy.layers import Layer, LayerMeasurement, measure_layers
from tightfit.distributed import slowest
from tightfit.memory_limit import read_memory
from tightfit.planner.pipeline import DeviceSpec, LayerMemory
from tightfit.profiler.calibrate import fit_alpha_beta
from tightfit.profiler.timing import clock_of

__all__ = ["InjectedSpeeds", "RankProfile", "profile_rank", "measure_links", "measure_link_fits", "fit_allreduce", "optimizer_rate",
           "step_overhead", "pipeline_overhead", "planner_inputs", "usable_memory", "pooled_seconds", "LINK_SIZES",
           "check_memory_caps"]

# Ping-pong sizes for the link fit: 4 KiB (latency-bound) to 1 MiB (bandwidth-bound), plus the model's
# own activation size (added by the strategy).
LINK_SIZES = (1 << 12, 1 << 16, 1 << 20)


class InjectedSpeeds:
    """The speed each rank plays (``speed_factors``: ``0.33`` is three times slower), changeable mid-run.

    With ``throttle`` a slowed rank's stages sleep for the time it would lack (:meth:`slowdown`), so the
    injected heterogeneity is real to the profiler, the schedule and the re-planner alike.

    Args:
        factors: one factor per global rank, or ``None`` (every rank at 1.0).
        throttle: make the factors real (``False``: the planner sees them, nothing sleeps).

    Example:
        >>> speeds = InjectedSpeeds((1.0, 0.25), throttle=True)
        >>> speeds.factor(1), speeds.slowdown(1)
        (0.25, 4.0)
    """

    def __init__(self, factors: Sequence[float] | None, *, throttle: bool) -> None:
        self._factors = None if factors is None else [float(f) for f in factors]
        self.throttle = throttle

    def factor(self, rank: int) -> float:
        return 1.0 if self._factors is None else self._factors[rank]

    def slowdown(self, rank: int) -> float:
        """How many times longer this rank's compute takes (1.0 without throttling)."""
        return 1.0 / self.factor(rank) if self.throttle else 1.0

    def slowdown_of(self, rank: int) -> Callable[[], float]:
        """``rank``'s slowdown read at call time, so a later :meth:`set` reaches running stages."""
        return lambda: self.slowdown(rank)

    def set(self, factors: Sequence[float], *, world: int) -> None:
        """Play other speeds from now on (e.g. one device slows down mid-run)."""
        if len(factors) != world or any(f <= 0 for f in factors):
            raise ValueError(f"set_speed_factors({list(factors)}): give {world} factors > 0")
        self._factors = [float(f) for f in factors]


@dataclass(frozen=True)
class RankProfile:
    """What one rank measured.

    Args:
        rank: global rank; device: its device name; speed_factor: the injected factor (1.0: none).
        layers: one measurement per layer; memory_bytes: memory usable for a stage.
        optimizer_bytes_per_s: parameter bytes the optimizer step updates per second here (``None``: not
            measured).
    """

    rank: int
    device: str
    speed_factor: float
    layers: tuple[LayerMeasurement, ...]
    memory_bytes: int
    optimizer_bytes_per_s: float | None = None

    @property
    def layer_seconds(self) -> tuple[float, ...]:
        """Each layer's seconds on this rank, pooled per layer kind (:func:`pooled_seconds`)."""
        return pooled_seconds(self.layers)

    @property
    def total_s(self) -> float:
        return sum(self.layer_seconds)


def pooled_seconds(layers: tuple[LayerMeasurement, ...] | list[LayerMeasurement]) -> tuple[float, ...]:
    """Per layer, the (trimmed) mean over every timed repeat of every layer of its kind (its own median
    when the measurement carries no samples or kind)."""
    pools: dict[str, list[float]] = {}
    for m in layers:
        if m.kind and m.samples:
            pools.setdefault(m.kind, []).extend(m.samples)
    means = {k: _trimmed_mean(v) for k, v in pools.items()}
    return tuple(means.get(m.kind, m.seconds) if m.kind and m.samples else m.seconds for m in layers)


def _trimmed_mean(samples: list[float], cut: float = 0.2) -> float:
    """Mean of the middle ``1 - 2 cut`` of the samples: a pipeline runs at the layers' *average* speed,
    which a median (the fastest half's edge) understates where the host's other work slows some runs."""
    xs = sorted(samples)
    # at least one sample off each end once there are three: one preempted repeat of a layer timed
    # 3 times (on a loaded host, a hundred times the embedding's own cost) would otherwise set its cost
    k = max(int(len(xs) * cut), 1 if len(xs) >= 3 else 0)
    mid = xs[k:len(xs) - k] or xs
    return statistics.fmean(mid)


def optimizer_rate(optimizers: Sequence[torch.optim.Optimizer], *, device: torch.device, dtype: torch.dtype,
                   numel: int = 1 << 18, repeats: int = 5, clock: Callable[[], float] = time.perf_counter,
                   ) -> float | None:
    """Parameter bytes per second the optimizers' step updates here: each optimizer's class and settings
    rebuilt on a scratch tensor of ``numel`` elements, median of ``repeats`` steps after one warm-up.
    ``None`` when there is no optimizer or one cannot be rebuilt so."""
    total = 0.0
    for opt in optimizers:
        p = torch.nn.Parameter(torch.randn(numel, device=device, dtype=dtype))
        p.grad = torch.randn_like(p)
        try:
            scratch = type(opt)([p], **opt.defaults)
        except Exception:  # noqa: BLE001 - an optimizer with extra constructor arguments: leave it unpriced
            return None
        times = []
        for rep in range(repeats + 1):
            start = clock()
            scratch.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:
                times.append(clock() - start)
        total += statistics.median(times)
    if not optimizers or total <= 0:
        return None
    return numel * torch.empty((), dtype=dtype).element_size() / total


def usable_memory(device: torch.device, resident_bytes: int, local_world_size: int) -> int:
    """Memory a stage may use: free device memory (CUDA) or this rank's share of what the host (and the memory
    cgroup limit the process runs under, :mod:`tightfit.memory_limit`) leaves free (CPU), plus what the full model
    already occupies there (it is released when partitioned)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + resident_bytes)
    reading = read_memory(settle=True)
    avail = reading.free if reading.capacity else 8 * 2**30  # unknown platform: assume 8 GiB
    return int(avail // max(1, local_world_size) + resident_bytes)


def check_memory_caps(caps: Sequence[int] | None, *, device: torch.device, local_world_size: int) -> None:
    """Refuse, in one line and on every rank alike, a per-rank memory cap above a rank's share of the memory limit
    this process runs under (:mod:`tightfit.memory_limit`; ranks of a host share one limit). Nothing to check on a
    GPU (its memory is the device's), without caps, or without a limit below the machine's memory."""
    if caps is None or device.type != "cpu":
        return
    reading = read_memory()
    share = reading.share(local_world_size)
    for rank, cap in enumerate(caps):
        if reading.limited and int(cap) > share:
            raise ValueError(f"SkyStrategy(memory_caps[{rank}]={int(cap):,}) is more than a rank's share of the memory "
                             f"limit this process runs under ({share:,} bytes of {reading.capacity:,} in "
                             f"{reading.limit_file}, {local_world_size} rank(s) per host); give at most {share:,} "
                             "bytes, or leave memory_caps=None to plan within the limit")


def profile_rank(layers: list[Layer], sample, *, rank: int, device: torch.device, speed_factor: float,
                 memory_cap: int | None, local_world_size: int, repeats: int = 3, progress=None,
                 optimizers: Sequence[torch.optim.Optimizer] = (), clock: str = "wall") -> RankProfile:
    """What this rank measures: every layer (pooled per kind later), its usable memory, its optimizer's rate.
    ``clock="cpu"`` times the layers with process CPU time (CPU devices only)."""
    if clock == "cpu" and device.type != "cpu":
        raise ValueError(f"profile_clock='cpu' on {device}: a GPU's time is not host CPU time; use 'wall'")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    # Timing the layers round-robin keeps every layer's gradients at once (the model's size again); where the
    # memory limit this process runs under does not leave room for them, each layer is timed alone and its
    # gradients freed after it (measure_layers' offload mode: on a CPU the move is a no-op).
    grads = sum(p.numel() * p.element_size() for layer in layers for _, p in layer.parameters() if p.requires_grad)
    short = device.type == "cpu" and grads > read_memory().free // max(1, local_world_size)
    measured = measure_layers(layers, sample, device=device, repeats=repeats, speed_factor=speed_factor, sync=sync,
                              progress=progress, offload=device.type != "cpu" or short, clock=clock_of(clock))
    resident = sum(m.param_bytes for m in measured)
    mem = usable_memory(device, resident, local_world_size)
    if memory_cap is not None:
        mem = min(mem, int(memory_cap))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = next((p.dtype for layer in layers for _, p in layer.parameters() if p.is_floating_point()), torch.float32)
    rate = optimizer_rate(optimizers, device=device, dtype=dtype, clock=clock_of(clock)) if optimizers else None
    return RankProfile(rank=rank, device=name, speed_factor=speed_factor, layers=tuple(measured), memory_bytes=mem,
                       optimizer_bytes_per_s=rate)


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


def measure_link_fits(sizes: tuple[int, ...] | list[int] = LINK_SIZES, *, device: torch.device, repeats: int = 3,
                      sync: Callable[[], None] | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """``(bandwidth bytes/s, latency s)`` between every pair of ranks: one-way ping-pong times at each
    size fitted to ``t = alpha + bytes / bandwidth`` (:func:`~tightfit.profiler.calibrate.fit_alpha_beta`).
    Every rank returns the same matrices (diagonal: inf bandwidth, 0 latency)."""
    sizes = sorted({int(x) for x in sizes})
    mats = [measure_links(n, device=device, repeats=repeats, sync=sync) for n in sizes]
    world = len(mats[0])
    bw = [[float("inf")] * world for _ in range(world)]
    lat = [[0.0] * world for _ in range(world)]
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            one_way = [n / m[a][b] for n, m in zip(sizes, mats)]
            lat[a][b], bw[a][b] = fit_alpha_beta([float(n) for n in sizes], one_way, 1.0)
    return bw, lat


def fit_allreduce(group: dist.ProcessGroup | None, *, device: torch.device,
                  sizes: tuple[int, ...] = (1 << 12, 1 << 18, 1 << 22), repeats: int = 3) -> tuple[float, float]:
    """``(alpha s, bus bandwidth bytes/s)`` of an all-reduce over ``group``: fp32 messages of ``sizes``
    bytes, median of ``repeats`` after one warm-up, the slowest rank's time, fitted like the collectives
    of :func:`tightfit.profiler.calibrate_device`."""
    world = dist.get_world_size(group)
    times = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), device=device)
        samples = []
        for rep in range(repeats + 1):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:
                samples.append(time.perf_counter() - start)
        times.append(slowest(statistics.median(samples), group=group))
    return fit_alpha_beta([float(n) for n in sizes], times, 2.0 * (world - 1) / max(1, world))


# Collectives every SkyStrategy step runs whatever the partition: Lightning's per-step broadcast of its
# stop flag, and the output's way to every rank (broadcast_object_list: a size and a payload, then the
# tensor itself) - four latency-bound collectives.
STEP_COLLECTIVES = 4


def step_overhead(latency: list[list[float]] | None, bandwidth: list[list[float]] | float | None,
                  output_bytes: int) -> float:
    """Seconds per step outside the pipeline: :data:`STEP_COLLECTIVES` collectives at the slowest link's
    latency plus the batch output's bytes over the slowest link (0 without measured links)."""
    if not latency:
        return 0.0
    alpha = max(max(row) for row in latency)
    if isinstance(bandwidth, (int, float)):
        slowest = float(bandwidth)
    elif bandwidth:
        slowest = min(min(row) for row in bandwidth)
    else:
        slowest = float("inf")
    return STEP_COLLECTIVES * alpha + output_bytes / slowest


def planner_inputs(profiles: list[RankProfile]) -> tuple[list[float], list[LayerMemory], list[DeviceSpec]]:
    """Layer costs on the reference device (rank 0's speed = 1.0), per-layer memory, one device per rank.

    Each device carries its own measured seconds per layer (pooled per layer kind, see
    :func:`pooled_seconds`); the planner prices a stage on a device with *those*. A rank's ``speed``
    (rank 0's total time over its own) and the reference ``costs`` (the mean over ranks of a layer's
    time scaled to the reference) remain for what sees one speed per device (Sky Computing's allocator).
    """
    ref = profiles[0].total_s
    speeds = [ref / p.total_s if p.total_s > 0 else 1.0 for p in profiles]
    n = len(profiles[0].layers)
    pooled = [p.layer_seconds for p in profiles]
    costs = [statistics.fmean(ps[i] * s for ps, s in zip(pooled, speeds)) for i in range(n)]
    first = profiles[0].layers
    mems = [LayerMemory(param_bytes=m.param_bytes, activation_bytes=m.activation_bytes, output_bytes=m.output_bytes)
            for m in first]
    devices = [DeviceSpec(name=f"rank{p.rank}:{p.device}" + (f"x{p.speed_factor:g}" if p.speed_factor != 1 else ""),
                          speed=s, memory_bytes=max(1, p.memory_bytes), layer_seconds=ps,
                          optimizer_bytes_per_s=p.optimizer_bytes_per_s)
               for p, s, ps in zip(profiles, speeds, pooled)]
    return costs, mems, devices


class _Scale(torch.nn.Module):
    """A stand-in stage: one scalar weight, so the schedule runs a real (trivial) backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w


def pipeline_overhead(microbatches: int, schedule: str, *, device: torch.device, group: dist.ProcessGroup | None,
                      slowdown: Callable[[], float] = lambda: 1.0, warmup: int = 2, repeats: int = 5) -> float:
    """Seconds one step of the real pipeline schedule costs when the stages compute nothing.

    One stand-in stage per rank of ``group`` (a scalar multiply on a ``2 x 8`` float microbatch: its
    bytes are negligible, the links' alpha-beta prices real activations), run by the same
    :class:`~sky_strategy.layers.TimedStage` and ``torch.distributed.pipelining`` schedule class the
    runtime uses, at the planned microbatch count. What it measures is what the step model otherwise
    misses: the schedule's per-microbatch bookkeeping (stage setup, p2p posting and waits, the loss
    and backward calls) and its per-step fixed cost. ``"interleaved"`` is timed as 1F1B with one stage
    per rank (its stand-in would need ``virtual_stages`` stages per rank). Starts are aligned by a
    barrier; the result is the slowest rank's median over ``repeats`` (0 for a pipeline of one rank).
    ``slowdown`` is the rank's injected one: a slowed rank stretches a chunk's bookkeeping as it
    stretches its compute (everything inside ``forward_one_chunk`` / ``backward_one_chunk`` is timed).
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from sky_strategy.layers import StageModule, TimedStage, stage_timer

    world = dist.get_world_size(group)
    if world < 2:
        return 0.0
    rank = dist.get_rank(group)
    stage = TimedStage(StageModule([_Scale().to(device)]), rank, world, device, slowdown=slowdown,
                       timer=stage_timer(device), group=group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=microbatches, loss_fn=lambda out, y: (out - y).square().mean())
    x = torch.randn(2 * microbatches, 8, device=device)
    y = torch.zeros_like(x)
    times = []
    for i in range(warmup + repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return slowest(statistics.median(times), group=group)
