"""The store's index (names, shapes, dtypes, extents, checksums) as JSON, and the slot allocator.

Layout of a store directory::

    LOCK          the owner's lock (``fcntl.flock``), holding its pid
    index.json    the index at the last ``sync()``, replaced atomically (temp file, fsync, rename, fsync dir)
    data.bin      extents in fixed-size slots: slot ``i`` starts at byte ``i * extent_bytes``

A tensor of ``n`` bytes is ``ceil(n / extent_bytes)`` extents; extent ``k`` holds its bytes
``[k * extent_bytes, ...)`` in some slot, with the checksum (CRC-32C, or zlib's CRC-32 where ``crc32c`` is
not installed; the index records which) of exactly those bytes. A store created with ``checksum_block``
also records one checksum per block of that many bytes of each extent (``[slot, length, crc, blocks]``,
``blocks`` the base64 of little-endian 32-bit checksums), so a read of a few bytes reads and verifies only
the blocks holding them (:meth:`TensorStore.read_ranges`). A write goes to fresh
slots and switches the index only once complete; a slot the last synced index references is never
reused before the next ``sync()``, so a crash, or ENOSPC, leaves the synced state intact.
"""

from __future__ import annotations

import base64
import heapq
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tightfit.storage.checksums import DEFAULT_CHECKSUM, checksum_function
from tightfit.storage.errors import StorageError
from tightfit.storage.fs import ALIGN

__all__ = ["INDEX", "DATA", "LOCK", "DTYPES", "DTYPE_SIZES", "CHECKSUM", "Extent", "Entry", "Index", "Slots", "fsync_dir", "valid_block"]

INDEX, DATA, LOCK = "index.json", "data.bin", "LOCK"
_FORMAT, _VERSION = "tightfit-store", 1
# A new store's checksum (tightfit.storage.checksums): CRC-32C where PyPI's crc32c is installed, else zlib's
# CRC-32; an index without the field predates the choice and was written with "crc32".
CHECKSUM = DEFAULT_CHECKSUM
_LEGACY_CHECKSUM = "crc32"
# dtype name -> bytes per element (the names torch prints without "torch.")
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
               "float8_e5m2": 1}
DTYPES = tuple(DTYPE_SIZES)


@dataclass(slots=True)
class Extent:
    """One extent: ``length`` bytes in slot ``slot`` with checksum ``crc``; ``seq`` orders writes (not saved)."""

    slot: int
    length: int
    crc: int
    seq: int = 0
    blocks: bytes | None = None  # little-endian uint32 checksum per ``checksum_block`` bytes (block stores)


@dataclass(slots=True)
class Entry:
    """One named tensor or buffer: its size, dtype and shape (``None`` for a flat buffer) and extents
    (``None``: never written, reads as zeros)."""

    nbytes: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    extents: list[Extent | None] = field(default_factory=list)
    replace_seq: int = 0  # a put() replaces what older writes would do: they are dropped at commit


@dataclass(slots=True)
class Index:
    extent_bytes: int
    entries: dict[str, Entry] = field(default_factory=dict)
    checksum: str = CHECKSUM  # the algorithm of every extent's ``crc`` (one per store)
    checksum_block: int | None = None  # bytes per block checksum (None: one checksum per extent only)

    def to_json(self) -> str:
        entries = {name: {"nbytes": e.nbytes, "dtype": e.dtype, "shape": None if e.shape is None else list(e.shape),
                          "extents": [None if x is None else _extent_json(x) for x in e.extents]}
                   for name, e in self.entries.items()}
        head: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "extent_bytes": self.extent_bytes,
                                "checksum": self.checksum}
        if self.checksum_block is not None:  # absent in stores without block checksums: older readers open them
            head["checksum_block"] = self.checksum_block
        return json.dumps({**head, "entries": entries}, separators=(",", ":"))

    @classmethod
    def load(cls, path: Path) -> Index:
        """Parse and check ``index.json``; anything malformed raises naming the file and the field."""
        fix = "the index is damaged: restore the directory from a backup, or delete it to start empty"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise StorageError(f"{path}: cannot read the store index ({err}); {fix}") from err
        if not isinstance(raw, dict) or raw.get("format") != _FORMAT or raw.get("version") != _VERSION:
            raise StorageError(f"{path}: not a tightfit store index of version {_VERSION}; {fix}")
        algorithm = raw.get("checksum", _LEGACY_CHECKSUM)
        checksum_function(algorithm if isinstance(algorithm, str) else repr(algorithm), str(path))
        size = raw.get("extent_bytes")
        if not isinstance(size, int) or size < ALIGN or size % ALIGN:
            raise StorageError(f"{path}: extent_bytes={size!r} must be a positive multiple of {ALIGN}; {fix}")
        block = raw.get("checksum_block")
        if block is not None and not valid_block(block, size):
            raise StorageError(f"{path}: checksum_block={block!r} must be a multiple of {ALIGN} that divides "
                               f"extent_bytes={size}; {fix}")
        index = cls(extent_bytes=size, checksum=algorithm, checksum_block=block)
        seen: set[int] = set()
        for name, e in _field(raw, "entries", dict, path, fix).items():
            index.entries[name] = _entry(name, e, size, block, seen, path, fix)
        return index

    @staticmethod
    def write_text(directory: Path, text: str) -> None:
        """Write ``text`` as ``index.json`` atomically and durably: temp file, fsync, rename, fsync of the directory."""
        tmp = directory / f".{INDEX}.tmp"
        data = text.encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, directory / INDEX)
        fsync_dir(directory)

    def slots(self) -> set[int]:
        return {x.slot for e in self.entries.values() for x in e.extents if x is not None}


