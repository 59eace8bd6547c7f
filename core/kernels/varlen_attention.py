"""Causal attention over packed, variable-length sequences whose keys and values live in a paged cache.

    out = paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, scale=s, max_q_len=m)
    store_kv(k, v, k_cache, v_cache, slot_mapping)       # write the new tokens' keys/values first

Layout (the same on both backends):

- ``q``: ``(T, Hq, D)`` — the new tokens of ``B`` sequences packed back to back, no padding;
  sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
- ``k_cache`` / ``v_cache``: ``(num_blocks, block_size, Hk, D)``; ``Hq`` must be a multiple of ``Hk``
  (grouped-query attention: query head ``h`` reads key head ``h // (Hq // Hk)``).
- ``block_tables``: ``(B, max_blocks)`` int32; token ``p`` of sequence ``b`` sits in block
  ``block_tables[b, p // block_size]`` at offset ``p % block_size``.
- ``kv_lens``: ``(B,)`` — keys of sequence ``b`` *including* its new tokens, so the new tokens are
  at positions ``kv_lens[b] - q_len .. kv_lens[b] - 1`` and query ``i`` sees keys ``0 .. kv_len - q_len + i``.

One call serves a prefill (``q_len == kv_len``), a decode step (``q_len == 1``), a chunked prefill
(anything between) and any mix of them in one batch, which is what continuous batching needs.

Three options shape the scores, on every backend and as transformers' eager attention applies them: a sliding
``window`` (a query at position ``p`` sees keys ``p - window + 1 .. p``; pages wholly before a query's window are
never read, so the scheduler may release them, leaving ``-1`` in the table), tanh soft-capping
(``softcap * tanh(score * scale / softcap)``, Gemma 2) and ``sinks`` (gpt-oss: one learned logit per query head
joins the softmax as one more key, and its share is dropped). The softmax stays exact in fp32.

The Triton kernel is a flash-attention loop (online softmax, fp32 accumulators) with one program
per (sequence, query head, block of 16+ queries); its key tiles gather rows through the block table
per key, so a tile can span several cache blocks and any ``block_size`` works. Queries past the
causal frontier of their tile skip the remaining keys (the loop stops at the tile's last query), and with a
window the loop starts at the tile's first query's window.
Not yet tuned on a GPU: BLOCK_N=64 and 4 warps are the usual flash-attention starting point.

Example:
    >>> import torch
    >>> q = torch.randn(5, 2, 8); kc = torch.zeros(4, 4, 1, 8); vc = torch.zeros(4, 4, 1, 8)
    >>> kv = torch.randn(5, 1, 8)
    >>> store_kv(kv, kv, kc, vc, torch.tensor([0, 1, 2, 4, 5]))        # seq 0: 3 tokens, seq 1: 2 tokens
    >>> bt = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    >>> out = paged_attention(q, kc, vc, bt, torch.tensor([0, 3, 5]), torch.tensor([3, 2]), scale=8**-0.5,
    ...                       max_q_len=3)
    >>> tuple(out.shape)
    (5, 2, 8)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from tightfit.kernels.dispatch import interpreter_enabled, register_kernel
from tightfit.kernels.index_rows import scatter_rows
from tightfit.kernels.varlen_attention_cpu import (
    native_attention_error,
    paged_attention_native,
    store_kv_native,
)

__all__ = [
    "attend_sequences",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "store_kv",
]

triton: Any = None
tl: Any = None


# --------------------------------------------------------------------------- Triton kernel


@functools.cache
def _kernel() -> Any:
    global triton, tl
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl

    @triton.jit
    def _paged_attn_fwd_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, cu_ptr, kvlen_ptr, sink_ptr, scale, window, softcap,
        q_st, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_st, o_sh, bt_s0,
        GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr, WINDOWED: tl.constexpr, CAPPED: tl.constexpr, SINKS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        m_block = tl.program_id(2)
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        if m_block * BLOCK_M < q_len:
            kv_len = tl.load(kvlen_ptr + seq)
            kv_head = head // GROUP
            offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            m_mask = offs_m < q_len
            d_mask = offs_d < HEAD_DIM
            rows = (q_start + offs_m).to(tl.int64)
            q = tl.load(q_ptr + rows[:, None] * q_st + head * q_sh + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            q_pos = kv_len - q_len + offs_m  # absolute position of each query
            if SINKS:  # the sink logit starts every row's running max; its exp joins the sum at the end
                sink = tl.load(sink_ptr + head).to(tl.float32)
                m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
            else:
                m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            # The tile's last query sees keys up to its own position: stop there (causal skip). With a window, the
            # tile's first query sees none before its window: start there (those pages may be released holes).
            hi = tl.minimum(kv_len, kv_len - q_len + (m_block + 1) * BLOCK_M)
            lo = 0
            if WINDOWED:
                lo = tl.maximum(kv_len - q_len + m_block * BLOCK_M - window + 1, 0)
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_mask = offs_n < kv_len
                page = tl.load(bt_ptr + seq * bt_s0 + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
                slot = (offs_n % PAGE).to(tl.int64)
                kv_mask = n_mask[:, None] & d_mask[None, :]
                k = tl.load(k_ptr + page[:, None] * k_sb + slot[:, None] * k_ss + kv_head * k_sh + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
                if CAPPED:  # softcap * tanh(s / softcap), tanh written with exp (no libdevice on every target)
                    s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
                visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
                if WINDOWED:
                    visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
                # A row whose keys all lie past this tile (or before its window) keeps m = -inf: exp against 0 then
                # gives alpha = p = 0 instead of nan.
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + page[:, None] * v_sb + slot[:, None] * v_ss + kv_head * v_sh + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                if UPCAST:
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
                m_i = m_new
            if SINKS:
                l_i += tl.exp(sink - m_i)
            if WINDOWED:  # rows past q_len may see no key at all: 0 / 1, not 0 / 0 (they are not stored)
                l_i = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_i[:, None]
            tl.store(o_ptr + rows[:, None] * o_st + head * o_sh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & d_mask[None, :])

    return _paged_attn_fwd_kernel


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                           *, scale: float, max_q_len: int, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher (no checks; call :func:`paged_attention`)."""
    kernel = _kernel()
    t, hq, d = q.shape
    out = torch.empty_like(q)
    batch = kv_lens.shape[0]
    if t == 0 or batch == 0:
        return out
    # tl.dot needs tiles of at least 16 in every dimension.
    block_m = 16 if max_q_len <= 16 else 64
    block_n = 64
    block_d = max(16, triton.next_power_of_2(d))
    grid = (batch, hq, triton.cdiv(max_q_len, block_m))
    kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, kv_lens,
        sinks.to(torch.float32).contiguous() if sinks is not None else kv_lens, float(scale), int(window),
        float(softcap) or 1.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=hq // k_cache.shape[2], PAGE=k_cache.shape[1], HEAD_DIM=d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # Triton 3.9's CPU interpreter computes tl.dot on bf16 operands wrongly (a 16x16 matmul off
        # by 1e10; fp16 and fp32 are right), so there the tiles are upcast; on a GPU bf16 stays bf16.
        UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda and interpreter_enabled(),
        # fp32 dots default to TF32 on NVIDIA GPUs (10-bit mantissa, ~1e-3 error); fp32 inputs ask for
        # IEEE so the kernel holds the same 1e-4 logit tolerance as the reference. bf16/fp16 ignore it.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOWED=window > 0, CAPPED=softcap > 0, SINKS=sinks is not None,
    )
    return out


