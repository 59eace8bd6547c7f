"""``calibrate_device``: the measurements that turn the device profile into a step-time model that matches.

``profile_device`` measures peak rates; a training step also pays for what rates leave out. With a
process group initialised, every rank calls :func:`calibrate_device` and gets its profile back with:

* **collectives as latency + bandwidth**: all-gather, reduce-scatter and all-reduce timed over
  message sizes from 4 KiB to a few MiB, fitted by least squares to ``t = alpha + S * (W-1)/W / busbw``
  (all-reduce: twice the bandwidth term) per collective at this world size. On gloo over loopback
  alpha dominates small messages: a 64 KiB all-gather costs mostly latency, which a bandwidth table
  alone would price at a large message's rate;
* **FSDP2's per-unit overhead**: a stack of ``K`` tiny linear layers trained as ``K`` units and as
  one unit; ``(t_K - t_1) / (K - 1)`` per phase (forward, backward, optimizer) is what one more unit
  costs beyond its collectives (hooks, copy-in/copy-out, DTensor dispatch in ``optimizer.step``),
  per mode (``reshard``, ``keep``, ``replicate``, ``offload``); the collectives' fitted latency is
  subtracted, so the planner does not count it twice. Also per parameter tensor (``mode/tensor``) and
  per unsharded parameter byte (``mode/byte``: the same unit with 36x larger layers; copy-in/copy-out and,
  on a CPU, page faults of the unsharded buffers FSDP2 allocates every step);
* **overlap of communication with compute**: a matmul loop alone, an all-reduce alone, and both
  at once, in interleaved trials; ``overlap = mean(t_compute + t_comm - t_both) / min(t_compute, t_comm)``
  (a trimmed mean over the trials; the loops' median times) in ``[0, 1]``. On
  gloo with one thread per rank the collective's copies and reductions run on the core the
  matmuls need (overlap near 0); on NCCL with a copy engine it is near 1;
* ``unified_memory`` for a CPU "device": offload copies cost nothing.

Results are cached beside the device profile (``calibrated-...json``); ``refresh=True`` re-measures.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from tightfit.console import reporter
from tightfit.distributed import slowest
from tightfit.profiler.types import DeviceProfile

_log = logging.getLogger(__name__)

__all__ = ["calibrate_device", "fit_alpha_beta", "OVERHEAD_MODES"]

OVERHEAD_MODES = ("reshard", "keep", "replicate", "offload")


def fit_alpha_beta(sizes: list[float], seconds: list[float], factor: float) -> tuple[float, float]:
    """Least-squares ``t = alpha + x / busbw`` with ``x = factor * size``; returns ``(alpha >= 0, busbw > 0)``.

    >>> a, bw = fit_alpha_beta([1e3, 1e6, 1e7], [1e-4 + 1e3 / 1e9, 1e-4 + 1e6 / 1e9, 1e-4 + 1e7 / 1e9], 1.0)
    >>> round(a * 1e6), round(bw / 1e9, 3)
    (100, 1.0)
    """
    xs = [factor * s for s in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(seconds)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / var if var > 0 else 0.0
    if slope <= 0:  # flat timings: all latency; the largest message bounds the bandwidth from below
        slope = max(seconds) / max(xs) / 10 if max(xs) > 0 else 1e-12
    alpha = my - slope * mx
    if alpha < 0:  # refit through the origin: no negative latency
        alpha = 0.0
        slope = sum(x * y for x, y in zip(xs, seconds)) / sum(x * x for x in xs)
    return alpha, 1.0 / slope


_NOW: list[Callable[[], float]] = [time.perf_counter]  # the clock of the calibration in progress


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    import torch.distributed as dist

    now = _NOW[0]
    out = []
    for i in range(warmup + repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = now()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            out.append(now() - t0)
    return slowest(statistics.median(out))


def _collective_fits(device: torch.device, repeats: int, quick: bool) -> dict[str, dict[int, list[float]]]:
    import torch.distributed as dist

    world = dist.get_world_size()
    sizes = [2**12, 2**15, 2**18, 2**20, 2**22] + ([] if quick else [2**24])
    fits: dict[str, dict[int, list[float]]] = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        times = []
        for size in sizes:
            numel = max(world, size // 4 // world * world)
            full = torch.zeros(numel, device=device)
            shard = torch.zeros(numel // world, device=device)
            fn: Callable[[], object]
            if kind == "all_gather":
                fn = functools.partial(dist.all_gather_into_tensor, full, shard)
            elif kind == "reduce_scatter":
                fn = functools.partial(dist.reduce_scatter_tensor, shard, full)
            else:
                fn = functools.partial(dist.all_reduce, full)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                times.append(_median_time(fn, device, repeats))
        factor = (2.0 if kind == "all_reduce" else 1.0) * (world - 1) / world
        alpha, bw = fit_alpha_beta([float(s) for s in sizes], times, factor)
        fits[kind] = {world: [alpha, bw]}
    return fits


def _unit_overheads(device: torch.device, repeats: int, fits: dict[str, dict[int, list[float]]],
                    ) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    world = dist.get_world_size()
    # 16 units: the per-unit difference is small on gloo; with 8, noise on a loaded host could make keep's
    # backward dearer than reshard's (which does strictly more).
    k, width, big = 16, 32, 192
    mesh = init_device_mesh(device.type, (world,))
    hsdp = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    xs = {w: torch.randn(4, w, device=device) for w in (width, big)}

    def build(units: int, mode: str, per_unit: int = 1, w: int = width) -> tuple[nn.Module, torch.optim.Optimizer]:
        """``k`` groups of ``per_unit`` linear layers of width ``w``; ``units > 1``: one FSDP2 unit per group
        ("plain": no FSDP2)."""
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(*[nn.Linear(w, w) for _ in range(per_unit)])
                                for _ in range(k)]).to(device)
        if mode != "plain":
            policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if mode == "offload" else OffloadPolicy()
            on = hsdp if mode == "replicate" else mesh
            if units > 1:
                for layer in model:
                    fully_shard(layer, mesh=on, reshard_after_forward=mode != "keep", offload_policy=policy)
            fully_shard(model, mesh=on, reshard_after_forward=mode != "keep", offload_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def phases(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        box: dict[str, torch.Tensor] = {}

        x = xs[next(model.parameters()).shape[-1]]

        def fwd() -> None:
            box["loss"] = model(x).square().mean()

        def bwd() -> None:
            fwd()
            box["loss"].backward()

        def step() -> None:
            opt.step()

        t_f = _median_time(fwd, device, repeats)
        t_fb = _median_time(bwd, device, repeats)
        t_o = _median_time(step, device, repeats)
        opt.zero_grad(set_to_none=True)
        return [t_f, max(0.0, t_fb - t_f), t_o]

    def latency(kind: str) -> float:
        return fits.get(kind, {}).get(world, [0.0, 1.0])[0]

    def bandwidth_s(kind: str, size: float) -> float:
        """The bandwidth part of a collective's fitted time (the planner prices it itself)."""
        bw = fits.get(kind, {}).get(world, [0.0, 0.0])[1]
        factor = (2.0 if kind == "all_reduce" else 1.0) * (world - 1) / world
        return factor * size / bw if bw > 0 and world > 1 else 0.0

    out: dict[str, list[float]] = {}
    wide = 6  # a transformer layer has ~12 parameter tensors: 6 linear layers' weights and biases
    plain1, plain6 = phases(*build(1, "plain")), phases(*build(1, "plain", wide))
    plain_big = phases(*build(1, "plain", wide, big))
    extra_bytes = 4.0 * k * wide * (big * big + big - width * width - width)  # fp32, big unit less the small one
    for mode in OVERHEAD_MODES:
        many = phases(*build(k, mode))
        one = phases(*build(1, mode))
        one6 = phases(*build(1, mode, wide))
        one_big = phases(*build(1, mode, wide, big))
        # Per parameter tensor beyond plain training (copy-in/out, DTensor dispatch in the optimizer):
        # one unit of 12k tensors vs one of 2k, less what the same layers cost without FSDP2.
        tensors = 2 * k * (wide - 1)
        out[f"{mode}/tensor"] = [max(0.0, ((c - b) - (p6 - p1)) / tensors)
                                 for b, c, p1, p6 in zip(one, one6, plain1, plain6)]
        # Per unsharded parameter byte: the same tensors 36x larger (3.6 M parameters). What grows with the
        # bytes beyond the compute and the collectives' bandwidth: copy-in/copy-out, and on a CPU the page
        # faults of the unsharded buffers FSDP2 allocates and frees every step (on gloo ranks a cost per MB
        # gathered that tiny units cannot show). The optimizer runs on the shard it owns.
        owned = 1.0 if mode == "replicate" else 1.0 / world
        comm_f = bandwidth_s("all_gather", extra_bytes) if mode != "replicate" else 0.0
        comm_b = (bandwidth_s("all_reduce", extra_bytes) if mode == "replicate"
                  else bandwidth_s("reduce_scatter", extra_bytes)
                  + (bandwidth_s("all_gather", extra_bytes) if mode != "keep" else 0.0))
        grow = [c - b for b, c in zip(one6, one_big)]
        plain_grow = [c - b for b, c in zip(plain6, plain_big)]
        out[f"{mode}/byte"] = [max(0.0, (grow[0] - plain_grow[0] - comm_f) / extra_bytes),
                               max(0.0, (grow[1] - plain_grow[1] - comm_b) / extra_bytes),
                               max(0.0, (grow[2] - owned * plain_grow[2]) / extra_bytes)]
        per = [max(0.0, (a - b) / (k - 1)) for a, b in zip(many, one)]
        # Collectives one more unit issues, priced by their fitted latency (the planner adds them itself).
        if mode == "replicate":
            per[1] = max(0.0, per[1] - latency("all_reduce"))
        else:
            per[0] = max(0.0, per[0] - latency("all_gather"))
            per[1] = max(0.0, per[1] - latency("reduce_scatter") - (latency("all_gather") if mode != "keep" else 0.0))
        out[mode] = per
    return out  # mode -> per unit, "mode/tensor" -> per parameter tensor; [forward, backward, optimizer] s


