"""``tightfit serve`` against ``vllm serve``, both measured by vLLM's own client, ``vllm bench serve``.

    python -m benchmarks.energon_serve [--quick] [--rounds N] [--shapes h384-v2k,h1024-v32k] [--smoke]
                                       [--energon-args "--token-budget measured"] [--sections shapes,structured]

The models are ones nobody here tuned for: random ``LlamaForCausalLM`` checkpoints saved with ``save_pretrained``
over a shape sweep (:data:`SHAPES`: hidden 384 and 1024, vocabularies of about 2k, 32k and 128k), each beside a
byte-level BPE tokenizer of that vocabulary trained on this repository's text (padded with made-up words where
the text has too few merges; ``tokenizer.json`` + ``tokenizer_config.json``, as ``PreTrainedTokenizerFast``
writes them). Per shape both servers start once at their defaults (fp32; vLLM compiled, its default; each given
every core of the machine) and stay up for that shape's runs (long-lived, not fresh per round; each warmed by a
few requests first); then ``vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
--ignore-eos`` (input 80-240 tokens, output 32-96) runs against one and then the other, alternating, each run with
a fresh seed (fresh prompts, so no prefix cache is warmed on the timed data), over:

* two Poisson request rates, below and above saturation: half and twice the request rate energon served at
  ``--max-concurrency 64`` in a calibration run of that shape, and
* a ``--max-concurrency`` sweep, 1, 4, 16 and 64 (requests sent as fast as the slots free up).

Round ``r`` of both servers uses the same seed, so the same prompts in the same order: the two runs of a round
are a pair. Reported side by side, the median over the rounds of each server's output tokens/s, time to first
token and time per output token (mean and p99), and for each metric the paired ratio energon / vLLM (the median of
the per-round ratios, the rounds energon won, their range: ``benchmarks/README.md``); every run is in the JSON. Beside
the tokens/s: the fraction of the machine's limit, the model's matmul FLOPs for the tokens processed (prompt +
output) over the time, divided by the measured fp32 matmul rate of all cores. With each energon run goes its time
account (``GET /v1/account``, reset before the run: :mod:`energon_infer.engine.account`); the report shows where a
request's and a step's time went at the lowest and the highest load. vLLM comes from ``.venv-peers/``
(``python -m benchmarks.peers``); without it the benchmark says why and stops. ``--smoke``: the smallest shape,
one round, a few prompts: checks the path, measures nothing worth reporting (nothing is written; nor with only some
``--sections``: the result holds them all).

The ``structured`` section (:mod:`benchmarks._serve_structured`): structured outputs (a 20-field JSON schema) and
tool calls (``tool_choice`` required and named) at 16 requests/s against ``vllm serve`` on one shape
(:data:`STRUCTURED_SHAPE`), driven by that module's client, vLLM writing compact JSON as energon does; valid outputs
on both servers, tokens/s against energon unconstrained and against vLLM, time to first token with a fresh schema
against a cached one, and whether a large schema's compile stalls the other requests; then vLLM at its defaults
once, for the valid fraction of the schema workload (a note).
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
          "energon_infer.worker.model", "energon_infer.structured", "energon_infer.worker.grammar",
          "energon_infer.serving.tool_calls")
TITLE = "energon_infer serving vs vLLM, through vLLM's own benchmark client (vllm bench serve)"
ROOT = Path(__file__).resolve().parent.parent
LAYERS = 6
#: The shape sweep: name -> (hidden, heads, kv heads, intermediate, vocabulary). Head size 64, GQA 3:1 and 4:1.
SHAPES = {"h384-v2k": (384, 6, 2, 1024, 2048), "h384-v32k": (384, 6, 2, 1024, 32768),
          "h384-v128k": (384, 6, 2, 1024, 131072), "h1024-v2k": (1024, 16, 4, 2816, 2048),
          "h1024-v32k": (1024, 16, 4, 2816, 32768), "h1024-v128k": (1024, 16, 4, 2816, 131072)}
INPUT, OUTPUT, RANGE = 160, 64, 0.5  # uniform in [80, 240] and [32, 96] tokens
CONCURRENCY = (1, 4, 16, 64)
RATES = (0.5, 2.0)  # x the request rate energon serves at concurrency 64: below and above saturation
STRUCTURED_SHAPE = "h384-v32k"  # the structured section's model: a grammar's mask work grows with the vocabulary
SECTIONS = ("shapes", "structured")

__all__ = ["make_model", "main"]


def make_model(path: Path, shape: str = "h384-v2k", *, layers: int = LAYERS) -> Path:
    """A random LLaMA of ``shape`` (:data:`SHAPES`) and a BPE tokenizer of its vocabulary, trained on this
    repository's Markdown and Python, padded with made-up words (seeded) where that text has too few merges."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, heads, kv_heads, intermediate, vocab = SHAPES[shape]
    texts = [p.read_text(errors="replace") for d in ("docs", "core", "plugins") for p in sorted((ROOT / d).rglob("*"))
             if p.suffix in (".md", ".py")] + [(ROOT / "README.md").read_text()]
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(4, 9))) for _ in range(vocab)]
    texts += [" ".join(words[i:i + 64] * 3) for i in range(0, len(words), 64)]  # each word often enough to merge
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=tok.get_vocab_size(),
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


