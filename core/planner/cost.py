"""Cost-model pieces shared by the planners: bytes per element, rates read from device profiles.

Every function here turns a profile number into a time or a byte count with one documented
formula, so the planners (Elixir's sharding x offload search, Sky's partitioner, cache sizing)
price the same hardware the same way. Planners are pure: nothing here touches a device.

Conventions:
    * collective bandwidths are *bus* bandwidths (nccl-tests convention), keyed by the total
      message size in bytes: an all-gather whose output is ``S`` bytes over ``W`` ranks moves
      ``S * (W - 1) / W`` bytes through each rank's link, so ``t = S * (W - 1) / W / busbw(S)``;
    * a rate missing from a profile falls back to a stated assumption, and the fallback is
      reported through ``notes`` so a plan can say what it guessed.

Example:
    >>> from tightfit.planner.cost import precision_spec, optimizer_state_bytes
    >>> precision_spec("bf16-mixed").compute_bytes, optimizer_state_bytes("adamw", 4)
    (2, 8)
"""

from __future__ import annotations

import bisect
import math

from tightfit.planner.memo import frozen
from tightfit.planner.optimizers import OPTIMIZERS, PRECISIONS, PrecisionSpec, optimizer_spec, precision_spec
from tightfit.profiler.types import DeviceProfile

__all__ = [
    "PRECISIONS",
    "OPTIMIZERS",
    "PrecisionSpec",
    "precision_spec",
    "optimizer_spec",
    "optimizer_state_bytes",
    "optimizer_temp_bytes",
    "matmul_rate",
    "bus_bandwidth",
    "collective_time",
    "CollectiveTimes",
    "collective_fit",
    "copy_rate",
    "host_optimizer_rate",
    "device_optimizer_rate",
    "FALLBACK_BUS_BYTES_PER_S",
    "FALLBACK_HOST_COPY_BYTES_PER_S",
]

# Assumptions used only when a profile lacks the number (each use is reported as a note).
FALLBACK_BUS_BYTES_PER_S = {"cuda": 50e9, "cpu": 2e9}
"""Collective bus bandwidth by device type when a profile has none: for CUDA a conservative NVLink-class
bandwidth (A100 NVLink all-gather reaches ~230 GB/s, PCIe-only nodes ~20 GB/s); for the CPU gloo over
loopback on a loaded host."""
FALLBACK_HOST_COPY_BYTES_PER_S = 10e9
"""Host copy rate when a profile has none. A "device" that is itself the CPU has no PCIe link: FSDP2's CPU
offload then costs a host memcpy, one core's memcpy rate on a 2020s server."""
# Host AdamW when unmeasured: ~1e9 elements/s is a fused CPU AdamW on ~16 cores (DeepSpeed's
# CPUAdam paper reports 1.4e9/s on 48 cores); on-device AdamW ~ HBM bandwidth / 16 B per element.
FALLBACK_HOST_ADAM_ELEMS_PER_S = 1e9
FALLBACK_DEVICE_ADAM_ELEMS_PER_S = {"cuda": 5e10, "cpu": 1e9}


def optimizer_state_bytes(optimizer: str, master_bytes: int) -> int:
    """Optimizer-state bytes per parameter element: ``states * master_bytes`` (state lives in the master dtype).

    The states come from :data:`tightfit.planner.optimizers.OPTIMIZERS` (SGD planned with momentum).
    """
    return optimizer_spec(optimizer).planned_states * master_bytes


def optimizer_temp_bytes(optimizer: str, master_bytes: int) -> int:
    """Peak temporary bytes per parameter element inside ``optimizer.step()`` (foreach implementation)."""
    return optimizer_spec(optimizer).temp_states * master_bytes


def matmul_rate(device: DeviceProfile, dtype: str, notes: list[str] | None = None) -> float:
    """Sustained FLOP/s for ``dtype``; falls back to float32's rate (noted) when ``dtype`` was not measured.

    Compute time of ``F`` FLOPs is ``F / matmul_rate``: transformer steps are dominated by matmuls,
    and the profile's FLOPs count only those (``torch.utils.flop_counter``).
    """
    rates = device.matmul_flops
    if rates.get(dtype, 0) > 0:
        return float(rates[dtype])
    for other in ("float32", *rates):
        if rates.get(other, 0) > 0:
            if notes is not None:
                notes.append(f"{device.name}: no {dtype} matmul rate in the profile; used its {other} rate")
            return float(rates[other])
    raise ValueError(
        f"device profile {device.name!r} has no matmul rate (matmul_flops={rates!r}); "
        "measure it with tightfit.profiler.profile_device() or use a datasheet preset"
    )


