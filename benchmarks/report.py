"""Generate ``benchmarks/results/REPORT.md`` and the README's headline table from ``benchmarks/results/*.json``.

    python -m benchmarks.report            # what `make bench-report` and `tightfit bench --update-report` run

The report has one section per result JSON, in name order, each preceded by an anchor named after the result
(``REPORT.md#energon_serve``: the link the docs use) and headed by the commit it measured; when the code it
measured changed since, a warning says by how many commits (:mod:`benchmarks.staleness`). The README's block
between ``<!-- generated: results-table -->`` and ``<!-- end generated: results-table -->`` becomes
:func:`headline_table`: one row per plugin claim, each value computed from the JSON's ``results`` (never from its
prose). ``tests/test_report.py`` checks that both committed files are what this module makes of the committed JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, format_paired, paired
from benchmarks.staleness import Verdict, check_all, git_root, rerun_hint

__all__ = ["report_text", "headline_table", "write_report", "update_readme", "without_staleness", "README",
           "TABLE_BEGIN", "TABLE_END"]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TABLE_BEGIN = "<!-- generated: results-table -->"
TABLE_END = "<!-- end generated: results-table -->"
REPORT_LINK = "benchmarks/results/REPORT.md"  # from the README, at the repository root
STALE_CELL = " ⚠ stale"
# What depends on the checkout's history rather than on the JSON: the stale warnings (see without_staleness).
_STALE = re.compile(rf"^> \*\*(?:Stale|Not checked):\*\*.*\n\n?|{re.escape(STALE_CELL)}", re.M)


def without_staleness(text: str) -> str:
    """``text`` (a report or a headline table) without its stale warnings: what the JSON alone determines."""
    return _STALE.sub("", text)


def _load(results_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        out[str(data.get("name", path.stem))] = {**data, "_file": path.name}
    return out


def _verdicts(results_dir: Path, staleness: bool) -> dict[str, Verdict]:
    if not staleness:
        return {}
    repo = git_root(ROOT)
    return check_all(results_dir, repo) if repo is not None else {}


def _measured(data: dict) -> str:
    """Which commit a section measured, as the report prints it."""
    commit = data.get("commit")
    if not isinstance(commit, dict) or not commit.get("sha"):
        return "commit not recorded"
    note = " with uncommitted changes to the measured code" if commit.get("dirty") else ""
    load = data.get("load_average")
    busy = f", load {load[0]:.1f}" if isinstance(load, list) and load else ""
    return f"measured at {str(commit['sha'])[:10]}{note}{busy}"


def _warning(v: Verdict | None) -> str | None:
    """The section's stale line, or None when the result describes this checkout."""
    if v is None:
        return None
    rerun = f"(rerun: `{rerun_hint(v.name)}`)"
    if v.skip:
        return f"> **Not checked:** {v.skip}"
    if not v.problem:
        return None
    if v.changed:
        n = "some" if v.commits is None else str(v.commits)
        return (f"> **Stale:** {n} commit{'' if v.commits == 1 else 's'} changed the code this measured since "
                f"{(v.sha or '')[:7]} {rerun}")
    return f"> **Stale:** {v.problem}"


def _section(name: str, data: dict[str, Any], verdict: Verdict | None) -> str:
    m = data.get("machine", {})
    machine = f"{m.get('platform', '?')}, {m.get('cpu_count', '?')} CPUs, torch {m.get('torch', '?')}, " \
              f"{m.get('date', '?')}"
    body = [f'<a id="{name}"></a>', "", f"## {data.get('title', name)}", "",
            f"_`{data['_file']}` — {machine}; {_measured(data)}_", ""]
    warning = _warning(verdict)
    if warning:
        body += [warning, ""]
    body.append(str(data.get("markdown", "")).strip())
    for plot in data.get("plots", []):
        body += ["", f"![{plot}]({plot})"]
    return "\n".join(body)


def report_text(results_dir: Path = RESULTS, *, staleness: bool = True) -> str:
    """The report of every result JSON in ``results_dir``. With ``staleness``, each section whose measured code
    changed since (against this checkout's HEAD) carries a warning line; :func:`without_staleness` removes them."""
    results = _load(results_dir)
    verdicts = _verdicts(results_dir, staleness)
    head = ["# tightfit benchmark report", "",
            "Generated from `benchmarks/results/*.json` by `python -m benchmarks.report`; do not edit by hand. How "
            "the benchmarks run, what a paired ratio and a target mean, and how to rerun one: `benchmarks/README.md`. "
            "A section whose measured code changed since its run says so under its heading.", ""]
    if not results:
        return "\n".join(head + ["No benchmark results yet.", ""])
    head += [f"- [{data.get('title', name)}](#{name})" for name, data in results.items()] + [""]
    sections = [_section(name, data, verdicts.get(name)) for name, data in results.items()]
    return "\n".join(head) + "\n" + "\n\n".join(sections) + "\n"


