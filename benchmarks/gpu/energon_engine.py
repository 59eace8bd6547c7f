"""energon_infer engine on one GPU: continuous vs static batching vs transformers per request, and pooling cost.

    python -m benchmarks.gpu.energon_engine [--quick] [--smoke]

The CPU benchmark (``benchmarks/energon_engine.py``) at GPU scale: a random LLaMA-architecture
model in bf16 (hidden 2048, 8 layers: 0.5 B parameters), one worker process on ``cuda:0``.

1. A request stream (Poisson arrivals, prompts 32-512 tokens, outputs 16-64 tokens) replayed
   against the engine with continuous batching, with static batching, and transformers
   ``generate`` once per request in arrival order: tokens/s and p50/p99 latency.
2. Peer memory pooling with 0 %, 50 %, 100 % of the layers in pinned host memory, prefetched on a
   side CUDA stream: tokens/s of a closed batch, against the limit set by the measured
   host-to-device bandwidth (pooled bytes per step / bandwidth when nothing overlaps).

Not measured here: ``tp``/``pp`` > 1 (they need two GPUs; the loan has one) and a peer-GPU pool
(same reason). Runs on the GPU image's packages (torch, transformers, safetensors, tokenizers);
the checkout is made importable without installing it. ``--smoke`` runs tiny sizes on the CPU to
check the script; its numbers mean nothing.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu.common import ROOT, parser, skip, summarize, write_result

NAME, TITLE = "energon_engine", "energon_infer engine on one GPU: continuous batching and memory pooling"


def _importable() -> None:
    """``tightfit`` and ``energon_infer`` importable here and in spawned workers, installed or not."""
    if importlib.util.find_spec("tightfit") and importlib.util.find_spec("energon_infer"):
        return
    links = Path(tempfile.mkdtemp(prefix="tightfit-src-"))
    (links / "tightfit").symlink_to(ROOT / "core")
    (links / "energon_infer").symlink_to(ROOT / "plugins" / "energon_infer")
    sys.path.insert(0, str(links))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(links), os.environ.get("PYTHONPATH")) if p)


def _h2d_bandwidth(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return nbytes * 10 / (start.elapsed_time(end) / 1e3)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        return skip(NAME, TITLE, "no CUDA device (use --smoke to check the script on a CPU)")
    for module in ("transformers", "safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            return skip(NAME, TITLE, f"{module} is not installed on this image")
    _importable()
    from transformers import AutoModelForCausalLM

    from benchmarks.energon_engine import (
        closed_batch,
        make_trace,
        replay_engine,
        replay_transformers,
        save_model,
    )
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    smoke, quick = args.smoke, args.quick or args.smoke
    repeats = args.repeats or (1 if smoke else 3 if quick else 5)
    if smoke:
        hidden, layers, vocab, n, rate, prompt, output, dtype = 64, 2, 512, 6, 50.0, (4, 16), (2, 6), "float32"
    else:
        hidden, layers, vocab, dtype = 2048, 8, 32000, "bfloat16"
        n, rate, prompt, output = (16, 16.0, (32, 512), (16, 48)) if quick else (64, 16.0, (32, 512), (16, 64))
    device = "cpu" if smoke else "cuda"
    opts = dict(progress=False, dtype=dtype, kv_cache_tokens=65536 if not smoke else 4096, max_batch_tokens=8192,
                threads_per_worker=1 if smoke else 0)
    results: dict = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="energon-gpu-bench-") as tmp:
        print(f"[{NAME}] saving a random LLaMA (hidden {hidden}, {layers} layers, {dtype})", flush=True)
        path = save_model(Path(tmp) / "llama", hidden=hidden, layers=layers, vocab=vocab)
        trace = make_trace(n, rate, prompt=prompt, output=output, vocab=vocab)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        cont = Engine.from_pretrained(path, **opts)
        static = Engine.from_pretrained(path, policy="static", **opts)
        try:
            contenders = {"continuous": lambda: replay_engine(cont, trace),
                          "static": lambda: replay_engine(static, trace),
                          "transformers": lambda: replay_transformers(hf, trace, device)}
            runs: dict[str, list] = {k: [] for k in contenders}
            for fn in contenders.values():  # warm-up (CUDA context, allocator, kernels)
                fn()
            for i in range(repeats):
                for name, fn in contenders.items():
                    runs[name].append(fn())
                print(f"  stream {i + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]['tokens_per_s']:.0f} tok/s"
                                                                   for k, v in runs.items()), flush=True)
        finally:
            static.shutdown()
        contenders.clear()  # drops the transformers model with the closure that held it
        hf = None
        if device == "cuda":
            torch.cuda.empty_cache()
        results["stream"] = {k: {m: summarize([r[m] for r in v]) for m in v[0]} for k, v in runs.items()}

        g = random.Random(1)
        batch = [[g.randrange(3, vocab) for _ in range(g.randint(*prompt))] for _ in range(32 if not smoke else 4)]
        engines = {"pool 0%": cont}
        try:
            for frac in (0.5, 1.0):
                engines[f"pool {int(frac * 100)}%"] = Engine.from_pretrained(
                    path, memory_pool=MemoryPoolConfig(fraction=frac, lookahead=1), **opts)  # 2 device slots
            pool_runs: dict[str, list] = {k: [] for k in engines}
            for e in engines.values():
                closed_batch(e, batch, output[1])
            for _ in range(repeats):
                for name, e in engines.items():
                    pool_runs[name].append(closed_batch(e, batch, output[1]))
            info = {k: e.worker_info[0]["pool"] for k, e in engines.items()}  # WorkerInfo reads as JSON: dict or None
            device_bytes = {k: (i or {}).get("device_bytes", engines[k].worker_info[0]["weight_bytes"])
                            for k, i in info.items()}
        finally:
            for e in engines.values():
                e.shutdown()
        layer_bytes = max((i or {}).get("layer_bytes", 0) for i in info.values())
        bw = _h2d_bandwidth(max(layer_bytes, 1 << 20)) if device == "cuda" else 0.0
        pool = {k: {m: summarize([r[m] for r in v]) for m in v[0]} for k, v in pool_runs.items()}
        base = pool["pool 0%"]["seconds"]["median"]
        for k, i in info.items():
            if i and bw:
                steps = pool[k]["steps"]["median"]
                pool[k]["limit"] = {"pooled_layers": len(i["pooled"]), "h2d_copy_per_step_s": len(i["pooled"]) * layer_bytes / bw,
                                    "extra_per_step_s": (pool[k]["seconds"]["median"] - base) / steps}
        results["pool"] = {"runs": pool_runs, "summary": pool, "h2d_bytes_per_s": bw, "layer_bytes": layer_bytes,
                           "device_weight_bytes": device_bytes}

    s, p = results["stream"], results["pool"]["summary"]
    ratio_hf = s["continuous"]["tokens_per_s"]["median"] / s["transformers"]["tokens_per_s"]["median"]
    ratio_static = s["continuous"]["tokens_per_s"]["median"] / s["static"]["tokens_per_s"]["median"]
    pool50 = p["pool 50%"]["tokens_per_s"]["median"] / p["pool 0%"]["tokens_per_s"]["median"]
    summary = (f"continuous {ratio_hf:.1f}x transformers-per-request, {ratio_static:.2f}x static tok/s; p99 "
               f"{s['continuous']['p99_s']['median'] * 1e3:.0f} vs {s['transformers']['p99_s']['median'] * 1e3:.0f} ms; "
               f"50% layers pooled: {pool50:.2f}x tok/s")
    print(summary, flush=True)
    write_result(NAME, title=TITLE, results=results, summary=summary + (" (smoke: numbers mean nothing)" if smoke else ""),
                 params={"hidden": hidden, "layers": layers, "vocab": vocab, "dtype": dtype, "requests": n,
                         "rate_per_s": rate, "prompt": prompt, "output": output, "repeats": repeats,
                         "seconds": time.monotonic() - t_start, "smoke": smoke})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