def _overlap(device: torch.device, repeats: int) -> float:
    """The share of an all-reduce that a matmul loop as long as it hides: ``3 * repeats`` interleaved trials, each
    timing the loop alone (``t_c``), the all-reduce alone (``t_n``) and both at once (``t_b``); the trials' mean
    hidden time ``t_c + t_n - t_b`` (the fastest and slowest fifth left out) over the shorter of the two medians
    ``t_c`` and ``t_n``, in ``[0, 1]``.

    Sized so: a loop much shorter than the all-reduce would make the all-reduce's own noise the whole figure. Paired
    per trial, a slow spell that stretches one trial stretches its three timings together. Where the ranks' four
    threads share two cores, whether the all-reduce gets a core beside the loop differs from trial to trial: the
    hidden times fall in two clusters, whose median jumps from one to the other as their shares cross half, while
    a trimmed mean moves with the shares. The denominator is a median of many timings, not a trial's shorter one,
    which a single fast loop would shrink and so swell that trial's ratio. The figure's spread falls as the square
    root of the trials, hence three times the ``repeats`` the other measurements take."""
    import torch.distributed as dist

    n = 256 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device)
    buf = torch.zeros((2**24 if device.type == "cpu" else 2**26) // 4, device=device)

    def comm() -> None:
        dist.all_reduce(buf)

    t_n = _median_time(comm, device, repeats)
    t_mm = _median_time(lambda: torch.mm(a, a), device, repeats)
    reps = max(1, round(t_n / max(t_mm, 1e-9)))

    def compute() -> None:
        for _ in range(reps):
            torch.mm(a, a)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    trials = [[_median_time(fn, device, 1, warmup=0) for fn in (compute, comm, both)] for _ in range(3 * repeats)]
    hidden = sorted(t_c + t_n - t_b for t_c, t_n, t_b in trials)
    cut = len(hidden) // 5
    shorter = min(statistics.median(t[0] for t in trials), statistics.median(t[1] for t in trials))
    return float(min(1.0, max(0.0, statistics.fmean(hidden[cut: len(hidden) - cut]) / max(1e-9, shorter))))


def _adam_rate(device: torch.device, repeats: int) -> float:
    """AdamW (foreach, as ``torch.optim.AdamW`` defaults to) elements per second on the calibration clock."""
    p = nn.Parameter(torch.randn(2**20, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)
    return float(p.numel() / max(1e-9, _median_time(opt.step, device, repeats)))


def calibrate_device(profile: DeviceProfile, *, device: str | torch.device | None = None, quick: bool = False,
                     refresh: bool = False, progress: bool = True, clock: str = "wall") -> DeviceProfile:
    """``profile`` with collective α–β fits, FSDP2 per-unit overheads, measured overlap and ``unified_memory``.

    Every rank of the initialised process group must call it (the collectives are measured together);
    without a group only ``unified_memory`` is set. Cached beside the device profile; rank 0 writes.
    ``clock="cpu"`` times with process CPU time (CPU devices on a shared host; see
    :func:`tightfit.profiler.timing.clock_of`); the optimizer rates are then re-measured on it too.
    """
    import torch.distributed as dist

    from tightfit.profiler.device import cache_file
    from tightfit.profiler.timing import clock_of

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    base = dataclasses.replace(profile, unified_memory=dev.type == "cpu")
    if not (dist.is_available() and dist.is_initialized()):
        return base
    world = dist.get_world_size()
    path = cache_file(f"calibrated v7 | {profile.key} | world {world} | threads {torch.get_num_threads()} | {clock}",
                      quick)
    cached = None
    if not refresh and path.is_file():
        try:
            cached = DeviceProfile.from_json(path)
        except (ValueError, TypeError, KeyError):
            cached = None
    flag = torch.tensor([1 if cached is not None else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # measure together or not at all
    if int(flag.item()) and cached is not None:
        return cached
    say = reporter(_log, "calibrate_device", enabled=progress and dist.get_rank() == 0)
    repeats = 7 if quick else 11
    _NOW[0] = clock_of(clock)
    t0 = time.perf_counter()
    say(f"1/3 collectives alpha-beta on {world} ranks ({dist.get_backend()})")
    fits = _collective_fits(dev, repeats, quick) if world > 1 else {}  # one rank moves nothing
    say("2/3 FSDP2 per-unit overhead (16 tiny units vs 1)")
    overhead = _unit_overheads(dev, 2 * repeats + 1, fits)
    say("3/3 overlap of an all-reduce with matmuls" + (" (CPU clock: 0 by definition)" if clock == "cpu" else ""))
    # CPU time adds up whatever runs concurrently: under clock="cpu" nothing is hidden by definition
    # (measuring it anyway gave 0.00 in one run and 1.00 in the next on a host at load 16).
    overlap = -1.0 if world == 1 else 0.0 if clock == "cpu" else _overlap(dev, repeats)
    adam = {}
    if clock == "cpu":
        rate = _adam_rate(dev, repeats)
        adam = {"device_adam_elems_per_s": rate, "host_adam_elems_per_s": rate}
    _NOW[0] = time.perf_counter
    out = dataclasses.replace(base, collective_fit=fits, unit_overhead_s=overhead, comm_overlap=overlap, **adam)
    if dist.get_rank() == 0:
        out.to_json(path)
    dist.barrier()
    say(f"done in {time.perf_counter() - t0:.1f} s: overlap {overlap:.2f}, all-gather alpha "
        f"{fits.get('all_gather', {}).get(world, [0.0])[0] * 1e6:.0f} us, unit overhead (reshard) "
        f"{sum(overhead['reshard']) * 1e3:.2f} ms; cached in {path}")
    return out