def bus_bandwidth(device: DeviceProfile, collective: str, size_bytes: float,
                  notes: list[str] | None = None) -> float:
    """Bus bandwidth for one message of ``size_bytes``, interpolated in log(size) between measured sizes.

    Outside the measured range the nearest measurement is used (small messages are latency-bound,
    so extrapolating a small-message rate down is already pessimistic enough). ``"all_reduce"``
    without its own measurement is priced as its two halves (reduce-scatter then all-gather), so
    its bus bandwidth is the harmonic mean of theirs.
    """
    table = device.collective_bytes_per_s.get(collective)
    if not table and collective == "all_reduce":
        rs = bus_bandwidth(device, "reduce_scatter", size_bytes, notes)
        ag = bus_bandwidth(device, "all_gather", size_bytes, notes)
        return 2.0 / (1.0 / rs + 1.0 / ag)
    if not table:
        other = "all_gather" if collective != "all_gather" else "reduce_scatter"
        table = device.collective_bytes_per_s.get(other)
    if not table:
        bw = FALLBACK_BUS_BYTES_PER_S["cuda" if device.kind == "cuda" else "cpu"]
        if notes is not None:
            notes.append(f"{device.name}: collective bandwidth not measured; assumed {bw / 1e9:.0f} GB/s bus bandwidth")
        return bw
    sizes = sorted(int(s) for s in table)
    rates = [float(table[s]) for s in sizes]
    if size_bytes <= sizes[0]:
        return rates[0]
    if size_bytes >= sizes[-1]:
        return rates[-1]
    i = bisect.bisect_right(sizes, size_bytes)
    lo, hi = sizes[i - 1], sizes[i]
    w = (math.log(size_bytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return rates[i - 1] + w * (rates[i] - rates[i - 1])


def collective_time(device: DeviceProfile, collective: str, size_bytes: float, world_size: int,
                    *, inter_node_bytes_per_s: float = 0.0, notes: list[str] | None = None) -> float:
    """Seconds for one collective whose full (gathered / unreduced) message is ``size_bytes``.

    ``t = size * (W - 1) / W / busbw`` for all-gather and reduce-scatter; an all-reduce moves
    twice that (``2 * size * (W - 1) / W / busbw``). Across nodes the bus bandwidth is capped by
    ``inter_node_bytes_per_s``. One rank: no traffic, 0 s. With a measured latency + bandwidth fit
    for this collective and world size (:func:`collective_fit`) its latency ``alpha`` is added and
    its bandwidth replaces the size table.
    """
    if world_size <= 1 or size_bytes <= 0:
        return 0.0
    fit = collective_fit(device, collective, world_size)
    if fit is not None:
        alpha, fit_bw = fit
        if inter_node_bytes_per_s > 0:
            fit_bw = min(fit_bw, inter_node_bytes_per_s)
        factor = 2.0 if collective == "all_reduce" else 1.0
        return alpha + factor * size_bytes * (world_size - 1) / world_size / fit_bw
    bw = bus_bandwidth(device, collective, size_bytes, notes)
    if inter_node_bytes_per_s > 0:
        bw = min(bw, inter_node_bytes_per_s)
    factor = 2.0 if collective == "all_reduce" else 1.0  # nccl-tests: all-reduce busbw = algbw * 2(W-1)/W
    return factor * size_bytes * (world_size - 1) / world_size / bw


class CollectiveTimes:
    """``times(kind, size_bytes)``: :func:`collective_time` on one device at one world size, memoised per
    (kind, whole bytes). :meth:`memo_key` holds the inputs that determine every answer, so a planner's inputs
    holding one can key a memo (:mod:`tightfit.planner.memo`).

    Args:
        device: the device whose collective table or fit prices them.
        world_size: ranks taking part.
        inter_node_bytes_per_s: the bandwidth cap across nodes (0: one node).
        notes: where the fallbacks assumed are reported (the caller's list).
    """

    __slots__ = ("_device", "_world", "_inter_node", "_notes", "_memo", "_key")

    def __init__(self, device: DeviceProfile, world_size: int, inter_node_bytes_per_s: float = 0.0,
                 notes: list[str] | None = None) -> None:
        self._device, self._world, self._inter_node, self._notes = device, world_size, inter_node_bytes_per_s, notes
        self._memo: dict[tuple[str, int], float] = {}
        self._key = (frozen(device), world_size, inter_node_bytes_per_s)

    def __call__(self, kind: str, size_bytes: float) -> float:
        key = (kind, int(size_bytes))
        if key not in self._memo:
            self._memo[key] = collective_time(self._device, kind, size_bytes, self._world, notes=self._notes,
                                              inter_node_bytes_per_s=self._inter_node)
        return self._memo[key]

    def memo_key(self) -> tuple:
        """The device (by value), the world size and the inter-node cap."""
        return self._key


def collective_fit(device: DeviceProfile, collective: str, world_size: int) -> tuple[float, float] | None:
    """``(alpha s, bus bytes/s)`` measured for ``collective`` at ``world_size`` ranks, or ``None``.

    With a fit (:func:`tightfit.profiler.calibrate_device`) a collective costs
    ``alpha + factor * S * (W-1)/W / busbw``; an all-reduce without its own fit is a reduce-scatter
    then an all-gather (their alphas add, their bandwidths combine harmonically).
    """
    fits = device.collective_fit.get(collective)
    if fits:
        for w in (world_size, str(world_size)):
            if w in fits:
                alpha, bw = fits[w]  # type: ignore[index]
                return float(alpha), float(bw)
        return None
    if collective == "all_reduce":
        rs, ag = collective_fit(device, "reduce_scatter", world_size), collective_fit(device, "all_gather", world_size)
        if rs is not None and ag is not None:
            return rs[0] + ag[0], 2.0 / (1.0 / rs[1] + 1.0 / ag[1])
    return None


def copy_rate(device: DeviceProfile, direction: str, notes: list[str] | None = None) -> float:
    """Host<->device copy bandwidth (``direction`` ``"h2d"`` or ``"d2h"``) from pinned memory.

    FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` keeps offloaded shards pinned, so the pinned rate
    applies; pageable is the fallback. A CPU "device" has no link: a host memcpy (assumed, noted).
    """
    table = device.h2d_bytes_per_s if direction == "h2d" else device.d2h_bytes_per_s
    for kind in ("pinned", "pageable"):
        if table.get(kind, 0) > 0:
            return float(table[kind])
    if device.kind == "cpu":
        return FALLBACK_HOST_COPY_BYTES_PER_S
    bw = 12e9  # PCIe 4.0 x16 pinned copies reach ~12-25 GB/s; the low end is the safe guess
    if notes is not None:
        notes.append(f"{device.name}: {direction} bandwidth not measured; assumed {bw / 1e9:.0f} GB/s")
    return bw


def host_optimizer_rate(device: DeviceProfile, ranks_on_host: int, notes: list[str] | None = None) -> float:
    """AdamW elements/s one rank gets on its host: the measured host rate shared by the ranks on that host.

    The host rate is measured by one process using every core; ``ranks_on_host`` processes stepping
    at the same time split the cores (and the memory bandwidth AdamW is bound by), so each gets
    ``host_adam_elems_per_s / ranks_on_host``.
    """
    rate = device.host_adam_elems_per_s
    if rate <= 0:
        rate = FALLBACK_HOST_ADAM_ELEMS_PER_S
        if notes is not None:
            notes.append(f"{device.name}: host AdamW rate not measured; assumed {rate:.1e} elements/s per host")
    return rate / max(1, ranks_on_host)


def device_optimizer_rate(device: DeviceProfile, notes: list[str] | None = None) -> float:
    """AdamW elements/s on the device itself (measured, else assumed and noted)."""
    if device.device_adam_elems_per_s > 0:
        return float(device.device_adam_elems_per_s)
    rate = FALLBACK_DEVICE_ADAM_ELEMS_PER_S["cuda" if device.kind == "cuda" else "cpu"]
    if device.kind == "cpu" and device.host_adam_elems_per_s > 0:
        rate = device.host_adam_elems_per_s  # the device is the host
    if notes is not None and device.kind == "cuda":
        notes.append(f"{device.name}: device AdamW rate not measured; assumed {rate:.1e} elements/s")
    return rate
