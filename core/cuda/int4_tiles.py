"""The tiled int4 layout: a packed int4 weight (:func:`~tightfit.cuda.quant_linear.pack_int4`) with each 16
rows' bytes reordered so that one 64-byte load is 16 output features' next four packed bytes.

    if int4_tiles_apply(n, k, group_size):
        tiled = tile_int4(packed)              # same shape, dtype and bytes
        assert torch.equal(untile_int4(tiled), packed)

The int8-activation kernel (:mod:`tightfit.cuda.quant_linear_a8`) reads it with no transpose per call, the
native dequantiser (:func:`~tightfit.cuda.quant_linear.int4_linear`'s prefill path) row by row; energon holds
its int4 projections so where :func:`int4_tiles_apply` (``energon_infer.parallel.int4_tiling``).
"""

from __future__ import annotations

import torch

__all__ = ["INT4_TILE", "int4_tiles_apply", "check_tiled", "tile_int4", "untile_int4"]

INT4_TILE = 16  # features per tile


def int4_tiles_apply(n: int, k: int, group_size: int) -> bool:
    """Whether an ``(n, k)`` int4 weight in groups of ``group_size`` can be held tiled (:func:`tile_int4`): ``n`` a
    multiple of 16, groups of 128 or a multiple of 256 dividing ``k``."""
    return (n > 0 and n % INT4_TILE == 0 and k % group_size == 0
            and (group_size == 128 or (group_size > 0 and group_size % 256 == 0)))


def check_tiled(name: str, n: int, k: int, group_size: int) -> None:
    """Raise (one line, naming the fix) unless an ``(n, k)`` weight in groups of ``group_size`` can be tiled."""
    if not int4_tiles_apply(n, k, group_size):
        raise ValueError(f"{name}: tiled=True needs a multiple of {INT4_TILE} output features and groups of 128 or a "
                         f"multiple of 256 (tile_int4); got {n} features, group_size {group_size}: pass the "
                         "row-order weight with tiled=False")


def tile_int4(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` (:func:`~tightfit.cuda.quant_linear.pack_int4`, ``(N, K/2)`` uint8, ``N % 16 == 0``, ``K % 128
    == 0``) with each 16 rows' bytes reordered for the int8-activation kernel: per 64-byte run ``u`` of a row, 16
    runs of 64 bytes, run ``i`` holding bytes ``64u + 4i .. 64u + 4i + 3`` of the tile's 16 rows side by side.
    Same shape, dtype and bytes; a tile's bytes stay its rows' bytes (rows can still be split at multiples of 16).
    The kernel then reads 16 features' four inputs with one load, where the row order costs it a 16 x 16
    transpose per 1 KiB of weight and call. :func:`untile_int4` inverts it."""
    n, half = packed.shape
    words = packed.contiguous().view(torch.int32)  # 4 bytes = one 32-bit lane of the kernel
    return words.view(n // INT4_TILE, INT4_TILE, half // 64, 16).permute(0, 2, 3, 1).contiguous().view(
        torch.uint8).view(n, half)


def untile_int4(tiled: torch.Tensor) -> torch.Tensor:
    """The row order (:func:`~tightfit.cuda.quant_linear.pack_int4`) of a :func:`tile_int4` weight."""
    n, half = tiled.shape
    words = tiled.contiguous().view(torch.int32)
    return words.view(n // INT4_TILE, half // 64, 16, INT4_TILE).permute(0, 3, 1, 2).contiguous().view(
        torch.uint8).view(n, half)
