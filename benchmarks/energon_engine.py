"""energon_infer engine under a request stream (CPU): continuous vs static batching vs transformers per request,
the cost of peer memory pooling, and the non-blocking pipeline.

    python -m benchmarks.energon_engine [--quick]

1. **Serving a request stream.** One trace of requests with Poisson arrivals and mixed prompt and
   output lengths is replayed against: the engine with continuous batching, the same engine with
   static batching (a batch admits new requests only when all of it has finished), and
   transformers ``generate`` called once per request in arrival order (what a simple server does).
   Reported: throughput (generated tokens / time from the first arrival to the last answer) and
   p50 / p99 latency (arrival to last token, queueing included).
2. **Peer memory pooling.** Tokens/s of a closed batch with 0 %, 50 % and 100 % of the layers'
   weights in a host-memory pool, copied into device slots ahead of use. The limit: if no copy
   were hidden behind compute, each step would add pooled bytes / copy bandwidth (measured here);
   we report the share of that copy time the prefetch hid.
3. **Non-blocking pipeline.** ``pp=2`` with two steps in flight (one group of requests per stage,
   the engine's default), against the runtime's own overlap (each step split into two micro-batches
   that drain before the next step) and a blocking pipeline (one step, one micro-batch: a stage
   idles while the other works): tokens/s and each stage's measured utilisation (limit: 1.0).

All contenders run in the same script, alternating (A B C, A B C, ...) after a warm-up; the model
is a random LLaMA-architecture checkpoint saved with ``save_pretrained``, fp32, one thread per
worker process (and for transformers), so the comparison is per core.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import parser, plot_path, summarize, write_result

NAME = "energon_engine"
TITLE = "energon_infer engine (CPU): continuous batching, memory pooling, non-blocking pipeline"

__all__ = ["save_model", "make_trace", "replay_engine", "replay_transformers", "closed_batch", "main"]


def save_model(path: Path, *, hidden: int, layers: int, vocab: int, max_positions: int = 1024) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 32,
                      num_key_value_heads=hidden // 64, intermediate_size=hidden * 8 // 3 // 32 * 32,
                      vocab_size=vocab, max_position_embeddings=max_positions, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_trace(n: int, rate: float, *, prompt: tuple[int, int], output: tuple[int, int], vocab: int,
               seed: int = 0) -> list[tuple[float, list[int], int]]:
    """``(arrival seconds, prompt ids, max_tokens)``: Poisson arrivals at ``rate``/s, lengths uniform in the ranges."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        length = rng.randint(*prompt)
        out.append((t, [rng.randrange(3, vocab) for _ in range(length)], rng.randint(*output)))
    return out


def _stats(latencies: list[float], tokens: int, makespan: float) -> dict[str, float]:
    lat = sorted(latencies)
    return {"tokens_per_s": tokens / makespan, "p50_s": statistics.median(lat),
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "makespan_s": makespan}


def replay_engine(engine: Any, trace: list[tuple[float, list[int], int]]) -> dict[str, float]:
    """Submit each request at its arrival time; latency is measured by the engine (queueing included)."""
    from energon_infer.sampling import SamplingParams

    t0 = time.monotonic()
    futures = []
    for arrival, prompt, max_tokens in trace:
        delay = t0 + arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    done = [f.result(timeout=600) for f in futures]
    return _stats([c.latency_s for c in done], sum(len(c.token_ids) for c in done), max(c.finished for c in done) - t0)


@torch.no_grad()
def replay_transformers(model: Any, trace: list[tuple[float, list[int], int]], device: str = "cpu") -> dict[str, float]:
    """One ``generate`` per request, in arrival order (a request waits while an earlier one runs)."""
    t0 = time.monotonic()
    latencies, tokens = [], 0
    for arrival, prompt, max_tokens in trace:
        delay = t0 + arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        tokens += out.shape[1] - len(prompt)
        latencies.append(time.monotonic() - t0 - arrival)
    return _stats(latencies, tokens, time.monotonic() - t0)


def closed_batch(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """All requests at once; tokens/s and the number of steps the engine ran."""
    from energon_infer.sampling import SamplingParams

    steps0 = engine.metrics.steps
    start = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in done)
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "steps": engine.metrics.steps - steps0}


def _rounds(contenders: dict[str, Any], repeats: int, label: str) -> dict[str, list[dict[str, float]]]:
    """Warm-up once, then ``repeats`` rounds alternating the contenders; every run kept."""
    for fn in contenders.values():
        fn()
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in contenders}
    for i in range(repeats):
        for name, fn in contenders.items():
            runs[name].append(fn())
        print(f"  {label} repeat {i + 1}/{repeats}: " + ", ".join(
            f"{n} {r[-1]['tokens_per_s']:.0f} tok/s" for n, r in runs.items()), file=sys.stderr, flush=True)
    return runs


def _summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    return {name: {key: summarize([r[key] for r in rs]) for key in rs[0]} for name, rs in runs.items()}


