"""The differentiable cached lookup (no TorchRec import: the GPU benchmark uses it on a bare torch install).

Forward: gather the batch's unique rows (U x dim) from the cache, pool them with ``F.embedding_bag``.
Backward: each unique row's gradient is the sum over its occurrences of its bag's output gradient
(times the per-id weight, divided by the bag length for mean pooling), accumulated with
:func:`tightfit.cuda.scatter_add_rows`; then the fused optimizer updates the rows where they live,
or, without one, the gradient goes to the host table as a sparse tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tightfit.cuda import scatter_add_rows
from torchrec_cache.cache import Batch, TableCache

__all__ = ["cached_lookup"]


class _CachedLookup(torch.autograd.Function):
    """Pooled lookup over the batch's unique rows; the backward feeds the cache's optimizer."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, cache: TableCache, batch: Batch, offsets: torch.Tensor,
                weights: torch.Tensor | None, mode: str) -> torch.Tensor:
        rows = cache.gather(batch)
        out = F.embedding_bag(batch.inv, rows, offsets, mode=mode, per_sample_weights=weights,
                              include_last_offset=True)
        ctx.cache, ctx.batch, ctx.mode = cache, batch, mode
        ctx.save_for_backward(offsets, weights, rows)
        return out.float()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        offsets, weights, rows = ctx.saved_tensors
        cache: TableCache = ctx.cache
        batch: Batch = ctx.batch
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        grad_bag = grad_out.index_select(0, bag)  # (L, dim): each id's share of its bag's gradient
        grad_weights = None
        if weights is not None and ctx.needs_input_grad[4]:
            grad_weights = (grad_bag * rows.float().index_select(0, batch.inv)).sum(1)
        if weights is not None:
            grad_bag = grad_bag * weights.unsqueeze(1)
        if ctx.mode == "mean":
            grad_bag = grad_bag / lengths.clamp(min=1).index_select(0, bag).unsqueeze(1).to(grad_bag.dtype)
        grad_rows = torch.zeros(batch.uniq.numel(), grad_out.shape[1], dtype=grad_out.dtype, device=grad_out.device)
        scatter_add_rows(grad_rows, batch.inv, grad_bag.contiguous(), validate=False)
        grad_anchor = None
        if cache.fused:
            with torch.no_grad():
                cache.apply_grad(batch, grad_rows)
        else:
            grad_anchor = cache.sparse_grad(batch, grad_rows)
        return grad_anchor, None, None, None, grad_weights, None


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.long(), 0, out=out[1:])
    return out


def cached_lookup(cache: TableCache, ids: torch.Tensor, lengths: torch.Tensor, *, weights: torch.Tensor | None = None,
                  mode: str = "sum", anchor: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled embeddings of bags of ``ids`` (``lengths`` per bag) through ``cache``; differentiable.

    ``anchor``: a tensor requiring grad that ties the result into autograd when the cache has a fused
    optimizer (default: a fresh one); without a fused optimizer the host table itself is the anchor.
    """
    batch = cache.prepare(ids)
    if anchor is None:
        anchor = torch.zeros((), device=cache.device, requires_grad=True) if cache.fused else cache.host_weight
    offsets = _offsets(lengths.to(cache.device))
    w = weights.to(cache.device) if weights is not None else None
    return _CachedLookup.apply(anchor, cache, batch, offsets, w, mode)
