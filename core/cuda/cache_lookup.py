"""Embedding-cache index kernels: id -> slot lookup with miss detection, and victim selection.

    slots = cache_lookup(row_slot, ids, counts, slot_score, pinned_until, step, mode)
    victims = select_victims(slot_score, pinned_until, step, k)

A software cache keeps some rows of a table in ``C`` device *slots*. Its index is three device
tensors: ``row_slot`` (one int32 per table row, the slot holding it or -1), ``slot_score`` (int64
per slot, what the eviction policy ranks: a use count for LFU, the last step used for LRU, the
dataset frequency for a static policy; ``EMPTY_SCORE`` marks a free slot) and ``pinned_until``
(int64 per slot: the slot may not be evicted while ``pinned_until >= step``).

:func:`cache_lookup` takes the batch's *unique* ids, returns each one's slot (-1: a miss) and, in the
same pass, "touches" every hit: adds its count to the score (``mode=LFU``) or stamps the step
(``mode=LRU``), and pins it for this step so that making room for the misses cannot evict a row the
batch is about to read. Ids are unique, so no two programs write the same slot (no atomics).

:func:`select_victims` ranks every slot by ``(pinned ? +inf : score)`` and returns the ``k`` lowest
that are not pinned: free slots first (their score is ``EMPTY_SCORE``), then the policy's coldest.

Example:
    >>> import torch
    >>> row_slot = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    >>> score = torch.tensor([5, 2]); pinned = torch.zeros(2, dtype=torch.int64)
    >>> cache_lookup(row_slot, torch.tensor([1, 2]), torch.tensor([3, 1]), score, pinned, 7, LFU).tolist()
    [0, -1]
    >>> score.tolist(), select_victims(score, pinned, 7, 1).tolist()   # slot 0 is pinned by the hit
    ([8, 2], [1])
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tightfit.cuda.dispatch import register_kernel

__all__ = [
    "STATIC",
    "LFU",
    "LRU",
    "EMPTY_SCORE",
    "PINNED_KEY",
    "cache_lookup",
    "select_victims",
    "cache_lookup_reference",
    "cache_lookup_triton",
    "victim_keys_reference",
    "victim_keys_triton",
]

STATIC, LFU, LRU = 0, 1, 2
EMPTY_SCORE = -(2**62)  # below any count, step or frequency: free slots are taken first
PINNED_KEY = 2**63 - 1  # the key of a slot that may not be evicted now

triton: Any = None
tl: Any = None


@functools.cache
def _kernels() -> dict[str, Any]:
    global triton, tl
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl

    @triton.jit
    def _cache_lookup_kernel(row_slot_ptr, ids_ptr, counts_ptr, score_ptr, pinned_ptr, out_ptr, n, step,
                             MODE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int64)
        slot = tl.load(row_slot_ptr + ids, mask=mask, other=-1).to(tl.int64)
        tl.store(out_ptr + offs, slot, mask=mask)
        hit = mask & (slot >= 0)
        safe = tl.where(hit, slot, 0)
        step64 = tl.zeros([BLOCK], dtype=tl.int64) + step
        if MODE == 1:
            count = tl.load(counts_ptr + offs, mask=hit, other=0).to(tl.int64)
            old = tl.load(score_ptr + safe, mask=hit, other=0)
            tl.store(score_ptr + safe, old + count, mask=hit)
        if MODE == 2:
            tl.store(score_ptr + safe, step64, mask=hit)
        pinned = tl.load(pinned_ptr + safe, mask=hit, other=0)
        tl.store(pinned_ptr + safe, tl.maximum(pinned, step64), mask=hit)

    @triton.jit
    def _victim_keys_kernel(score_ptr, pinned_ptr, keys_ptr, n, step, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        score = tl.load(score_ptr + offs, mask=mask, other=0)
        pinned = tl.load(pinned_ptr + offs, mask=mask, other=0)
        top = tl.zeros([BLOCK], dtype=tl.int64) + 9223372036854775807
        tl.store(keys_ptr + offs, tl.where(pinned >= step, top, score), mask=mask)

    return {"lookup": _cache_lookup_kernel, "keys": _victim_keys_kernel}


# 1024 ids per program: the lookup is one dependent gather per id, so wide programs only hide latency.
_BLOCK = 1024


def cache_lookup_triton(row_slot: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, slot_score: torch.Tensor,
                        pinned_until: torch.Tensor, step: int, mode: int) -> torch.Tensor:
    """Triton launcher of :func:`cache_lookup` (no checks)."""
    kernels = _kernels()
    out = torch.empty(ids.shape[0], dtype=torch.int64, device=ids.device)
    n = ids.shape[0]
    if n:
        kernels["lookup"][(triton.cdiv(n, _BLOCK),)](row_slot, ids, counts, slot_score, pinned_until, out, n, step,
                                                     MODE=mode, BLOCK=_BLOCK)
    return out


def cache_lookup_reference(row_slot: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, slot_score: torch.Tensor,
                           pinned_until: torch.Tensor, step: int, mode: int) -> torch.Tensor:
    """Pure PyTorch :func:`cache_lookup`."""
    slots = row_slot.index_select(0, ids.long()).long()
    hit_slots = slots[slots >= 0]
    if hit_slots.numel():
        if mode == LFU:
            slot_score.index_add_(0, hit_slots, counts[slots >= 0].to(slot_score.dtype))
        elif mode == LRU:
            slot_score.index_fill_(0, hit_slots, step)
        pinned_until.index_copy_(0, hit_slots, pinned_until.index_select(0, hit_slots).clamp(min=step))
    return slots


def victim_keys_triton(slot_score: torch.Tensor, pinned_until: torch.Tensor, step: int) -> torch.Tensor:
    """Triton launcher: the eviction key of every slot (no checks)."""
    kernels = _kernels()
    n = slot_score.shape[0]
    keys = torch.empty_like(slot_score)
    if n:
        kernels["keys"][(triton.cdiv(n, _BLOCK),)](slot_score, pinned_until, keys, n, step, BLOCK=_BLOCK)
    return keys


def victim_keys_reference(slot_score: torch.Tensor, pinned_until: torch.Tensor, step: int) -> torch.Tensor:
    """Pure PyTorch: ``PINNED_KEY`` where ``pinned_until >= step``, the score elsewhere."""
    return torch.where(pinned_until >= step, torch.full_like(slot_score, PINNED_KEY), slot_score)


def _lookup_class(row_slot: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, slot_score: torch.Tensor,
                  pinned_until: torch.Tensor, step: int, mode: int) -> tuple:
    return (str(row_slot.dtype), str(ids.dtype), str(counts.dtype), int(mode))


def _lookup_probe(row_slot: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, slot_score: torch.Tensor,
                  pinned_until: torch.Tensor, step: int, mode: int) -> tuple[tuple, dict]:
    # 50 rows, 16 slots, 20 unique ids: some hit, some miss; some slots already pinned past the step.
    dev = row_slot.device
    gen = torch.Generator(device=dev).manual_seed(0)
    rs = torch.full((50,), -1, dtype=row_slot.dtype, device=dev)
    rs[torch.randperm(50, generator=gen, device=dev)[:16]] = torch.arange(16, device=dev).to(row_slot.dtype)
    probe_ids = torch.randperm(50, generator=gen, device=dev)[:20].to(ids.dtype)
    probe_counts = torch.randint(1, 5, (20,), generator=gen, device=dev).to(counts.dtype)
    score = torch.randint(0, 100, (16,), generator=gen, device=dev)
    pinned = torch.randint(0, 10, (16,), generator=gen, device=dev)
    return (rs, probe_ids, probe_counts, score, pinned, 5, int(mode)), {}


def _keys_probe(slot_score: torch.Tensor, pinned_until: torch.Tensor, step: int) -> tuple[tuple, dict]:
    gen = torch.Generator(device=slot_score.device).manual_seed(0)
    score = torch.randint(0, 100, (40,), generator=gen, device=slot_score.device)
    score[:3] = EMPTY_SCORE
    return (score, torch.randint(0, 10, (40,), generator=gen, device=slot_score.device), 5), {}


_lookup = register_kernel("cache_lookup", reference=cache_lookup_reference, triton=cache_lookup_triton,
                          doc="id -> cache slot with miss detection; touches and pins the hits",
                          shape_class=_lookup_class, probe=_lookup_probe)
_keys = register_kernel("victim_keys", reference=victim_keys_reference, triton=victim_keys_triton,
                        doc="eviction key per cache slot (pinned slots rank last)",
                        shape_class=lambda slot_score, pinned_until, step: (), probe=_keys_probe)


def _check_index(row_slot: torch.Tensor, slot_score: torch.Tensor, pinned_until: torch.Tensor) -> None:
    if row_slot.dim() != 1 or row_slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_slot must be a 1-D int32/int64 tensor (one entry per table row), got "
                         f"{row_slot.dim()}-D {row_slot.dtype}")
    if slot_score.dtype != torch.int64 or pinned_until.dtype != torch.int64 or slot_score.shape != pinned_until.shape:
        raise ValueError(f"slot_score and pinned_until must be int64 tensors of one shape (one entry per slot), got "
                         f"{slot_score.dtype} {tuple(slot_score.shape)} and {pinned_until.dtype} "
                         f"{tuple(pinned_until.shape)}")


def cache_lookup(row_slot: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, slot_score: torch.Tensor,
                 pinned_until: torch.Tensor, step: int, mode: int, *, backend: str | None = None) -> torch.Tensor:
    """Slots of the unique ``ids`` (int64, -1 for a miss); updates the hits' score and pin in place.

    Args:
        row_slot: (rows,) int32/int64, the slot of each table row or -1.
        ids: (n,) unique row ids, all within ``[0, rows)`` (the caller checks the range once per batch).
        counts: (n,) how often each id occurs in the batch (used by ``mode=LFU``).
        slot_score, pinned_until: (slots,) int64 index state, updated in place for the hits.
        step: the current step (LRU stamp, and hits are pinned until it).
        mode: :data:`LFU`, :data:`LRU` or :data:`STATIC` (scores untouched).
    """
    _check_index(row_slot, slot_score, pinned_until)
    if mode not in (STATIC, LFU, LRU):
        raise ValueError(f"cache_lookup mode={mode} must be STATIC (0), LFU (1) or LRU (2)")
    if ids.dim() != 1 or counts.shape != ids.shape:
        raise ValueError(f"ids and counts must be 1-D tensors of one length, got {tuple(ids.shape)} and "
                         f"{tuple(counts.shape)}")
    return _lookup(row_slot, ids, counts, slot_score, pinned_until, int(step), int(mode), backend=backend)


def select_victims(slot_score: torch.Tensor, pinned_until: torch.Tensor, step: int, k: int, *,
                   backend: str | None = None) -> torch.Tensor:
    """Up to ``k`` slots to (re)fill, lowest key first: free slots, then the coldest unpinned ones.

    Fewer than ``k`` come back when fewer slots are unpinned; the caller spills what does not fit.
    """
    if slot_score.dtype != torch.int64 or pinned_until.shape != slot_score.shape:
        raise ValueError("select_victims: slot_score and pinned_until must be int64 tensors of one shape")
    k = min(int(k), slot_score.shape[0])
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=slot_score.device)
    keys = _keys(slot_score, pinned_until, int(step), backend=backend)
    values, slots = torch.topk(keys, k, largest=False, sorted=False)
    return slots[values < PINNED_KEY]
