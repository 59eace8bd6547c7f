"""The vocabulary's two tables read from the checkpoint's files instead of held: the embedding by row, the head by chunk.

Under a tight memory limit the embedding and the vocabulary head can be the largest things a stage holds (a 32k x
2048 fp32 table is 250 MiB, as much as two decoder layers). Neither has to stay:

* :class:`DiskEmbedding` looks up a step's token ids by reading only their rows from the safetensors file (one
  ``os.preadv`` per run of consecutive ids, each distinct id once): a step reads a few KiB per token, far less than
  one streamed layer, so moving the embedding out of memory costs almost nothing;
* :class:`DiskHead` computes the logits in chunks of vocabulary rows (at most :data:`HEAD_CHUNK_BYTES` and an
  eighth of the table), each read into one of two buffers while the other's product runs (the read of chunk
  ``k + 1`` overlaps the product of chunk ``k``) and laid out input-major as the held head is: the head's bytes are
  read once per step, like one more streamed layer, for three chunks of memory instead of the whole table.

Both hold exactly what loading would: the checkpoint's rows converted to the serving dtype, this rank's vocabulary
shard (rows past the checkpoint's vocabulary, the padding of a shard, are zeros), and they check every file's size
and modification time around each read as the disk tier's layers do. Each logit is the same dot product as the
whole table's, so the greedy tokens are those of the engine holding the tables. The engine's serving plan
(:mod:`energon_infer.engine.memory_plan`) moves them out only where the process would not fit its memory limit
otherwise (``MemoryPoolConfig(disk_vocab=...)``); :func:`disk_vocab_bytes` is what each one holds instead.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from energon_infer.loading.config import ModelConfig
from energon_infer.loading.safetensors_files import TensorFiles
from energon_infer.loading.weights import WeightError, hf_parts
from energon_infer.parallel import Grid, vocab_shard
from tightfit.storage import IOCounters, ReadAhead, direct_buffer_bytes

__all__ = ["DISK_VOCAB", "HEAD_CHUNK_BYTES", "DiskEmbedding", "DiskHead", "disk_vocab_bytes", "install_disk_vocab",
           "vocab_source"]

#: The stage's parts that may stay in the checkpoint: its embedding and its vocabulary head.
DISK_VOCAB = ("embed", "lm_head")

#: Bytes of one chunk of the head's rows as stored (two chunk buffers are held while the head streams).
HEAD_CHUNK_BYTES = 32 * 2**20


def vocab_source(cfg: ModelConfig, name: str, keys: set[str]) -> str | None:
    """The checkpoint tensor stage parameter ``name`` (``embed.weight`` / ``lm_head.weight``) is read from whole, or
    ``None`` where it is assembled (several parts, a transform): such a table must be loaded."""
    parts = hf_parts(cfg, name, keys)
    if len(parts) != 1 or parts[0].transform is not None or parts[0].source not in keys:
        return None
    return parts[0].source


#: The fewest rows of a chunk: narrower products take other GEMM kernels, whose sums may round differently.
MIN_CHUNK_ROWS = 64

#: A chunk is at most this share of the table: a small table streams in small chunks.
CHUNKS_AT_LEAST = 8


def _chunk_rows(row_bytes: int, rows: int, chunk_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """Rows per chunk of a ``rows``-row table: at most ``chunk_bytes`` and an eighth of the table (but
    :data:`MIN_CHUNK_ROWS`), balanced so that the last chunk is not a sliver."""
    most = max(MIN_CHUNK_ROWS, min(chunk_bytes, rows * row_bytes // CHUNKS_AT_LEAST) // max(1, row_bytes))
    return -(-rows // -(-rows // most))


def disk_vocab_bytes(part: str, cfg: ModelConfig, file_itemsize: int, itemsize: int, tp: int = 1, *,
                     chunk_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """What ``part`` (``"embed"`` or ``"lm_head"``) holds while it is read from disk: the head's two read buffers and
    its chunk in the serving dtype and layout; the embedding nothing beyond a step's rows (counted with the step's
    activations)."""
    if part == "embed":
        return 0
    width = cfg.embed_dim
    rows = _chunk_rows(width * file_itemsize, vocab_shard(cfg.vocab_size, tp), chunk_bytes)
    return 2 * direct_buffer_bytes(rows * width * file_itemsize) + rows * width * itemsize


class _Rows:
    """This rank's shard ``[start, start + rows)`` of a vocabulary table in the checkpoint, read by row range."""

    def __init__(self, files: TensorFiles, source: str, rows: int, start: int, dtype: torch.dtype):
        self.files, self.source, self.dtype = files, source, dtype
        ext = files.extents[source]
        self.file_rows, self.start, self.rows = ext.shape[0], start, rows
        self.used = {ext.file}
        self.io = IOCounters()

    @property
    def bytes_read(self) -> int:
        return self.io.totals.bytes_read

    def read(self, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the shard (local numbering) in the serving dtype; rows past the file are zeros."""
        a, b = self.start + lo, min(self.start + hi, self.file_rows)
        with self.io.reading() as tally:
            t = self.files.read(self.source, (a, b), out=out) if b > a else None
            tally.bytes = 0 if t is None else t.numel() * t.element_size()
        if t is not None and t.dtype == self.dtype and b - a == hi - lo:
            return t
        width = self.files.extents[self.source].shape[1]
        full = torch.zeros(hi - lo, width, dtype=self.dtype)
        if t is not None:
            full[: b - a].copy_(t)
        return full


class DiskEmbedding(nn.Module):
    """The token embedding with its table left in the checkpoint: each step reads the rows of the ids it looks up.

    Args:
        rows: this rank's table rows (:func:`~energon_infer.parallel.vocab_shard`); files / source: where the table
            is; grid: this rank's place; dtype: the serving dtype.
    """

    def __init__(self, files: TensorFiles, source: str, rows: int, grid: Grid, dtype: torch.dtype):
        super().__init__()
        self.grid = grid
        self.start = grid.tp_rank * rows
        self.table = _Rows(files, source, rows, self.start, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.table.rows)
        wanted, where = torch.unique(local[inside], return_inverse=True)
        width = self.table.files.extents[self.table.source].shape[1]
        rows = torch.empty(wanted.numel(), width, dtype=self.table.dtype)
        self.table.files.check(self.table.used)
        # Consecutive ids read together: one request per run.
        values = wanted.tolist()
        i = 0
        while i < len(values):
            j = i + 1
            while j < len(values) and values[j] == values[j - 1] + 1:
                j += 1
            rows[i:j] = self.table.read(values[i], values[j - 1] + 1)
            i = j
        self.table.files.check(self.table.used)
        if self.grid.tp == 1:
            return rows[where]
        out = torch.zeros(ids.shape[0], width, dtype=self.table.dtype)
        out[inside] = rows[where]
        return self.grid.all_reduce(out)


class DiskHead(nn.Module):
    """The vocabulary head with its table left in the checkpoint: logits computed over chunks of rows read per step.

    Args:
        vocab_size: the true vocabulary (the logits are trimmed to it); rows: this rank's shard; files / source:
            where the table is; grid: this rank's place; dtype: the serving dtype; chunk_bytes: bytes of a chunk as
            stored (:data:`HEAD_CHUNK_BYTES`).
    """

    def __init__(self, files: TensorFiles, source: str, vocab_size: int, rows: int, grid: Grid, dtype: torch.dtype,
                 chunk_bytes: int = HEAD_CHUNK_BYTES):
        super().__init__()
        self.grid, self.vocab_size = grid, vocab_size
        self.table = _Rows(files, source, rows, grid.tp_rank * rows, dtype)
        ext = files.extents[source]
        self.chunk = _chunk_rows(ext.row_bytes, rows, chunk_bytes)
        self._reads = [torch.empty(direct_buffer_bytes(self.chunk * ext.row_bytes), dtype=torch.uint8)
                         for _ in range(2)]
        # The chunk input-major, in the serving dtype: the layout the loaded head multiplies by
        # (parallel.linear_weight), so each logit comes out of the same product.
        self._major = torch.empty(self.chunk * ext.shape[1], dtype=dtype)
        self._lock = threading.Lock()

    def _read(self, k: int, slot: int) -> torch.Tensor:
        lo = k * self.chunk
        return self.table.read(lo, min(lo + self.chunk, self.table.rows), out=self._reads[slot])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = -(-self.table.rows // self.chunk)
        logits = torch.empty(x.shape[0], self.table.rows, dtype=x.dtype)
        with self._lock:  # one step at a time owns the two buffers
            self.table.files.check(self.table.used)
            # the next chunk's read overlaps this chunk's product, in the other buffer
            with ReadAhead(range(n), self._read, depth=1) as ahead:
                for k in range(n):
                    w = ahead.take(k)
                    lo, rows = k * self.chunk, w.shape[0]
                    major = self._major[: rows * w.shape[1]].view(w.shape[1], rows)
                    major.copy_(w.t())
                    logits[:, lo: lo + rows] = torch.mm(x, major)
            self.table.files.check(self.table.used)
        return self.grid.all_gather_last_dim(logits)[..., : self.vocab_size]


def install_disk_vocab(stage: nn.Module, cfg: ModelConfig, grid: Grid, files: TensorFiles, parts: tuple[str, ...],
                       dtype: torch.dtype, *, chunk_bytes: int = HEAD_CHUNK_BYTES) -> None:
    """Replace ``parts`` of ``stage`` (left on the meta device at load) by their disk-read versions."""
    keys = set(files.keys())
    for part in parts:
        if part not in DISK_VOCAB:
            raise ValueError(f"disk_vocab part {part!r} is not one of {DISK_VOCAB}")
        module = getattr(stage, part, None)
        if module is None:  # not this pipeline stage's
            continue
        source = vocab_source(cfg, f"{part}.weight", keys)
        if source is None:
            raise WeightError(f"{part}.weight of this {cfg.model_type} checkpoint in {files.path} is assembled from "
                              "several tensors or transformed at load, so it cannot be read from disk; leave "
                              f"{part!r} out of MemoryPoolConfig(disk_vocab=...)")
        rows = module.weight.shape[0]
        if part == "embed":
            setattr(stage, part, DiskEmbedding(files, source, rows, grid, dtype))
        else:
            setattr(stage, part, DiskHead(files, source, cfg.vocab_size, rows, grid, dtype, chunk_bytes=chunk_bytes))
