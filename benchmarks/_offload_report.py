"""The energon_offload benchmark's report: the Markdown table, the targets met or missed, the plot (from the
measured cells ``benchmarks/energon_offload.py`` collects)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import format_paired, paired, plot_path

NAME = "energon_offload"
GiB, MiB = 2**30, 2**20
ENERGON, ENERGON_RAM = "energon (limit)", "energon all in RAM (no limit)"
ACCEL, LLAMA = "transformers + accelerate (limit)", "llama.cpp mmap (limit)"
TARGETS = {"roofline": 0.80, "vs_accelerate": 3.0}


def _median(runs: list[dict[str, Any]], contender: str, key: str) -> float | None:
    vals = [r["cells"][contender].get(key) for r in runs if contender in r["cells"]]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def _paired(runs: list[dict[str, Any]], a: str, b: str, key: str = "tokens_per_s") -> dict[str, object] | None:
    """``a`` / ``b`` paired over the repeats where both measured ``key`` (a repeat's cells ran the same prompts)."""
    pairs = [(r["cells"][a].get(key), r["cells"][b].get(key)) for r in runs if a in r["cells"] and b in r["cells"]]
    pairs = [(x, y) for x, y in pairs if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y]
    return paired([x for x, _ in pairs], [y for _, y in pairs]) if pairs else None


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(r: dict[str, Any], hidden: int, layers: int, vocab: int, new_tokens: int, threads: int,
              repeats: int) -> str:
    lim = r["limit_bytes"]
    lines = [f"Random LLaMA (hidden {hidden}, {layers} layers, vocabulary {vocab}, fp32): **{r['weight_bytes'] / GiB:.2f} "
             f"GiB of weights under a {lim / GiB:.2f} GiB cgroup v1 limit** ({r['weight_bytes'] / lim:.1f}x), host "
             f"budget given to energon and accelerate {r['budget_bytes'] / MiB:.0f} MiB; disk "
             f"{r['disk_bytes_per_s'] / 1e9:.2f} GB/s (the best of O_DIRECT reads, 4 MiB requests, 1 or 2 threads, before and after "
             "the run: " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in r["disk_bandwidths"].items()) + "); "
             f"{new_tokens} greedy tokens "
             f"per prompt of 4-12 tokens; {threads} threads each; page cache dropped before every cell; "
             f"{repeats} run(s) per cell (median where more)."]
    for c, why in r["skipped"].items():
        lines += ["", f"**{c}: not run**: {why}."]
    lines += ["", "| batch | contender | tokens/s | decode tokens/s | of the I/O roofline | TTFT s | peak MiB | "
              "OOM kills | disk read per step MiB | greedy = reference |", "|---|---|---|---|---|---|---|---|---|---|"]
    for batch, runs in r["batches"].items():
        names = list(runs[0]["cells"])
        for c in sorted(names, key=[ENERGON, ACCEL, LLAMA, ENERGON_RAM].index):
            cell = runs[0]["cells"][c]
            if "error" in cell:
                m = re.search(r"killed after (\d+) s", cell["error"])
                what = (f"< {int(batch) * new_tokens / int(m.group(1)):.2f} (not done in {m.group(1)} s: stopped)"
                        if m and not cell["oom_kills"] else f"failed: {cell['error'][:160]}")
                lines.append(f"| {batch} | {c} | {what} | | | | {cell['peak_bytes'] / MiB:.0f} | {cell['oom_kills']} | | |")
                continue
            same = cell.get("same_as_ram")
            lines.append(
                f"| {batch} | {c} | {_f(_median(runs, c, 'tokens_per_s'), '.2f')} | "
                f"{_f(_median(runs, c, 'decode_tokens_per_s'), '.2f')} | "
                f"{_f(_median(runs, c, 'roofline_fraction'), '.0%')} | {_f(_median(runs, c, 'ttft_s'), '.2f')} | "
                f"{_median(runs, c, 'peak_bytes') / MiB:.0f} | {max(x['cells'][c]['oom_kills'] for x in runs)} | "
                f"{_mib(_median(runs, c, 'read_bytes_per_step'))} | "
                f"{'-' if same is None else f'{same:.0%}'} |")
    lines += ["", *_targets(r)]
    src = {b: runs[0]["streamed_source"] for b, runs in r["batches"].items()}
    lines += ["", f"I/O roofline: batch x disk bandwidth / bytes energon streams per step ({', '.join(sorted(set(src.values())))}); "
              "the decode tokens/s are set against it (the prompts' step is left out of both)."]
    return "\n".join(lines)


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / MiB:.0f}"


