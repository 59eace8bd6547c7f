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