# ---- the headline table: one row per claim, each value computed from a result's `results` ----

def _rate(seconds: list[float]) -> list[float]:
    return [1.0 / s for s in seconds]


def _energon_serve(r: dict) -> str:
    if "shapes" in r:  # the shape sweep: its first shape, above saturation
        first = r["shapes"][0]
        runs = next(by for label, by in first["runs"].items() if label.startswith("rate 2x"))
    else:
        runs = r["runs"]["rate 16/s"]
    tok = paired([x["output_throughput"] for x in runs["energon"]], [x["output_throughput"] for x in runs["vllm"]])
    ttft = paired([x["mean_ttft_ms"] for x in runs["energon"]], [x["mean_ttft_ms"] for x in runs["vllm"]],
                  higher_is_better=False)
    return f"tokens/s {format_paired(tok)}; TTFT {format_paired(ttft)}"


def _energon_structured(r: dict) -> str | None:
    if "structured" not in r:  # a result from before the section: no row
        return None
    s = r["structured"]["summary"]
    return (f"tokens/s {format_paired(s['paired']['schema_vs_vllm'])}; valid {s['energon']['schema_valid']:.0%} "
            f"(vLLM {s['vllm']['schema_valid']:.0%}); vs unconstrained "
            f"{format_paired(s['paired']['schema_vs_unconstrained'])}")


def _energon_engine(r: dict) -> str:
    runs = r["offline"]["runs"]
    return format_paired(paired([x["tokens_per_s"] for x in runs["energon"]],
                                [x["tokens_per_s"] for x in runs["vLLM-cpu"]]))


def _energon_offload(r: dict) -> str:
    runs = r["batches"]["32"]
    return format_paired(paired([x["cells"]["energon (limit)"]["tokens_per_s"] for x in runs],
                                [x["cells"]["transformers + accelerate (limit)"]["tokens_per_s"] for x in runs]))


def _energon_quant(r: dict) -> str:
    row = next(d for d in r["decode"] if d["batch"] == 8)["tokens_per_s"]
    return format_paired(paired(row["int4"], row["llama.cpp Q4_0"]))


def _energon_spec(r: dict) -> str:
    cells = r["ram"]
    copy, fresh = cells["copying/b1"]["ngram"], cells["fresh/b1"]["ngram"]
    same = all(v["greedy_equal"] for cell in cells.values() for v in cell.values())
    acc = f"{copy['acceptance']:.2f}" if copy["acceptance"] is not None else "-"
    # The non-copying target holds at every batch: the worst batch is shown beside batch 1.
    worst = min((k for k in cells if k.startswith("fresh/") and "ngram" in cells[k]),
                key=lambda k: cells[k]["ngram"]["vs_plain"]["median"])
    extra = f", {worst.split('/')[1]} {format_paired(cells[worst]['ngram']['vs_plain'])}" if worst != "fresh/b1" else ""
    return (f"copying {format_paired(copy['vs_plain'])} (acceptance {acc}); non-copying "
            f"{format_paired(fresh['vs_plain'])}{extra}; greedy outputs {'identical' if same else 'DIFFER'}")


def _elixir_vs_ddp(r: dict) -> str:
    m = r["llama"]
    return format_paired(paired(_rate(m["elixir"]["repeats"]), _rate(m["ddp"]["repeats"])))


def _elixir_fabric(r: dict) -> str:
    return format_paired(r["elixir_over_peer"])


def _elixir_disk(r: dict) -> str:
    h, stats = r["headline"], r["stats"]
    ds = stats.get("deepspeed nvme", {})
    peer = "killed (out of memory)" if ds.get("oom_killed") else (
        f"{h['vs_deepspeed']:.2f}x Elixir's step time" if h.get("vs_deepspeed") else "did not finish")
    same = "bit-equal to RAM" if h.get("exact") else "NOT equal to RAM"
    return f"state {h['state_over_limit']:.2f}x the limit, {same}; DeepSpeed ZeRO-Infinity: {peer}"


def _torchrec_cache(r: dict) -> str:
    hit = r["hit_rate"]["stationary"]["0.015"]
    step = r["step_time"]["samples"]
    speed = paired(_rate(step["cached_1.5pct_fused_adam"]), _rate(step["ebc_sparse_adam"]))
    return (f"hit rate {hit['lfu+prefetch8']:.2f} (Belady's optimum {hit['belady']:.2f}); "
            f"steps/s vs EBC {format_paired(speed)}")


