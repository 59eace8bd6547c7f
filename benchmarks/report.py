"""Stitch ``benchmarks/results/*.json`` into ``benchmarks/results/REPORT.md`` with their plots."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import RESULTS


def _measured(data: dict) -> str:
    """Which commit a section measured, as the report prints it."""
    commit = data.get("commit")
    if not isinstance(commit, dict) or not commit.get("sha"):
        return "commit not recorded (measured before results recorded their commit)"
    note = " with uncommitted changes to the measured code" if commit.get("dirty") else ""
    load = data.get("load_average")
    busy = f", load {load[0]:.1f}" if isinstance(load, list) and load else ""
    return f"measured at {str(commit['sha'])[:10]}{note}{busy}"


def write_report(results_dir: Path = RESULTS) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        m = data.get("machine", {})
        machine = f"{m.get('platform', '?')}, {m.get('cpu_count', '?')} CPUs, torch {m.get('torch', '?')}, {m.get('date', '?')}"
        body = [f"## {data.get('title', data['name'])}", "", f"_`{path.name}` — {machine}; {_measured(data)}_", "",
                data.get("markdown", "")]
        for plot in data.get("plots", []):
            body += ["", f"![{plot}]({plot})"]
        sections.append("\n".join(body))
    text = "# tightfit benchmark report\n\nRatios measured side by side, interleaved, on the same machine " \
           "(see ../shared/BENCHMARKS.md). Regenerate with `make bench`.\n\n"
    text += "\n\n".join(sections) if sections else "No benchmark results yet.\n"
    out = results_dir / "REPORT.md"
    out.write_text(text + "\n")
    return out


if __name__ == "__main__":
    print(write_report())
