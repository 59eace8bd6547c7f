"""The README runs as written: its Python blocks execute, its commands parse, the outputs it shows are what the
commands print, and every measured figure it quotes (ratios, %, times, sizes, rates) is backed by the committed
benchmark report (benchmarks/results/*.json), through tests/helpers/figures.py.

Blocks that need a model directory or spawn processes are run by their plugin's own test (listed in
``ELSEWHERE``); this file checks that list is complete, so a new block cannot go untested.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# README section heading (prefix) -> the test that runs that section's Python block(s) as written.
ELSEWHERE = {
    "### Elixir training": "tests/lightning_elixir/test_readme.py",
    "### EnergonAI inference runtime": "tests/energon_infer/test_readme.py",
    "### EnergonAI serving": "tests/energon_infer/test_engine_readme.py",
    "### Serving beyond memory": "tests/energon_infer/test_disk_pool.py",
    "### Quantized weights beyond memory": "tests/energon_infer/test_quantized_pool.py",
}


def _sections() -> list[tuple[str, str]]:
    """(heading, body) for every ## / ### heading, in order."""
    parts = re.split(r"^(#{2,3} .*)$", README, flags=re.M)
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(section heading, code) for every fenced block of this language."""
    out = []
    for heading, body in _sections():
        for code in re.findall(rf"^```{lang}\n(.*?)^```", body, flags=re.S | re.M):
            out.append((heading, code))
    return out


def _elsewhere(heading: str) -> str | None:
    return next((test for prefix, test in ELSEWHERE.items() if heading.startswith(prefix)), None)


def _run_here() -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for heading, code in _blocks("python"):
        if _elsewhere(heading) is None:
            grouped.setdefault(heading, []).append(code)
    return grouped


def test_every_python_block_is_run_by_some_test():
    for heading, _ in _blocks("python"):
        for prefix, test in ELSEWHERE.items():
            if heading.startswith(prefix):  # that test must really read this section of the README
                text = (ROOT / test).read_text()
                assert "README" in text and prefix in text, (heading, test)
    assert set(_run_here()) >= {"## Profiling", "### Elixir planning (`tightfit plan elixir`)"}


@pytest.mark.parametrize("heading", sorted(_run_here()))
def test_python_blocks_run_as_written(heading, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the snippets write (plan.json) land here
    monkeypatch.setenv("TIGHTFIT_README_MODEL", "gpt2")  # the README says so: gpt2-xl as written, smaller here
    namespace: dict = {"__name__": "readme"}
    for code in _run_here()[heading]:  # a section's blocks share one namespace, as a reader's session would
        exec(compile(code, f"README.md: {heading}", "exec"), namespace)
    if heading.startswith("### Elixir planning"):
        assert (tmp_path / "plan.json").is_file() and namespace["plan"].world_size == 4
    if heading.startswith("### Embedding cache"):  # the disk-tier snippet trained through the disk and host level
        assert namespace["d"]["rows_read"] > 0 and namespace["d"]["host_hits"] > 0, namespace["d"]
    if heading.startswith("### Sky"):
        import torch

        net = namespace["Net"]()
        assert net.loss_fn(net(torch.randn(4, 16)), torch.tensor([0, 1, 2, 3])).ndim == 0
        assert namespace["trainer"].strategy.__class__.__name__ == "SkyStrategy"


def _commands() -> list[str]:
    """Every `tightfit ...` command in a console or bash block (continuation lines joined)."""
    found = []
    for lang in ("console", "bash"):
        for _, code in _blocks(lang):
            code = code.replace("\\\n", " ")
            for line in code.splitlines():
                line = line.strip().removeprefix("$ ").strip()
                if line.startswith("tightfit ") or line.startswith("tightfit\t"):
                    found.append(line)
    return found


@pytest.mark.parametrize("command", _commands())
def test_commands_parse(command):
    from tightfit.cli import build_parser

    argv = shlex.split(command, comments=True)[1:]
    if argv[0] == "serve":
        from energon_infer.serving.serve import build_parser as serve_parser

        serve_parser().parse_args(argv[1:])
        return
    build_parser().parse_args(argv)  # raises UsageError with the reason if the README drifted from the CLI


def _shown_output(command_prefix: str) -> tuple[str, list[str]]:
    for _, code in _blocks("console"):
        lines = code.splitlines()
        if lines and lines[0].startswith(f"$ {command_prefix}"):
            return lines[0][2:], lines[1:]
    raise AssertionError(f"no console block starts with $ {command_prefix}")


# Lines that carry a wall-clock measurement, which differs from run to run.
_TIMING = re.compile(r"priced in [0-9.]+ s|done in [0-9.]+ s")


@pytest.mark.parametrize("prefix", ["tightfit plan elixir", "tightfit profile model"])
def test_shown_outputs_are_what_the_commands_print(prefix, tmp_path):
    command, shown = _shown_output(prefix)
    out = subprocess.run([sys.executable, "-m", "tightfit.cli", *shlex.split(command)[1:]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr[-3000:]
    printed = [ln.rstrip() for ln in out.stdout.splitlines()]
    missing = [ln for ln in shown if ln.strip() and ln != "..." and not _TIMING.search(ln)
               and ln.rstrip() not in printed]
    assert not missing, "README lines the command no longer prints:\n" + "\n".join(missing)


# Numbers of the prose that are settings, budgets or facts rather than measurements: (figure as written, a few
# words of its paragraph that pin the place, line breaks read as spaces; why it is not in the report). Keep it short; a stale entry fails below.
NOT_MEASURED = [
    ("0.3x", "target 0.3x", "issue 34's target for int4's weight bytes"),
    ("1.5x", "its target (1.5x fp32)", "issue 34's target for int4 decode at batch 1"),
    ("95%", "(target 95%)", "issue 34's target for greedy agreement"),
    ("10%", "the bound is 10%", "the tolerance tests/core/test_profiler_model.py asserts"),
    ("40 GiB", "4 A100s of 40 GiB", "the device size of the paper's setting, a configuration"),
    ("25%", "beyond 25% they warn", "the strategies' warning threshold for predicted vs measured step time"),
    ("40 GiB", "under 24 / 40 GiB", "the GPU benchmark's device sizes (benchmarks/gpu/elixir.py), a configuration"),
    ("0.01", "between 0.01 and 100", "the server's temperature floor, a setting"),
    ("33.8M", "Criteo Kaggle's 33.8M rows", "the size of a public data set"),
    ("2.2 GB", "~2.2 GB at dim 16", "33.8M rows x 16 x 4 bytes: arithmetic on the data set's size"),
    ("10 minutes", "protocol's 10 minutes", "the benchmark protocol's time budget (BENCHMARKS.md)"),
    ("5–6 minutes", "about 5–6 minutes", "an estimate said to be one; benchmarks/run.py now records each benchmark's "
     "time in results/suite.json, so after the next `make bench-report` check it against suite.json instead"),
    ("200 s", "for up to 200 s", "the GPU check's time budget for tests (scripts/gpu_check.sh)"),
    ("250 s", "for up to 250 s", "the GPU check's time budget for benchmarks (scripts/gpu_check.sh)"),
    ("8 minutes", "about 8 minutes in all", "the GPU check's total budget (scripts/gpu_check.sh)"),
    ("1.3x", "weights alone are 1.3x the limit", "the table size tests/torchrec_cache/test_disk_memory.py sets"),
    ("6%", "under bf16 one smaller than ~6%", "8 ulps of bf16 (8 x 2^-7): arithmetic on the dtype, not a measurement"),
]


def _figures():
    from tests.helpers.figures import figures, load_reports

    pools = load_reports(ROOT / "benchmarks" / "results")
    return figures(README, set(pools)), pools


def _allowed(fig) -> bool:
    return any(fig.text == text and where in fig.paragraph for text, where, _ in NOT_MEASURED)


def test_numbers_in_the_prose_are_in_the_benchmark_report():
    """Every measured figure outside code (ratios, %, ms, s, MiB, tokens/s, decimals, "a vs b", table cells)
    is backed by the committed report of the benchmark its paragraph names (tests/helpers/figures.py)."""
    from tests.helpers.figures import unmatched

    figs, pools = _figures()
    assert sum(f.unit == "x" for f in figs) >= 10, "the README quotes almost no measured ratio: is the parser broken?"
    missing = [f for f in unmatched(figs, pools) if not _allowed(f)]
    assert not missing, (
        "README figures not backed by benchmarks/results/*.json (update the figure from the report, name the "
        "benchmark it comes from in its paragraph, or, for a setting rather than a measurement, put it in a code "
        "span or NOT_MEASURED in tests/test_readme.py):\n" + "\n".join(f.where() for f in missing))


def test_not_measured_list_is_current():
    figs, _ = _figures()
    stale = [entry for entry in NOT_MEASURED
             if not any(f.text == entry[0] and entry[1] in f.paragraph for f in figs)]
    assert not stale, f"NOT_MEASURED entries that match no README figure any more (remove them): {stale}"


def test_figure_checker_catches_drift():
    """The checker itself: a figure that is in the report passes, the same figure changed fails, a setting in
    code is not a figure, and the source a paragraph names is the one it is checked against."""
    from tests.helpers.figures import Pool, figures, unmatched

    pools = {"demo_bench": Pool(entries=((1.48, "x"), (5561.0, None), (82.8, "MiB"), (0.86, None))),
             "other": Pool(entries=((2.0, "x"),))}
    text = ("## Demo\n\nMeasured (`python -m benchmarks.demo_bench --quick`): 1.48x, p99 5.6 s, 83 MiB, "
            "rank correlation 0.86; run with `--devices 4 --budget 24GiB`.\n\nIts spread: 2.0x.\n\n"
            "| a | b |\n|---|---|\n| 0.86 | 5561 |\n")
    figs = figures(text, set(pools))
    assert [f.text for f in figs] == ["1.48x", "5.6 s", "83 MiB", "0.86", "2.0x", "0.86", "5561"]
    assert all(f.sources == ("demo_bench",) for f in figs)  # the second paragraph inherits the first's source
    assert [f.text for f in unmatched(figs, pools)] == ["2.0x"]  # 2.0x is only in the other benchmark
    drifted = figures(text.replace("1.48x", "1.52x").replace("5.6 s", "4.1 s").replace("83 MiB", "90 MiB"),
                      set(pools))
    assert [f.text for f in unmatched(drifted, pools)] == ["1.52x", "4.1 s", "90 MiB", "2.0x"]
    assert "README.md:3 [Demo] '1.52x'" in unmatched(drifted, pools)[0].where()


def test_every_report_section_measured_the_code_in_this_checkout():
    """Every section of the committed report (the README's figures are checked against any of them) records the
    commit it measured, measured committed code, and none of the files it measured changed since: otherwise its
    figures describe code that is no longer here (tests/helpers/staleness.py)."""
    from tests.helpers.staleness import check_result, git_root

    repo = git_root(ROOT)
    if repo is None or repo.resolve() != ROOT.resolve():
        pytest.skip(f"{ROOT} is not a git checkout: cannot tell which code the results measured")
    verdicts = [check_result(p, ROOT) for p in sorted((ROOT / "benchmarks" / "results").glob("*.json"))]
    problems = [v.problem for v in verdicts if v.problem]
    assert not problems, "benchmark results that no longer describe this checkout:\n" + "\n".join(problems)
    skipped = [v.skip for v in verdicts if v.skip]
    if skipped:
        pytest.skip("; ".join(skipped))


def test_staleness_checker_flags_a_result_whose_measured_code_changed(tmp_path):
    """The checker itself, on a throwaway repository: current when nothing measured changed (even when other files
    did), stale naming the file once a measured one changes, and a missing commit or a dirty run is flagged."""
    import json

    from tests.helpers.staleness import check_result, git_root

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert git_root(tmp_path) is None or git_root(tmp_path) != tmp_path
    git("init", "-q")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "model.py").write_text("RATE = 1\n")
    (tmp_path / "core" / "other.py").write_text("X = 1\n")
    git("add", ".")
    git("commit", "-qm", "code")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    result = tmp_path / "demo.json"

    def record(**commit):
        result.write_text(json.dumps({"name": "demo", "commit": commit}))
        return check_result(result, tmp_path)

    assert record(sha=sha, dirty=False, paths=["core/model.py"]).problem is None
    (tmp_path / "core" / "other.py").write_text("X = 2\n")  # a file the result did not measure
    git("commit", "-qam", "unrelated")
    assert record(sha=sha, dirty=False, paths=["core/model.py"]).problem is None
    (tmp_path / "core" / "model.py").write_text("RATE = 2\n")
    git("commit", "-qam", "the measured code changes")
    verdict = record(sha=sha, dirty=False, paths=["core/model.py"])
    assert verdict.problem is not None and "demo is stale" in verdict.problem
    assert "core/model.py" in verdict.problem and "make bench-report ONLY=demo" in verdict.problem
    assert "other.py" not in verdict.problem
    assert "records no commit" in (record().problem or "")
    assert "uncommitted" in (record(sha=sha, dirty=True, paths=["core/model.py"]).problem or "")
    skipped = record(sha="0" * 40, dirty=False, paths=["core/model.py"])
    assert skipped.problem is None and skipped.skip and "not in this clone's history" in skipped.skip
