"""tightfit.cuda kernels vs their PyTorch references on one GPU (CUDA-event timing, interleaved).

    python -m benchmarks.gpu.kernels [--quick]

Cases are the shapes the embedding cache moves (a 1M-row table, 64K looked-up rows, 128 columns)
and sequence packing (16K tokens x 4096 hidden, half of them kept). The reference is what the
dispatcher runs without Triton (``index_select`` / ``index_copy_`` / ``index_add_``); the headline
is reference time / Triton time (> 1: the kernel is faster). Every case is checked for equality first.
"""

from __future__ import annotations

import functools
import os
import sys

from benchmarks.gpu.common import ensure_tightfit, interleave_cuda, parser, skip, summarize, write_result

NAME, TITLE = "kernels", "tightfit.cuda row gather / scatter / scatter-add vs PyTorch"


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


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__ or TITLE).parse_args(argv)
    import torch

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    elif not torch.cuda.is_available():
        return skip(NAME, TITLE, "no CUDA device")
    ensure_tightfit()
    from tightfit.cuda import get_kernel
    from tightfit.cuda.dispatch import triton_available, triton_import_error

    if not triton_available():
        return skip(NAME, TITLE, f"Triton does not import ({triton_import_error()})")
    repeats = args.repeats or (2 if args.smoke else 5 if args.quick else 7)
    dev = torch.device("cpu" if args.smoke else "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
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
                        "triton_gbps": moved / t["median"] / 1e9})
        line = (f"{op:17s} {label:18s} triton {t['median'] * 1e6:8.1f} us  torch {r['median'] * 1e6:8.1f} us  "
                f"x{speedup:.2f} ({moved / t['median'] / 1e9:.0f} GB/s)")
        lines.append(line)
        print(line, flush=True)
        del table, rows_in, run_t, run_r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    best = min(results, key=lambda x: x["speedup"])
    summary = (f"{len(results)} cases, speed-up vs torch {min(x['speedup'] for x in results):.2f}x.."
               f"{max(x['speedup'] for x in results):.2f}x (slowest: {best['op']} {best['case']})")
    if args.smoke:
        summary = "smoke run on CPU (interpreter): " + summary
    write_result(NAME, title=TITLE, results=results, summary=summary,
                 params={"quick": args.quick, "smoke": args.smoke, "repeats": repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
