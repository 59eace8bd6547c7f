"""energon_infer decode steps with and without CUDA graphs on one GPU (~0.9B LLaMA-architecture, bf16).

    python -m benchmarks.gpu.energon_graphs [--quick] [--smoke]

For each decode batch size (1, 5, 16, 64; quick: 1, 16, 64; 5 sits between the buckets 4 and 8 and
runs padded to 8), the same sequences (256 tokens of context each) are prefilled on two runners built
from the same weights, one with ``cuda_graphs=False`` and one with graphs for the default buckets; then
one decode step (``ModelRunner.forward``: metadata, copy to the device, the stage's forward, logits) is
timed on each, interleaved (CUDA events around 10 back-to-back steps, median of the repeats). Before
timing, one step on both is compared: max logit difference and greedy agreement.

Limit: a decode step reads every weight once, so it takes at least ``weight bytes / memory bandwidth``
(bandwidth measured here with a device-to-device copy); the fraction of that floor each contender
reaches is reported beside it. ``--smoke`` runs a tiny model on the CPU with the padded path eager
(``capture=False``: there is no graph to capture there) to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import time

from benchmarks.gpu.common import (
    interleave_cuda,
    parser,
    skip,
    summarize,
    write_result,
)
from benchmarks.gpu.energon import ensure_energon, llama_model

NAME, TITLE = "energon_graphs", "energon_infer decode steps: CUDA graphs vs eager on one GPU (~0.9B LLaMA, bf16)"
CONTEXT = 256


def _copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted): the memory bandwidth a decode step can use."""
    import torch

    if device.type != "cuda":
        return 0.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 5 / (start.elapsed_time(end) / 1e3)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        return skip(NAME, TITLE, "no CUDA device (use --smoke to check the script on a CPU)")
    try:
        import transformers  # noqa: F401
    except ImportError:
        return skip(NAME, TITLE, "transformers is not installed (it builds the random model)")
    ensure_energon()
    from energon_infer.loading.config import config_from_hf
    from energon_infer.worker.cuda_graphs import DecodeGraphs, default_buckets
    from energon_infer.worker.runtime import ModelRunner, RuntimeConfig

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = "float32" if args.smoke else "bfloat16"
    repeats = args.repeats or (2 if args.smoke else 5 if args.quick else 7)
    sizes = (1, 5) if args.smoke else (1, 16, 64) if args.quick else (1, 5, 16, 64)
    context = 16 if args.smoke else CONTEXT
    t0 = time.perf_counter()
    hf = llama_model(args.smoke, device, getattr(torch, dtype))
    config, weights = config_from_hf(hf.config.to_dict()), hf.state_dict()
    opts = dict(dtype=dtype, device=str(device), kv_cache_tokens=max(sizes) * (context + 256) + 1024, progress=False)
    eager = ModelRunner(config, weights, RuntimeConfig(cuda_graphs=False, **opts))
    graphed = ModelRunner(config, weights, RuntimeConfig(cuda_graphs=None if device.type == "cuda" else False, **opts))
    if device.type != "cuda":  # the smoke run: the padded buffers, run eagerly
        graphed.decode_graphs = DecodeGraphs(graphed.stage, graphed.cache, buckets=default_buckets(),
                                             max_context=graphed.max_context, capture=False)
    graphs = graphed.decode_graphs
    assert graphs is not None, "cuda_graphs=None on a CUDA device at tp=1 should turn graphs on"
    weight_bytes = sum(p.numel() * p.element_size() for p in eager.stage.parameters())
    del hf, weights
    bandwidth = _copy_bandwidth(device)
    floor = weight_bytes / bandwidth if bandwidth else 0.0
    print(f"[{NAME}] {weight_bytes / 2**30:.2f} GiB of weights loaded twice in {time.perf_counter() - t0:.0f} s; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, step floor {floor * 1e3:.3f} ms", flush=True)
    g = torch.Generator().manual_seed(1)
    results: dict = {"weight_bytes": weight_bytes, "copy_bytes_per_s": bandwidth, "step_floor_s": floor,
                     "buckets": list(graphs.buckets), "batches": {}}
    for b in sizes:
        prompts = [torch.randint(3, config.vocab_size, (context,), generator=g).tolist() for _ in range(b)]
        seqs = list(range(b))
        firsts = [r.forward(list(zip(seqs, prompts))) for r in (eager, graphed)]
        feed = {s: [int(t)] for s, t in zip(seqs, firsts[0].argmax(-1).tolist())}

        def step(runner, feed=feed, seqs=seqs):
            return runner.forward([(s, feed[s]) for s in seqs])

        want, got = step(eager).float(), step(graphed).float()  # also captures the bucket's graph
        diff = (want - got).abs().max().item()
        agree = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
        times = interleave_cuda({"eager": lambda step=step: step(eager), "graphs": lambda step=step: step(graphed)},
                                repeats=repeats, warmup=1, iters=2 if args.smoke else 10)
        med = {k: summarize(v)["median"] for k, v in times.items()}
        bucket = min(x for x in graphs.buckets if x >= b)
        results["batches"][str(b)] = {
            "bucket": bucket, "max_abs_logit_diff": diff, "greedy_agreement": agree, "times_s": times,
            "step_ms": {k: v * 1e3 for k, v in med.items()}, "speedup": med["eager"] / med["graphs"],
            "tokens_per_s": {k: b / v for k, v in med.items()},
            "fraction_of_floor": {k: floor / v for k, v in med.items()} if floor else None,
        }
        print(f"[{NAME}] batch {b} (bucket {bucket}): eager {med['eager'] * 1e3:.2f} ms, graphs "
              f"{med['graphs'] * 1e3:.2f} ms per step ({med['eager'] / med['graphs']:.2f}x); logits differ by "
              f"{diff:.3g}, greedy agreement {agree:.2f}", flush=True)
        for r in (eager, graphed):
            for s in seqs:
                r.free(s)
    results["captured"] = list(graphs.captured)
    results["capture_failed"] = graphs.failed
    per = results["batches"]
    summary = "decode step graphs vs eager: " + ", ".join(f"b={b} {per[str(b)]['speedup']:.2f}x" for b in sizes)
    if floor:
        summary += f"; b=1 at {per['1']['fraction_of_floor']['graphs']:.0%} of the weight-read floor with graphs"
    if graphs.failed:
        summary += f"; CAPTURE FAILED ({graphs.failed[:80]}): both ran eagerly"
    if args.smoke:
        summary = "smoke (CPU, padded path without capture; numbers mean nothing): " + summary
    write_result(NAME, title=TITLE, results=results, summary=summary,
                 params={"quick": args.quick, "smoke": args.smoke, "repeats": repeats, "dtype": dtype,
                         "context": context, "sizes": list(sizes)})
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
