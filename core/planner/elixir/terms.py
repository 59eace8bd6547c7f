"""Per-unit terms of Elixir's cost model (:class:`UnitTerms`) and where a priced step's time and memory go
(:class:`Detail`); :mod:`tightfit.planner.elixir.sim` computes both (notation there)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UnitTerms", "Detail", "slowest_overheads"]


@dataclass(frozen=True, slots=True)
class UnitTerms:
    """Durations (s) and bytes of one unit under one (mode, offload) choice; checkpointing excluded."""

    cf: float        # forward compute: sum(fwd_s) measured, else sum(fwd_flops) / rate; + the unit's forward overhead
    cb: float        # backward compute without recompute, likewise; + the unit's backward overhead
    h2d_f: float     # forward fetch over PCIe (offloaded): E * m / h2d
    ag_f: float      # forward all-gather: collective(all_gather, P * c)
    h2d_b: float     # backward re-fetch (offloaded, not kept)
    ag_b: float      # backward re-gather (reshard only)
    red: float       # reduce-scatter P * r (sharded) or all-reduce P * r (replicate)
    d2h: float       # gradient shard to the host (offloaded): E * m / d2h
    opt: float       # optimizer step: E / host_rate (offloaded) or E / device_rate; + the unit's optimizer overhead;
                     # on disk: compute + io - f * min(compute, io) (io: read and write E * o, f: disk overlap)
    state: float     # device-resident sharded state: E * (m + m + o), 0 when offloaded (unified: E * (m + m) on disk)
    host: float      # host-resident state per rank: E * (m + m + o) when offloaded, E * (m + m) on disk
    gathered: float  # unsharded parameters while live: P * c
    grads: float     # unsharded gradients + reduce buffer while its backward runs: P * (c + r)
    red_buf: float   # reduce buffer still in flight while the next unit's backward runs: P * r
    opt_tmp: float   # foreach temporaries inside optimizer.step() on the device: E * t
    kept: bool       # gathered parameters stay from forward to backward (mode "keep")
    grad_state: float = 0.0  # the gradient part of ``state`` (E * m): absent until backward (calibrated model)
    disk: float = 0.0        # optimizer state on disk per rank: E * o (state tier 2)
    disk_io: float = 0.0     # seconds of disk I/O in ``opt`` before overlap: read + write of ``disk`` bytes
    fetch: float = 0.0       # tier 3: the parameter shard read from disk ahead of each use, E * m (live while used)
    disk_f: float = 0.0      # tier 3: seconds to read ``fetch`` bytes ahead of the forward (latency + bytes / bw)
    disk_b: float = 0.0      # tier 3: the same ahead of the backward (tier 4: + writing its gradient shard behind it)
    grad_buf: float = 0.0    # tier 4: the gradient shard on the host from its reduce until written, E * m


@dataclass(slots=True)
class Detail:
    """Where the time and the memory go (filled when asked for; the search does not)."""

    compute: float = 0.0
    recompute: float = 0.0
    stall_fwd: tuple[float, ...] = ()
    stall_bwd: tuple[float, ...] = ()
    tail: float = 0.0
    optimizer: float = 0.0
    peak_phase: str = ""
    peak_block: str = ""
    peak_state: float = 0.0
    peak_params: float = 0.0
    peak_acts: float = 0.0


def slowest_overheads(devices: tuple) -> tuple[tuple[str, tuple[float, float, float]], ...]:
    """Per-unit (forward, backward, optimizer) overheads by mode: the largest over the devices (the slowest rank
    paces the step); ``()`` unless every device measured them."""
    if not all(d.unit_overhead_s for d in devices):
        return ()
    modes = set.intersection(*(set(d.unit_overhead_s) for d in devices))
    out: list[tuple[str, tuple[float, float, float]]] = []
    for m in sorted(modes):
        vals = [d.unit_overhead_s[m] for d in devices]
        f, b, o = (max(float(v[i]) for v in vals) for i in range(3))
        out.append((m, (f, b, o)))
    return tuple(out)