def copy_bandwidth(layer_bytes: int, layers: int, repeats: int = 5) -> float:
    """Bytes/s of copying ``layers`` distinct pool buffers of ``layer_bytes`` into one slot, as the prefetch does."""
    srcs = [torch.empty(layer_bytes // 4, dtype=torch.float32).normal_() for _ in range(max(layers, 2))]
    dst = torch.empty_like(srcs[0])
    for src in srcs:
        dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        for src in srcs:
            dst.copy_(src)
    return layer_bytes * len(srcs) * repeats / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    args = p.parse_args(argv)
    quick = args.quick
    repeats = args.repeats or (5 if quick else 9)
    hidden = args.hidden or (256 if quick else 512)
    layers = args.layers or (6 if quick else 8)
    vocab = 4096
    # Offered load well above what one request at a time sustains, so batching decides throughput and queueing.
    n_requests, rate = (32, 40.0) if quick else (96, 40.0)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from energon_infer.engine import Engine
    from energon_infer.memory_pool import MemoryPoolConfig

    opts = dict(progress=False, threads_per_worker=1, kv_cache_tokens=16384, max_batch_tokens=2048)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="energon-bench-") as tmp:
        path = save_model(Path(tmp) / "llama", hidden=hidden, layers=layers, vocab=vocab)
        trace = make_trace(n_requests, rate, prompt=(8, 96), output=(8, 64), vocab=vocab)
        print(f"[1/3] request stream: {n_requests} requests, Poisson {rate}/s, prompts 8-96, outputs 8-64 tokens",
              file=sys.stderr, flush=True)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with Engine.from_pretrained(path, **opts) as cont, Engine.from_pretrained(path, policy="static", **opts) as st:
            runs = _rounds({"continuous": lambda: replay_engine(cont, trace),
                            "static": lambda: replay_engine(st, trace),
                            "transformers": lambda: replay_transformers(hf, trace)}, repeats, "stream")
        results["stream"] = {"runs": runs, "summary": _summary(runs)}
        hf = None  # free it before the next cases

        print("[2/3] peer memory pooling: 0%, 50%, 100% of layers in a host pool", file=sys.stderr, flush=True)
        g = random.Random(1)
        batch = [[g.randrange(3, vocab) for _ in range(g.randint(8, 96))] for _ in range(16)]
        new_tokens = 32
        # One layer fetched ahead (2 slots): the device keeps (layers - pooled + 2) layers' weights.
        engines = {f"pool {int(f * 100)}%": Engine.from_pretrained(
            path, memory_pool=MemoryPoolConfig(fraction=f, lookahead=1) if f else None, **opts) for f in (0.0, 0.5, 1.0)}
        try:
            runs = _rounds({k: (lambda e=e: closed_batch(e, batch, new_tokens)) for k, e in engines.items()},
                           repeats, "pool")
            layer_bytes = max(i.get("pool", {}).get("layer_bytes", 0) for e in engines.values() for i in e.worker_info)
            pooled_layers = {k: len(e.worker_info[0].get("pool", {}).get("pooled", [])) for k, e in engines.items()}
            device_bytes = {k: e.worker_info[0].get("pool", {}).get("device_bytes", e.worker_info[0]["weight_bytes"])
                            for k, e in engines.items()}
        finally:
            for e in engines.values():
                e.shutdown()
        bw = copy_bandwidth(layer_bytes, layers)
        summ = _summary(runs)
        base = summ["pool 0%"]["seconds"]["median"]
        pool = {"runs": runs, "summary": summ, "copy_bytes_per_s": bw, "layer_bytes": layer_bytes, "limits": {},
                "device_weight_bytes": device_bytes}
        for k, n in pooled_layers.items():
            if n:
                steps = summ[k]["steps"]["median"]
                # The limit: each step copies n layers; un-overlapped, that is n * bytes / bandwidth per step.
                pool["limits"][k] = {"pooled_layers": n, "serial_copy_per_step_s": n * layer_bytes / bw,
                                     "extra_per_step_s": (summ[k]["seconds"]["median"] - base) / steps}
        results["pool"] = pool

        print("[3/3] pipeline pp=2: two steps in flight, two micro-batches per step, blocking", file=sys.stderr,
              flush=True)
        engines = {"2 steps in flight (engine)": Engine.from_pretrained(path, pp=2, **opts),
                   "2 micro-batches per step (runtime)": Engine.from_pretrained(path, pp=2, pipeline_groups=1,
                                                                                microbatches=2, **opts),
                   "blocking (1 step, 1 micro-batch)": Engine.from_pretrained(path, pp=2, pipeline_groups=1,
                                                                              microbatches=1, **opts)}
        util: dict[str, list[list[float]]] = {k: [] for k in engines}

        def pipe(name: str) -> dict[str, float]:
            engines[name].pipeline_stats(reset=True)
            out = closed_batch(engines[name], batch, new_tokens)
            stages = engines[name].pipeline_stats(reset=True)["stages"]
            util[name].append(stages)
            return {**out, "stage0_util": stages[0], "stage1_util": stages[1]}

        try:
            runs = _rounds({k: (lambda k=k: pipe(k)) for k in engines}, repeats, "pipeline")
        finally:
            for e in engines.values():
                e.shutdown()
        results["pipeline"] = {"runs": runs, "summary": _summary(runs)}

    md = _markdown(results, n_requests, rate, hidden, layers, repeats)
    print(md)
    write_result(NAME, title=TITLE, params={"quick": quick, "repeats": repeats, "hidden": hidden, "layers": layers,
                                            "vocab": vocab, "requests": n_requests, "rate_per_s": rate,
                                            "threads_per_worker": 1},
                 results=results, markdown=md, plots=_plot(results))
    return 0


def _fmt(s: dict[str, float], scale: float = 1.0, digits: int = 0) -> str:
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"


def _markdown(r: dict[str, Any], n: int, rate: float, hidden: int, layers: int, repeats: int) -> str:
    s = r["stream"]["summary"]
    c, st, hf = s["continuous"], s["static"], s["transformers"]
    lines = [
        f"Random LLaMA (hidden {hidden}, {layers} layers, fp32), one thread per process, median of {repeats} "
        "interleaved repeats (min-max).",
        "",
        f"**Request stream** ({n} requests, Poisson {rate:g}/s, prompts 8-96, outputs 8-64 tokens): continuous "
        f"batching serves **{c['tokens_per_s']['median'] / hf['tokens_per_s']['median']:.1f}x** the tokens/s of "
        f"transformers `generate` per request and **{c['tokens_per_s']['median'] / st['tokens_per_s']['median']:.2f}x** "
        f"static batching; p99 latency {hf['p99_s']['median'] / c['p99_s']['median']:.1f}x lower than transformers.",
        "",
        "| contender | tokens/s | p50 latency ms | p99 latency ms |",
        "|---|---|---|---|",
    ]
    for name, v in s.items():
        lines.append(f"| {name} | {_fmt(v['tokens_per_s'])} | {_fmt(v['p50_s'], 1e3)} | {_fmt(v['p99_s'], 1e3)} |")
    pool = r["pool"]
    lines += ["", f"**Peer memory pooling** (16 requests x 32 tokens; copy bandwidth measured "
                  f"{pool['copy_bytes_per_s'] / 1e9:.1f} GB/s, {pool['layer_bytes'] / 2**20:.2f} MiB per layer):", "",
              "| pooled | weights on the device | tokens/s | vs 0% | copies per step if not overlapped | "
              "measured extra per step |", "|---|---|---|---|---|---|"]
    base = pool["summary"]["pool 0%"]["tokens_per_s"]["median"]
    for name, v in pool["summary"].items():
        lim = pool["limits"].get(name)
        cost = (f"{lim['serial_copy_per_step_s'] * 1e6:.0f} us | {lim['extra_per_step_s'] * 1e6:.0f} us" if lim
                else "- | -")
        dev = pool["device_weight_bytes"][name] / 2**20
        lines.append(f"| {name} | {dev:.1f} MiB | {_fmt(v['tokens_per_s'])} | {v['tokens_per_s']['median'] / base:.2f}x "
                     f"| {cost} |")
    pipe = r["pipeline"]["summary"]
    lines += ["", "**Non-blocking pipeline** (pp=2, same batch, two worker processes): stage utilisation is busy "
                  "time / span per stage (limit 1.0; in a blocking pipeline the stages never work at once, so their "
                  "utilisations add up to at most 1).", "", "| schedule | tokens/s | stage 0 util | stage 1 util |", "|---|---|---|---|"]
    for name, v in pipe.items():
        lines.append(f"| {name} | {_fmt(v['tokens_per_s'])} | {v['stage0_util']['median']:.2f} | "
                     f"{v['stage1_util']['median']:.2f} |")
    return "\n".join(lines)


def _plot(r: dict[str, Any]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    s = r["stream"]["summary"]
    names = list(s)
    axes[0].bar(names, [s[n]["tokens_per_s"]["median"] for n in names], color=["C0", "C1", "C2"])
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("request stream: throughput")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [s[n]["p50_s"]["median"] * 1e3 for n in names], width=0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [s[n]["p99_s"]["median"] * 1e3 for n in names], width=0.4, label="p99")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("latency ms")
    axes[1].set_title("request stream: latency")
    axes[1].legend()
    p = r["pool"]["summary"]
    axes[2].bar(list(p), [p[n]["tokens_per_s"]["median"] for n in p], color="C3")
    axes[2].set_ylabel("tokens/s")
    axes[2].set_title("layers in a host memory pool")
    fig.tight_layout()
    out = plot_path(NAME)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


if __name__ == "__main__":
    raise SystemExit(main())
