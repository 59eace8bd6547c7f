"""energon with weight-only quantized weights (torchao int8 / int4) vs fp32, and llama.cpp at Q8_0 / Q4_0.

    python -m benchmarks.energon_quant [--quick] [--no-llama]

1. Bytes: the weights each rank holds (fp32, int8, int4 at group 128), from the loaded stage's parameters.
2. Decode tokens/s at batch 1, 8 and 32: each repeat prefills fresh random prompts of 32 tokens, then decodes
   ``new_tokens - 1`` steps of one token per sequence; the figure is ``batch * (new_tokens - 1) / decode time``.
   energon fp32, int8 and int4 alternate (A B C A B C ...) in this process, every contender of a repeat on the
   same prompts (fresh each repeat), so ratios are paired repeat by repeat (``benchmarks/README.md``); llama.cpp (``llama-cpp-python``'s C
   API, as benchmarks/energon_offload.py drives it: all prompts in one ``llama_decode``, then one token per
   sequence per step) runs the same prompts in its own venv, alternated with them, on the same model converted
   by llama.cpp's own converter (f32 GGUF) and quantized by its own ``llama_model_quantize`` to Q8_0 and Q4_0.
   Its decode time is its total minus its time to the first token, the same split as ours.
3. Time to first token: a fresh 256-token prompt, prefill alone.
4. Quality on the trained fixture (tests/energon_infer/fixtures/trained_llama): logit KL, argmax agreement and
   greedy match against fp32 (:mod:`energon_infer.worker.quantization_quality`).
5. With the disk tier under a hard memory cap (cgroup): the largest model each format serves, and its tokens/s
   (benchmarks/_quant_disk.py; ``--no-disk`` leaves it out).

The speed model is a random LLaMA-architecture checkpoint (heads of 128, 2 key/value heads, fp32), large enough
that a decode step is bound by the weight bytes it reads, not by per-op overhead. All threads the process has, on
both sides. Targets: int4 weights <= 0.3x fp32's bytes; int4 decode at batch 1 >= 1.5x fp32; greedy
agreement >= 95% on the trained fixture; energon at or above llama.cpp's tokens/s at the same bits, batch >= 8
(each a paired median).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import format_paired, interleave, paired, parser, summarize, write_result

NAME = "energon_quant"
TITLE = "energon weight-only quantization (torchao int8/int4) vs fp32 and llama.cpp Q8_0/Q4_0 (CPU)"
SPECS = {"fp32": (None, None), "int8": ("int8", None), "int4": ("int4", 128)}
GGUF_TYPES = {"llama.cpp Q8_0": ("q8_0", 7), "llama.cpp Q4_0": ("q4_0", 2)}  # LLAMA_FTYPE_MOSTLY_Q8_0 / Q4_0
BITS = {"int8": "llama.cpp Q8_0", "int4": "llama.cpp Q4_0"}

# Runs in the peers' venv: llama.cpp's own quantizer on the f32 GGUF.
_QUANTIZE = r"""
import ctypes, sys
import llama_cpp as ll
ll.llama_backend_init()
p = ll.llama_model_quantize_default_params()
p.ftype = int(sys.argv[3])
p.nthread = int(sys.argv[4])
rc = ll.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
sys.exit(rc)
"""


def _prompts(batch: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def _runner(path: Path, method: str | None, group: int | None, kv_tokens: int):
    from energon_infer import ModelRunner

    return ModelRunner.from_pretrained(path, progress=False, quantization=method, group_size=group,
                                       kv_cache_tokens=kv_tokens)


def _decode(runner, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode seconds of ``new_tokens - 1`` steps after prefilling ``prompts`` (freed after)."""
    import time

    from energon_infer import SamplingParams

    ids = list(range(len(prompts)))
    runner.prefill(dict(zip(ids, prompts)), SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        runner.decode(ids)
    elapsed = time.perf_counter() - start
    for s in ids:
        runner.free(s)
    return elapsed


def _ttft(runner, prompt: list[int]) -> float:
    import time

    from energon_infer import SamplingParams

    start = time.perf_counter()
    runner.prefill({0: prompt}, SamplingParams(temperature=0, max_tokens=1))
    elapsed = time.perf_counter() - start
    runner.free(0)
    return elapsed


def _weight_bytes(runner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.stage.parameters())


def _projection_bytes(runner) -> int:
    names = (".qkv.", ".o.", ".up.", ".down.")
    return sum(p.numel() * p.element_size() for n, p in runner.stage.named_parameters() if any(k in n for k in names))


def _llama_setup(model: Path, threads: int) -> tuple[dict[str, Path], str]:
    """``({contender: gguf}, note)``: Q8_0 and Q4_0 files made by llama.cpp's quantizer, or why not."""
    from benchmarks.energon_offload import PEER_VENV, prepare_peers, to_gguf

    why = prepare_peers(install=False)
    if why:
        return {}, "; ".join(f"{k}: {v}" for k, v in why.items())
    f32, note = to_gguf(model)
    if f32 is None:
        return {}, note
    out: dict[str, Path] = {}
    for name, (suffix, ftype) in GGUF_TYPES.items():
        dst = model / f"model-{suffix}.gguf"
        if not dst.exists():
            done = subprocess.run([str(PEER_VENV / "bin" / "python"), "-c", _QUANTIZE, str(f32), str(dst) + ".part",
                                   str(ftype), str(threads)], capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                return out, f"llama_model_quantize to {suffix} failed: {(done.stderr or done.stdout)[-300:]}"
            Path(str(dst) + ".part").replace(dst)
        out[name] = dst
    notes = []
    for name, gguf in list(out.items()):  # one short run first: a file llama.cpp cannot run is left out, with why
        try:
            _llama_run(gguf, model, [[5, 6, 7, 8]], 2, threads)
        except RuntimeError as exc:
            del out[name]
            notes.append(f"{name} left out: {str(exc).splitlines()[0][:160]}")
    return out, "; ".join(notes)


def _llama_run(gguf: Path, model: Path, prompts: list[list[int]], new_tokens: int, threads: int) -> dict[str, Any]:
    from benchmarks._offload_children import RESULT_TAG
    from benchmarks.energon_offload import PEER_VENV, ROOT

    spec = {"runner": "llamacpp", "gguf": str(gguf), "model": str(model), "prompts": prompts,
            "new_tokens": new_tokens, "threads": threads}
    with tempfile.TemporaryDirectory(prefix="energon-quant-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        done = subprocess.run([str(PEER_VENV / "bin" / "python"), "-m", "benchmarks._offload_children", str(path)],
                              capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith(RESULT_TAG)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"llama.cpp run failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return json.loads(line[len(RESULT_TAG):])


def decode_case(path: Path, runners: dict[str, Any], llama: dict[str, Path], *, batch: int, new_tokens: int,
                vocab: int, repeats: int, threads: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch)
    rounds: list[list[list[int]]] = []  # the prompts of each round (the warm-up is round 0)
    calls: dict[str, int] = {}

    def prompts_for(name: str) -> list[list[int]]:
        # A contender's i-th call decodes round i's prompts: fresh every round (no cache serves a repeat), the
        # same for every contender of the round (so the rounds pair up).
        i = calls[name] = calls.get(name, -1) + 1
        while len(rounds) <= i:
            rounds.append(_prompts(batch, 32, vocab, gen))
        return rounds[i]

    contenders: dict[str, Any] = {n: (lambda r=r, n=n: _decode(r, prompts_for(n), new_tokens))
                                  for n, r in runners.items()}
    llama_tokens: dict[str, list] = {}
    for name, gguf in llama.items():
        def run(name=name, gguf=gguf) -> float:
            out = _llama_run(gguf, path, prompts_for(name), new_tokens, threads)
            llama_tokens.setdefault(name, []).append(out["tokens"])
            return float(out["seconds"] - out["ttft_s"])
        contenders[name] = run
    times = interleave(contenders, repeats=repeats)
    steps = batch * (new_tokens - 1)
    tps = {k: [steps / t for t in v] for k, v in times.items()}
    return {"batch": batch, "new_tokens": new_tokens, "times_s": times, "tokens_per_s": tps,
            "summary": {k: summarize(v) for k, v in tps.items()},
            "mean": {k: sum(v) / len(v) for k, v in tps.items()}}


def quality_case(fast: bool) -> dict[str, Any]:
    from energon_infer.loading.quantization import QuantSpec
    from energon_infer.worker.quantization_quality import measure_quality
    from tests.energon_infer.fixtures.make_trained_llama import OUT, corpus_batch, markov_table

    prompts = corpus_batch(32, torch.Generator().manual_seed(7), markov_table(torch.Generator().manual_seed(0)))
    out = {}
    for name, (method, group) in SPECS.items():
        if method is None:
            continue
        out[name] = measure_quality(OUT, QuantSpec(method=method, group_size=group), prompts[:, :8].tolist(),
                                    new_tokens=24 if fast else 48)
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.energon_offload import save_model

    p = parser(__doc__ or TITLE)
    p.add_argument("--no-llama", action="store_true", help="leave the llama.cpp columns out")
    p.add_argument("--no-disk", action="store_true", help="leave the disk tier under a memory cap out")
    args = p.parse_args(argv)
    quick = args.quick
    repeats = args.repeats or (5 if quick else 7)
    hidden, layers, vocab = (768, 6, 4096) if quick else (1024, 12, 8192)
    new_tokens = 12 if quick else 24
    batches = (1, 8, 32)
    threads = torch.get_num_threads()
    model = save_model(hidden, layers, vocab)
    kv = max(batches) * (32 + new_tokens) + 512
    runners = {name: _runner(model, m, g, kv) for name, (m, g) in SPECS.items()}
    bytes_ = {n: _weight_bytes(r) for n, r in runners.items()}
    proj = {n: _projection_bytes(r) for n, r in runners.items()}
    llama, llama_note = ({}, "left out (--no-llama)") if args.no_llama else _llama_setup(model, threads)
    llama_bytes = {n: f.stat().st_size for n, f in llama.items()}
    print(f"[{NAME}] bytes {bytes_}; llama.cpp: {llama_bytes or llama_note}", file=sys.stderr, flush=True)
    decode = [decode_case(model, runners, llama, batch=b, new_tokens=new_tokens, vocab=vocab, repeats=repeats,
                          threads=threads) for b in batches]
    gen = torch.Generator().manual_seed(99)
    ttft = interleave({n: (lambda r=r: _ttft(r, _prompts(1, 256, vocab, gen)[0])) for n, r in runners.items()},
                      repeats=repeats)
    quality = quality_case(quick)
    from benchmarks._quant_disk import disk_case
    from benchmarks._quant_disk import markdown as disk_markdown

    disk = {"skipped": "left out (--no-disk)"} if args.no_disk else disk_case(quick)
    results = {"weight_bytes": bytes_, "projection_bytes": proj, "llama_gguf_bytes": llama_bytes,
               "llama_note": llama_note, "decode": decode, "ttft_s": ttft,
               "ttft": {k: summarize(v) for k, v in ttft.items()}, "quality": quality, "disk_tier": disk}
    tps = {d["batch"]: d["tokens_per_s"] for d in decode}
    results["ratios"] = {  # bytes: one number each; tokens/s: paired per repeat
        "int4_bytes_vs_fp32": bytes_["int4"] / bytes_["fp32"], "int8_bytes_vs_fp32": bytes_["int8"] / bytes_["fp32"],
        "int4_projection_bytes_vs_fp32": proj["int4"] / proj["fp32"],
        **{f"{q}_decode_vs_fp32_batch{b}": paired(tps[b][q], tps[b]["fp32"]) for b in batches for q in ("int8", "int4")},
        **{f"{q}_vs_llama_batch{b}": paired(tps[b][q], tps[b][BITS[q]]) for b in batches for q in ("int8", "int4")
           if BITS[q] in tps[b]},
    }
    md = _markdown(results, hidden=hidden, layers=layers, vocab=vocab, threads=threads, repeats=repeats,
                   new_tokens=new_tokens) + "\n\n" + disk_markdown(disk)
    write_result(NAME, title=TITLE, params={"quick": quick, "repeats": repeats, "hidden": hidden, "layers": layers,
                                            "vocab": vocab, "new_tokens": new_tokens, "batches": list(batches),
                                            "threads": threads, "int4_group_size": SPECS["int4"][1]},
                 results=results, markdown=md, measures=("benchmarks/_offload_children.py",))
    print(md)
    return 0


def _markdown(r: dict[str, Any], *, hidden: int, layers: int, vocab: int, threads: int, repeats: int,
              new_tokens: int) -> str:
    mib = 2**20
    ratios = r["ratios"]
    names = list(r["decode"][0]["summary"])
    lines = [
        f"Random LLaMA-architecture model (hidden {hidden}, {layers} layers, heads of 128, 2 key/value heads, vocab "
        f"{vocab}), {threads} threads, int4 at group 128; median of {repeats} interleaved repeats (min-max), mean "
        f"beside; fresh prompts of 32 tokens every repeat (the same for every contender of a repeat), "
        f"{new_tokens - 1} decode steps timed. Ratios of tokens/s are paired: the median of the per-repeat ratios, "
        "the repeats the first was faster, the range.",
        "",
        "| weights | energon bytes | projections only |",
        "|---|---|---|",
        *[f"| {n} | {b / mib:.1f} MiB ({b / r['weight_bytes']['fp32']:.2f}x) | "
          f"{r['projection_bytes'][n] / mib:.1f} MiB ({r['projection_bytes'][n] / r['projection_bytes']['fp32']:.2f}x) |"
          for n, b in r["weight_bytes"].items()],
        *[f"| {n} (GGUF file) | {b / mib:.1f} MiB | |" for n, b in r["llama_gguf_bytes"].items()],
        "",
        "Decode tokens/s:",
        "",
        "| batch | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        *[f"| {d['batch']} | " + " | ".join(
            f"{d['summary'][n]['median']:.1f} ({d['summary'][n]['min']:.1f}-{d['summary'][n]['max']:.1f}; mean "
            f"{d['mean'][n]:.1f})" for n in names) + " |" for d in r["decode"]],
        "",
        "Time to first token (256-token prompt): " + ", ".join(
            f"{n} {v['median'] * 1e3:.0f} ms" for n, v in r["ttft"].items()) + ".",
        "",
        f"int4 holds **{ratios['int4_bytes_vs_fp32']:.2f}x** fp32's weight bytes (projections "
        f"{ratios['int4_projection_bytes_vs_fp32']:.2f}x; the head is quantized too, the embedding stays fp32) "
        "and decodes "
        f"**{format_paired(ratios['int4_decode_vs_fp32_batch1'])}** fp32's tokens/s at batch 1 "
        f"({format_paired(ratios['int4_decode_vs_fp32_batch8'])} at 8, "
        f"{format_paired(ratios['int4_decode_vs_fp32_batch32'])} at 32); "
        f"int8: {ratios['int8_bytes_vs_fp32']:.2f}x the bytes, {format_paired(ratios['int8_decode_vs_fp32_batch1'])} "
        "at batch 1.",
    ]
    vs = [f"{q} / {BITS[q]} at batch {b}: {format_paired(ratios[f'{q}_vs_llama_batch{b}'])}" for q in ("int8", "int4")
          for b in (1, 8, 32) if f"{q}_vs_llama_batch{b}" in ratios]
    lines += ["", ("energon vs llama.cpp tokens/s: " + "; ".join(vs) + ".") if vs else
              f"llama.cpp: {r['llama_note']}.", *([f"llama.cpp note: {r['llama_note']}."] if vs and r["llama_note"] else [])]
    q = r["quality"]
    lines += ["", "Quality on the trained fixture (tiny LLaMA trained here; fp32 greedy continuations, teacher-forced):",
              "", "| | KL (nats) | argmax agreement | greedy match | per-layer KL |", "|---|---|---|---|---|",
              *[f"| {n} | {v['kl']:.2e} | {v['agreement']:.1%} | {v['greedy_match']:.1%} | "
                + ", ".join(f"{k:.1e}" for k in v["per_layer_kl"]) + " |" for n, v in q.items()]]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
