"""A checkpoint's own safetensors files as tensors by byte range: names mapped to extents, read in place.

The disk tier of the memory pool (:mod:`energon_infer.worker.disk_pool`) reads the layers it streams from
the model directory itself on every pass, so it needs what ``safe_open`` hides: where each tensor's bytes
are. A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the data, each
tensor's bytes row-major from ``8 + N + begin``. :func:`read_header` parses and checks that (nothing is
unpickled or executed, offsets must lie inside the file, each extent must hold exactly its shape's bytes);
:class:`TensorFiles` maps every tensor of a directory (single file or sharded with an index) to its
:class:`Extent` and reads a whole tensor, or a range of its rows (one tensor-parallel rank's slice of a
column-parallel weight is a contiguous row range). The bytes move through the store's reader of foreign files
(:class:`tightfit.storage.ExternalFile`: ``O_DIRECT`` in place where it can, buffered else); this module only
says which bytes.

A file that changes under a running server (its size or modification time differ from when it was
opened) is refused: :meth:`TensorFiles.check` raises :class:`CheckpointChangedError` naming it, and the
reader calls it before and after every batch of reads, so a pass never mixes old and new bytes.

Example:
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> d = tempfile.mkdtemp()
    >>> save_file({"w": torch.arange(6.0).view(3, 2)}, f"{d}/model.safetensors")
    >>> files = TensorFiles(d)
    >>> files.extents["w"].shape, files.extents["w"].nbytes
    ((3, 2), 24)
    >>> files.read("w", rows=(1, 3)).tolist()
    [[2.0, 3.0], [4.0, 5.0]]
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from energon_infer.errors import BadInputError
from energon_infer.loading.weights import WeightError, _read_index
from tightfit.storage import ChecksumError, ExternalFile

__all__ = ["Extent", "TensorFiles", "CheckpointChangedError", "read_header", "DTYPES", "MAX_HEADER_BYTES"]

# safetensors dtype names -> torch dtypes (those torch has).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# The format's own limit (the reference implementation refuses larger headers): a hostile length field
# cannot make the reader allocate gigabytes.
MAX_HEADER_BYTES = 100_000_000


class CheckpointChangedError(BadInputError, RuntimeError):
    """A checkpoint file changed (size or modification time) while the engine was reading from it."""


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one tensor's bytes are: ``file``, absolute byte ``start``, and its dtype and shape."""

    file: Path
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


def read_header(file: Path, size: int | None = None) -> dict[str, Extent]:
    """Every tensor of one safetensors file (``size``: the file's size if already known); raises
    :class:`~energon_infer.loading.weights.WeightError` naming the file and what is wrong."""
    size = file.stat().st_size if size is None else size

    def bad(why: str) -> WeightError:
        return WeightError(f"{file} is not a valid safetensors file: {why}; it is truncated or corrupt: copy it again "
                           "from the original model directory")

    if size < 8:
        raise bad(f"it has {size} bytes, fewer than the 8-byte header length")
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise bad(f"its header length {n} exceeds {'the format limit' if n > MAX_HEADER_BYTES else 'the file'}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data = 8 + n
    out: dict[str, Extent] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r} needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise bad(f"tensor {name!r} has dtype {dtype!r}; known: {', '.join(DTYPES)}")
        ints = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        pair = (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets))
        if not ints or not pair:
            raise bad(f"tensor {name!r} needs a shape of whole numbers >= 0 and data_offsets [begin, end]")
        ext = Extent(file, data + offsets[0], DTYPES[dtype], tuple(shape))
        if not 0 <= offsets[0] <= offsets[1] or data + offsets[1] > size or offsets[1] - offsets[0] != ext.nbytes:
            raise bad(f"tensor {name!r} ({dtype} {shape}: {ext.nbytes} bytes) has data_offsets {offsets}, which do "
                      f"not hold exactly its bytes inside the file's {size - data} data bytes")
        out[name] = ext
    return out


