"""The layout of the disk tier's streamed optimizer step (:mod:`lightning_elixir.disk_state`): each unit's local
shards laid out flat with aligned starts (:func:`flat_layout`), cut into chunks, the staging sets the chunks
stream through, and what a step measured (:class:`StepIO`). Alignment and chunk sizes are explained in
:mod:`lightning_elixir.disk_state`."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["StepIO", "Piece", "Chunk", "Staging", "flat_layout", "chunks_of", "local_of", "align", "wait_all",
           "CHUNK_ELEMENTS", "ALIGN_ELEMENTS"]

# 8 Mi elements per state tensor per staging set: fp32 AdamW's two state tensors make 2 x 2 x 32 MiB = 128 MiB,
# the host staging area core's planner counts per rank (tightfit.planner.elixir.disk.DISK_STAGING_BYTES).
CHUNK_ELEMENTS = 8 * 2**20
# Chunk boundaries inside a tensor, and each tensor's offset on disk, are multiples of this (see the docstring).
ALIGN_ELEMENTS = 4096


def wait_all(futures: Sequence[Future[Any]]) -> None:
    """Wait for every one of ``futures``, then raise the first one's error (a DiskFullError, a ChecksumError):
    stopping at the first would leave the others in flight over buffers the caller then frees or reuses."""
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the rest are done
            first = first or e
    if first is not None:
        raise first


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a DTensor's local tensor; a plain tensor is its own)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@dataclass(frozen=True, kw_only=True, slots=True)
class StepIO:
    """One streamed optimizer step, as measured (the benchmark's optimizer-phase bandwidth reads it).

    Args:
        seconds: wall time of the disk units' step, reads, updates, write-backs and the sync included.
        bytes_read / bytes_written: state moved from and to the store.
        wait_seconds: time blocked on the store (I/O the updates did not hide).
        sync_seconds: the store's ``sync()`` at the end of the step (part of ``seconds``).
        chunks: chunks streamed.
    """

    seconds: float
    bytes_read: int
    bytes_written: int
    wait_seconds: float
    sync_seconds: float
    chunks: int

    @property
    def bytes_per_s(self) -> float:
        """Bytes moved (read + written) per second of the step."""
        return (self.bytes_read + self.bytes_written) / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Piece:
    param: nn.Parameter
    start: int  # first element of the local shard in this piece
    stop: int
    offset: int  # element offset of ``start`` in the unit's flat buffer


@dataclass(frozen=True, slots=True)
class Chunk:
    unit: int
    lo: int  # element range of the unit's flat buffer
    hi: int
    pieces: tuple[Piece, ...]


@dataclass
class Staging:
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    writes: list[Future[Any]] = field(default_factory=list)
    master: torch.Tensor | None = None  # tier-3 chunks: the chunk's master weights
    grad: torch.Tensor | None = None  # tier-4 chunks: the chunk's gradients, read from disk


def align(n: int) -> int:
    return -(-n // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def flat_layout(params: Sequence[nn.Parameter]) -> tuple[list[tuple[nn.Parameter, int, int]], int]:
    """A unit's local shards laid out flat: ``[(parameter, first element, local numel)]`` (aligned starts, empty
    shards left out) and the flat length; the optimizer state and tier-3 master weights share it."""
    layout, end = [], 0
    for p in params:
        n = local_of(p).numel()
        if n == 0:
            continue
        start = align(end)
        layout.append((p, start, n))
        end = start + n
    return layout, end


def chunks_of(units: Sequence[tuple[int, Sequence[nn.Parameter]]], chunk: int,
            where: dict[int, tuple[int, int]]) -> tuple[list[Chunk], dict[int, int]]:
    """Each unit's local shards laid out flat (aligned starts), cut into chunks of at most ``chunk`` elements;
    returns the chunks in plan order and each unit's flat length, and fills ``where`` (parameter id ->
    (unit, first element))."""
    out: list[Chunk] = []
    lengths: dict[int, int] = {}
    for unit, params in units:
        layout, end = flat_layout(params)
        for p, start, _ in layout:
            where[id(p)] = (unit, start)
        lengths[unit] = end
        for lo in range(0, end, chunk):
            hi = min(lo + chunk, end)
            pieces = tuple(Piece(p, max(lo, s) - s, min(hi, s + n) - s, max(lo, s))
                           for p, s, n in layout if s < hi and s + n > lo)
            if pieces:
                out.append(Chunk(unit, lo, hi, pieces))
    return out, lengths
