"""The tiled weight layouts: a quantized weight of one byte per element (int8 ``(N, K)``, or int4 packed two to a
byte by :func:`~tightfit.kernels.quant_linear.pack_int4`, ``(N, K/2)``) with each 16 rows' bytes reordered so that one
64-byte load is 16 output features' next four bytes.

    if int4_tiles_apply(n, k, group_size):
        tiled = tile_int4(packed)              # same shape, dtype and bytes
        assert torch.equal(untile_int4(tiled), packed)
    if int8_tiles_apply(n, k):
        tiled = tile_int8(qweight)             # likewise for an int8 weight
        assert torch.equal(untile_int8(tiled), qweight)

The int8-activation kernel (:mod:`tightfit.kernels.quant_linear_a8`) reads them with no transpose per call: one
``vpdpbusd`` meets four broadcast inputs of a row with those inputs' weights of 16 features, and a row's 16 sums
land in one vector. The native dequantiser (the prefill paths of :func:`~tightfit.kernels.quant_linear.int8_linear`
and :func:`~tightfit.kernels.quant_linear.int4_linear`) reads them row by row. energon holds its quantized projections
so where its kernel runs (``energon_infer.parallel.quant_tiling``).
"""

from __future__ import annotations

import torch

__all__ = ["TILE", "int4_tiles_apply", "int8_tiles_apply", "check_tiled", "check_tiled_int8", "tile_int4",
           "untile_int4", "tile_int8", "untile_int8"]

TILE = 16  # features per tile


def int4_tiles_apply(n: int, k: int, group_size: int) -> bool:
    """Whether an ``(n, k)`` int4 weight in groups of ``group_size`` can be held tiled (:func:`tile_int4`): ``n`` a
    multiple of 16, groups of 128 or a multiple of 256 dividing ``k``."""
    return (n > 0 and n % TILE == 0 and k % group_size == 0
            and (group_size == 128 or (group_size > 0 and group_size % 256 == 0)))


def int8_tiles_apply(n: int, k: int) -> bool:
    """Whether an ``(n, k)`` int8 weight can be held tiled (:func:`tile_int8`): ``n`` a multiple of 16, ``k`` of 128
    (the kernel's activation block: two 64-byte runs)."""
    return n > 0 and n % TILE == 0 and k > 0 and k % 128 == 0


def check_tiled(name: str, n: int, k: int, group_size: int) -> None:
    """Raise (one line, naming the fix) unless an ``(n, k)`` int4 weight in groups of ``group_size`` can be tiled."""
    if not int4_tiles_apply(n, k, group_size):
        raise ValueError(f"{name}: tiled=True needs a multiple of {TILE} output features and groups of 128 or a "
                         f"multiple of 256 (tile_int4); got {n} features, group_size {group_size}: pass the "
                         "row-order weight with tiled=False")


def check_tiled_int8(name: str, n: int, k: int) -> None:
    """Raise (one line, naming the fix) unless an ``(n, k)`` int8 weight can be tiled."""
    if not int8_tiles_apply(n, k):
        raise ValueError(f"{name}: tiled=True needs a multiple of {TILE} output features and of 128 inputs "
                         f"(tile_int8); got {n} features, {k} inputs: pass the row-order weight with tiled=False")


def _tile(rows: torch.Tensor) -> torch.Tensor:
    n, width = rows.shape
    words = rows.contiguous().view(torch.int32)  # 4 bytes = one 32-bit lane of the kernel
    return words.view(n // TILE, TILE, width // 64, 16).permute(0, 2, 3, 1).contiguous().view(rows.dtype).view(n, width)


def _untile(tiled: torch.Tensor) -> torch.Tensor:
    n, width = tiled.shape
    words = tiled.contiguous().view(torch.int32)
    return words.view(n // TILE, width // 64, 16, TILE).permute(0, 3, 1, 2).contiguous().view(tiled.dtype).view(n, width)


def tile_int4(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` (:func:`~tightfit.kernels.quant_linear.pack_int4`, ``(N, K/2)`` uint8, ``N % 16 == 0``, ``K % 128
    == 0``) with each 16 rows' bytes reordered for the int8-activation kernel: per 64-byte run ``u`` of a row, 16
    runs of 64 bytes, run ``i`` holding bytes ``64u + 4i .. 64u + 4i + 3`` of the tile's 16 rows side by side.
    Same shape, dtype and bytes; a tile's bytes stay its rows' bytes (rows can still be split at multiples of 16).
    The kernel then reads 16 features' four inputs with one load, where the row order costs it a 16 x 16
    transpose per 1 KiB of weight and call. :func:`untile_int4` inverts it."""
    return _tile(packed)


def untile_int4(tiled: torch.Tensor) -> torch.Tensor:
    """The row order (:func:`~tightfit.kernels.quant_linear.pack_int4`) of a :func:`tile_int4` weight."""
    return _untile(tiled)


def tile_int8(qweight: torch.Tensor) -> torch.Tensor:
    """An ``(N, K)`` int8 weight (``N % 16 == 0``, ``K % 128 == 0``) in :func:`tile_int4`'s byte order: per 64-byte
    run of a row, one 64-byte load is the tile's 16 features' next four weights. Same shape, dtype and bytes;
    :func:`untile_int8` inverts it."""
    return _tile(qweight)


def untile_int8(tiled: torch.Tensor) -> torch.Tensor:
    """The row order of a :func:`tile_int8` weight."""
    return _untile(tiled)
