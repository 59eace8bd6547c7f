"""tightfit's kernels vs their PyTorch references on one GPU (CUDA-event timing, interleaved).

    python -m benchmarks.gpu.kernels [--quick | --smoke]

Row moves: the shapes the embedding cache moves (a 1M-row table, 64K looked-up rows, 128 columns)
and sequence packing (16K tokens x 4096 hidden, half of them kept). The reference is what the
dispatcher runs without Triton (``index_select`` / ``index_copy_`` / ``index_add_``).

Paged attention (bf16, 32 query / 8 key heads of 128): a decode step of 64 sequences with 512..4096
cached tokens and a prefill of 16 prompts of 128..2048 tokens, against the reference (what runs
without Triton) and against ``F.scaled_dot_product_attention`` on the same keys laid out densely and
padded (prefill: right padding with ``is_causal``, flash attention's case; decode: a key mask), the
dense layout built before timing (the peer at its strongest).

Headline per case: reference (or SDPA) time / Triton time (> 1: the kernel is faster), and the bytes
each kernel must move over its time as a fraction of the device's copy bandwidth, measured here
first (a 1 GiB device-to-device copy, bytes read + written). Every case is checked for equality first.
"""

from __future__ import annotations

import functools
import os
import sys

from benchmarks.gpu.common import ensure_tightfit, interleave_cuda, parser, skip, summarize, write_result

NAME, TITLE = "kernels", "tightfit.kernels row gather / scatter / scatter-add vs PyTorch"


def _cases(quick: bool, smoke: bool):
    import torch

    if smoke:
        return [("smoke", op, 50, 37, 33, dt, op == "scatter_add_rows")
                for op in ("gather_rows", "scatter_rows", "scatter_add_rows") for dt in (torch.float32, torch.bfloat16)]

    cases = [  # (label, op, table rows, index length, columns, dtype, duplicate-heavy index)
        ("cache fp32", "gather_rows", 1_000_000, 65_536, 128, torch.float32, False),
        ("cache fp32", "scatter_rows", 1_000_000, 65_536, 128, torch.float32, False),
        ("cache fp32 zipf", "scatter_add_rows", 1_000_000, 65_536, 128, torch.float32, True),
        ("pack bf16", "gather_rows", 16_384, 8_192, 4096, torch.bfloat16, False),
        ("unpack bf16", "scatter_rows", 16_384, 8_192, 4096, torch.bfloat16, False),
    ]
    if not quick:
        cases += [
            ("cache bf16", "gather_rows", 4_000_000, 262_144, 64, torch.bfloat16, False),
            ("cache bf16 zipf", "scatter_add_rows", 1_000_000, 262_144, 64, torch.bfloat16, True),
            ("grad fp32 uniform", "scatter_add_rows", 1_000_000, 262_144, 128, torch.float32, False),
        ]
    return cases


