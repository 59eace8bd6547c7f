"""``tightfit serve`` against ``vllm serve``, both measured by vLLM's own client, ``vllm bench serve``.

    python -m benchmarks.energon_serve [--quick] [--rounds N]

The model is one nobody here wrote: a random ``LlamaForCausalLM`` (6 layers x 384, GQA 6/2 heads) saved with
``save_pretrained`` beside a byte-level BPE tokenizer trained on this repository's text (``tokenizer.json`` +
``tokenizer_config.json``, as ``PreTrainedTokenizerFast.save_pretrained`` writes them). Both servers start once at
their defaults (fp32; vLLM compiled, its default; each given every core of the machine) and stay up; then
``vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random --ignore-eos`` (input
80-240 tokens, output 32-96) runs against one and then the other, alternating, each run with a fresh seed (fresh
prompts, so no prefix cache is warmed on the timed data), over:

* two Poisson request rates (``--request-rate``), and
* a ``--max-concurrency`` sweep (requests sent as fast as the slots free up).

Round ``r`` of both servers uses the same seed, so the same prompts in the same order: the two runs of a round
are a pair. Reported side by side, the median over the rounds of each server's output tokens/s, time to first
token and time per output token (mean and p99), and for each metric the paired ratio energon / vLLM (the median of
the per-round ratios, the rounds energon won, their range: ``benchmarks/README.md``); every run is in the JSON. Beside the tokens/s: the fraction of the machine's limit, the
model's matmul FLOPs for the tokens processed (prompt + output) over the time, divided by the measured fp32 matmul
rate of all cores. vLLM comes from ``.venv-peers/`` (``python -m benchmarks.peers``); without it the benchmark
says why and stops.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.common import format_paired, paired, parser, write_result
from benchmarks.peers import vllm_cli, vllm_env, vllm_python

NAME = "energon_serve"
# `tightfit serve` runs in a process of its own and its model in a worker of that: import here what they run, so
# the result records that code and goes stale when it changes.
SERVED = ("energon_infer.serving.serve", "energon_infer.serving.server", "energon_infer.worker.runtime",
          "energon_infer.worker.model")
TITLE = "energon_infer serving vs vLLM, through vLLM's own benchmark client (vllm bench serve)"
ROOT = Path(__file__).resolve().parent.parent
LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 6, 384, 6, 2, 1024, 8192
INPUT, OUTPUT, RANGE = 160, 64, 0.5  # uniform in [80, 240] and [32, 96] tokens

__all__ = ["make_model", "main"]


def make_model(path: Path) -> Path:
    """The random LLaMA (GQA 6/2) and a BPE tokenizer trained on this repository's Markdown and Python."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [p.read_text(errors="replace") for d in ("docs", "core", "plugins") for p in sorted((ROOT / d).rglob("*"))
             if p.suffix in (".md", ".py")] + [(ROOT / "README.md").read_text()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, vocab_size=tok.get_vocab_size(),
                      max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process (its own process group) and its URL; :meth:`wait` until ``/v1/models`` answers."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], log: Path):
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def bench(py: Path, server: Server, model: Path, work: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``server``; its saved result (vLLM's JSON)."""
    name = f"{server.name}-{seed}.json"
    cmd = vllm_cli(py) + [
        "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", server.url,
        "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", str(INPUT),
        "--random-output-len", str(OUTPUT), "--random-range-ratio", str(RANGE), "--num-prompts", str(work["prompts"]),
        "--request-rate", str(work.get("rate", "inf")), "--ignore-eos", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm"]
    if "concurrency" in work:
        cmd += ["--max-concurrency", str(work["concurrency"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=vllm_env(f"0-{_cores() - 1}"))
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed: {done.stderr[-2000:]}")
    r = json.loads((out / name).read_text())
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
            "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms")
    row = {k: r.get(k) for k in keep}
    row["warned_tokenize"] = "/tokenize unavailable" in done.stdout
    print(f"  {server.name:7s} {work['label']:>14s} seed {seed}: {row['output_throughput']:.1f} tok/s, "
          f"TTFT {row['mean_ttft_ms']:.0f} ms, TPOT {row['mean_tpot_ms']:.1f} ms, {row['completed']} ok",
          file=sys.stderr, flush=True)
    return row


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def peak_flops() -> float:
    """The fp32 matmul rate of every core, FLOP/s: :func:`benchmarks.energon_engine.peak_flops` over 1.5 s of 768-square
    products. The first products of a fresh process run at a quarter of the rate (38 and 51 GFLOP/s, then 140-219)
    and would set the whole limit; the best over a second and a half is past them."""
    from benchmarks.energon_engine import peak_flops as best_rate

    return best_rate(768, 20, seconds=1.5)


def flops_per_token(vocab: int) -> float:
    d = HIDDEN // HEADS
    per_layer = HIDDEN * (HEADS * d + 2 * KV_HEADS * d) + HEADS * d * HIDDEN + 3 * HIDDEN * INTERMEDIATE
    return 2.0 * (LAYERS * per_layer + HIDDEN * vocab)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or NAME)
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: 2 quick, 3 full)")
    args = p.parse_args(argv)
    for module in SERVED:
        importlib.import_module(module)
    py, why = vllm_python(install=True)
    if py is None:
        print(f"{NAME}: no vLLM peer ({why}); nothing to compare", file=sys.stderr)
        return 1
    rounds = args.rounds or (2 if args.quick else 3)
    n = 32 if args.quick else 64
    works = [{"label": "rate 4/s", "rate": 4, "prompts": n}, {"label": "rate 16/s", "rate": 16, "prompts": n},
             {"label": "concurrency 1", "concurrency": 1, "prompts": n // 8},
             {"label": "concurrency 4", "concurrency": 4, "prompts": n // 2},
             {"label": "concurrency 16", "concurrency": 16, "prompts": n}]
    cores = _cores()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = make_model(tmp_path / "llama-gqa")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        ours = Server("energon", [str(Path(sys.executable).parent / "tightfit"), "serve", str(model), "--port",
                                  str(port := _free_port()), "--log-level", "warning"], port, dict(os.environ),
                      tmp_path / "energon.log")
        vport = _free_port()
        peer = Server("vllm", vllm_cli(py) + ["serve", str(model), "--port", str(vport), "--host", "127.0.0.1",
                                              "--dtype", "float32", "--max-model-len", "1024",
                                              "--uvicorn-log-level", "warning"], vport, vllm_env(f"0-{cores - 1}"), tmp_path / "vllm.log")
        try:
            ours.wait(300)
            peer.wait(600)
            peak = peak_flops()
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {w["label"]: {"energon": [], "vllm": []} for w in works}
            bench(py, ours, model, {"label": "warm-up", "rate": "inf", "prompts": 4}, 999, tmp_path)
            bench(py, peer, model, {"label": "warm-up", "rate": "inf", "prompts": 4}, 999, tmp_path)
            for r in range(rounds):
                for w in works:
                    order = (ours, peer) if r % 2 == 0 else (peer, ours)
                    for srv in order:
                        runs[w["label"]][srv.name].append(bench(py, srv, model, w, 1000 * r + works.index(w), tmp_path))
        finally:
            ours.stop()
            peer.stop()
    per_token = flops_per_token(vocab)
    summary = {label: {name: _median(rows, per_token, peak) for name, rows in by.items()} for label, by in runs.items()}
    ratios = {label: _paired(by) for label, by in runs.items()}
    results = {"runs": runs, "summary": summary, "paired": ratios, "peak_flops": peak, "flops_per_token": per_token}
    params = {"quick": args.quick, "rounds": rounds, "works": works, "layers": LAYERS, "hidden": HIDDEN,
              "heads": HEADS, "kv_heads": KV_HEADS, "intermediate": INTERMEDIATE, "vocab": vocab, "cores": cores,
              "input": [int(INPUT * (1 - RANGE)), int(INPUT * (1 + RANGE))],
              "output": [int(OUTPUT * (1 - RANGE)), int(OUTPUT * (1 + RANGE))]}
    md = _markdown(summary, ratios, params)
    print(md)
    write_result(NAME, title=TITLE, params=params, results=results, markdown=md)
    return 0


def _median(rows: list[dict[str, Any]], per_token: float, peak: float) -> dict[str, float]:
    out = {k: statistics.median(float(r[k]) for r in rows)
           for k in ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "duration")}
    out["completed"] = min(int(r["completed"]) for r in rows)
    out["failed"] = max(int(r["failed"]) for r in rows)
    work = statistics.median((r["total_input_tokens"] + r["total_output_tokens"]) * per_token / r["duration"]
                             for r in rows)
    out["limit_fraction"] = work / peak
    return out


# Metric -> whether higher is better (tokens/s) or lower (times).
METRICS = {"output_throughput": True, "mean_ttft_ms": False, "p99_ttft_ms": False, "mean_tpot_ms": False,
           "p99_tpot_ms": False}


def _paired(by: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, object]]:
    """energon / vLLM per metric, round by round (round r of both ran the same prompts)."""
    return {k: paired([float(r[k]) for r in by["energon"]], [float(r[k]) for r in by["vllm"]], higher_is_better=up)
            for k, up in METRICS.items()}


def _markdown(summary: dict[str, dict[str, dict[str, float]]], ratios: dict[str, dict[str, dict[str, object]]],
              params: dict[str, Any]) -> str:
    lines = [f"A random `LlamaForCausalLM` ({params['layers']} layers x {params['hidden']}, GQA "
             f"{params['heads']}/{params['kv_heads']}, vocabulary {params['vocab']} of a trained BPE tokenizer), "
             f"fp32, both servers at their defaults with all {params['cores']} cores; `vllm bench serve --backend "
             f"openai --endpoint /v1/completions --dataset-name random --ignore-eos` (input {params['input'][0]}-"
             f"{params['input'][1]} tokens, output {params['output'][0]}-{params['output'][1]}) against each, "
             f"alternating, the same fresh prompts for both in a round; median of {params['rounds']} rounds. Ratios: "
             "energon / vLLM, paired: the median of the per-round ratios, the rounds energon won of all, the range "
             "(tokens/s: higher is better; times: lower is better). Limit: the model's matmul FLOPs for the tokens "
             "processed over the time, as a fraction of the measured fp32 matmul rate of all cores.", "",
             "| load | server | output tok/s | TTFT mean ms | TTFT p99 ms | TPOT mean ms | TPOT p99 ms | "
             "of limit | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for label, by in summary.items():
        e, v = by["energon"], by["vllm"]
        for name, s in (("energon", e), ("vLLM", v)):
            lines.append(f"| {label} | {name} | {s['output_throughput']:.1f} | {s['mean_ttft_ms']:.0f} | "
                         f"{s['p99_ttft_ms']:.0f} | {s['mean_tpot_ms']:.1f} | {s['p99_tpot_ms']:.1f} | "
                         f"{s['limit_fraction']:.2f} | {s['completed']} |")
        cells = [format_paired(ratios[label][k]) for k in METRICS]
        lines.append(f"| {label} | **paired ratio** | **{cells[0]}** | " + " | ".join(cells[1:]) + " | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
