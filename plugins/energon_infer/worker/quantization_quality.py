"""How much a quantization changes a model's predictions: logit KL divergence and greedy agreement, per layer and end to end.

    q = measure_quality("path/to/model", QuantSpec(method="int4", group_size=64), prompts, new_tokens=32)
    q["kl"], q["agreement"], q["greedy_match"], q["per_layer_kl"]

The unquantized model (fp32) first continues every prompt greedily; then both models score the same tokens
(the prompt and that continuation, teacher-forced) and at every continuation position we compare their
next-token distributions: ``kl`` is the mean ``KL(p_fp32 || p_quant)`` in nats, ``agreement`` the fraction of
positions whose argmax is the same. ``greedy_match`` is the fraction of the fp32 continuation the quantized
model reproduces when it generates on its own (up to its first different token, per prompt). ``per_layer_kl``
quantizes one block at a time (the others stay fp32): where the error comes from.

The one-block models are fp32 runners whose projection weights were replaced by torchao's dequantisation
of their quantization (:func:`dequantised_runner`), the same values a quantized runner holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from energon_infer.loading.quantization import PROJECTIONS, QuantSpec, quantize_weight, reference_dequantize
from energon_infer.sampling import SamplingParams
from energon_infer.worker.runtime import ModelRunner
from tightfit.kernels.quant_linear import NATIVE_MAX_ROWS

__all__ = ["measure_quality", "dequantised_runner", "dequantise_head", "logit_kl", "score"]


def dequantised_runner(path: str | Path, spec: QuantSpec, *, layers: Sequence[int] | None = None,
                       **runtime: Any) -> ModelRunner:
    """An fp32 runner whose block projections (those of ``layers``, default all of this rank's, and then the
    vocabulary head as :func:`~energon_infer.loading.quantization.quantize_head` takes it) hold torchao's
    dequantisation of their quantization: this rank's slices, as a quantized runner quantises them."""
    runner = ModelRunner.from_pretrained(path, progress=False, packed_weights=False, **runtime)
    with torch.no_grad():
        for i, block in runner.stage.layers.items():
            if layers is not None and int(i) not in layers:
                continue
            for name in PROJECTIONS:
                w = getattr(block, name).weight
                w.copy_(reference_dequantize(quantize_weight(w, spec), spec, w.dtype))
        if layers is None:
            dequantise_head(runner.stage, spec)
    return runner


def dequantise_head(stage: torch.nn.Module, spec: QuantSpec) -> None:
    """The head's weight replaced (in place) by torchao's dequantisation of the quantization a quantized runner
    holds it in (none where :func:`~energon_infer.loading.quantization.quantize_head` leaves it)."""
    head = getattr(stage, "lm_head", None)
    if head is None or (spec.method == "int4" and head.weight.shape[1] % (spec.group_size or 1)):
        return
    head.weight.copy_(reference_dequantize(quantize_weight(head.weight, spec), spec, head.weight.dtype))


def logit_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(p) || softmax(q))`` per row, in nats (fp64)."""
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def score(runner: ModelRunner, seqs: Sequence[Sequence[int]], max_rows: int = NATIVE_MAX_ROWS
          ) -> list[torch.Tensor]:
    """Every position's logits of each sequence (the sequences are freed after). Sequences are packed into steps
    of at most ``max_rows`` tokens (a longer one alone): the rows a decode step runs, so a quantized model is
    scored on the kernels it decodes with (the int8-activation ones, tightfit.kernels.quant_linear_a8, where
    they apply), not only on the prefill path."""
    steps: list[list[int]] = [[]]
    for i, s in enumerate(seqs):
        if steps[-1] and sum(len(seqs[j]) for j in steps[-1]) + len(s) > max_rows:
            steps.append([])
        steps[-1].append(i)
    out: list[torch.Tensor] = []
    for step in steps:
        ids = [-(10_000 + i) for i in step]
        try:
            logits = runner.forward(list(zip(ids, (seqs[i] for i in step))), all_logits=True, broadcast=True)
        finally:
            for seq in ids:
                if seq in runner.cache:
                    runner.free(seq)
        assert logits is not None
        out.extend(logits.float().split([len(seqs[i]) for i in step]))
    return out


def _compare(ref: list[torch.Tensor], got: list[torch.Tensor], starts: list[int]) -> tuple[float, float]:
    # Positions start-1 .. end-2 predict the continuation tokens.
    r = torch.cat([x[s - 1:-1] for x, s in zip(ref, starts)])
    g = torch.cat([x[s - 1:-1] for x, s in zip(got, starts)])
    return float(logit_kl(r, g).mean()), float((r.argmax(-1) == g.argmax(-1)).double().mean())


def measure_quality(path: str | Path, spec: QuantSpec, prompts: Sequence[Sequence[int]], *, new_tokens: int = 32,
                    per_layer: bool = True, **runtime: Any) -> dict[str, Any]:
    """The figures of the module docstring for ``spec`` on the model at ``path`` (tp=1)."""
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    runtime = {"kv_cache_tokens": max(4096, 2 * len(prompts) * (max(map(len, prompts)) + new_tokens)), **runtime}
    base = ModelRunner.from_pretrained(path, progress=False, **runtime)
    cont = [g.token_ids for g in base.generate([list(p) for p in prompts], greedy)]
    seqs = [list(p) + c for p, c in zip(prompts, cont)]
    starts = [len(p) for p in prompts]
    ref = score(base, seqs)
    quant = ModelRunner.from_pretrained(path, progress=False, quantization=spec.method, group_size=spec.group_size,
                                        **runtime)
    kl, agreement = _compare(ref, score(quant, seqs), starts)
    own = [g.token_ids for g in quant.generate([list(p) for p in prompts], greedy)]
    matched = 0
    for a, b in zip(own, cont):
        for x, y in zip(a, b):
            if x != y:
                break
            matched += 1
    out: dict[str, Any] = {"method": spec.method, "group_size": spec.group_size, "kl": kl, "agreement": agreement,
                           "greedy_match": matched / sum(map(len, cont)), "positions": sum(map(len, cont))}
    if per_layer:
        out["per_layer_kl"] = [
            _compare(ref, score(dequantised_runner(path, spec, layers=[i], **runtime), seqs), starts)[0]
            for i in range(base.config.n_layers)]
    return out