# --------------------------------------------------------------------------- reference


def _gather_keys(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    # (n_blocks, block_size, H, D) rows of one sequence -> (length, H, D)
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                              *, scale: float, max_q_len: int, window: int = 0, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Pure PyTorch: ``scaled_dot_product_attention`` per sequence (one batched call for decode steps); with a
    window, soft-cap or sinks, a masked softmax per sequence (:func:`attend_sequences`)."""
    batch = kv_lens.shape[0]
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    if batch == 0:
        return torch.empty_like(q)
    if max_q_len == 1 and q.shape[0] == batch and not (window or softcap or sinks is not None):
        # Decode: one query per sequence. Gather every sequence's keys into (B, max_kv) with a
        # key mask; the padding here is only along the key axis of attention, never a linear layer.
        # Whole pages are gathered with one index_select (a per-slot index is several times slower on
        # the CPU), and the g query heads sharing a key head are that head's g queries (B, Hk, g, D): no
        # copy of the keys per query head, as enable_gqa makes (which is slower).
        max_kv = int(kv_lens.max())
        pos = torch.arange(max_kv, device=q.device)
        n_blocks = (max_kv + block_size - 1) // block_size
        pages = block_tables[:, :n_blocks].long().flatten()
        shape = (batch, n_blocks * block_size, hk, k_cache.shape[3])
        k = k_cache.index_select(0, pages).view(shape)[:, :max_kv].transpose(1, 2)  # (B, Hk, max_kv, D)
        v = v_cache.index_select(0, pages).view(shape)[:, :max_kv].transpose(1, 2)
        mask = pos[None, :] < kv_lens[:, None].to(pos.device)
        group = q.shape[1] // hk
        out = F.scaled_dot_product_attention(q.view(batch, hk, group, q.shape[2]), k, v,
                                             attn_mask=mask[:, None, None, :], scale=scale)
        return out.reshape(q.shape)
    out = torch.empty_like(q)
    attend_sequences(q, k_cache, v_cache, block_tables, cu_seqlens_q.tolist(), kv_lens.tolist(), range(batch), out,
                     scale=scale, window=window, softcap=softcap, sinks=sinks)
    return out


#: scores (query rows x keys x heads) per chunk of a sequence's queries in the masked softmax
_CHUNK_SCORES = 1 << 24


def _attend_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, kv: int,
                   *, scale: float, window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """The ``n`` new queries ``(n, H, D)`` of one sequence with ``kv`` keys, written out in fp32: scores scaled,
    soft-capped, masked (causal, window), softmax joined by the sink column, which is then dropped. Only the pages
    from the first query's window on are gathered: the ones before may be released (``-1``)."""
    n, h, d = q.shape
    block, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    rows = max(1, _CHUNK_SCORES // max(1, (min(kv, window) if window else kv) * h))
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        first, last = kv - n + lo, kv - n + hi - 1  # positions of the chunk's first and last query
        start = max(0, first - window + 1) // block * block if window else 0
        pages = table[start // block: last // block + 1].long()
        k = k_cache.index_select(0, pages).flatten(0, 1)[:last + 1 - start].float()  # (L, Hk, D)
        v = v_cache.index_select(0, pages).flatten(0, 1)[:last + 1 - start].float()
        qs = q[lo:hi].float().view(hi - lo, hk, h // hk, d)
        scores = torch.einsum("nkgd,lkd->kgnl", qs, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(first, last + 1, device=q.device)[:, None]
        kpos = torch.arange(start, last + 1, device=q.device)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.float().view(hk, h // hk, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out[lo:hi] = torch.einsum("kgnl,lkd->nkgd", probs, v).reshape(hi - lo, h, d).to(q.dtype)
    return out


def attend_sequences(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     cu: list[int], lens: list[int], seqs: Iterable[int], out: torch.Tensor, *, scale: float,
                     window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> None:
    """Write the attention of sequences ``seqs`` into their rows of ``out``: one sdpa call per sequence, or with a
    window, soft-cap or sinks one masked softmax.

    ``cu`` and ``lens`` are ``cu_seqlens_q`` and ``kv_lens`` as host lists. The reference's general case,
    and the native backend's path for long prefill chunks.
    """
    block_size = k_cache.shape[1]
    gqa = q.shape[1] != k_cache.shape[2]
    for b in seqs:
        n, kv = cu[b + 1] - cu[b], lens[b]
        if n == 0:
            continue
        if window or softcap or sinks is not None:
            out[cu[b]:cu[b + 1]] = _attend_masked(q[cu[b]:cu[b + 1]], k_cache, v_cache, block_tables[b], kv,
                                                  scale=scale, window=window, softcap=softcap, sinks=sinks)
            continue
        blocks = block_tables[b, : (kv + block_size - 1) // block_size].long()
        k = _gather_keys(k_cache, blocks, kv).transpose(0, 1)[None]
        v = _gather_keys(v_cache, blocks, kv).transpose(0, 1)[None]
        qs = q[cu[b]:cu[b + 1]].transpose(0, 1)[None]
        if n == kv:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            rows = torch.arange(n, device=q.device)[:, None] + (kv - n)
            mask = torch.arange(kv, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[cu[b]:cu[b + 1]] = o[0].transpose(0, 1)


def _attention_class(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, *, scale: float, max_q_len: int,
                     window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> tuple:
    # What picks the kernel's specialisation: dtype, heads, width, page size, the query tile (16 or 64), and
    # whether it windows, caps or has sinks.
    shape = "decode" if max_q_len == 1 else "short" if max_q_len <= 16 else "long"
    return (str(q.dtype), q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], shape,
            str(block_tables.dtype), str(cu_seqlens_q.dtype), str(kv_lens.dtype), window > 0, softcap > 0,
            sinks is not None)


def _attention_probe(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, *, scale: float,
                     max_q_len: int, window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> tuple[tuple, dict]:
    # Three sequences of the call's class: query lengths up to min(max_q_len, 17) (17 still takes the
    # 64-query tile), keys spanning several pages, pages in shuffled order; the call's window (at most 5, so that
    # it masks), soft-cap and sinks.
    dev, page, hk, d = q.device, k_cache.shape[1], k_cache.shape[2], q.shape[2]
    gen = torch.Generator(device=dev).manual_seed(0)
    m = min(max_q_len, 17)
    q_lens = [1, 1, 1] if m == 1 else [m, 1, max(1, m - 1)]
    kv = [q_lens[0] + 6, q_lens[1], q_lens[2] + 2 * page + 1]
    pages = [(n + page - 1) // page for n in kv]
    perm = torch.randperm(sum(pages) + 1, generator=gen, device=dev)
    tables = torch.zeros(3, max(pages), dtype=block_tables.dtype, device=dev)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[start:start + n].to(block_tables.dtype)
        start += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev).to(q.dtype)

    kc, vc = rand(sum(pages) + 1, page, hk, d).to(k_cache.dtype), rand(sum(pages) + 1, page, hk, d).to(v_cache.dtype)
    cu = torch.tensor([0, q_lens[0], q_lens[0] + q_lens[1], sum(q_lens)], dtype=cu_seqlens_q.dtype, device=dev)
    lens = torch.tensor(kv, dtype=kv_lens.dtype, device=dev)
    options = {"window": min(window, 5), "softcap": softcap,
               "sinks": None if sinks is None else rand(q.shape[1]).to(sinks.dtype)}
    return (rand(sum(q_lens), q.shape[1], d), kc, vc, tables, cu, lens), {"scale": scale, "max_q_len": max(q_lens),
                                                                          **options}


_paged = register_kernel("paged_attention", reference=paged_attention_reference, triton=paged_attention_triton,
                         doc="causal attention of packed variable-length queries over a paged KV cache",
                         shape_class=_attention_class, probe=_attention_probe,
                         native=paged_attention_native, native_error=native_attention_error)


# --------------------------------------------------------------------------- public API


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, *, scale: float, max_q_len: int,
                    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """Causal attention of packed queries over paged keys/values (layout in the module docstring).

    ``max_q_len`` (the longest ``q_len`` in the batch, a host integer) sizes the Triton grid and
    picks the decode fast path of the reference; ``backend`` overrides ``TIGHTFIT_KERNELS``. On CPU the
    native backend (:mod:`tightfit.kernels.varlen_attention_cpu`, fp32) runs where a C compiler built it.
    ``window`` > 0: a query at position ``p`` sees keys ``p - window + 1 .. p`` only (pages wholly before that
    are never read: their table entries may be ``-1``); ``softcap`` > 0: scores become
    ``softcap * tanh(score * scale / softcap)``; ``sinks`` ``(Hq,)``: one logit per query head joins its softmax.
    """
    _check_options(q, window, softcap, sinks)
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"paged_attention: q must be (tokens, heads, head_dim) and both caches (blocks, block_size, "
            f"kv_heads, head_dim) of one shape; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"paged_attention: {q.shape[1]} query heads of width {q.shape[2]} do not fit {k_cache.shape[2]} key "
            f"heads of width {k_cache.shape[3]}: query heads must be a multiple of key heads and widths equal"
        )
    if cu_seqlens_q.shape[0] != kv_lens.shape[0] + 1 or block_tables.shape[0] != kv_lens.shape[0]:
        raise ValueError(
            f"paged_attention: {kv_lens.shape[0]} sequences need cu_seqlens_q of length {kv_lens.shape[0] + 1} "
            f"and {kv_lens.shape[0]} block-table rows; got {cu_seqlens_q.shape[0]} and {block_tables.shape[0]}"
        )
    return _paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, scale=scale, max_q_len=max_q_len,
                  window=window, softcap=softcap, sinks=sinks, backend=backend)


def _check_options(q: torch.Tensor, window: int, softcap: float, sinks: torch.Tensor | None) -> None:
    if window < 0:
        raise ValueError(f"paged_attention: window={window} is negative; it is the number of keys a query sees "
                         f"(itself included), or 0 for no window")
    if softcap < 0 or softcap != softcap:
        raise ValueError(f"paged_attention: softcap={softcap} must be a positive cap on the scores, or 0 for none")
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(f"paged_attention: sinks must hold one logit per query head, shape ({q.shape[1]},) on "
                         f"{q.device}; got shape {tuple(sinks.shape)} on {sinks.device}")


def _store_kv_with(backend: str) -> Any:
    def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        rows = k_cache.shape[0] * k_cache.shape[1]
        width = k_cache.shape[2] * k_cache.shape[3]
        scatter_rows(k_cache.view(rows, width), slot_mapping, k.reshape(-1, width).to(k_cache.dtype),
                     validate=False, backend=backend)
        scatter_rows(v_cache.view(rows, width), slot_mapping, v.reshape(-1, width).to(v_cache.dtype),
                     validate=False, backend=backend)
    store.__name__ = f"store_kv_{backend}"
    return store


store_kv_reference = _store_kv_with("reference")
store_kv_triton = _store_kv_with("triton")


def _store_class(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple:
    return (str(k.dtype), str(k_cache.dtype), k_cache.shape[2] * k_cache.shape[3], str(slot_mapping.dtype))


def _store_probe(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[tuple, dict]:
    gen = torch.Generator(device=k.device).manual_seed(0)
    shape = (6, 2, *k_cache.shape[2:])
    kc, vc = torch.zeros(shape, dtype=k_cache.dtype, device=k.device), torch.zeros(shape, dtype=v_cache.dtype,
                                                                                  device=k.device)
    new = torch.randn(3, *k_cache.shape[2:], generator=gen, device=k.device).to(k.dtype)
    slots = torch.tensor([7, 0, 4], dtype=slot_mapping.dtype, device=k.device)
    return (new, new * 2, kc, vc, slots), {}


_store = register_kernel("store_kv", reference=store_kv_reference, triton=store_kv_triton,
                         doc="write new keys and values to their paged-cache slots",
                         shape_class=_store_class, probe=_store_probe,
                         native=store_kv_native, native_error=native_attention_error)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    """Write new keys/values ``(T, Hk, D)`` to cache slots (``slot = block * block_size + offset``).

    A row scatter (:func:`tightfit.kernels.index_rows.scatter_rows`) on the caches viewed as
    ``(blocks * block_size, Hk * D)``, or on CPU one native call for keys and values; slots come from
    the runtime's own block tables, so they are not validated again (that would cost a host sync per layer).
    """
    _store(k, v, k_cache, v_cache, slot_mapping, backend=backend)
