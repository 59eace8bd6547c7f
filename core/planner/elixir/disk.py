"""The disk tier in Elixir's cost model: state-tier codes, the host staging area, the disk a synchronous step
sees, and the price of a disk unit's optimizer step (part of :mod:`tightfit.planner.elixir`).

A unit's state tier (:class:`Tier`, ``UnitPlan.tier``) says how much of its training state waits off the device:
``DEVICE`` (0) all of it on the device; ``HOST`` (1) parameters, gradients and optimizer state on the host (FSDP2
``CPUOffloadPolicy``); ``DISK`` (2) like ``HOST`` but the optimizer state (``o`` bytes per owned element, 8 of the
16 of fp32 AdamW) waits on disk between steps and is streamed through the host during the host optimizer step
(ZeRO-Infinity and Colossal-AI put optimizer state on NVMe first); ``DISK_PARAMS`` (3) the fp32 master weights wait
on disk too, with the optimizer state (``m + o`` bytes per owned element, streamed together in the step), and so do
the parameters between uses: FSDP2's sharded parameters *are* the master weights, so a unit's parameters are read
from disk ahead of its forward and again ahead of its backward (one unit ahead, like FSDP2's prefetch) and dropped
after each; only its gradients (``m``) stay on the host. ``DISK_GRADS`` (4) like ``DISK_PARAMS``, and the gradients
wait on disk too, between backward and the optimizer step: each unit's gradient shard is written behind its backward
(after the reduce) and read back by the streamed step with the state, so the host keeps no per-parameter state of
the unit at all (``m + o + m`` on disk; the step reads ``m + o + m`` and writes ``m + o``). Under gradient
accumulation the micro-batches' sums stay in RAM only where the plan says they fit the host budget
(:attr:`~tightfit.planner.elixir.ElixirPlan.grads_accumulate_on_host`), else each micro-batch reads, adds and writes
them back. Each tier keeps everything the one before it keeps off the device, so "offloaded" is ``tier >= HOST``
and "optimizer state on disk" is ``tier >= DISK``.

Example:
    >>> from tightfit.profiler.types import DiskProfile
    >>> disk = DiskProfile(path="/nvme", free_bytes=2**40, read_fit=(1e-3, 1e9), write_fit=(1e-3, 5e8))
    >>> opt, io = disk_optimizer_seconds(disk, 1e9, compute=1.0, sharers=1, overlap=1.0)
    >>> round(io, 3), round(opt, 3)   # read 1.001 s + write 2.001 s, the 1 s update hidden behind it
    (3.002, 3.002)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from enum import IntEnum
from typing import TYPE_CHECKING

from tightfit.planner.errors import TIERS
from tightfit.planner.tiers import disk_seconds
from tightfit.profiler.types import DiskProfile

if TYPE_CHECKING:  # sim imports this module
    from tightfit.planner.elixir.sim import Context, UnitTerms

__all__ = ["TIERS", "Tier", "DISK_CODES", "DISK_STAGING_BYTES", "DISK_COPIES", "disk_state_budget", "disk_bytes_needed",
           "slowest_disk", "disk_optimizer_seconds", "per_element_on_disk", "host_bytes", "in_flight", "disk_bytes",
           "fetched_around"]


class Tier(IntEnum):
    """A plan unit's state tier (the module docstring says what each keeps where); deeper tiers keep more off the device."""

    DEVICE = 0  # parameters, gradients and optimizer state on the device
    HOST = 1  # all three on the host (FSDP2 CPUOffloadPolicy)
    DISK = 2  # as HOST, the optimizer state on disk between steps
    DISK_PARAMS = 3  # as DISK, the fp32 master weights too, and the parameters between uses
    DISK_GRADS = 4  # as DISK_PARAMS, the gradients too, between backward and the optimizer step

    @property
    def state_on(self) -> str:
        """Where the optimizer state lives (``TIERS`` names it): ``"device"``, ``"host"`` or ``"disk"``."""
        return TIERS[min(self, Tier.DISK)]

    @property
    def params_on(self) -> str:
        """Where the fp32 master weights live and the parameters wait between uses: the disk from ``DISK_PARAMS``."""
        return "disk" if self >= Tier.DISK_PARAMS else TIERS[min(self, Tier.HOST)]

    @property
    def grads_on(self) -> str:
        """Where the gradients wait between backward and the optimizer step: the disk in ``DISK_GRADS``."""
        return "disk" if self == Tier.DISK_GRADS else TIERS[min(self, Tier.HOST)]


DISK_CODES = (Tier.DISK, Tier.DISK_PARAMS, Tier.DISK_GRADS)

# Host staging area of the disk tier: the optimizer step of a disk unit streams its optimizer state in and out
# in chunks (AdamW is elementwise), one chunk updating while the next is read: two 64 MiB chunks, counted once
# per rank whatever the number of disk units. 64 MiB is 16 requests of the store's 4 MiB (DiskProfile's
# default request size), enough to keep its queue full, and small beside the gigabytes it saves.
DISK_STAGING_BYTES = 2 * 64 * 2**20
# Copies of a plan's disk state the disk must hold at once: the store writes every update to fresh extents and
# frees the replaced ones at the step's sync (tightfit.storage: the last synced index must stay readable), so at
# the end of a step the old state and the new are both there. The planner fits DISK_COPIES x its disk bytes.
DISK_COPIES = 2