def valid_block(block: object, extent_bytes: int) -> bool:
    """Whether ``block`` can be a store's ``checksum_block``: a positive multiple of ALIGN dividing the extent."""
    return isinstance(block, int) and not isinstance(block, bool) and block >= ALIGN and block % ALIGN == 0 \
        and extent_bytes % block == 0


def _extent_json(x: Extent) -> list[Any]:
    out: list[Any] = [x.slot, x.length, x.crc]
    if x.blocks is not None:
        out.append(base64.b64encode(x.blocks).decode("ascii"))
    return out


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _field(raw: dict[str, Any], key: str, kind: type, path: Path, fix: str) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind):
        raise StorageError(f"{path}: field {key!r}={value!r} must be a {kind.__name__}; {fix}")
    return value


def _entry(name: str, e: Any, size: int, block: int | None, seen: set[int], path: Path, fix: str) -> Entry:
    where = f"{path}: entry {name!r}"
    if not isinstance(e, dict):
        raise StorageError(f"{where} must be an object; {fix}")
    nbytes, dtype, shape, extents = e.get("nbytes"), e.get("dtype"), e.get("shape"), e.get("extents")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise StorageError(f"{where}: nbytes={nbytes!r} must be a whole number >= 0; {fix}")
    if dtype is not None and dtype not in DTYPES:
        raise StorageError(f"{where}: dtype={dtype!r} is not one of {', '.join(DTYPES)}; {fix}")
    if shape is not None and not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise StorageError(f"{where}: shape={shape!r} must be a list of whole numbers >= 0; {fix}")
    itemsize = DTYPE_SIZES.get(dtype, 0) if isinstance(dtype, str) else 0
    if (dtype is None) != (shape is None) or shape is not None and math.prod(shape) * itemsize != nbytes:
        raise StorageError(f"{where}: dtype={dtype!r} and shape={shape!r} must both be given (or both null) and "
                           f"describe its {nbytes} bytes; {fix}")
    if not isinstance(extents, list) or len(extents) != -(-nbytes // size):
        raise StorageError(f"{where}: needs {-(-nbytes // size)} extents of {size} bytes for {nbytes} bytes; {fix}")
    out: list[Extent | None] = []
    for k, x in enumerate(extents):
        if x is None:
            out.append(None)
            continue
        want = min(size, nbytes - k * size)
        fields = 3 if block is None else 4
        ok = isinstance(x, list) and len(x) == fields and all(isinstance(v, int) and v >= 0 for v in x[:3])
        if not ok or not 0 < x[1] <= want or x[0] in seen:  # shorter: the rest of the extent was never written
            tail = "checksum" if block is None else "checksum, block checksums"
            raise StorageError(f"{where}: extent {k}={x!r} must be [slot, 1..{want}, {tail}] with a slot no other "
                               f"extent uses; {fix}")
        blocks = None if block is None else _blocks(x[3], -(-x[1] // block), f"{where}: extent {k}", fix)
        seen.add(x[0])
        out.append(Extent(slot=x[0], length=x[1], crc=x[2], blocks=blocks))
    return Entry(nbytes=nbytes, dtype=dtype, shape=None if shape is None else tuple(shape), extents=out)


def _blocks(text: Any, count: int, where: str, fix: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 4 * count:
        raise StorageError(f"{where}: block checksums {str(text)[:40]!r} must be the base64 of {count} 32-bit "
                           f"checksums; {fix}")
    return raw


class Slots:
    """Which slots of ``data.bin`` are free, under the crash-safety rule.

    A slot the last synced index references (``durable``) is released only after the next ``sync()``
    (``pending``); a slot a read in flight uses is released when the last such read ends. Free slots
    are handed out lowest first, which keeps ``data.bin`` compact.
    """

    def __init__(self, used: set[int]) -> None:
        self.next = max(used) + 1 if used else 0
        self.free = [s for s in range(self.next) if s not in used]
        heapq.heapify(self.free)
        self.durable = set(used)
        self.pending: set[int] = set()
        self.readers: dict[int, int] = {}
        self.unreferenced: set[int] = set()  # released while read: free once the reads end

    def alloc(self) -> int:
        if self.free:
            return heapq.heappop(self.free)
        self.next += 1
        return self.next - 1

    def release(self, slot: int) -> None:
        if slot in self.durable:
            self.pending.add(slot)
        elif self.readers.get(slot):
            self.unreferenced.add(slot)
        else:
            heapq.heappush(self.free, slot)

    def read_begin(self, slot: int) -> None:
        self.readers[slot] = self.readers.get(slot, 0) + 1

    def read_end(self, slot: int) -> None:
        left = self.readers[slot] - 1
        if left:
            self.readers[slot] = left
            return
        del self.readers[slot]
        if slot in self.unreferenced:
            self.unreferenced.discard(slot)
            self.release(slot)

    def synced(self, referenced: set[int], give_back: Callable[[int], object] | None = None) -> None:
        """The index referencing ``referenced`` is now durable: what was pending and is no longer used frees.
        ``give_back(slot)`` runs first for each slot no read is using (to return its blocks to the filesystem)."""
        self.durable = set(referenced)
        pending, self.pending = self.pending - referenced, self.pending & referenced
        for slot in sorted(pending):
            if give_back is not None and not self.readers.get(slot):
                give_back(slot)
            self.release(slot)
