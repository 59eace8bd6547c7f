"""The one reading of memory every profiler and planner uses: the machine's memory and the memory cgroup limit the
process lives under (a container, a systemd slice, a Slurm job), cgroup v2 and v1.

Nothing else in tightfit opens ``/proc/meminfo`` or a cgroup's memory files (a test greps the source tree): a planner
that read the machine's memory where a limit applies would plan for memory the kernel never gives, and the process
would be OOM-killed mid-step instead of refused before it starts. This module imports nothing heavy (no torch), so
``tightfit doctor`` can show the reading at once.

Example:
    >>> reading = read_memory()
    >>> reading.capacity <= reading.total or reading.total == 0
    True
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tightfit.units import format_bytes

__all__ = ["MemoryReading", "read_memory", "release_freed_heap", "NO_LIMIT"]

NO_LIMIT = 1 << 60
"""Limits at or above this many bytes mean "no limit" (cgroup v1 writes a page-rounded 2**63 there)."""

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryReading:
    """What memory this process may use, read once.

    Args:
        total: the machine's ``MemTotal`` in bytes (0 where ``/proc/meminfo`` is unreadable).
        available: the machine's ``MemAvailable`` in bytes (0 where unreadable).
        limit: the tightest memory cgroup limit over this process's group and the groups above it, in bytes;
            ``None`` where there is none (or none could be read).
        usage: that group's current usage in bytes, page cache included (0 without a limit).
        reclaimable: that group's inactive file pages in bytes: page cache the kernel reclaims first, so it
            counts as free (0 without a limit).
        limit_file: the file the limit was read from (``".../memory.max"``), ``""`` without a limit.
        resident: this process's resident set in bytes, its mapped library code included (``/proc/self/statm``; 0
            where unreadable): what it holds now, counted whole (the code it runs stays resident under a limit).
    """

    total: int
    available: int
    limit: int | None = None
    usage: int = 0
    reclaimable: int = 0
    limit_file: str = ""
    resident: int = 0

    @property
    def capacity(self) -> int:
        """The memory this process lives in: the limit where there is one (at most the machine's), else MemTotal."""
        if self.limit is None:
            return self.total
        return min(self.limit, self.total) if self.total else self.limit

    @property
    def free(self) -> int:
        """Bytes this process could still allocate: ``MemAvailable``, bounded by what the limit leaves
        (``limit - usage + reclaimable``)."""
        if self.limit is None:
            return self.available
        left = max(0, self.limit - self.usage + self.reclaimable)
        return min(self.available, left) if self.available else left

    @property
    def limited(self) -> bool:
        """Whether a cgroup limit below the machine's memory applies."""
        return self.limit is not None and (not self.total or self.limit < self.total)

    def share(self, ranks: int) -> int:
        """One of ``ranks`` processes' share of :attr:`capacity` (ranks of a node share one limit and one RAM)."""
        return self.capacity // max(1, int(ranks))

    def describe(self) -> str:
        """One line: the limit and where it came from, or the machine's memory when there is none."""
        if not self.limited:
            return f"no memory limit: the machine's {format_bytes(self.total)} ({format_bytes(self.free)} free)"
        return (f"memory limit {format_bytes(self.capacity)} ({self.limit_file}), {format_bytes(self.usage)} in use "
                f"of which {format_bytes(self.reclaimable)} reclaimable page cache, {format_bytes(self.free)} free; "
                f"the machine has {format_bytes(self.total)}")

    def to_dict(self) -> dict[str, object]:
        """The fields and the derived figures, for a JSON report."""
        return {"total_bytes": self.total, "available_bytes": self.available, "limit_bytes": self.limit,
                "usage_bytes": self.usage, "reclaimable_bytes": self.reclaimable, "limit_file": self.limit_file,
                "resident_bytes": self.resident, "capacity_bytes": self.capacity, "free_bytes": self.free}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _meminfo(text: str, key: str) -> int:
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if fields[1:2] == ["kB"] or len(fields) == 1 else 1)
    return 0


def _groups(cgroups: str, cgroup_root: Path) -> Iterator[tuple[Path, str, str, str]]:
    """(group directory, limit file, usage file, inactive-file key of memory.stat) of every memory cgroup this
    process is in and of each group above it: cgroup v2 (the ``0::`` line) and v1's ``memory`` hierarchy."""
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            top, files = cgroup_root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in parts[1].split(","):
            top, files = cgroup_root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                  "total_inactive_file")
        else:
            continue
        group = top / parts[2].strip().lstrip("/")
        while True:
            yield (group, *files)
            if group == top or group.parent == group or top not in group.parents:
                break
            group = group.parent


def release_freed_heap() -> None:
    """Give the C heap's freed pages back to the system: collect Python's garbage, then glibc's ``malloc_trim(0)``
    (elsewhere nothing). Freed memory below the heap's top stays resident until trimmed, so a process that has
    just measured something (a calibration, a quantization pass) would count it as held and plan for less
    memory than it has, or leave it for the kernel to OOM-kill it over."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def read_memory(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT, *, settle: bool = False) -> MemoryReading:
    """Read the machine's memory (``/proc/meminfo``) and the tightest memory cgroup limit above this process.

    ``settle=True`` first gives freed heap pages back (:func:`release_freed_heap`): what a planner budgets from,
    so its reserve (what the process holds now) counts only memory in use.

    A group counts where its limit and usage both read as whole bytes below :data:`NO_LIMIT` (``"max"``, an
    unreadable file or a missing group is no limit); the tightest is the one that leaves the least free
    (``limit - usage + inactive file pages``). Never raises: what cannot be read is left out.
    """
    if settle:
        release_freed_heap()
    meminfo = _read(proc / "meminfo") or ""
    total, available = _meminfo(meminfo, "MemTotal"), _meminfo(meminfo, "MemAvailable")
    statm = (_read(proc / "self" / "statm") or "").split()
    resident = int(statm[1]) * os.sysconf("SC_PAGE_SIZE") if len(statm) > 1 and statm[1].isdigit() else 0
    best: tuple[int, int, int, int, str] | None = None  # (free under it, limit, usage, reclaimable, file)
    for group, limit_file, usage_file, inactive_key in _groups(_read(proc / "self" / "cgroup") or "", cgroup_root):
        limit, usage = _int(_read(group / limit_file)), _int(_read(group / usage_file))
        if limit is None or usage is None or limit >= NO_LIMIT:
            continue
        stat = _read(group / "memory.stat") or ""
        inactive = next((_int(line.split()[1]) or 0 for line in stat.splitlines()
                         if line.startswith(inactive_key + " ") and len(line.split()) > 1), 0)
        free = max(0, limit - usage + inactive)
        if best is None or free < best[0] or (free == best[0] and limit < best[1]):
            best = (free, limit, usage, inactive, str(group / limit_file))
    if best is None:
        return MemoryReading(total=total, available=available, resident=resident)
    _, limit, usage, inactive, source = best
    return MemoryReading(total=total, available=available, limit=limit, usage=usage, reclaimable=inactive,
                         limit_file=source, resident=resident)
