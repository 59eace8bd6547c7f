"""The three memory tiers every memory planner sees: device, host and disk, each a budget, two with a speed.

A planner is handed one :class:`MemoryTiers` (built by :func:`memory_tiers` from the user's budgets and the
profiles) and answers where each unit, layer or table lives. Pricing is shared: a move of ``n`` bytes
to or from disk costs ``latency + n / bandwidth`` from the disk profile's fits (:func:`disk_seconds`), the
bandwidth split between the ranks of a node that stream at the same time. Where a tier is short, the
planner raises :func:`tier_error`'s :class:`~tightfit.planner.errors.PlanInfeasibleError`, which names
the tier, the bytes it has and the bytes the plan needs.

On a CPU-only machine ``device`` and ``host`` are one memory (``unified``): moving something to the host
saves nothing there, so the disk tier is the only move that saves memory.

Pure: numbers in, numbers out.

Example:
    >>> from tightfit.profiler.types import DiskProfile
    >>> disk = DiskProfile(path="/nvme", free_bytes=12 * 2**30, read_fit=(1e-4, 2e9), write_fit=(1e-4, 1e9))
    >>> t = memory_tiers(device_bytes=8 * 2**30, host_bytes="4GiB", disk=disk)
    >>> t.disk_bytes == 12 * 2**30, round(disk_seconds(disk, 2e9), 4), round(disk_seconds(disk, 2e9, sharers=2), 4)
    (True, 1.0001, 2.0001)
    >>> print(tier_error(t, "disk", needed=int(31.5 * 2**30), what="the optimizer state"))
    disk has 12.00 GiB free in /nvme, the optimizer state needs 31.50 GiB (19.50 GiB short); free space there, \
give a larger disk_dir, or raise the device or host budget so less goes to disk
"""

from __future__ import annotations

from dataclasses import dataclass

from tightfit.checks import check_number
from tightfit.planner.errors import TIERS, PlanError, PlanInfeasibleError
from tightfit.profiler.types import DiskProfile
from tightfit.units import format_bytes, parse_bytes

__all__ = ["TIERS", "MemoryTiers", "memory_tiers", "disk_seconds", "tier_error"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryTiers:
    """Budgets of the three tiers for one planning problem (per device / per rank, as the planner says).

    Args:
        device_bytes: what the device may hold (``None``: unbounded, e.g. a planner that only places off-device).
        host_bytes: what host memory may hold (``None``: unbounded).
        disk_bytes: what the disk tier may hold (0 without a disk tier).
        disk: the disk's profile (``None``: no disk tier).
        unified: host and device are one memory (a CPU "device"): host-resident bytes count against the device too.
    """

    device_bytes: int | None
    host_bytes: int | None
    disk_bytes: int = 0
    disk: DiskProfile | None = None
    unified: bool = False

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes"):
            value = getattr(self, name)
            if value is not None:
                check_number(value, name, where="MemoryTiers", integer=True, low=0, error=PlanError,
                             fix="give bytes, or None for no limit")
        check_number(self.disk_bytes, "disk_bytes", where="MemoryTiers", integer=True, low=0, error=PlanError,
                     fix="give bytes (0: no disk tier)")
        if self.disk is None and self.disk_bytes:
            raise PlanError(f"MemoryTiers: disk_bytes={self.disk_bytes} without a disk profile; give disk= "
                            "(tightfit.profiler.profile_disk(path)) or disk_bytes=0")

    @property
    def has_disk(self) -> bool:
        return self.disk is not None and self.disk_bytes > 0


def memory_tiers(*, device_bytes: int | str | None, host_bytes: int | str | None = None,
                 disk: DiskProfile | None = None, disk_bytes: int | str | None = None, unified: bool = False,
                 sharers: int = 1) -> MemoryTiers:
    """Build :class:`MemoryTiers` from user budgets (ints or ``"4GiB"``).

    ``disk_bytes=None`` takes the disk's free bytes, split between ``sharers`` ranks of a node writing to the
    same disk; a disk profile that is RAM (tmpfs) is refused: it would save no memory.
    """
    def size(value: int | str | None, name: str) -> int | None:
        if value is None:
            return None
        try:
            return parse_bytes(value)
        except ValueError as err:
            raise PlanError(f"{name}: {err}") from None

    check_number(sharers, "sharers", where="memory_tiers", integer=True, low=1, error=PlanError,
                 fix="the number of ranks of a node sharing the disk, e.g. 1")
    if disk is not None and disk.in_memory:
        raise PlanError(f"disk tier {disk.path!r} is on {disk.filesystem} (RAM): moving state there saves no "
                        "memory; give a directory on an NVMe/SSD drive")
    disk_budget = 0
    if disk is not None:
        given = size(disk_bytes, "disk budget")
        disk_budget = (disk.free_bytes // sharers) if given is None else min(given, disk.free_bytes // sharers)
    return MemoryTiers(device_bytes=size(device_bytes, "device budget"), host_bytes=size(host_bytes, "host budget"),
                       disk_bytes=disk_budget, disk=disk, unified=unified)


def disk_seconds(disk: DiskProfile, nbytes: float, *, write: bool = False, sharers: int = 1) -> float:
    """Seconds to move ``nbytes`` to (``write``) or from the disk: ``latency + nbytes * sharers / bandwidth``.

    ``sharers`` ranks streaming at the same time split the disk's bandwidth (their latencies overlap).
    """
    if nbytes <= 0:
        return 0.0
    latency, bandwidth = disk.write_fit if write else disk.read_fit
    return latency + nbytes * max(1, sharers) / bandwidth


def tier_error(tiers: MemoryTiers, tier: str, *, needed: int, what: str = "the plan",
               suggestions: tuple[str, ...] = ()) -> PlanInfeasibleError:
    """The error for ``tier`` being short: names the tier, what it has, what ``what`` needs, and the fix."""
    if tier not in TIERS:
        raise ValueError(f"tier={tier!r} must be one of {TIERS}")
    budget = {"device": tiers.device_bytes, "host": tiers.host_bytes, "disk": tiers.disk_bytes}[tier] or 0
    short = max(0, needed - budget)
    if tier == "disk":
        if tiers.disk is None:
            head = f"there is no disk tier, and {what} needs {format_bytes(needed)} on disk"
            fixes = suggestions or ("give a disk directory (disk_dir) on an NVMe/SSD drive",)
        else:
            head = (f"disk has {format_bytes(budget)} free in {tiers.disk.path}, {what} needs {format_bytes(needed)} "
                    f"({format_bytes(short)} short)")
            fixes = suggestions or ("free space there, give a larger disk_dir, or raise the device or host budget so "
                                    "less goes to disk",)
    elif tier == "host":
        head = (f"host memory budget is {format_bytes(budget)}, {what} needs {format_bytes(needed)} "
                f"({format_bytes(short)} short)")
        fixes = suggestions or (("raise host_budget or give a disk directory (disk_dir) for the rest",)
                                if not tiers.has_disk else ("raise host_budget or the disk budget",))
    else:
        head = (f"device budget is {format_bytes(budget)}, {what} needs {format_bytes(needed)} "
                f"({format_bytes(short)} short)")
        fixes = suggestions or ("raise the device budget, or move more to host or disk",)
    return PlanInfeasibleError(f"{head}; {'; '.join(fixes)}", needed_bytes=needed, budget_bytes=budget,
                               suggestions=tuple(fixes), tier=tier)
