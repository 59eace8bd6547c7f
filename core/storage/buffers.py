"""Byte views of what callers hand the store: CPU tensors and buffers in, CPU tensors and buffers out.

A CUDA tensor is refused with the fix (a pinned host buffer and a non-blocking copy), so no transfer
allocates behind the caller's back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tightfit.storage.errors import StorageError
from tightfit.storage.fs import ALIGN
from tightfit.storage.index import DTYPES

__all__ = ["host_tensor", "readable", "writable", "aligned_empty"]


def host_tensor(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise StorageError(f"{what}: the tensor is on {t.device}; the store moves host memory only: use a pinned "
                           f"CPU tensor (torch.empty(..., pin_memory=True)) and copy it to/from the device with "
                           f"non_blocking=True")
    return t.detach()


def readable(data: Any, what: str) -> tuple[memoryview, tuple[str, tuple[int, ...]] | None]:
    """A byte view of ``data`` and, for a tensor, its (dtype, shape)."""
    if isinstance(data, torch.Tensor):
        t = host_tensor(data, what).contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise StorageError(f"{what}: dtype {dtype} is not stored; dtypes: {', '.join(DTYPES)}")
        return t.reshape(-1).view(torch.uint8).numpy().data, (dtype, tuple(t.shape))
    try:
        view = memoryview(data)
    except TypeError:
        raise StorageError(f"{what}: {type(data).__name__} is neither a tensor nor a buffer; pass a CPU tensor, "
                           f"bytes, bytearray, memoryview or numpy array") from None
    if not view.c_contiguous:
        view = np.ascontiguousarray(view).data
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view, None


def writable(out: Any, what: str) -> memoryview:
    if isinstance(out, torch.Tensor):
        t = host_tensor(out, what)
        if not t.is_contiguous():
            raise StorageError(f"{what}: the output tensor is not contiguous; pass a contiguous buffer "
                               f"(reads land in place, there is no copy to make it contiguous)")
        return t.reshape(-1).view(torch.uint8).numpy().data
    try:
        view = memoryview(out)
    except TypeError:
        raise StorageError(f"{what}: {type(out).__name__} is not a buffer; pass a CPU tensor, bytearray or "
                           f"numpy array") from None
    if view.readonly or not view.c_contiguous:
        raise StorageError(f"{what}: the output buffer is read-only or not contiguous; pass a writable, "
                           f"contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None,
                  *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts at a 4 KiB boundary: O_DIRECT reads land in it with no bounce."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % ALIGN
    flat = raw[skip:skip + nbytes].view(dtype)
    return flat.reshape(shape) if shape is not None else flat
