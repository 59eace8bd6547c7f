"""energon serving a Mixture-of-Experts model larger than its memory limit: experts placed one by one against whole
layers streamed, with the all-in-RAM engine as the ceiling.

    python -m benchmarks.energon_moe [--quick] [--limit 0.7GiB] [--batches 1,8,32] [--routing skewed,uniform]
        [--peer-python PATH]

Question: with an MoE model's fp32 weights several times the cgroup memory limit of the serving process, how many
tokens/s does energon's default plan (experts placed one by one: the dense parts and the experts used most per byte
in memory, the rest read from the checkpoint when routed, an expert cache of one slot per layer) sustain on offline
batches of 1, 8 and 32, against the plan it used before (whole layers streamed from disk), how many bytes does each
read per token, and how do the cache's hits compare with the offline optimum (Belady's, at the same slots, on the
same lookups)?

Setup: a random Qwen3-MoE checkpoint (``Qwen3MoeForCausalLM`` from its config, fp32, ``save_pretrained``; kept under
``/tmp/energon-moe-bench`` between runs, keyed by its shape and routing). Full: 12 layers, hidden 1024, 64 experts of
intermediate 512, 8 active (about 4.8 GB) under a 1.25 GiB limit; ``--quick``: 4 layers, hidden 512, 32 experts of
512, 4 active (about 0.4 GB) under 0.7 GiB. Routing, per checkpoint: ``uniform`` (the random router) or ``skewed``:
every token's embedding gets a constant feature and each router row a weight on it of ``log`` of a Zipf(1.0)
share (experts in a random order per layer), so the router's logits carry a per-expert bias and popularity follows
that skew (the measured popularity is reported). Each cell is one fresh process in its own cgroup v1 memory group,
page cache dropped first (``benchmarks/_offload_children.py``, as ``energon_offload``): greedy, prompts of 4-12
random tokens drawn fresh per batch and repeat (the same for every contender of a repeat: ratios are paired), all
the cores. Contenders: **experts** (the default plan), **layers** (the same engine with the expert placement turned
off: whole layers streamed), **llama.cpp** (``llama-cpp-python`` from ``.venv-offload``, the checkpoint converted to
GGUF f32 by llama.cpp's own converter with a placeholder vocabulary, ``mmap``ed under the same limit, its own MoE
path; as ``energon_offload`` runs it), **transformers + accelerate** (``device_map="auto"`` under the limit less
the processes' own 896 MiB, the rest offloaded to disk: ``energon_offload``'s ``accelerate_spec``, run by
``.venv-offload``'s python or ``--peer-python``), **RAM** (no limit: the ceiling). The experts contender also reports
the lookahead's accuracy (the share of routed experts the next-layer prediction named) and the share of its reads
ahead that were used.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import paired, parser, write_result
from benchmarks.energon_offload import _CONVERT, PEER_VENV, accelerate_spec, prepare_peers, run_cell, to_gguf

NAME = "energon_moe"
ROOT = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/energon-moe-bench")
GiB = 2**30
EXPERTS, LAYERS, RAM = "experts (limit)", "whole layers (limit)", "all in RAM (no limit)"
LLAMA = "llama.cpp mmap (limit)"
ACCEL = "transformers + accelerate (limit)"
MiB = 2**20
# What the peer's process holds besides the weights it keeps (interpreter, torch, KV, page cache): energon_offload's
# default budget is the limit less this.
PROCESS_BYTES = 896 * MiB
# llama.cpp's converter as energon_offload runs it, the placeholder vocabulary given to its Qwen3-MoE class too.
_CONVERT_MOE = _CONVERT.replace("llama.LlamaModel.set_vocab = set_vocab",
                                "llama.LlamaModel.set_vocab = set_vocab\n"
                                "from conversion import qwen\nqwen.Qwen3MoeModel.set_vocab = set_vocab")
FULL = dict(layers=12, hidden=1024, experts=64, inter=512, active=8, limit=1.25 * GiB)
QUICK = dict(layers=4, hidden=512, experts=32, inter=512, active=4, limit=0.7 * GiB)
VOCAB = 4096

_WRITE = r"""
import json, math, random, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
s = json.loads(sys.argv[2])
cfg = AutoConfig.for_model("qwen3_moe", vocab_size=s["vocab"], hidden_size=s["hidden"],
    num_hidden_layers=s["layers"], num_attention_heads=s["hidden"] // 64, num_key_value_heads=max(1, s["hidden"] // 256),
    head_dim=64, intermediate_size=2 * s["hidden"], moe_intermediate_size=s["inter"], num_experts=s["experts"],
    num_experts_per_tok=s["active"], norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.mul_(4.0)  # clear logits: greedy decoding off near-ties
    if s["routing"] == "skewed":
        rng = random.Random(1)
        model.model.embed_tokens.weight[:, 0] = 8.0  # a constant feature every token carries through the layers
        for layer in model.model.layers:
            order = list(range(s["experts"]))
            rng.shuffle(order)
            zipf = [1.0 / (r + 1) for r in range(s["experts"])]
            total = sum(zipf)
            gate = layer.mlp.gate.weight
            for rank, e in enumerate(order):
                gate[e, 0] = 2.0 * math.log(zipf[rank] / total * s["experts"])
model.save_pretrained(sys.argv[1], safe_serialization=True)
"""


def save_model(shape: dict[str, Any], routing: str) -> Path:
    """The random Qwen3-MoE directory for ``shape`` and ``routing``, written once in a subprocess."""
    spec = {**{k: shape[k] for k in ("layers", "hidden", "experts", "inter", "active")}, "vocab": VOCAB,
            "routing": routing}
    path = WORK / "models" / ("moe-" + "-".join(f"{k}{v}" for k, v in spec.items()))
    if (path / "done").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([sys.executable, "-c", _WRITE, str(path), json.dumps(spec)], check=True, cwd=ROOT)
    (path / "done").write_text("")
    return path


def _prompts(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(1000 * seed + batch)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(batch)]


def _spec(model: Path, prompts: list[list[int]], new_tokens: int, threads: int, whole_layers: bool) -> dict[str, Any]:
    return {"runner": "energon", "model": str(model), "prompts": prompts, "new_tokens": new_tokens,
            "threads": threads, "planned": True, "whole_layers": whole_layers}


def _cell(contender: str, model: Path, prompts: list[list[int]], new_tokens: int, limit: int,
          gguf: Path | None = None, peer_python: str | None = None) -> dict[str, Any]:
    threads = os.cpu_count() or 1
    if contender == ACCEL:
        base = {"model": str(model), "prompts": prompts, "new_tokens": new_tokens, "threads": threads}
        python, spec = accelerate_spec(base, max(limit - PROCESS_BYTES, 64 * MiB), peer_python)
    elif contender == LLAMA:
        python, spec = str(PEER_VENV / "bin" / "python"), {"runner": "llamacpp", "gguf": str(gguf), "prompts": prompts,
                                                           "new_tokens": new_tokens, "threads": threads}
    else:
        python, spec = sys.executable, _spec(model, prompts, new_tokens, threads, contender == LAYERS)
    cell = run_cell(contender, python, spec, None if contender == RAM else limit, timeout_s=3600)
    if "tokens" in cell:
        generated = sum(len(t) for t in cell["tokens"])
        cell["tokens_per_s"] = generated / cell["seconds"]
        cell["bytes_read_per_token"] = cell["read_bytes"] / generated
    return cell


def _popularity_skew(model: Path) -> float | None:
    """The share of routed uses the most used eighth of each layer's experts took, from the profile the capped
    engine saved beside the model (``None`` where there is none)."""
    from tightfit.profiler.experts import ExpertPopularity

    try:
        pop = ExpertPopularity.load(model)
    except (FileNotFoundError, ValueError):
        return None
    shares = []
    for layer in range(pop.num_layers):
        counts = sorted(pop.counts(layer), reverse=True)
        if sum(counts):
            shares.append(sum(counts[: max(1, len(counts) // 8)]) / sum(counts))
    return sum(shares) / len(shares) if shares else None


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--limit", type=float, default=None, help="the memory limit in GiB")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32; quick 1,8)")
    p.add_argument("--routing", default="skewed,uniform")
    p.add_argument("--tokens", type=int, default=None, help="greedy tokens per prompt (default 16; quick 8)")
    p.add_argument("--peer-python", default=None, help="a python with transformers and accelerate for their peer "
                                                       "(default: .venv-offload's, where it is set up)")
    args = p.parse_args(argv)
    shape = QUICK if args.quick else FULL
    limit = int((args.limit * GiB) if args.limit else shape["limit"])
    batches = [int(b) for b in (args.batches or ("1,8" if args.quick else "1,8,32")).split(",")]
    repeats = args.repeats or (1 if args.quick else 2)
    new_tokens = args.tokens or (8 if args.quick else 16)
    results: dict[str, Any] = {}
    for routing in args.routing.split(","):
        model = save_model(shape, routing)
        (model / "tightfit-expert-popularity.json").unlink(missing_ok=True)  # every run plans from the same start
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        gguf, why = to_gguf(model, _CONVERT_MOE) if (PEER_VENV / "bin" / "python").exists() else \
            (None, f"{PEER_VENV} is not set up (python -m benchmarks.energon_offload --prepare-only)")
        accel_why = "" if args.peer_python else prepare_peers(install=False).get(ACCEL, "")
        rows: dict[str, Any] = {"model_bytes": size, "batches": {}, "llama_cpp": why or "run",
                                "accelerate": accel_why or "run"}
        contenders = [EXPERTS, LAYERS, RAM] + ([LLAMA] if gguf is not None else []) + ([] if accel_why else [ACCEL])
        for batch in batches:
            cells: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
            for r in range(repeats):
                prompts = _prompts(batch, r)
                order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
                for contender in order:
                    cell = _cell(contender, model, prompts, new_tokens, limit, gguf, args.peer_python)
                    if contender == EXPERTS:  # what the capped engine counted while serving, saved at its stop
                        cell["top_eighth_share"] = _popularity_skew(model)
                    (model / "tightfit-expert-popularity.json").unlink(missing_ok=True)
                    cells[contender].append(cell)
                    print(f"[{NAME}] {routing} batch {batch} repeat {r} {contender}: "
                          f"{cell.get('tokens_per_s', 0):.2f} tok/s {cell.get('error', '')}", flush=True)
            rows["batches"][str(batch)] = _summarize(cells)
        shares = [c.get("top_eighth_share") for b in rows["batches"].values()
                  for c in b["cells"][EXPERTS] if c.get("top_eighth_share") is not None]
        rows["top_eighth_share"] = sorted(shares)[len(shares) // 2] if shares else None
        results[routing] = rows
    write_result(NAME, title="energon MoE beyond memory: experts placed one by one vs whole layers streamed",
                 params={"shape": shape, "limit_bytes": limit, "batches": batches, "repeats": repeats,
                         "new_tokens": new_tokens, "quick": args.quick},
                 results=results, markdown=markdown(results, limit, new_tokens),
                 measures=["benchmarks/_offload_children.py", "benchmarks/energon_offload.py"])
    return 0


def _summarize(cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ok = all("tokens" in c for k, cs in cells.items() if k not in (LLAMA, ACCEL) for c in cs)
    out: dict[str, Any] = {"cells": cells}
    if not ok:
        return out
    ex, la, ram = cells[EXPERTS], cells[LAYERS], cells[RAM]
    out["exact"] = all(a["tokens"] == b["tokens"] == c["tokens"] for a, b, c in zip(ex, la, ram))
    out["experts_vs_layers"] = paired([c["tokens_per_s"] for c in ex], [c["tokens_per_s"] for c in la])
    out["experts_vs_ram"] = paired([c["tokens_per_s"] for c in ex], [c["tokens_per_s"] for c in ram])
    if cells.get(LLAMA) and all("tokens" in c for c in cells[LLAMA]):
        out["experts_vs_llama"] = paired([c["tokens_per_s"] for c in ex], [c["tokens_per_s"] for c in cells[LLAMA]])
        out["llama_agree"] = sum(a["tokens"] == b["tokens"] for a, b in zip(ex, cells[LLAMA])) / len(ex)
    if cells.get(ACCEL) and all("tokens" in c for c in cells[ACCEL]):
        out["experts_vs_accelerate"] = paired([c["tokens_per_s"] for c in ex], [c["tokens_per_s"] for c in cells[ACCEL]])
        out["accelerate_agree"] = sum(a["tokens"] == b["tokens"] for a, b in zip(ex, cells[ACCEL])) / len(ex)
    pool = ex[-1].get("pool", {})
    hits, belady = pool.get("expert_cache_hits"), pool.get("expert_belady_hits")
    out["cache_vs_belady"] = hits / belady if hits is not None and belady else None
    out["expert_hit_rate"] = pool.get("expert_hit_rate") or _hit_rate(pool)
    routed = pool.get("expert_lookahead_routed")
    out["lookahead_accuracy"] = pool["expert_lookahead_correct"] / routed if routed else None
    issued = pool.get("expert_prefetches")
    out["prefetches_used"] = pool["expert_prefetches_used"] / issued if issued else None
    return out


def _hit_rate(pool: dict[str, Any]) -> float | None:
    uses = pool.get("expert_uses")
    if not uses:
        return None
    return (pool.get("expert_uses_in_memory", 0) + pool.get("expert_cache_hits", 0)) / uses


def markdown(results: dict[str, Any], limit: int, new_tokens: int) -> str:
    lines = [f"Random Qwen3-MoE checkpoints under a {limit / GiB:.2f} GiB cgroup limit, {new_tokens} greedy tokens "
             "per prompt; tokens/s medians over the repeats; ratios paired (median of per-repeat ratios, wins, range).",
             "", "| routing | model GB | batch | experts tok/s | whole layers tok/s | llama.cpp tok/s | accelerate tok/s | "
             "RAM tok/s | experts / layers | experts / llama.cpp | experts / accelerate | MB read per token (experts / "
             "layers) | uses served without a read | cache hits / Belady | lookahead accuracy (reads ahead used) | "
             "exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for routing, rows in results.items():
        for batch, b in rows["batches"].items():
            if "experts_vs_layers" not in b:
                lines.append(f"| {routing} | {rows['model_bytes'] / 1e9:.2f} | {batch} | failed: "
                             f"{next((c.get('error') for cs in b['cells'].values() for c in cs if 'error' in c), '')}"
                             " | | | | | | | | | | | | |")
                continue
            med = {k: sorted(c["tokens_per_s"] for c in cs)[len(cs) // 2] for k, cs in b["cells"].items()
                   if all("tokens_per_s" in c for c in cs)}
            mb = {k: sorted(c["bytes_read_per_token"] for c in cs)[len(cs) // 2] / 1e6 for k, cs in b["cells"].items()
                  if all("bytes_read_per_token" in c for c in cs)}
            lr = b.get("experts_vs_llama")
            llama = f"{med[LLAMA]:.2f}" if LLAMA in med else rows.get("llama_cpp", "not run")
            vs_llama = f"{lr['median']:.2f}x ({lr['wins']}/{lr['rounds']})" if lr else "n/a"
            ar = b.get("experts_vs_accelerate")
            accel = f"{med[ACCEL]:.2f}" if ACCEL in med else rows.get("accelerate", "not run")
            vs_accel = f"{ar['median']:.2f}x ({ar['wins']}/{ar['rounds']})" if ar else "n/a"
            acc, used = b.get("lookahead_accuracy"), b.get("prefetches_used")
            ahead = "n/a" if acc is None else f"{acc:.2f} ({'n/a' if used is None else f'{used:.2f}'})"
            r = b["experts_vs_layers"]
            belady = "n/a" if b["cache_vs_belady"] is None else f"{b['cache_vs_belady']:.2f}"
            hit = "n/a" if b["expert_hit_rate"] is None else f"{b['expert_hit_rate']:.2f}"
            lines.append(f"| {routing} | {rows['model_bytes'] / 1e9:.2f} | {batch} | {med[EXPERTS]:.2f} | "
                         f"{med[LAYERS]:.2f} | {llama} | {accel} | {med[RAM]:.2f} | {r['median']:.2f}x ({r['wins']}/"
                         f"{r['rounds']}, {r['min']:.2f}-{r['max']:.2f}x) | {vs_llama} | {vs_accel} | "
                         f"{mb[EXPERTS]:.1f} / {mb[LAYERS]:.1f} | {hit} | {belady} | {ahead} | "
                         f"{'yes' if b['exact'] else 'no'} |")
    skew = {k: v.get("top_eighth_share") for k, v in results.items()}
    lines += ["", "Share of routed uses the most used eighth of each layer's experts took (measured): " +
              ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} n/a" for k, v in skew.items()) +
              " (uniform routing: about 0.125)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
