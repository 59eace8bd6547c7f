"""The disk tier of a cluster description: datasheet disk presets, and a :class:`DiskProfile` from CLI options.

Presets (:data:`DISK_DATASHEETS`, ``source="datasheet:<name>"``) are *typical* figures of a class of
drive, for planning a disk you do not have (or have not measured): sequential bandwidth at large requests
from vendors' datasheets (PCIe 4.0 x4 NVMe ~7 GB/s read, PCIe 3.0 x4 ~3.5 GB/s, SATA 6 Gbit/s ~0.55 GB/s
after encoding), and the latency of one request at queue depth 1. A real drive can be slower (a full
drive past its SLC cache writes at a fraction of its datasheet rate); measure it with
``tightfit profile disk PATH`` (:func:`tightfit.profiler.profile_disk`) when it is at hand.

The disk tier is per host, like host memory: every rank of a node sees the same directory's free
space (the store gives each rank a sub-directory of it).

Example:
    >>> d = disk_preset("nvme-gen4", path="/mnt/nvme", free_bytes=2 * 10**12)
    >>> d.source, round(d.read_fit[1] / 1e9, 1), round(d.read_seconds(7e9), 3)
    ('datasheet:nvme-gen4', 7.0, 1.0)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from tightfit.commands.args import add_disk_arguments  # re-exported: the parsers' half of the disk tier
from tightfit.profiler.types import ClusterSpec, DiskProfile, ProfileError
from tightfit.units import parse_bytes

__all__ = ["DISK_DATASHEETS", "disk_preset", "preset_label", "disk_tier", "with_disk", "add_disk_arguments",
           "disk_from_args"]

GB = 10**9
MiB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Sheet:
    """Typical figures of one class of drive.

    Args:
        label: what it is, for tables.
        read_gb_s / write_gb_s: sequential bandwidth at large requests, GB/s (10^9 bytes).
        read_latency_s / write_latency_s: one small request at queue depth 1, seconds.
        queue_depth: requests a store keeps in flight to reach that bandwidth.
        direct: whether O_DIRECT is the better mode (every flash drive; the page cache helps a disk that seeks).
    """

    label: str
    read_gb_s: float
    write_gb_s: float
    read_latency_s: float
    write_latency_s: float
    queue_depth: int = 4
    direct: bool = True


# Typical, not guaranteed: vendors' sequential figures at 128 KiB+ requests, QD32; latencies of a 4 KiB
# request at QD1 (NVMe reads ~80 us, writes land in the drive's cache in ~20-30 us).
_SHEETS: dict[str, _Sheet] = {
    "nvme-gen4": _Sheet(label="NVMe SSD, PCIe 4.0 x4 (typical)", read_gb_s=7.0, write_gb_s=5.0,
                        read_latency_s=80e-6, write_latency_s=30e-6, queue_depth=8),
    "nvme-gen3": _Sheet(label="NVMe SSD, PCIe 3.0 x4 (typical)", read_gb_s=3.5, write_gb_s=3.0,
                        read_latency_s=90e-6, write_latency_s=30e-6, queue_depth=8),
    "sata-ssd": _Sheet(label="SATA SSD, 6 Gbit/s (typical)", read_gb_s=0.55, write_gb_s=0.50,
                       read_latency_s=120e-6, write_latency_s=60e-6, queue_depth=4),
    # 7200 rpm: ~4 ms half a rotation + ~8 ms average seek; ~0.2 GB/s on the outer tracks.
    "hdd": _Sheet(label="hard disk, 7200 rpm (typical)", read_gb_s=0.20, write_gb_s=0.20,
                  read_latency_s=12e-3, write_latency_s=12e-3, queue_depth=2, direct=False),
}


def _profile(name: str, sheet: _Sheet, *, path: str, free_bytes: int, total_bytes: int = 0,
             filesystem: str = "") -> DiskProfile:
    request = 4 * MiB
    read, write = sheet.read_gb_s * GB, sheet.write_gb_s * GB
    return DiskProfile(
        path=path, free_bytes=free_bytes, total_bytes=total_bytes, filesystem=filesystem,
        read_fit=(sheet.read_latency_s, read), write_fit=(sheet.write_latency_s, write),
        read_bytes_per_s={request: {sheet.queue_depth: read}}, write_bytes_per_s={request: {sheet.queue_depth: write}},
        request_bytes=request, queue_depth=sheet.queue_depth, direct=sheet.direct,
        source=f"datasheet:{name}", key=f"datasheet:{name}",
    )


# The presets at a nominal 1 TB free (a listing; :func:`disk_preset` gives the real path and free space).
DISK_DATASHEETS: dict[str, DiskProfile] = {
    name: _profile(name, sheet, path="", free_bytes=1000 * GB) for name, sheet in _SHEETS.items()}


def disk_preset(name: str, *, path: str | Path, free_bytes: int, total_bytes: int = 0,
                filesystem: str = "") -> DiskProfile:
    """The datasheet disk profile ``name`` (``"nvme-gen4"``) for a directory with ``free_bytes`` free.

    An unknown name raises ``KeyError`` listing the presets.
    """
    sheet = _SHEETS.get(name.lower())
    if sheet is None:
        raise KeyError(f"unknown disk preset {name!r}; presets: {', '.join(_SHEETS)}")
    return _profile(name.lower(), sheet, path=str(path), free_bytes=int(free_bytes), total_bytes=int(total_bytes),
                    filesystem=filesystem)


def preset_label(name: str) -> str:
    """The one-line description of a preset (``"NVMe SSD, PCIe 4.0 x4 (typical)"``)."""
    return _SHEETS[name.lower()].label


def disk_tier(*, path: str | Path | None = None, preset: str | None = None, space: str | int | None = None,
              quick: bool = True, refresh: bool = False, progress: bool = False) -> DiskProfile | None:
    """The disk tier a plan may use, or ``None`` when nothing names one.

    Args:
        path: the directory; alone, it is measured (:func:`tightfit.profiler.profile_disk`, cached).
        preset: a datasheet speed (:data:`DISK_DATASHEETS`) instead of measuring; with ``path``, the
            free space is that directory's.
        space: the disk budget (``"500GiB"``), overriding the free space: with ``preset`` and no ``path``
            (or a path on another machine), plan a disk you do not have.
        quick / refresh / progress: passed to :func:`~tightfit.profiler.profile_disk`.

    A directory that is missing, not writable or a file is refused here, before any work.
    """
    budget = None if space is None else parse_bytes(space)
    if budget is not None and budget <= 0:
        raise ValueError(f"disk space {space!r} is {budget} bytes; give a size > 0 such as '500GiB'")
    if path is None and preset is None:
        if budget is not None:
            raise ValueError("a disk space without a disk: give the directory (--disk-dir DIR) or a disk preset "
                             f"(--disk-preset, one of {', '.join(_SHEETS)}) with it")
        return None
    if path is not None and preset is None:
        from tightfit.profiler.disk import profile_disk

        disk = profile_disk(path, quick=quick, refresh=refresh, progress=progress)
    elif path is None or budget is not None and not os.path.isdir(path):
        if budget is None:
            raise ValueError(f"disk preset {preset!r} without a directory: say how much space it offers "
                             "(--disk-space SIZE, e.g. 500GiB) or name the directory (--disk-dir DIR)")
        assert preset is not None
        disk = disk_preset(preset, path=str(path or ""), free_bytes=budget)
    else:
        from tightfit.storage import check_disk_dir, free_bytes, mount_of

        where = check_disk_dir(path)
        free, total = free_bytes(where)
        assert preset is not None
        disk = disk_preset(preset, path=str(where), free_bytes=free, total_bytes=total,
                           filesystem=mount_of(where).filesystem)
    if budget is not None:
        disk = dataclasses.replace(disk, free_bytes=budget)
    return disk


def with_disk(spec: ClusterSpec, disk: DiskProfile | None) -> ClusterSpec:
    """``spec`` with every device's disk tier set to ``disk`` (``None``: unchanged)."""
    if disk is None:
        return spec
    if not isinstance(disk, DiskProfile):
        raise ProfileError(f"with_disk: {disk!r} is not a DiskProfile; build one with profile_disk(path) or "
                           "disk_preset(name, path=..., free_bytes=...)")
    return dataclasses.replace(spec, devices=tuple(dataclasses.replace(d, disk=disk) for d in spec.devices))


def disk_from_args(args: argparse.Namespace) -> DiskProfile | None:
    """The :class:`DiskProfile` of :func:`add_disk_arguments`' options (``None``: no disk tier)."""
    return disk_tier(path=getattr(args, "disk_dir", None), preset=getattr(args, "disk_preset", None),
                     space=getattr(args, "disk_space", None))
