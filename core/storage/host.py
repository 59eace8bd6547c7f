"""Host memory the disk tier frees must go back to the system, or a memory limit counts it still.

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and gives it back
on ``free``; smaller ones come from the heap, whose free space stays with the process. The threshold starts at
128 KiB and is *dynamic*: each freed mmap'd block raises it to that block's size (up to 32 MiB). A run that keeps
freeing 4-16 MiB tensors (parameters dropped between uses, gradients, staging buffers, FSDP2's unsharded
parameters) soon has its tensors on the heap, where freed pages stay resident and fragment. Measured with
``benchmarks/elixir_disk.py``'s child on an 8-block GPT (33.6 M parameters, tier 3, 3 steps): resident peak
1368 MiB growing 60-100 MiB a step with the default; 983 MiB and flat with the threshold fixed at 1 MiB.

:func:`return_large_frees` fixes the threshold (setting it turns the dynamic adjustment off); it affects
allocations made after the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from pathlib import Path

__all__ = ["return_large_frees", "MMAP_THRESHOLD_BYTES", "host_available_bytes"]

MMAP_THRESHOLD_BYTES = 1 << 20  # 1 MiB: every tensor of 256 K fp32 elements or more is mmap'd and given back on free
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_frees(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make ``malloc`` map blocks of ``threshold`` bytes or more on their own (returned to the system when freed).

    Returns whether it took effect: ``False`` where the C library is not glibc (musl, macOS: nothing to do there,
    or no such knob). Raises ``ValueError`` for a threshold outside glibc's range."""
    if not 0 < threshold <= 32 << 20:
        raise ValueError(f"threshold={threshold}: the mmap threshold must be between 1 byte and 32 MiB "
                         "(glibc's maximum); pass e.g. 1 << 20")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


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
