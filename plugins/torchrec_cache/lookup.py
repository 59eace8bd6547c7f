"""The differentiable lookup over a :class:`~torchrec_cache.cache.FusedCache` (no TorchRec import: the GPU
benchmark uses it on a bare torch install).

Forward: one :meth:`FusedCache.lookup` for all tables, then per slot tensor (one for tables of one
dim) the batch's unique rows (U x dim) come out of :class:`CachedRows` and one ``F.embedding_bag``
pools every bag of every feature. Backward: ``embedding_bag``'s own backward sums each unique row's
gradient (per-id weights and mean pooling included); :class:`CachedRows` then applies the fused
optimizer where each row lives, or hands each host table a sparse gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from torchrec_cache.cache import Batch, FusedCache

__all__ = ["CachedRows", "offsets_from_lengths", "cached_pooled_lookup", "cached_unpooled_lookup", "prepare_batch"]


class CachedRows(torch.autograd.Function):
    """The unique rows of one slot-tensor group of a batch; the backward feeds the cache's optimizer."""

    @staticmethod
    def forward(ctx: Any, cache: FusedCache, batch: Batch, group: int, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.cache, ctx.batch, ctx.group, ctx.n = cache, batch, group, len(anchors)
        return cache.store.gather(batch, group)

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[Any, ...]:
        cache: FusedCache = ctx.cache
        batch: Batch = ctx.batch
        grads: tuple[Any, ...]
        if cache.fused:
            with torch.no_grad():
                cache.store.apply_grad(batch, ctx.group, grad_rows)
            grads = (None,) * ctx.n
        else:
            grads = tuple(cache.store.sparse_grads(batch, ctx.group, grad_rows))
        batch.groups_left -= 1
        if batch.groups_left == 0:
            cache.release(batch)
        return (None, None, None, *grads)


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Bag offsets (n + 1, int64, starting at 0) of bag ``lengths`` (n,)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.long(), 0, out=out[1:])
    return out


def prepare_batch(cache: FusedCache, values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor, *,
                  value_bounds: list[int] | None = None, train: bool | None = None) -> Batch:
    """:meth:`FusedCache.lookup` for a training or eval lookup (``train``: whether grad is on, unless given).
    Rows are held until the lookup has gathered them (eval) or until the backward (train), so a prefetch
    thread cannot move them before."""
    return cache.lookup(values, lengths, feature_table, value_bounds=value_bounds,
                        train=torch.is_grad_enabled() if train is None else train)


def _anchors(cache: FusedCache, group: int, anchor: torch.Tensor | None,
             host_params: list[list[torch.Tensor]] | None) -> tuple[torch.Tensor, ...]:
    if cache.fused:
        if anchor is None:
            anchor = torch.zeros((), device=cache.device, requires_grad=True)
        return (anchor,)
    if host_params is None:
        raise ValueError("a cache without a fused optimizer needs the host tables' parameters (host_params) to "
                         "give them their sparse gradients")
    return tuple(host_params[group])


def cached_pooled_lookup(cache: FusedCache, batch: Batch, lengths: torch.Tensor, *, batch_size: int,
                         group_features: list[tuple[int, int]], weights: torch.Tensor | None = None,
                         mean: torch.Tensor | None = None, anchor: torch.Tensor | None = None,
                         host_params: list[list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """Pooled embeddings of every bag, one ``(batch_size, features_g * dim_g)`` tensor per group.

    Args:
        cache, batch: the cache and the batch it prepared.
        lengths: (F * B,) bag lengths, feature-major.
        batch_size: B.
        group_features: per group, its features' run ``(first, end)`` in the feature order.
        weights: (L,) per-id weights (sum pooling), or ``None``.
        mean: (F,) bool, the features pooled by mean, or ``None`` (all sums).
        anchor: a tensor requiring grad that ties a fused cache's rows into autograd.
        host_params: per group, the host tables' parameters (autograd mode).
    """
    B = batch_size
    offsets = offsets_from_lengths(lengths)
    out = []
    for gi, (fa, fb) in enumerate(group_features):
        va, vb = batch.value_bounds[gi], batch.value_bounds[gi + 1]
        ua = cache.space.group_run(batch.key_bounds, gi)[0]
        rows = CachedRows.apply(cache, batch, gi, *_anchors(cache, gi, anchor, host_params))
        inv = batch.inv[va:vb] if ua == 0 else batch.inv[va:vb] - ua
        offs = offsets[fa * B: fb * B + 1]
        offs = offs if va == 0 else offs - va
        w = weights[va:vb] if weights is not None else None
        pooled = F.embedding_bag(inv, rows, offs, mode="sum", per_sample_weights=w, include_last_offset=True)
        if mean is not None:
            m = mean[fa:fb].repeat_interleave(B)
            scale = torch.where(m, 1.0 / lengths[fa * B: fb * B].clamp(min=1).to(pooled.dtype),
                                torch.ones((), dtype=pooled.dtype, device=pooled.device))
            pooled = pooled * scale.unsqueeze(1)
        dim = rows.shape[1]
        out.append(pooled.float().view(fb - fa, B, dim).transpose(0, 1).reshape(B, (fb - fa) * dim))
    cache.gathered(batch)
    return out


def cached_unpooled_lookup(cache: FusedCache, batch: Batch, *, anchor: torch.Tensor | None = None,
                           host_params: list[list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """Per group, the (L_g, dim) row of every id of the batch (an ``EmbeddingCollection`` lookup)."""
    out = []
    for gi in range(len(cache.groups)):
        va, vb = batch.value_bounds[gi], batch.value_bounds[gi + 1]
        ua = cache.space.group_run(batch.key_bounds, gi)[0]
        rows = CachedRows.apply(cache, batch, gi, *_anchors(cache, gi, anchor, host_params))
        inv = batch.inv[va:vb] if ua == 0 else batch.inv[va:vb] - ua
        out.append(rows.index_select(0, inv).float())
    cache.gathered(batch)
    return out
