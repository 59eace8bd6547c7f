"""The README and the docs run as written: every Python block executes, every `tightfit` command parses, the
outputs shown are what the commands print, no measured figure stands in their prose (measured figures live in
``benchmarks/results/REPORT.md``), the README stays a short front page, and the docs site builds strictly.

A section's Python blocks run here, in one namespace, unless the section is in ``ELSEWHERE`` (a block that needs a
model directory, spawns processes or runs as a script): then the named test reads the block from the page and
runs it, and this file checks the named test really names that page and section.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.docs import PAGES, ROOT, blocks, page_text, prose_figures, sections, strip_generated

# (page, section heading prefix) -> the test that runs that section's Python block(s) as written.
ELSEWHERE: dict[tuple[str, str], str] = {
    ("README.md", "EnergonAI: serve a model"): "tests/energon_infer/test_readme_example.py",
    ("README.md", "Sky: pipelines balanced"): "tests/sky_strategy/test_readme_example.py",
    ("docs/elixir.md", 'Train a model with `strategy="elixir"`'): "tests/lightning_elixir/test_docs_examples.py",
    ("docs/elixir.md", "State on disk"): "tests/lightning_elixir/test_docs_examples.py",
    ("docs/elixir.md", 'Or write the loop: `Fabric(strategy="elixir")`'): "tests/lightning_elixir/test_docs_examples.py",
    ("docs/energon.md", "Generate in your process"): "tests/energon_infer/test_readme.py",
    ("docs/energon.md", "Serve from one controller"): "tests/energon_infer/test_engine_readme.py",
    ("docs/serving.md", "Call it with the OpenAI client"): "tests/energon_infer/test_server_openai.py",
    ("docs/serving.md", "The time account"): "tests/energon_infer/test_serving_account.py",
    ("docs/serving.md", "Tool calls"): "tests/energon_infer/test_tool_calls.py",
    ("docs/serving.md", "Structured outputs"): "tests/energon_infer/test_structured_outputs.py",
    ("docs/energon-memory.md", "Serving a model larger than memory"): "tests/energon_infer/test_disk_pool.py",
    ("docs/energon-memory.md", "Quantized weights beyond memory"): "tests/energon_infer/test_quantized_pool.py",
}


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _elsewhere(page: str, heading: str) -> tuple[str, str] | None:
    """The ELSEWHERE key (page, heading prefix) that covers this section, if any."""
    return next((key for key in ELSEWHERE if key[0] == page and heading.startswith(key[1])), None)


def _python_sections() -> list[tuple[str, str, list[str]]]:
    """(page, heading, its python blocks) for every section of every page that has any."""
    found = []
    for page in PAGES:
        for heading, body in sections(page_text(page)):
            code = blocks(body, "python")
            if code:
                found.append((_rel(page), heading, code))
    return found


def _run_here() -> list[tuple[str, str, list[str]]]:
    return [(p, h, code) for p, h, code in _python_sections() if _elsewhere(p, h) is None]


def test_every_python_block_is_run_by_some_test():
    live = {key for page, heading, _ in _python_sections() if (key := _elsewhere(page, heading)) is not None}
    for page, prefix in live:  # the named test must really read this section of this page
        test = ELSEWHERE[(page, prefix)]
        text = (ROOT / test).read_text()
        assert page in text and prefix in text, f"{test} does not read {page}, section {prefix!r}"
    assert live == set(ELSEWHERE), f"ELSEWHERE entries that match no section any more: {set(ELSEWHERE) - live}"


# Extra checks on what particular sections leave behind, beyond running without an error.
def _check_elixir_plan(ns: dict, cwd: Path) -> None:
    assert (cwd / "plan.json").is_file() and ns["plan"].world_size == 4


def _check_cache_disk(ns: dict, cwd: Path) -> None:  # the disk-tier snippet trained through the disk and host level
    assert ns["d"]["rows_read"] > 0 and ns["d"]["host_hits"] > 0, ns["d"]


def _check_readme_cache(ns: dict, cwd: Path) -> None:
    assert ns["ebc"].disk_stats()["rows_read"] > 0 and 0 < ns["ebc"].cache_stats()["hit_rate"] < 1


def _check_readme_elixir(ns: dict, cwd: Path) -> None:
    assert (cwd / "lightning_logs").is_dir()  # the Trainer ran in this directory


def _check_sky_net(ns: dict, cwd: Path) -> None:
    import torch

    net = ns["Net"]()
    assert net.loss_fn(net(torch.randn(4, 16)), torch.tensor([0, 1, 2, 3])).ndim == 0
    assert ns["trainer"].strategy.__class__.__name__ == "SkyStrategy"


CHECKS = {
    ("docs/elixir-planning.md", "The planner from Python"): _check_elixir_plan,
    ("docs/embedding-cache.md", "The disk tier"): _check_cache_disk,
    ("README.md", "Embedding cache"): _check_readme_cache,
    ("README.md", "Elixir"): _check_readme_elixir,
    ("docs/sky.md", "Quick start"): _check_sky_net,
}


@pytest.mark.parametrize(("page", "heading", "code"), [pytest.param(p, h, c, id=f"{p}-{h}") for p, h, c in _run_here()])
def test_python_blocks_run_as_written(page, heading, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the snippets write (plan.json, logs) land here
    monkeypatch.setenv("TIGHTFIT_README_MODEL", "gpt2")  # the pages say so: a large preset as written, smaller here
    namespace: dict = {"__name__": "docs"}
    for block in code:  # a section's blocks share one namespace, as a reader's session would
        exec(compile(block, f"{page}: {heading}", "exec"), namespace)
    for (p, prefix), check in CHECKS.items():
        if p == page and heading.startswith(prefix):
            check(namespace, tmp_path)


def test_every_extra_check_names_a_section_run_here():
    here = {(p, h) for p, h, _ in _run_here()}
    stale = [key for key in CHECKS if not any(p == key[0] and h.startswith(key[1]) for p, h in here)]
    assert not stale, f"CHECKS entries that match no section run here: {stale}"


def _commands() -> list[tuple[str, str]]:
    """(page, command) for every `tightfit ...` line of a console or bash block (continuation lines joined)."""
    found = []
    for page in PAGES:
        for lang in ("console", "bash"):
            for code in blocks(page_text(page), lang):
                for line in code.replace("\\\n", " ").splitlines():
                    line = line.strip().removeprefix("$ ").strip()
                    if line.startswith("tightfit "):
                        found.append((_rel(page), line))
    return found


@pytest.mark.parametrize(("page", "command"), _commands())
def test_commands_parse(page, command):
    from tightfit.cli import build_parser

    argv = shlex.split(command, comments=True)[1:]
    if argv[0] == "serve":
        from energon_infer.serving.serve import build_parser as serve_parser

        serve_parser().parse_args(argv[1:])
        return
    if argv[:2] == ["plan", "serve"]:
        from energon_infer.serving.plan_serve import build_parser as plan_serve_parser

        plan_serve_parser().parse_args(argv[2:])
        return
    build_parser().parse_args(argv)  # raises UsageError with the reason if the page drifted from the CLI


def test_the_pages_show_commands():
    assert len(_commands()) >= 10, "the pages show almost no `tightfit` command: is the block parser broken?"


# Console blocks whose shown output is compared with what the command prints (deterministic outputs only).
SHOWN = ("tightfit plan elixir", "tightfit profile model")
# Lines that carry a wall-clock measurement, which differs from run to run.
_TIMING = re.compile(r"priced in [0-9.]+ s|done in [0-9.]+ s")


def _shown() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in PAGES:
        for code in blocks(page_text(page), "console"):
            lines = code.splitlines()
            if lines and any(lines[0].startswith(f"$ {prefix}") for prefix in SHOWN) and len(lines) > 1:
                found.append((_rel(page), lines[0][2:], lines[1:]))
    return found


def test_every_shown_command_is_on_some_page():
    shown = {next(p for p in SHOWN if cmd.startswith(p)) for _, cmd, _ in _shown()}
    assert shown == set(SHOWN), f"no page shows the output of {set(SHOWN) - shown}"


@pytest.mark.parametrize(("page", "command", "shown"), _shown())
def test_shown_outputs_are_what_the_commands_print(page, command, shown, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tightfit.cli", *shlex.split(command)[1:]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr[-3000:]
    printed = [ln.rstrip() for ln in out.stdout.splitlines()]
    missing = [ln for ln in shown if ln.strip() and ln != "..." and not _TIMING.search(ln)
               and ln.rstrip() not in printed]
    assert not missing, f"{page}: lines the command no longer prints:\n" + "\n".join(missing)


# Numbers in prose that look measured but are not: (page, text of the finding as prose_figures gives it; why).
NOT_MEASURED: list[tuple[str, str, str]] = []


@pytest.mark.parametrize("page", [_rel(p) for p in PAGES])
def test_no_measured_figure_in_the_prose(page):
    """Measured figures live in benchmarks/results/REPORT.md (and the README's generated table): a page links to
    the report's section instead of quoting its numbers, so no number can go stale or be mis-attributed."""
    found = [f for f in prose_figures(page) if not any(page == p and what in f for p, what, _ in NOT_MEASURED)]
    assert not found, (f"{page} states measured-looking figures in its prose (link to the report section, "
                       "`benchmarks/results/REPORT.md#NAME`, instead; a setting goes in a code span):\n"
                       + "\n".join(found))


def test_not_measured_list_is_current():
    stale = [entry for entry in NOT_MEASURED if not any(entry[1] in f for f in prose_figures(entry[0]))]
    assert not stale, f"NOT_MEASURED entries that match no figure any more (remove them): {stale}"


def test_the_figure_check_finds_figures():
    """The check above is not vacuous: the prose of a page that quotes a measurement is flagged, the same numbers in
    a code span or a generated block are not."""
    from tests.helpers.figures import figures

    prose = "## Speed\n\nThe engine serves 1.02x vLLM's tokens/s at 16 req/s, TTFT 34 ms.\n"
    assert [f.text for f in figures(prose, set())] == ["1.02x", "34 ms"]
    assert figures("## Speed\n\nRun with `--budget 1.5GiB` and `0.84x`.\n", set()) == []
    generated = "<!-- generated: t -->\n| a | 1.02x |\n<!-- end generated: t -->\n"
    assert figures(strip_generated(generated), set()) == []


README_LINES = 200
EXAMPLE_BY_LINE = 120
EXAMPLE_LINES = 15
PLUGINS = ("lightning_elixir", "energon_infer", "torchrec_cache", "sky_strategy")


def test_readme_is_a_short_front_page():
    text = page_text("README.md")
    assert len(text.splitlines()) <= README_LINES, f"README.md is {len(text.splitlines())} lines (at most {README_LINES})"
    for plugin in PLUGINS:  # a runnable example of each plugin, starting within the first lines
        found = [(text[:m.start()].count("\n") + 1, m.group(1))
                 for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
                 if re.search(rf"\b{plugin}\b", m.group(1))]
        assert found and found[0][0] <= EXAMPLE_BY_LINE, \
            f"no Python example using {plugin} starts within the README's first {EXAMPLE_BY_LINE} lines"
        size = sum(1 for ln in found[0][1].splitlines() if ln.strip())
        assert size <= EXAMPLE_LINES, f"the README's {plugin} example is {size} lines (at most {EXAMPLE_LINES})"


def test_readme_results_table_is_generated():
    text = page_text("README.md")
    assert "<!-- generated: results-table -->" in text and "<!-- end generated: results-table -->" in text


def test_docs_site_builds_strictly(tmp_path):
    """`make docs`: mkdocs --strict fails on a broken link, a page missing from the nav or an unresolved API name."""
    pytest.importorskip("mkdocs")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert (tmp_path / "site" / "results" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "energon_infer" / "index.html").is_file()