def _targets(r: dict[str, Any]) -> list[str]:
    """The targets, each met or not, from the measured cells (a ratio met when its paired median meets it)."""
    out = ["**Targets** (ratios paired per repeat: the median, the repeats energon was faster, the range):"]
    cells = {int(b): runs for b, runs in r["batches"].items()}
    exact = [runs[0]["cells"][ENERGON].get("same_as_ram") for runs in cells.values() if ENERGON in runs[0]["cells"]]
    ref = next((x[0]["cells"][ENERGON].get("reference") for x in cells.values() if ENERGON in x[0]["cells"]), "-")
    out.append(f"- exact (greedy tokens equal to {ref}'s, share of the sequences): "
               f"{'met' if exact and all(e == 1.0 for e in exact) else 'NOT met'} ({exact})")
    roof = {b: _median(runs, ENERGON, "roofline_fraction") for b, runs in cells.items() if b >= 32}
    out.append(f"- >= {TARGETS['roofline']:.0%} of the I/O roofline at batch >= 32: "
               f"{'met' if roof and all((v or 0) >= TARGETS['roofline'] for v in roof.values()) else 'NOT met'} "
               "(" + ", ".join(f"{b}: {_f(v, '.0%')}" for b, v in roof.items()) + ")")
    if 32 in cells:
        p = _paired(cells[32], ENERGON, ACCEL)
        met = p is not None and float(p["median"]) >= TARGETS["vs_accelerate"]  # type: ignore[arg-type]
        out.append(f"- >= {TARGETS['vs_accelerate']:.0f}x accelerate's tokens/s at batch 32: "
                   f"{'met' if met else 'NOT met'} ({'-' if p is None else format_paired(p)})")
    vs = {b: _paired(runs, ENERGON, LLAMA) for b, runs in cells.items() if b >= 8}
    missing = [b for b, p in vs.items() if p is None]
    measured = {b: p for b, p in vs.items() if p is not None}
    if not measured:
        out.append("- >= llama.cpp at every batch >= 8: not measured in this run")
    else:
        ok = all(float(p["median"]) >= 1.0 for p in measured.values())  # type: ignore[arg-type]
        out.append(f"- >= llama.cpp at every batch >= 8: {'met' if ok else 'NOT met'} (" + ", ".join(
            f"{b}: {format_paired(p)}" for b, p in measured.items()) + ")"
            + (f"; llama.cpp not measured at batch {', '.join(map(str, missing))}" if missing else ""))
    kills = sum(runs_[0]["cells"][ENERGON]["oom_kills"] for runs_ in cells.values() if ENERGON in runs_[0]["cells"])
    out.append(f"- never killed by the limit: {'met' if kills == 0 else 'NOT met'} ({kills} OOM kills of energon)")
    return out


def plot(r: dict[str, Any]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    batches = sorted(int(b) for b in r["batches"])
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for c in (ENERGON, ACCEL, LLAMA, ENERGON_RAM):
        ys = [_median(r["batches"][str(b)], c, "tokens_per_s") for b in batches]
        if any(y is not None for y in ys):
            ax.plot(batches, [y if y is not None else float("nan") for y in ys], marker="o", label=c)
    roof = [r["batches"][str(b)][0]["cells"].get(ENERGON, {}).get("roofline_tokens_per_s") for b in batches]
    if any(roof):
        ax.plot(batches, [y or float("nan") for y in roof], "k--", label="I/O roofline (energon's stream)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = plot_path(NAME)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]
