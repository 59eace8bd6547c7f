"""The models ``benchmarks.energon_spec`` judges speculation on, and the check that a workload does not copy.

A tiny model's decode step is mostly the engine's own per-step work, so speculation's gain or loss drowns in
noise there. These models have a decode step of several milliseconds at batch 1 on two cores:

* :func:`widen` makes a wider and deeper copy of a trained LLaMA checkpoint that computes **the same function**
  (the copying workload needs a model that has learned to copy: the trained fixture counts, and its widened copy
  counts exactly as it does). The added width and layers do real work that cannot reach the output: every weight
  that reads the residual stream (q, k, v, gate, up) is random where it is new, every weight that writes to it
  (the embedding's new columns, ``o_proj`` and ``down_proj``'s new rows and columns, the added layers' ``o_proj``
  and ``down_proj`` whole) is zero. The stream's new dimensions therefore stay 0; RMSNorm's mean over the wider
  stream is compensated by scaling the norms' weights by ``sqrt(hidden / new_hidden)`` and its ``eps`` by
  ``hidden / new_hidden`` (exact in binary where the ratio is a power of 4). Heads keep their size, and the
  original heads keep their key/value heads (the ratio of query to key/value heads is kept).
* the non-copying workload runs on a random model of the same shape
  (:func:`energon_infer.demo.write_random_llama`, untied head, a larger vocabulary): its acceptance is what it
  is, and :func:`copied` checks on the plain engine's outputs that prompt lookup had nothing right to find.

Example:
    >>> copied([5, 6, 7], [8, 5, 6, 9], min_n=1, max_n=4)  # after 5, lookup proposes 6: right once
    1
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["widen", "copied", "SHAPE"]

#: The judging models' shape: hidden, layers, intermediate (and heads of 32 dimensions).
SHAPE = {"hidden": 512, "layers": 8, "intermediate": 1536}


def copied(prompt: Sequence[int], output: Sequence[int], *, min_n: int, max_n: int) -> int:
    """Output tokens that prompt lookup (``min_n``..``max_n``, the engine's n-gram proposer) would have proposed
    right: at each output position, the token after the latest earlier occurrence of the sequence's longest
    matching tail. 0: the output never copies from the prompt or from itself."""
    from energon_infer.scheduling.speculation import ngram_propose

    seq, hits = list(prompt), 0
    for tok in output:
        hits += ngram_propose(seq, k=1, min_n=min_n, max_n=max_n) == [tok]
        seq.append(tok)
    return hits


def widen(src: Path, dst: Path, *, hidden: int, layers: int, intermediate: int, seed: int = 0) -> Path:
    """A LLaMA checkpoint ``src`` (one safetensors file) as one ``hidden`` wide, ``layers`` deep, with MLPs
    ``intermediate`` wide, computing the same logits (see the module docstring); written to ``dst`` in float32."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    h0, l0, i0 = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h0 // cfg["num_attention_heads"]
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    ratio = hidden / h0
    if not (ratio >= 1 and math.log(ratio, 4).is_integer() and hidden % (hd * group) == 0 and layers >= l0
            and intermediate >= i0 and cfg.get("tie_word_embeddings", False)):
        raise ValueError(f"widen {src} (hidden {h0}, {l0} layers, MLP {i0}) to hidden={hidden}, layers={layers}, "
                         f"intermediate={intermediate}: need hidden = {h0} x a power of 4 divisible by {hd * group}, "
                         "no fewer layers or MLP width, and tied embeddings")
    old = {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()}
    gen = torch.Generator().manual_seed(seed)
    heads, kv = hidden // hd, hidden // hd // group
    scale = (h0 / hidden) ** 0.5

    def block(rows: int, cols: int, tensor: str | None, *, reader: bool) -> torch.Tensor:
        # A reader's new entries are random (real work, read only from the zero dimensions or by a head that
        # writes nowhere); a writer's are zero. The original block sits at the top left.
        out = (torch.randn(rows, cols, generator=gen) * cols ** -0.5) if reader else torch.zeros(rows, cols)
        if tensor is not None:
            w = old[tensor]
            out[:w.shape[0], :w.shape[1]] = w
        return out

    def name(layer: int, tensor: str) -> str | None:  # the original tensor, where the layer was trained
        return f"model.layers.{layer}.{tensor}" if layer < l0 else None

    def norm(tensor: str | None) -> torch.Tensor:
        out = torch.full((hidden,), scale)
        if tensor is not None:
            out[:h0] = old[tensor] * scale
        return out

    new = {"model.embed_tokens.weight": block(cfg["vocab_size"], hidden, "model.embed_tokens.weight", reader=False),
           "model.norm.weight": norm("model.norm.weight")}
    for i in range(layers):
        p = f"model.layers.{i}."
        new |= {p + "input_layernorm.weight": norm(name(i, "input_layernorm.weight")),
                p + "post_attention_layernorm.weight": norm(name(i, "post_attention_layernorm.weight")),
                p + "self_attn.q_proj.weight": block(heads * hd, hidden, name(i, "self_attn.q_proj.weight"), reader=True),
                p + "self_attn.k_proj.weight": block(kv * hd, hidden, name(i, "self_attn.k_proj.weight"), reader=True),
                p + "self_attn.v_proj.weight": block(kv * hd, hidden, name(i, "self_attn.v_proj.weight"), reader=True),
                p + "self_attn.o_proj.weight": block(hidden, heads * hd, name(i, "self_attn.o_proj.weight"),
                                                     reader=False),
                p + "mlp.gate_proj.weight": block(intermediate, hidden, name(i, "mlp.gate_proj.weight"), reader=True),
                p + "mlp.up_proj.weight": block(intermediate, hidden, name(i, "mlp.up_proj.weight"), reader=True),
                p + "mlp.down_proj.weight": block(hidden, intermediate, name(i, "mlp.down_proj.weight"), reader=False)}
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in new.items()}, str(dst / "model.safetensors"))
    cfg |= {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate, "head_dim": hd,
            "num_attention_heads": heads, "num_key_value_heads": kv, "dtype": "float32",
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6) * h0 / hidden}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if (src / "generation_config.json").exists():
        (dst / "generation_config.json").write_text((src / "generation_config.json").read_text())
    return dst