def flops_per_token(shape: str, vocab: int, layers: int = LAYERS) -> float:
    hidden, heads, kv_heads, intermediate, _ = SHAPES[shape]
    d = hidden // heads
    per_layer = hidden * (heads * d + 2 * kv_heads * d) + heads * d * hidden + 3 * hidden * intermediate
    return 2.0 * (layers * per_layer + hidden * vocab)


def account(server: Server, *, reset: bool) -> dict[str, Any]:
    """energon's time account since the last reset (``reset``: start it again after the read); ``{}`` for vLLM."""
    if server.name != "energon":
        return {}
    view = httpx.get(server.url + "/v1/account", params={"reset": str(reset).lower()}, timeout=30).json()
    view.pop("recent", None)
    return view


def run_shape(py: Path, shape: str, args: Any, tmp_path: Path, cores: int) -> dict[str, Any]:
    """Every load of one shape, both servers long-lived, rounds alternating; the runs by load and server."""
    n = 8 if args.smoke else 32 if args.quick else 64
    rounds = 1 if args.smoke else args.rounds or (2 if args.quick else 3)
    layers = 2 if args.smoke else LAYERS
    model = make_model(tmp_path / shape, shape, layers=layers)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    extra = args.energon_args.split() if args.energon_args else []
    ours = Server("energon", [str(Path(sys.executable).parent / "tightfit"), "serve", str(model), "--port",
                              str(port := _free_port()), "--log-level", "warning", *extra], port, dict(os.environ),
                  tmp_path / f"energon-{shape}.log")
    vport = _free_port()
    peer = Server("vllm", vllm_cli(py) + ["serve", str(model), "--port", str(vport), "--host", "127.0.0.1",
                                          "--dtype", "float32", "--max-model-len", "1024",
                                          "--uvicorn-log-level", "warning"], vport, vllm_env(f"0-{cores - 1}"),
                  tmp_path / f"vllm-{shape}.log")
    try:
        ours.wait(300)
        peer.wait(600)
        for srv in (ours, peer):
            bench(py, srv, model, {"label": "warm-up", "rate": "inf", "prompts": 4}, 999, tmp_path)
        # Saturation: the request rate energon serves with 64 requests always in flight.
        calib = bench(py, ours, model, {"label": "calibration", "concurrency": 64, "prompts": n}, 998, tmp_path)
        saturated = float(calib["request_throughput"])
        works = [{"label": f"rate {k:g}x sat ({saturated * k:.1f}/s)", "rate": round(saturated * k, 2), "prompts": n}
                 for k in RATES]
        works += [{"label": f"concurrency {c}", "concurrency": c, "prompts": max(4, n * min(c, 16) // 16)}
                  for c in (CONCURRENCY[:2] if args.smoke else CONCURRENCY)]
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {w["label"]: {"energon": [], "vllm": []} for w in works}
        for r in range(rounds):
            for w in works:
                order = (ours, peer) if r % 2 == 0 else (peer, ours)
                for srv in order:
                    account(srv, reset=True)
                    row = bench(py, srv, model, w, 1000 * r + works.index(w), tmp_path)
                    row["account"] = account(srv, reset=True)
                    runs[w["label"]][srv.name].append(row)
    finally:
        ours.stop()
        peer.stop()
    return {"shape": shape, "vocab": vocab, "layers": layers, "works": works, "runs": runs, "rounds": rounds,
            "saturated_request_rate": saturated}


def run_structured(py: Path, args: Any, tmp_path: Path, cores: int) -> dict[str, Any]:
    """The structured section (:mod:`benchmarks._serve_structured`): both servers long-lived on one shape, rounds
    alternating which goes first, each round the same seeded requests to both."""
    from benchmarks._serve_structured import (
        VLLM_STRUCTURED,
        add_chat_template,
        markdown,
        run_round,
        run_schema_validity,
        summarize,
    )

    shape = "h384-v2k" if args.smoke else STRUCTURED_SHAPE
    n = 4 if args.smoke else 32 if args.quick else 64
    rounds = 1 if args.smoke else args.rounds or (2 if args.quick else 3)
    layers = 2 if args.smoke else LAYERS
    large_fields = 40 if args.smoke else 400
    model = add_chat_template(make_model(tmp_path / f"structured-{shape}", shape, layers=layers))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    extra = args.energon_args.split() if args.energon_args else []
    ours = Server("energon", [str(Path(sys.executable).parent / "tightfit"), "serve", str(model), "--port",
                              str(port := _free_port()), "--log-level", "warning", *extra], port, dict(os.environ),
                  tmp_path / "energon-structured.log")

    def vllm(name: str, settings: list[str]) -> Server:
        return Server(name, vllm_cli(py) + ["serve", str(model), "--port", str(vport := _free_port()), "--host",
                                            "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024",
                                            # vLLM 0.32 takes tool_choice required / named only with a tool parser,
                                            # which it loads only with auto tool choice on: the template's format
                                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                            "--uvicorn-log-level", "warning", *settings], vport,
                      vllm_env(f"0-{cores - 1}"), tmp_path / f"{name}-structured.log")

    # The paired peer writes compact JSON as energon does (VLLM_STRUCTURED); the default's validity is a note.
    peer = vllm("vllm", ["--structured-outputs-config", json.dumps(VLLM_STRUCTURED)])
    runs: dict[str, list[dict[str, Any]]] = {"energon": [], "vllm": []}
    try:
        ours.wait(300)
        peer.wait(600)
        for r in range(rounds):
            for srv in (ours, peer) if r % 2 == 0 else (peer, ours):
                row = run_round(srv.url, n, seed=100 + r, large_fields=large_fields)
                print(f"  {srv.name:7s} structured round {r}: schema {row['schema']['tok_s']:.1f} tok/s, "
                      f"{row['schema']['valid']}/{n} valid; tools {row['tools']['valid']}/{n} valid "
                      f"{(row['schema']['errors'] + row['tools']['errors'])[:2]} {row['schema']['invalid'][:1]}",
                      file=sys.stderr, flush=True)
                runs[srv.name].append(row)
    finally:
        ours.stop()
        peer.stop()
    default = vllm("vllm-default", [])
    try:
        default.wait(600)
        vllm_default = run_schema_validity(default.url, n, seed=100)
    finally:
        default.stop()
    res = {"shape": shape, "vocab": vocab, "layers": layers, "n": n, "rounds": rounds, "large_fields": large_fields,
           "runs": runs, "vllm_default": vllm_default}
    res["summary"] = summarize(runs)
    res["markdown"] = markdown(res)
    return res


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or NAME)
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: 2 quick, 3 full)")
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all; quick: "
                                                  "h384-v2k,h384-v128k,h1024-v32k)")
    p.add_argument("--smoke", action="store_true", help="one small shape, one round, a few prompts; writes nothing")
    p.add_argument("--energon-args", default="", help="extra `tightfit serve` flags, e.g. '--token-budget measured'")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated, of shapes (the shape sweep) and structured (structured outputs and tool calls)")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    if [s for s in sections if s not in SECTIONS] or not sections:
        p.error(f"--sections {args.sections!r}: give some of {', '.join(SECTIONS)}, comma-separated")
    shapes = (["h384-v2k"] if args.smoke else args.shapes.split(",") if args.shapes
              else ["h384-v2k", "h384-v128k", "h1024-v32k"] if args.quick else list(SHAPES))
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes {unknown} are not shapes of this benchmark; give some of {', '.join(SHAPES)}")
    for module in SERVED:
        importlib.import_module(module)
    py, why = vllm_python(install=True)
    if py is None:
        print(f"{NAME}: no vLLM peer ({why}); nothing to compare", file=sys.stderr)
        return 1
    cores = _cores()
    with tempfile.TemporaryDirectory() as tmp:
        peak = peak_flops()
        by_shape = [run_shape(py, shape, args, Path(tmp), cores) for shape in shapes] if "shapes" in sections else []
        structured = run_structured(py, args, Path(tmp), cores) if "structured" in sections else None
    for res in by_shape:
        per_token = flops_per_token(res["shape"], res["vocab"], res["layers"])
        res["summary"] = {label: {name: _median(rows, per_token, peak) for name, rows in by.items()}
                          for label, by in res["runs"].items()}
        res["paired"] = {label: _paired(by) for label, by in res["runs"].items()}
        res["flops_per_token"] = per_token
    params = {"quick": args.quick, "smoke": args.smoke, "shapes": {s: SHAPES[s] for s in shapes}, "cores": cores,
              "energon_args": args.energon_args, "concurrency": CONCURRENCY, "rates_x_saturation": RATES,
              "servers": "both long-lived per shape, warmed by 4 requests; rounds alternate the order",
              "input": [int(INPUT * (1 - RANGE)), int(INPUT * (1 + RANGE))],
              "output": [int(OUTPUT * (1 - RANGE)), int(OUTPUT * (1 + RANGE))], "sections": sections}
    md = "\n\n".join([_markdown(res, params) for res in by_shape]
                     + ([structured["markdown"]] if structured is not None else []))
    print(md)
    if args.smoke or len(sections) < len(SECTIONS):  # the result holds every section, measured together
        print(f"{NAME}: {'--smoke' if args.smoke else '--sections ' + args.sections}: nothing written", file=sys.stderr)
        return 0
    results: dict[str, Any] = {"shapes": by_shape, "peak_flops": peak}
    if structured is not None:
        results["structured"] = structured
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