def copy_bandwidth(dev) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the ceiling a row move can approach."""
    import torch

    from benchmarks.gpu.common import cuda_time

    n = (1 << 30) if dev.type == "cuda" else (1 << 20)
    a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    cuda_time(lambda: b.copy_(a), iters=2)
    seconds = min(cuda_time(lambda: b.copy_(a), iters=5) for _ in range(3))
    return 2 * n / seconds


def _attention_cases(quick: bool, smoke: bool):
    # (label, q_lens, kv_lens, q heads, kv heads, head_dim, page)
    import torch

    g = torch.Generator().manual_seed(0)
    if smoke:
        return [("decode smoke", [1, 1, 1], [5, 40, 17], 4, 2, 16, 4), ("prefill smoke", [9, 3, 20], [9, 3, 20], 4, 2, 16, 4)]
    b_dec, b_pre = (32, 8) if quick else (64, 16)
    dec = torch.randint(512, 4097, (b_dec,), generator=g).tolist()
    pre = torch.randint(128, 2049, (b_pre,), generator=g).tolist()
    return [(f"decode {b_dec} seqs", [1] * b_dec, dec, 32, 8, 128, 16), (f"prefill {b_pre} prompts", pre, pre, 32, 8, 128, 16)]


def _attention_case(dev, dtype, case, repeats: int, smoke: bool, ceiling: float) -> dict:
    """One paged-attention case: Triton vs reference vs SDPA on a dense padded copy of the same keys."""
    import torch
    import torch.nn.functional as F

    from tightfit.kernels.varlen_attention import paged_attention, store_kv

    label, q_lens, kv_lens, hq, hk, d, page = case
    g = torch.Generator(device=dev).manual_seed(0)
    b, max_kv = len(kv_lens), max(kv_lens)
    pages = [-(-k // page) for k in kv_lens]
    kc = torch.zeros(sum(pages) + 1, page, hk, d, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    order = torch.randperm(sum(pages), generator=g, device=dev)
    tables = torch.zeros(b, max(pages), dtype=torch.int32, device=dev)
    kd = torch.zeros(b, hk, max_kv, d, dtype=dtype, device=dev)  # the dense padded copy SDPA reads
    vd = torch.zeros_like(kd)
    start = 0
    for i, (kv, n) in enumerate(zip(kv_lens, pages)):
        blocks = order[start:start + n]
        start += n
        tables[i, :n] = blocks.to(torch.int32)
        k = torch.randn(kv, hk, d, generator=g, device=dev).to(dtype)
        v = torch.randn(kv, hk, d, generator=g, device=dev).to(dtype)
        pos = torch.arange(kv, device=dev)
        store_kv(k, v, kc, vc, blocks[pos // page] * page + pos % page)
        kd[i, :, :kv], vd[i, :, :kv] = k.transpose(0, 1), v.transpose(0, 1)
    q = torch.randn(sum(q_lens), hq, d, generator=g, device=dev).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    kl = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
    scale, mq = d ** -0.5, max(q_lens)
    decode = mq == 1
    if decode:
        qd = q.view(b, hq, 1, d)
        mask = (torch.arange(max_kv, device=dev)[None, :] < kl[:, None].long())[:, None, None, :]

        def sdpa():
            return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        qd = torch.zeros(b, hq, max_kv, d, dtype=dtype, device=dev)
        for i, n in enumerate(q_lens):
            qd[i, :, :n] = q[cu[i]:cu[i] + n].transpose(0, 1)

        def sdpa():
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)

    def run(backend):
        return lambda: paged_attention(q, kc, vc, tables, cu, kl, scale=scale, max_q_len=mq, backend=backend)

    got, want = run("triton")(), run("reference")()
    err = (got.float() - want.float()).abs().max().item()
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    if not err <= tol:
        raise AssertionError(f"paged attention {label}: Triton differs from the reference by {err:.3g} (> {tol})")
    times = interleave_cuda({"triton": run("triton"), "reference": run("reference"), "sdpa": sdpa},
                            repeats=repeats, warmup=0 if smoke else 2, iters=1 if smoke else 10)
    med = {k: summarize(v)["median"] for k, v in times.items()}
    elt = torch.finfo(dtype).bits // 8
    moved = (2 * sum(kv_lens) * hk * d + 2 * sum(q_lens) * hq * d) * elt  # K and V once, q in, out back
    flops = 4 * hq * d * sum(n * kv - n * (n - 1) / 2 for n, kv in zip(q_lens, kv_lens))  # causal QK^T and PV
    row = {"case": label, "op": "paged_attention", "dtype": str(dtype), "q_lens": q_lens,
           "kv_lens": kv_lens, "heads": [hq, hk, d], "page": page, "max_error": err,
           "triton_s": times["triton"], "reference_s": times["reference"], "sdpa_s": times["sdpa"],
           "speedup": med["reference"] / med["triton"], "vs_sdpa": med["sdpa"] / med["triton"],
           "triton_gbps": moved / med["triton"] / 1e9, "bandwidth_fraction": moved / med["triton"] / ceiling,
           "triton_tflops": flops / med["triton"] / 1e12}
    r = row
    print(f"paged_attention   {label:18s} triton {med['triton'] * 1e6:8.1f} us  ref {med['reference'] * 1e6:8.1f} us"
          f"  sdpa {med['sdpa'] * 1e6:8.1f} us  x{r['speedup']:.2f} ref, x{r['vs_sdpa']:.2f} sdpa "
          f"({r['triton_gbps']:.0f} GB/s = {r['bandwidth_fraction']:.0%} of copy, {r['triton_tflops']:.1f} TFLOP/s)",
          flush=True)
    return row


def run_attention(dev, quick: bool, smoke: bool, repeats: int, ceiling: float) -> list[dict]:
    """Paged attention cases (decode, prefill): see the module docstring."""
    import torch

    dtype = torch.float32 if smoke else torch.bfloat16
    return [_attention_case(dev, dtype, case, repeats, smoke, ceiling) for case in _attention_cases(quick, smoke)]


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__ or TITLE).parse_args(argv)
    import torch

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    elif not torch.cuda.is_available():
        return skip(NAME, TITLE, "no CUDA device")
    ensure_tightfit()
    from tightfit.kernels import get_kernel
    from tightfit.kernels.dispatch import triton_available, triton_import_error

    if not triton_available():
        return skip(NAME, TITLE, f"Triton does not import ({triton_import_error()})")
    repeats = args.repeats or (2 if args.smoke else 5 if args.quick else 7)
    dev = torch.device("cpu" if args.smoke else "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ceiling = copy_bandwidth(dev)
    print(f"device copy bandwidth (read + write): {ceiling / 1e9:.0f} GB/s", flush=True)
    results, lines = [], []
    for label, op, rows, n, cols, dtype, skewed in _cases(args.quick, args.smoke):
        kernel = get_kernel(op)
        table = torch.randn(rows, cols, device=dev, generator=g).to(dtype)
        if skewed:  # Zipf-like: a few hot rows take most updates, as embedding gradients do
            ranks = torch.rand(n, device=dev, generator=g).pow(4)
            index = (ranks * rows).long().clamp_max(rows - 1)
        elif op == "gather_rows":
            index = torch.randint(0, rows, (n,), device=dev, generator=g)
        else:
            index = torch.randperm(rows, device=dev, generator=g)[:n]
        rows_in = torch.randn(n, cols, device=dev, generator=g).to(dtype)
        if op == "gather_rows":
            out_t, out_r = torch.empty(n, cols, device=dev, dtype=dtype), torch.empty(n, cols, device=dev, dtype=dtype)
            run_t = functools.partial(kernel, table, index, out_t, backend="triton")
            run_r = functools.partial(kernel, table, index, out_r, backend="reference")
        else:
            run_t = functools.partial(kernel, table.clone(), index, rows_in, backend="triton")
            run_r = functools.partial(kernel, table.clone(), index, rows_in, backend="reference")
        got, want = run_t(), run_r()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        tol = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}
        if op == "scatter_add_rows":  # compare one application on fresh copies
            a, b = table.clone(), table.clone()
            torch.testing.assert_close(kernel(a, index, rows_in, backend="triton"),
                                       kernel(b, index, rows_in, backend="reference"), **tol)
        else:
            torch.testing.assert_close(got, want, **tol)
        times = interleave_cuda({"triton": run_t, "reference": run_r}, repeats=repeats,
                                warmup=0 if args.smoke else 2, iters=1 if args.smoke else 10)
        t, r = summarize(times["triton"]), summarize(times["reference"])
        moved = 2 * n * cols * table.element_size()  # bytes read + written by a gather or scatter
        speedup = r["median"] / t["median"]
        results.append({"case": label, "op": op, "rows": rows, "index": n, "cols": cols, "dtype": str(dtype),
                        "triton_s": times["triton"], "reference_s": times["reference"], "speedup": speedup,
                        "triton_gbps": moved / t["median"] / 1e9, "bandwidth_fraction": moved / t["median"] / ceiling})
        line = (f"{op:17s} {label:18s} triton {t['median'] * 1e6:8.1f} us  torch {r['median'] * 1e6:8.1f} us  "
                f"x{speedup:.2f} ({moved / t['median'] / 1e9:.0f} GB/s = {moved / t['median'] / ceiling:.0%} of copy)")
        lines.append(line)
        print(line, flush=True)
        del table, rows_in, run_t, run_r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    attention = run_attention(dev, args.quick, args.smoke, repeats, ceiling)
    results += attention
    best = min(results, key=lambda x: x["speedup"])
    summary = (f"{len(results)} cases, speed-up vs torch {min(x['speedup'] for x in results):.2f}x.."
               f"{max(x['speedup'] for x in results):.2f}x (slowest: {best['op']} {best['case']}); attention vs SDPA "
               + ", ".join(f"{a['case']} x{a['vs_sdpa']:.2f} ({a['bandwidth_fraction']:.0%} of copy bandwidth)"
                           for a in attention))
    if args.smoke:
        summary = "smoke run on CPU (interpreter): " + summary
    write_result(NAME, title=TITLE, results=results, summary=summary,
                 params={"quick": args.quick, "smoke": args.smoke, "repeats": repeats,
                         "copy_bandwidth_bytes_per_s": ceiling})
    return 0


if __name__ == "__main__":
    sys.exit(main())
