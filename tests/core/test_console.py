"""What the command shows: plots, progress without a terminal, tables and text fitted to the width, ratios."""

from __future__ import annotations

import logging

import pytest

from tightfit.cli import main
from tightfit.console import Progress, fit_text, setup_logging
from tightfit.units import format_ratio, format_table

PNG = b"\x89PNG\r\n\x1a\n"


def test_profile_model_plot(tmp_path, capsys):
    out = tmp_path / "memory.png"
    assert main(["profile", "model", "--model", "gpt2-tiny", "--batch", "2", "--quiet", "--checkpointing",
                 "blocks.0", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 20_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_plan_elixir_plot(tmp_path, capsys):
    out = tmp_path / "plan.svg"
    assert main(["-q", "plan", "elixir", "--model", "gpt2-tiny", "--batch", "2", "--seq", "64", "--devices", "2",
                 "--preset", "a100-40g", "--plot", str(out)]) == 0
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "Elixir plan for" in svg and "predicted ms" in svg
    assert f"wrote {out}" in capsys.readouterr().out


def test_progress_without_a_terminal_logs_a_line_per_stage(capsys):
    setup_logging(0)
    report = Progress("plan", tty=False, every_s=3600)
    for i, what in enumerate(["greedy descent"] * 3 + ["refining"] * 2 + ["done"], 1):
        report(i, 6, what)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.strip().splitlines()
    assert [ln.split("] ", 1)[1].split(" (")[0] for ln in lines] == ["greedy descent", "refining", "done"]
    setup_logging(-1)
    report = Progress("plan", tty=False)
    report(1, 2, "quiet")
    assert capsys.readouterr().err == ""
    setup_logging(0)
    assert logging.getLogger("tightfit").level == logging.INFO


def test_tables_and_text_fit_the_width():
    rows = [("elixir", "64.1 s", "60 steps on 2 processes, loss 5.56 -> 2.97; plan 9 units (7 offloaded, 5 resharded, "
             "2 blocks recomputed); checkpoint kept at runs/elixir_demo/last.ckpt")]
    table = format_table(rows, ("plugin", "time", "what it showed"), max_width=80)
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "runs/elixir_demo/last.ckpt" in table and len(table.splitlines()) > 3
    assert format_table(rows, ("plugin", "time", "what it showed")).count("\n") == 2  # no width: one line per row
    text = fit_text("peak memory: " + "state 1.00 GiB + " * 12 + "= 12 GiB\nshort row", width=100)
    assert max(len(line) for line in text.splitlines()) <= 100 and text.endswith("short row")


@pytest.mark.parametrize("ratios, expected", [
    ([1.4, 1.6, 1.5], "1.50x the samples/s (median of 3 interleaved repeats, 1.40-1.60x)"),
    ([0.9, 1.5, 1.2], "inconclusive on a busy machine (3 interleaved repeats span 0.90-1.50x)"),
    ([0.8, 0.9, 0.85], "0.85x the samples/s (median of 3 interleaved repeats, 0.80-0.90x)"),
    ([1.2, 1.4], "1.30x the samples/s (median of 2 interleaved repeats, 1.20-1.40x)"),
])
def test_format_ratio(ratios, expected):
    assert format_ratio(ratios, "the samples/s") == expected


_SAY = ("import logging, sys\n{setup}\nfrom tightfit.console import reporter\n"
        "reporter(logging.getLogger('tightfit.profiler.x'), 'profile_x')('step 1/2')\n"
        "reporter(logging.getLogger('tightfit.profiler.x'), 'profile_x', enabled=False)('never')\n")


@pytest.mark.parametrize(("setup", "expected"), [
    ("", "[profile_x] step 1/2\n"),  # nothing configured: asking for progress shows it, plainly
    ("logging.basicConfig(level=logging.WARNING)", ""),  # the application keeps warnings only: it is not shown
    ("logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s %(message)s')",
     "INFO tightfit.profiler.x [profile_x] step 1/2\n"),  # the application's format
], ids=["unconfigured", "application-keeps-warnings", "application-format"])
def test_library_progress_is_logging_that_shows_when_nothing_is_configured(setup, expected):
    """core's progress lines (profile_model/profile_device/time_blocks/calibrate_device with progress=True) are
    log records, not prints: an application's logging configuration decides, and without one they still show."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SAY.format(setup=setup)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == expected and proc.stdout == ""


def test_no_diagnostic_prints_to_stderr_in_core():
    """Diagnostics in core/ go through logging; only the CLI's own output (core/commands, cli.py) and the terminal
    layer (console.py: the tqdm bar on a terminal) write to stderr."""
    import re
    from pathlib import Path

    core = Path(__file__).resolve().parents[2] / "core"
    offenders = [f"{p.relative_to(core.parent)}:{i}" for p in core.rglob("*.py")
                 if p.parent.name != "commands" and p.name not in ("cli.py", "console.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"file=sys\.stderr|sys\.stderr\.write", line) and not line.lstrip().startswith("#")]
    assert not offenders, f"print to stderr instead of logging: {offenders}"