class TensorFiles:
    """Every tensor of a safetensors checkpoint directory by byte range, read through :class:`ExternalFile`.

    Args:
        path: the model directory (``model.safetensors``, or shards listed in ``model.safetensors.index.json``).
        drop_page_cache: after each buffered read, ``POSIX_FADV_DONTNEED`` its range (it will be read again from
            disk); direct reads leave nothing in the page cache.
        direct: read with ``O_DIRECT`` where the filesystem allows it (:class:`ExternalFile`); ``False``:
            buffered reads only.
    """

    def __init__(self, path: str | Path, *, drop_page_cache: bool = False, direct: bool = False):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            names = _read_index(index, self.path)
            files = sorted(set(names.values()))
        elif (self.path / "model.safetensors").is_file():
            files = [self.path / "model.safetensors"]
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {self.path}; the disk "
                                    "tier reads a Hugging Face safetensors directory")
        self.stamps: dict[Path, tuple[int, int]] = {}
        self.extents: dict[str, Extent] = {}
        self._files: dict[Path, ExternalFile] = {}
        for file in files:
            st = os.stat(file)
            self.stamps[file] = (st.st_size, st.st_mtime_ns)
            self.extents.update(read_header(file, st.st_size))
            self._files[file] = ExternalFile(file, direct=direct, drop_page_cache=drop_page_cache)

    @property
    def direct(self) -> bool:
        """Whether every file is read with ``O_DIRECT``."""
        return bool(self._files) and all(f.direct for f in self._files.values())

    @property
    def direct_reads(self) -> int:
        return sum(f.direct_reads for f in self._files.values())

    @property
    def buffered_reads(self) -> int:
        return sum(f.buffered_reads for f in self._files.values())

    def keys(self) -> list[str]:
        return list(self.extents)

    def check(self, files: set[Path] | None = None) -> None:
        """Raise :class:`CheckpointChangedError` if any of ``files`` (default all) changed since it was opened."""
        for file in self.stamps if files is None else files:
            size, mtime = self.stamps[file]
            try:
                st = os.stat(file)
                now: tuple[int, int] | None = (st.st_size, st.st_mtime_ns)
            except OSError:
                now = None
            if now != (size, mtime):
                what = "was removed" if now is None else (f"changed (size {size} -> {now[0]} bytes, mtime "
                                                          f"{mtime} -> {now[1]} ns)")
                raise CheckpointChangedError(
                    f"{file} {what} while the engine served from it; it stopped rather than read mixed weights: "
                    "restore the file, or restart the engine on the new checkpoint")

    def read(self, name: str, rows: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name`` (or its rows ``[lo, hi)``), read from disk into ``out`` (a ``uint8`` buffer of at least
        the bytes, or ``None``: a new one); returned as a view of it with the tensor's dtype and shape. The read
        is direct when the file was opened so and ``out`` has room for the aligned range (a buffer of
        :func:`tightfit.storage.direct_buffer_bytes` of the tensor always has)."""
        ext = self.extents[name]
        lo, hi = rows if rows is not None else (0, ext.shape[0] if ext.shape else 1)
        shape = (hi - lo, *ext.shape[1:]) if ext.shape else ()
        start = ext.start + lo * ext.row_bytes
        nbytes = (hi - lo) * ext.row_bytes if ext.shape else ext.nbytes
        buf = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
        try:
            got = self._files[ext.file].read(start, nbytes, buf, ext.dtype.itemsize)
        except ChecksumError as err:  # the file ends before the range: it changed or was truncated under us
            self.check({ext.file})
            raise CheckpointChangedError(f"{ext.file}: a read at byte {err.offset} came back short (the file is shorter "
                                         "than its header says: it changed or was truncated while serving); restore it "
                                         "or restart the engine on the new checkpoint") from None
        return got.view(ext.dtype).view(shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
