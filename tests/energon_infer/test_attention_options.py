"""energon_infer.worker.attention: windowed, soft-capped and sink layers through the native kernel (CPU fp32) or
masked_attention (other dtypes, kernels forced to the reference), against a float64 masked softmax.

Pages before each sequence's first query's window are released as the scheduler releases them (table entry -1,
the page itself NaN), so a path that read one fails or returns NaN.
"""

from __future__ import annotations

import pytest
import torch

from energon_infer.worker.attention import attention
from energon_infer.worker.kv_cache import StepMetadata
from tests.helpers.paged_attention import masked_softmax, released_pages_case


def _meta(tables, cu, kv_lens) -> StepMetadata:
    n = int(cu[-1])
    zeros = torch.zeros(n, dtype=torch.long)
    q_lens = (cu[1:] - cu[:-1]).tolist()
    return StepMetadata(positions=zeros, slot_mapping=zeros, block_tables=tables, cu_seqlens=cu, kv_lens=kv_lens,
                        last_index=cu[1:].long() - 1, max_q_len=max(q_lens), n_tokens=n)


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[(1, 70), (1, 9), (1, 130)], [(23, 23), (9, 61), (1, 40)]], ids=["decode", "mixed"])
@pytest.mark.parametrize("window, softcap, sinks", [(13, 0.0, False), (0, 7.5, False), (13, 7.5, False),
                                                   (13, 0.0, True), (0, 0.0, True)],
                         ids=["window", "softcap", "gemma2", "gpt-oss", "sinks"])
def test_options_reach_the_kernel_that_runs_them(kernels, dtype, lens, window, softcap, sinks, monkeypatch):
    monkeypatch.setenv("TIGHTFIT_KERNELS", kernels)
    hq, hk, d, block = 8, 4, 32, 4
    args, keys, values = released_pages_case(lens, hq, hk, d, block, window, seed=len(lens) + window)
    q, kc, vc, tables, cu, kv_lens = args
    sink = torch.randn(hq, generator=torch.Generator().manual_seed(3)) if sinks else None
    meta = _meta(tables, cu, kv_lens)
    got = attention(q.to(dtype), kc.to(dtype), vc.to(dtype), meta, scale=d ** -0.5, window=window, softcap=softcap,
                    sinks=sink.to(dtype) if sink is not None else None)
    cast = [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    want = masked_softmax(q.to(dtype), *cast, [n for n, _ in lens], d ** -0.5, window, softcap,
                       sink.to(dtype) if sink is not None else None)
    assert got.dtype == dtype and not got.isnan().any()
    assert (got.double() - want).abs().max().item() < (2e-5 if dtype == torch.float32 else 3e-2)
