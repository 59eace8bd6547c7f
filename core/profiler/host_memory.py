"""How much host memory this process could still take, for decisions made at run time (e.g. whether weights kept on
disk fit back in RAM after training): :attr:`tightfit.memory_limit.MemoryReading.free` of core's one reading of
memory (the kernel's estimate bounded by the memory cgroup limits the process runs under, v2 and v1)."""

from __future__ import annotations

from pathlib import Path

from tightfit.memory_limit import CGROUP_ROOT, PROC, read_memory

__all__ = ["host_available_bytes"]


def host_available_bytes(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process could still allocate (:func:`tightfit.memory_limit.read_memory`'s ``free``): the
    kernel's ``MemAvailable``, and under a memory cgroup limit (v2's ``memory.max`` or v1's
    ``memory.limit_in_bytes``, of this process's group or any group above it) what the limit leaves, counting the
    group's inactive file pages as free. ``None`` when ``/proc/meminfo`` is unreadable and there is no limit."""
    reading = read_memory(proc, cgroup_root)
    if reading.total == 0 and reading.available == 0 and reading.limit is None:
        return None
    return reading.free
