"""Inside a hard memory limit: each plugin's default path on the cases a new user brought, fitted or refused.

Question: under a hard cgroup memory limit smaller than what it uses unlimited, does the default path fit the whole
process (never OOM-killed) and give the unlimited run's results, with no budget given (energon) or only a disk
directory (Elixir)? Targets: fits, exact (greedy tokens / losses equal to the unlimited run), peak within the limit.

Cases (each a fresh process tree in its own cgroup v1 memory group, page cache dropped before each run; the peak is
the group's ``memory.max_usage_in_bytes``, page cache included):
    * energon: a random LLaMA of 16 layers x 2048 (GQA 16 / 4, MLP 4096, vocabulary 32000), fp32, 2.8 GB on disk,
      under a 1 GiB limit: ``Engine.from_pretrained(DIR)`` and ``tightfit serve DIR`` (the client in the same
      group), both with no budget; 2 prompts, 4 greedy tokens. Reference: the Engine unlimited.
    * elixir: Hugging Face ``GPT2LMHeadModel`` of ~240M parameters (1024 wide, 15 layers, vocabulary 50257; fp32 AdamW
      state ~3.9 GB), built in ``configure_model``, ``Trainer(strategy=ElixirStrategy(disk_dir=D))``, batch 1 x 128,
      3 steps, under a 1.25 GiB limit. Reference: the same script unlimited.
The children are ``benchmarks/_memory_limit_cases.py``. This measures fitting, not speed: the seconds are given for
what a user waits, one run each.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, parser, write_result
from benchmarks.memlimit import drop_page_cache, last_json_line, run_limited

NAME = "memory_limits"
GiB = 2**30
ENERGON_LIMIT, ELIXIR_LIMIT, UNLIMITED = 1 * GiB, int(1.25 * GiB), 64 * GiB
CHILD = [sys.executable, "-m", "benchmarks._memory_limit_cases"]


def _run(kind: str, arg: str, limit: int, label: str) -> dict[str, Any]:
    drop_page_cache()
    run = run_limited([*CHILD, kind, arg], limit, name=f"bench-{kind}", cwd=ROOT, timeout=3600)
    try:
        out = last_json_line(run.stdout)
    except (ValueError, json.JSONDecodeError):
        out = {"error": run.stderr[-2000:]}
    print(f"[{NAME}] {label}: rc {run.returncode}, peak {(run.peak_bytes or 0) / GiB:.2f} GiB, "
          f"{run.wall_seconds:.0f} s" + (f", {out['refused']}" if "refused" in out else ""), flush=True)
    return {"returncode": run.returncode, "oom_killed": run.oom_killed, "peak_bytes": run.peak_bytes,
            "limit_bytes": limit, "wall_seconds": run.wall_seconds, **out}


def energon_cases(root: Path) -> dict[str, Any]:
    from benchmarks._memory_limit_cases import ENERGON_MODEL
    from energon_infer.demo import write_random_llama

    model = write_random_llama(root / "llama-2p8", **ENERGON_MODEL)
    (model / "tokenizer.json").unlink(missing_ok=True)  # token ids in and out
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    ref = _run("energon", str(model), UNLIMITED, "energon unlimited")
    engine = _run("energon", str(model), ENERGON_LIMIT, "energon Engine under 1 GiB")
    serve = _run("serve", str(model), ENERGON_LIMIT, "energon tightfit serve under 1 GiB")
    shutil.rmtree(model, ignore_errors=True)
    return {"model_bytes": size, "unlimited": ref, "engine": engine, "serve": serve,
            "engine_exact": engine.get("tokens") == ref.get("tokens") is not None,
            "serve_exact": serve.get("tokens") == ref.get("tokens") is not None}


def elixir_cases(root: Path) -> dict[str, Any]:
    ref = _run("elixir", str(root / "elixir-free"), UNLIMITED, "elixir unlimited")
    limited = _run("elixir", str(root / "elixir-limited"), ELIXIR_LIMIT, "elixir under 1.25 GiB")
    return {"unlimited": ref, "limited": limited,
            "exact": limited.get("losses") == ref.get("losses") is not None}


def _row(case: str, what: str, run: dict[str, Any], exact: bool, ref: dict[str, Any]) -> str:
    fits = run["returncode"] == 0 and not run["oom_killed"]
    verdict = "fits" if fits else ("refused" if run["returncode"] == 3 else f"failed ({run['returncode']})")
    peak = (run["peak_bytes"] or 0) / GiB
    met = "met" if fits and exact and peak <= run["limit_bytes"] / GiB else "**missed**"
    return (f"| {case} | {what} | {run['limit_bytes'] / GiB:.2f} | {verdict} | {peak:.2f} | "
            f"{(ref['peak_bytes'] or 0) / GiB:.2f} | {'yes' if exact else 'no'} | {run['wall_seconds']:.0f} | {met} |")


def markdown(results: dict[str, Any]) -> str:
    rows = []
    if "energon" in results:
        e = results["energon"]
        rows.append(_row("energon 2.8 GB LLaMA", "`Engine.from_pretrained(DIR)`", e["engine"], e["engine_exact"],
                         e["unlimited"]))
        rows.append(_row("energon 2.8 GB LLaMA", "`tightfit serve DIR`", e["serve"], e["serve_exact"],
                         e["unlimited"]))
    if "elixir" in results:
        x = results["elixir"]
        rows.append(_row("Elixir GPT-2 240M", "`ElixirStrategy(disk_dir=D)`", x["limited"], x["exact"],
                         x["unlimited"]))
    return "\n".join([
        "Each case with no budget given (Elixir: only its disk directory) under a hard cgroup v1 memory limit; "
        "peak = the group's `memory.max_usage_in_bytes` (page cache included); exact = greedy tokens (energon) or "
        "losses (Elixir) equal to the same script unlimited; one run each, page cache dropped before each.",
        "",
        "| case | how | limit GiB | result | peak GiB | unlimited peak GiB | exact | wall s | target: fits, exact |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def _measured() -> list[str]:
    """The code the children run: the two plugins and core, and the children's script."""
    dirs = ("plugins/energon_infer", "plugins/lightning_elixir", "core")
    return ["benchmarks/_memory_limit_cases.py"] + sorted(str(p.relative_to(ROOT)) for d in dirs
                                                          for p in (ROOT / d).rglob("*.py"))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--cases", default="energon,elixir", help="comma-separated: energon, elixir")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tightfit-memory-limits-") as tmp:
        if "energon" in cases:
            results["energon"] = energon_cases(Path(tmp))
        if "elixir" in cases:
            results["elixir"] = elixir_cases(Path(tmp))
    write_result(NAME, title="Inside a hard memory limit: the default paths on a user's cases",
                 params={"cases": cases, "energon_limit_bytes": ENERGON_LIMIT, "elixir_limit_bytes": ELIXIR_LIMIT},
                 results=results, markdown=markdown(results),
                 measures=_measured())
    return 0


if __name__ == "__main__":
    sys.exit(main())
