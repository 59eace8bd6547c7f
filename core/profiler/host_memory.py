"""How much host memory this process could still take: the kernel's estimate, bounded by the memory cgroup limits
the process runs under (v2 and v1), for decisions made at run time (e.g. whether weights kept on disk fit back in
RAM after training)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

__all__ = ["host_available_bytes"]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _limits(groups: str, cgroup_root: Path) -> Iterator[tuple[Path, str, str, str]]:
    """(group directory, limit file, usage file, inactive-file key in memory.stat) of every memory cgroup this
    process is in, and of each group above it: cgroup v2 (``0::``) and v1's ``memory`` hierarchy."""
    for line in groups.splitlines():
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
            if group == top or group.parent == group:
                break
            group = group.parent


def host_available_bytes(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still allocate: the kernel's ``MemAvailable``, and under a memory cgroup limit (v2's
    ``memory.max`` or v1's ``memory.limit_in_bytes``, of this process's group or any group above it) what the limit
    leaves, counting the group's inactive file pages as free (the kernel reclaims them first). ``None`` when
    ``/proc/meminfo`` is unreadable."""
    meminfo = _read(proc / "meminfo")
    if meminfo is None:
        return None
    free = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")),
                None)
    if free is None:
        return None
    for group, limit_file, usage_file, inactive_key in _limits(_read(proc / "self" / "cgroup") or "", cgroup_root):
        limit, usage = (_read(group / limit_file) or "").strip(), (_read(group / usage_file) or "").strip()
        if not (limit.isdigit() and usage.isdigit()) or int(limit) >= 1 << 60:  # "max", or v1's "no limit"
            continue
        stat = _read(group / "memory.stat") or ""
        inactive = next((int(line.split()[1]) for line in stat.splitlines() if line.startswith(inactive_key + " ")), 0)
        free = min(free, max(0, int(limit) - int(usage) + inactive))
    return free
