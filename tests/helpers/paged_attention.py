"""A paged-attention test case whose pages before each sequence's window are released (table entry -1, the page
NaN), and attention written out from the definition in float64: shared by the kernel's tests and energon's."""

from __future__ import annotations

import torch


def masked_softmax(q, keys, values, q_lens, scale, window, softcap, sinks):
    """Float64, one sequence at a time: scaled scores, soft-capped, causal and window mask, a sink column."""
    out, row = [], 0
    for k, v, n in zip(keys, values, q_lens):
        kv, group = k.shape[0], q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("nhd,khd->hnk", q[row:row + n].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos, kpos = (kv - n + torch.arange(n))[:, None], torch.arange(kv)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
        p = s.softmax(-1)[..., :kv]
        out.append(torch.einsum("hnk,khd->nhd", p, v))
        row += n
    return torch.cat(out)


def released_pages_case(lens, hq, hk, d, block, window, seed):
    """Keys and values in shuffled pages; the pages before each sequence's first query's window released."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-kv // block) for _, kv in lens) + 2
    k_cache, v_cache = torch.randn(n_pages, block, hk, d, generator=g), torch.randn(n_pages, block, hk, d, generator=g)
    free = torch.randperm(n_pages, generator=g).tolist()
    tables = torch.full((len(lens), max(-(-kv // block) for _, kv in lens) + 1), -1, dtype=torch.int32)
    keys, values, released = [], [], []
    for b, (n, kv) in enumerate(lens):
        pages = [free.pop() for _ in range(-(-kv // block))]
        slots = torch.tensor([pages[p // block] * block + p % block for p in range(kv)], dtype=torch.long)
        keys.append(k_cache.view(-1, hk, d)[slots].clone())
        values.append(v_cache.view(-1, hk, d)[slots].clone())
        kept = max(0, kv - n - window + 1) // block if window else 0  # the first page the first query sees
        tables[b, kept:len(pages)] = torch.tensor(pages[kept:], dtype=torch.int32)
        released += pages[:kept]
    k_cache[released] = float("nan")
    v_cache[released] = float("nan")
    q = torch.randn(sum(n for n, _ in lens), hq, d, generator=g)
    cu = torch.tensor([0, *torch.tensor([n for n, _ in lens]).cumsum(0).tolist()], dtype=torch.int32)
    kv_lens = torch.tensor([kv for _, kv in lens], dtype=torch.int32)
    return (q, k_cache, v_cache, tables, cu, kv_lens), keys, values
