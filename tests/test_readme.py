"""The README runs as written: its Python blocks execute, its commands parse, the outputs it shows are what the
commands print, and every ratio it quotes is in the committed benchmark report (benchmarks/results/*.json).

Blocks that need a model directory or spawn processes are run by their plugin's own test (listed in
``ELSEWHERE``); this file checks that list is complete, so a new block cannot go untested.
"""

from __future__ import annotations

import json
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
        from energon_infer.serve import build_parser as serve_parser

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


def test_ratios_in_the_prose_are_in_the_benchmark_report():
    report = "\n".join(json.loads(p.read_text()).get("markdown", "")
                       for p in sorted((ROOT / "benchmarks" / "results").glob("*.json")))
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    ratios = set(re.findall(r"\b(\d+\.\d+x)\b", prose))
    assert ratios, "the README quotes no measured ratio?"
    missing = sorted(r for r in ratios if r not in report)
    assert not missing, f"README ratios not found in benchmarks/results/*.json: {missing}"
