"""Attention with a sliding window, tanh soft-capping and sinks, over the same paged KV cache as every other layer.

As transformers' eager attention: ``scores * scale``, then ``cap * tanh(scores / cap)``, then the causal and window
mask, softmax in fp32, a query at position ``p`` seeing the keys at ``p - window + 1 .. p``. Nothing caps the
context: the window is a mask. A sink (gpt-oss) is one learned logit per query head that joins the softmax as one
more column and is then dropped: the probabilities over the real keys sum to less than one, by what the sink took.

Where the native CPU kernel runs the step (fp32 on the CPU, its library built; see
:func:`tightfit.kernels.varlen_attention_cpu.native_runs`), :func:`attention` hands it all three options:
:func:`tightfit.kernels.varlen_attention.paged_attention` takes them. Elsewhere (other dtypes, a GPU, the kernels forced
to the reference) a layer with any runs :func:`masked_attention`, the PyTorch path below.

Only the blocks a window can reach are read: a decode step gathers the ``(window - 1) // block_size + 2`` blocks
from its query's window on (columns past the sequence's last block repeat that block, masked), and a prefill
chunk the blocks from its first query's window on. Blocks before the window are never touched, so the scheduler
releases them while the sequence runs (their table entries become holes, ``-1``; see
:mod:`energon_infer.scheduling.blocks`).

On a GPU, :func:`masked_attention`'s decode step needs no host value, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from energon_infer.loading.config import ModelConfig
from energon_infer.worker.kv_cache import StepMetadata
from tightfit.kernels.dispatch import get_kernel
from tightfit.kernels.varlen_attention import paged_attention
from tightfit.kernels.varlen_attention_cpu import native_runs

__all__ = ["attention", "every_layer_window", "masked_attention"]

#: scores per query chunk of a prefill (query rows x keys x heads) before it is split into smaller chunks
_CHUNK_SCORES = 1 << 24


def every_layer_window(cfg: ModelConfig) -> int:
    """The window every layer of ``cfg`` attends within (0: a layer reads the whole context): the scheduler
    releases a sequence's blocks before it, since no layer reads them again."""
    return max(cfg.windows) if cfg.windows and all(cfg.windows) else 0


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, *, scale: float,
              window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's queries ``(T, H, D)``: ``paged_attention`` for a plain layer, and for a layer
    with a window, soft-cap or ``sinks`` (``(H,)``) where the native kernel runs it; :func:`masked_attention`
    otherwise."""
    if sinks is None and not softcap and not window:
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens, meta.kv_lens, scale=scale,
                               max_q_len=meta.max_q_len)
    if _native(q, k_cache, v_cache):
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens, meta.kv_lens, scale=scale,
                               max_q_len=meta.max_q_len, window=window, softcap=softcap, sinks=sinks)
    return masked_attention(q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap, sinks=sinks)


def _native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``paged_attention`` runs these on the native CPU kernel (its backend rule picks it and the kernel
    takes them) rather than on Triton or the reference."""
    return native_runs(q, k_cache, v_cache) and get_kernel("paged_attention").backend_for(q) == "native"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q (..., Hk, g, n, D)``, ``k``/``v (..., Hk, L, D)``, ``visible (..., 1, 1|n, L)`` -> ``(..., Hk, g, n, D)``;
    ``sinks (Hk * g,)``."""
    scores = torch.matmul(q, k.unsqueeze(-3).transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible.unsqueeze(-3), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # the sink as one more column of every query's scores, dropped after the softmax
        hk, g = q.shape[-4], q.shape[-3]
        column = sinks.to(scores.dtype).view(hk, g, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        probs = probs.to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(-3))


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, scale: float,
            window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per sequence: each gathers the blocks its window reaches (the whole table without a window)."""
    b, h, d = q.shape
    block, hk = k_cache.shape[1], k_cache.shape[2]
    tables, lens = meta.block_tables, meta.kv_lens.long()
    width = tables.shape[1] if not window else min(tables.shape[1], (window - 1) // block + 2)
    last = lens - 1  # each query's position
    first = torch.zeros_like(lens) if not window else (last - window + 1).clamp(min=0) // block
    cols = first[:, None] + torch.arange(width, device=q.device)
    # Columns past the query's own last block (the step's longer tables, or the window's spare column) gather
    # that block again, masked: never another sequence's padding, nor a released block before the window.
    blocks = tables.long().gather(1, torch.minimum(cols, (last // block)[:, None])).flatten()
    k = k_cache.index_select(0, blocks).view(b, width * block, hk, d).transpose(1, 2)  # (B, Hk, L, D)
    v = v_cache.index_select(0, blocks).view(b, width * block, hk, d).transpose(1, 2)
    pos = cols[:, :, None] * block + torch.arange(block, device=q.device)  # (B, width, block)
    pos = pos.flatten(1)
    visible = pos <= last[:, None]
    if window:
        visible &= pos > (last - window)[:, None]
    out = _attend(q.view(b, hk, h // hk, 1, d), k, v, visible[:, None, None, :], scale, softcap, sinks)
    return out.reshape(b, h, d)


def _sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, kv: int,
              scale: float, window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """The ``n`` new queries ``(n, H, D)`` of one sequence with ``kv`` tokens of context, in query chunks."""
    n, h, d = q.shape
    block, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    rows = max(1, _CHUNK_SCORES // max(1, (min(kv, window) if window else kv) * h))
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        first_q, last_q = kv - n + lo, kv - n + hi - 1
        start = max(0, first_q - window + 1) // block * block if window else 0
        blocks = table[start // block: last_q // block + 1].long()
        length = last_q + 1 - start
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:length].transpose(0, 1)  # (Hk, L, D)
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:length].transpose(0, 1)
        qpos = torch.arange(first_q, last_q + 1, device=q.device)[:, None]
        kpos = torch.arange(start, last_q + 1, device=q.device)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        qs = q[lo:hi].transpose(0, 1).reshape(hk, h // hk, hi - lo, d)
        o = _attend(qs, k, v, visible[None, None], scale, softcap, sinks)  # (Hk, g, n, D)
        out[lo:hi] = o.reshape(h, hi - lo, d).transpose(0, 1)
    return out


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, *,
                     scale: float, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Causal attention of ``q (T, H, D)`` within a sliding ``window`` (0: none), scores soft-capped at ``softcap``
    (0: not capped), each head's softmax joined by its sink logit where ``sinks`` (``(H,)``) are given, over the
    paged cache; the layout of :mod:`tightfit.kernels.varlen_attention`."""
    if meta.max_q_len == 1 and q.shape[0] == meta.kv_lens.shape[0]:
        return _decode(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    out = torch.empty_like(q)
    cu, lens = meta.cu_seqlens.tolist(), meta.kv_lens.tolist()
    for b, kv in enumerate(lens):
        if cu[b + 1] > cu[b]:
            out[cu[b]:cu[b + 1]] = _sequence(q[cu[b]:cu[b + 1]], k_cache, v_cache, meta.block_tables[b], kv, scale,
                                             window, softcap, sinks)
    return out
