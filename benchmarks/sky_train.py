"""Real 2-process pipeline training with one slowed rank: even vs balanced partition, samples/s.

Two gloo processes (1 CPU thread each) train an 8-layer MLP (embedding, 6 residual blocks of width
768, head) with Lightning and ``SkyStrategy`` (1F1B, 4 microbatches of 16). Rank 1 plays a device
3x slower (``speed_factors=[1, 1/3]``): its stages sleep twice the compute they just did, so the
rank is busy exactly as long as a 3x slower device would be. Contenders alternate (even, balanced,
even, ...) inside the same processes; each repeat is a fresh ``Trainer.fit`` and reports the median
step time after two warm-up steps (the first step profiles and builds the schedules).
The limit: with perfect balance and free transfers, a 3x slower rank caps the pair at
(1 + 1/3) / 1 of one full-speed rank; the even split runs at the slow rank's pace.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import parser, plot_path, summarize, write_result

BATCH = 64


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    repeats = args.repeats or 5
    steps = 8 if args.quick else 16
    from sky_strategy.demo import train_side_by_side

    print(f"[sky_train] 2 ranks, rank 1 slowed 3x, {repeats} interleaved repeats of {steps} steps", file=sys.stderr,
          flush=True)
    res = train_side_by_side(slowdown=3.0, steps=steps, repeats=repeats, width=768, depth=6, batch=BATCH,
                             partitions=("even", "balanced", "parameter-balanced"))
    even, bal = res["even"], res["balanced"]
    ratios = [e / b for e, b in zip(even["step_s"], bal["step_s"])]
    rows = []
    from benchmarks.cost_model import spearman

    errors = {}
    for name, r in res.items():
        s = summarize(r["step_s"])
        errors[name] = r["predicted_step_s"] / s["median"] - 1
        rows.append(f"| {name}{' (ours)' if name == 'balanced' else ''} | {r['counts']} | {s['median'] * 1e3:.1f} "
                    f"[{s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}] | {BATCH / s['median']:.0f} | "
                    f"{r['predicted_step_s'] * 1e3:.1f} | {errors[name] * 100:+.0f}% |")
    names = list(res)
    rho = spearman([res[n]["predicted_step_s"] for n in names], [statistics.median(res[n]["step_s"]) for n in names])
    fastest = min(names, key=lambda n: statistics.median(res[n]["step_s"]))
    gap = statistics.median(bal["step_s"]) / statistics.median(res[fastest]["step_s"]) - 1
    markdown = "\n".join([
        f"Headline: balanced partition trains at **{statistics.median(ratios):.2f}x** the samples/s of the even split "
        f"(median of {repeats} interleaved repeats, range {min(ratios):.2f}-{max(ratios):.2f}x) with rank 1 slowed 3x.",
        "", "| partition | layers per rank | step ms median [min-max] | samples/s | planner's predicted ms | error |",
        "|---|---|---|---|---|---|", *rows, "",
        f"Predicted vs measured (Sky's cost model: measured per-layer seconds x one speed per rank, bandwidth-only "
        f"links): Spearman rank correlation {rho:.2f} over {len(names)} partitions; the planner's pick (balanced) is "
        f"{gap * 100:+.1f}% from the measured-fastest ({fastest}); worst step-time error "
        f"{max(abs(e) for e in errors.values()) * 100:.0f}%."])
    plots = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(["even", "balanced"], [BATCH / statistics.median(even["step_s"]), BATCH / statistics.median(bal["step_s"])])
        ax.set_ylabel("samples/s")
        ax.set_title("2 ranks, rank 1 slowed 3x")
        fig.tight_layout()
        path = plot_path("sky_train")
        fig.savefig(path)
        plots.append(path)
    except ImportError:
        pass
    print(markdown)
    write_result("sky_train", title="Sky: 2-process training with a 3x slower rank (even vs balanced)",
                 params={"batch": BATCH, "steps": steps, "repeats": repeats, "slowdown": 3.0, "width": 768, "depth": 6,
                         "schedule": "1f1b", "microbatches": 4},
                 results={**res, "ratios": ratios, "errors": errors, "spearman": rho, "fastest": fastest,
                          "pick_gap": gap}, markdown=markdown, plots=plots)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