def disk_state_budget(disk_bytes: float) -> float:
    """The bytes of state a plan may keep on a disk of ``disk_bytes`` free (:data:`DISK_COPIES` copies at a step's end)."""
    return float(disk_bytes) / DISK_COPIES


def disk_bytes_needed(state_bytes: float) -> int:
    """The free disk a plan with ``state_bytes`` of state on disk needs (:data:`DISK_COPIES` copies at a step's end)."""
    return math.ceil(state_bytes * DISK_COPIES)


def per_element_on_disk(code: int, opt_state: float, master: float) -> tuple[float, float, float]:
    """(streamed, gradient, fetched) bytes per owned element of a unit in state tier ``code``: what its step reads
    and writes back (``o``, + ``m`` master weights from tier 3 on), its gradient on disk (``m`` in tier 4: read by
    the step, not written back), and its parameters read ahead of each use (``m`` from tier 3 on)."""
    if code < Tier.DISK:
        return 0.0, 0.0, 0.0
    deep = code >= Tier.DISK_PARAMS
    return opt_state + (master if deep else 0.0), master if code == Tier.DISK_GRADS else 0.0, master if deep else 0.0


def slowest_disk(devices: Sequence[object]) -> DiskProfile | None:
    """The disk tier of a synchronous step: ``None`` unless every rank has one (``DeviceProfile.disk``); else the
    least free space and the slowest fits over the ranks (the slowest rank paces the step), and the least
    compute overlap where every rank measured one."""
    disks: list[DiskProfile | None] = [getattr(d, "disk", None) for d in devices]
    have = [d for d in disks if d is not None]
    if not have or len(have) < len(disks):
        return None
    first = min(have, key=lambda d: d.free_bytes)
    overlaps = [d.compute_overlap for d in have]
    return replace(
        first,
        read_fit=(max(d.read_fit[0] for d in have), min(d.read_fit[1] for d in have)),
        write_fit=(max(d.write_fit[0] for d in have), min(d.write_fit[1] for d in have)),
        compute_overlap=min(overlaps) if all(o >= 0 for o in overlaps) else -1.0)


def disk_optimizer_seconds(disk: DiskProfile, nbytes: float, *, compute: float, sharers: int,
                           overlap: float, read_only: float = 0.0) -> tuple[float, float]:
    """(optimizer seconds, disk I/O seconds) of a host optimizer step of ``compute`` seconds whose ``nbytes`` of
    optimizer state are read from disk and written back, ``sharers`` ranks of a node on the same disk:
    ``io = read + write`` (:func:`~tightfit.planner.tiers.disk_seconds`), ``opt = compute + io - overlap *
    min(compute, io)`` (chunked streaming hides the I/O behind the elementwise update as far as measured);
    ``read_only`` more bytes are read and not written back (tier 4's gradients)."""
    io = (disk_seconds(disk, nbytes + read_only, sharers=sharers)
          + disk_seconds(disk, nbytes, write=True, sharers=sharers))
    return compute + io - overlap * min(compute, io), io


def host_bytes(ctx: Context, terms: Sequence[UnitTerms]) -> float:
    """Host bytes per rank of a plan: its units' host state, plus the disk tier's staging area where the host is
    not the device (on unified memory the staging area counts in the device peak instead, see :func:`peak`)."""
    staging = DISK_STAGING_BYTES if not ctx.unified and any(t.disk > 0 for t in terms) else 0.0
    # Tier-3 units' parameter shards live on the host while used: this unit's and the one read ahead; tier 4's
    # gradient shards from their reduce until written (this unit's and the one still being written behind it):
    # two units' at most, bounded by the two largest (one, where a single unit is on disk).
    fetched = sum(in_flight(t.fetch + t.grad_buf for t in terms)) if not ctx.unified else 0.0
    return sum(t.host for t in terms) + staging + fetched


def in_flight(values: Iterable[float]) -> tuple[float, float]:
    """The two largest of ``values`` (0 where there are fewer): the tier-3/4 shards on the host at once."""
    top = sorted(values, reverse=True)[:2]
    return (top[0] if top else 0.0, top[1] if len(top) > 1 else 0.0)


def disk_bytes(terms: Sequence[UnitTerms]) -> float:
    """Disk bytes per rank of a plan: its units' optimizer state (and tier 3's master weights) on disk."""
    return sum(t.disk for t in terms)


def fetched_around(fetch: Sequence[float], u: int, step: int) -> float:
    """Tier-3 shards on the host while unit ``u`` runs (``step`` 1: forward, -1: backward). The runtime drops a unit's
    shards once they are gathered, and reads the next unit's ahead of each gather (FSDP2's prefetch gathers the next
    unit while ``u`` computes, which reads the one after): its own and the next at its start, the next two after."""
    ahead = [f for f in (fetch[k] for k in range(u + step, len(fetch) if step > 0 else -1, step)) if f > 0][:2]
    return max(fetch[u] + (ahead[0] if ahead else 0.0), sum(ahead))