def _account_lines(view: dict[str, Any]) -> list[str]:
    """energon's time account of one run: each part's share of a request's and of a step's wall time."""
    if not view:
        return []
    out = []
    for kind in ("requests", "steps"):
        v = view[kind]
        shares = ", ".join(f"{k} {x * 100:.0f}%" for k, x in sorted(v["share"].items(), key=lambda kv: -kv[1])
                           if x >= 0.005)
        out.append(f"  - {kind} ({v['count']}, mean wall {v['wall_mean_s'] * 1e3:.1f} ms): {shares}")
    return out


def _markdown(res: dict[str, Any], params: dict[str, Any]) -> str:
    hidden, heads, kv_heads, intermediate, _ = params["shapes"][res["shape"]]
    summary, ratios = res["summary"], res["paired"]
    lines = [f"**{res['shape']}**: a random `LlamaForCausalLM` ({res['layers']} layers x {hidden}, GQA "
             f"{heads}/{kv_heads}, MLP {intermediate}, vocabulary {res['vocab']} of a trained BPE tokenizer), fp32, "
             f"both servers at their defaults with all {params['cores']} cores ({params['servers']}"
             + (f"; energon with `{params['energon_args']}`" if params["energon_args"] else "") +
             f"); `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random --ignore-eos` "
             f"(input {params['input'][0]}-{params['input'][1]} tokens, output {params['output'][0]}-"
             f"{params['output'][1]}) against each, the same fresh prompts for both in a round; median of "
             f"{res['rounds']} rounds. Saturation: energon served {res['saturated_request_rate']:.2f} requests/s at "
             "concurrency 64. Ratios: energon / vLLM, paired: the median of the per-round ratios, the rounds energon "
             "won of all, the range (tokens/s: higher is better; times: lower is better). Limit: the model's matmul "
             "FLOPs for the tokens processed over the time, as a fraction of the measured fp32 matmul rate of all "
             "cores.", "",
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
    lines += ["", "energon's time account (its last round; shares of the wall time, largest first):"]
    for label, by in res["runs"].items():
        lines += [f"- {label}:", *_account_lines(by["energon"][-1].get("account", {}))]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
