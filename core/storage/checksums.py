"""The per-extent checksums a store can record: CRC-32C (PyPI ``crc32c``, hardware) where installed, else zlib's CRC-32.

The index records which one wrote the store (``"checksum": "crc32c"`` or ``"crc32"``); a store is read with
the algorithm it was written with, so a store written with zlib's CRC-32 keeps reading after ``crc32c`` is
installed, and one written with CRC-32C refuses to open, naming the fix, where ``crc32c`` is missing.

``crc32c`` is several times as fast as ``zlib.crc32`` on one core (the disk benchmark measures both:
benchmarks/results/REPORT.md#disk_io). Both release the GIL on large buffers (``crc32c`` from 32 KiB,
zlib from 5 KiB), so the I/O worker threads checksum in parallel with each other's I/O.

Example:
    >>> checksum_function("crc32")(b"tightfit")
    2767564745
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from tightfit.storage.errors import StorageError

__all__ = ["CHECKSUMS", "KNOWN_CHECKSUMS", "DEFAULT_CHECKSUM", "checksum_function", "Checksum"]

Checksum = Callable[..., int]  # (buffer, start=0) -> unsigned 32-bit checksum, continuing from ``start``


def _crc32(view: object, start: int = 0) -> int:
    return zlib.crc32(view, start) & 0xFFFFFFFF  # type: ignore[arg-type]


# name -> function, for the algorithms installed here; the benchmark's "checksums off" diagnostic swaps entries
CHECKSUMS: dict[str, Checksum] = {"crc32": _crc32}
KNOWN_CHECKSUMS = ("crc32c", "crc32")  # what an index may record, preferred first
try:
    import crc32c as _crc32c_module
except ImportError:  # core needs only torch, numpy and entrypoints: zlib is the fallback
    pass
else:
    CHECKSUMS["crc32c"] = _crc32c_module.crc32c
DEFAULT_CHECKSUM = next(name for name in KNOWN_CHECKSUMS if name in CHECKSUMS)
"""The checksum new stores record: ``"crc32c"`` when the ``crc32c`` package is installed, else ``"crc32"``."""


def checksum_function(name: str, where: str = "") -> Checksum:
    """The function of checksum ``name``; an unknown or uninstalled one raises one line naming the fix."""
    prefix = f"{where}: " if where else ""
    if name not in KNOWN_CHECKSUMS:
        raise StorageError(f"{prefix}checksum {name!r} is not {' or '.join(map(repr, reversed(KNOWN_CHECKSUMS)))}, "
                           f"the ones this version verifies; open it with the tightfit version that wrote it")
    if name not in CHECKSUMS:
        raise StorageError(f"{prefix}the store is checksummed with {name}, which is not installed here: "
                           f"pip install {name}")
    return _lookup(name)


def _lookup(name: str) -> Checksum:
    def run(view: object, start: int = 0) -> int:  # looked up per call: the benchmark's diagnostic can swap it
        return CHECKSUMS[name](view, start)

    return run