def _sky_train(r: dict) -> str:
    ranks = r["ranks"]

    def slowest(partition: str) -> list[float]:
        return [max(steps) for steps in zip(*(rank[partition]["step_s"] for rank in ranks))]

    return format_paired(paired(_rate(slowest("balanced")), _rate(slowest("even"))))


def _disk_io(r: dict) -> str:
    worst = r["headline"]["read"]["worst_size"]
    samples = {**r["samples"], **r.get("more_samples", {})}
    return format_paired(paired(_rate(samples[worst]["read_s"]), _rate(samples["raw"]["read_s"])))


# (result name, the claim, its value from that result's `results`, None: no row). Ratios are paired per round: the first
# contender over the second, "wins" the rounds the first was better (benchmarks/README.md).
CLAIMS: list[tuple[str, str, Callable[[dict], str | None]]] = [
    ("energon_serve", "energon server / vLLM, served at 16 req/s (`vllm bench serve`)", _energon_serve),
    ("energon_serve", "energon / vLLM with a 20-field JSON schema at 16 req/s (structured outputs)",
     _energon_structured),
    ("energon_engine", "energon engine / vLLM-cpu, offline tokens/s (one core)", _energon_engine),
    ("energon_offload", "energon / accelerate, weights 3x the memory limit, tokens/s at batch 32", _energon_offload),
    ("energon_quant", "energon int4 / llama.cpp Q4_0, decode tokens/s at batch 8", _energon_quant),
    ("energon_spec", "energon n-gram speculation / none, tokens/s at batch 1 in RAM (non-copying: and its worst batch)", _energon_spec),
    ("elixir_vs_ddp", "Elixir / DDP, steps/s with memory to spare (LLaMA, 2 ranks)", _elixir_vs_ddp),
    ("elixir_fabric", "Elixir under Fabric / Fabric's FSDP with CPU offload, steps/s (LLaMA, 2 ranks)", _elixir_fabric),
    ("elixir_disk", "Elixir with optimizer state on disk, under a hard memory limit", _elixir_disk),
    ("torchrec_cache", "embedding cache of 1.5% of the rows / TorchRec EBC", _torchrec_cache),
    ("sky_train", "Sky's balanced partition / even split, samples/s with a 3x slower rank", _sky_train),
    ("disk_io", "disk store / raw device, read bandwidth at its worst tensor size", _disk_io),
]


def headline_table(results_dir: Path = RESULTS, *, staleness: bool = True) -> str:
    """The README's results table: one row per claim of :data:`CLAIMS` whose result JSON is present, its value
    computed from that JSON, a link to the report section, and a stale mark when its measured code changed."""
    results = _load(results_dir)
    verdicts = _verdicts(results_dir, staleness)
    rows = ["| claim | measured (paired: median, rounds won, range) | report |", "|---|---|---|"]
    for name, claim, value in CLAIMS:
        if name not in results:
            continue
        try:
            got = value(results[name]["results"])
        except (KeyError, TypeError, ValueError, StopIteration, ZeroDivisionError) as e:
            got = f"not in this result ({type(e).__name__}: {e})"
        if got is None:
            continue
        text = got
        v = verdicts.get(name)
        mark = STALE_CELL if v is not None and v.stale else ""
        rows.append(f"| {claim} | {text} | [{name}]({REPORT_LINK}#{name}){mark} |")
    return "\n".join(rows) + "\n"


def update_readme(readme: Path = README, results_dir: Path = RESULTS) -> bool:
    """Rewrite the README's block between the markers with :func:`headline_table`; False when there are none."""
    if not readme.is_file():
        return False
    text = readme.read_text()
    pattern = re.compile(rf"({re.escape(TABLE_BEGIN)}\n).*?(^{re.escape(TABLE_END)})", re.S | re.M)
    if not pattern.search(text):
        return False
    table = headline_table(results_dir)
    new = pattern.sub(lambda m: m.group(1) + table + m.group(2), text, count=1)
    if new != text:
        readme.write_text(new)
    return True


def write_report(results_dir: Path = RESULTS) -> Path:
    """Write ``results_dir/REPORT.md``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    out = results_dir / "REPORT.md"
    out.write_text(report_text(results_dir))
    return out


def main() -> int:
    print(write_report(RESULTS))
    committed = (ROOT / "benchmarks" / "results").resolve()
    if RESULTS.resolve() == committed:  # a run directory's results never reach the README
        print(f"{README}: " + ("results table rewritten" if update_readme(README, RESULTS)
                               else f"no {TABLE_BEGIN} block; table not written"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
