"""The generated results: ``benchmarks/results/REPORT.md`` and the README's headline table are exactly what
``benchmarks/report.py`` makes of the committed JSON (so a figure cannot be edited or mis-attributed by hand), and
the staleness check behind the report's warnings (``benchmarks/staleness.py``) is right.

Whether results are fresh is not tested: a stale result is the report's warning (and the test run's summary line),
never a failure."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.report import TABLE_BEGIN, TABLE_END, headline_table, report_text, without_staleness

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
FIX = "regenerate it: `python -m benchmarks.report` (never edit REPORT.md or the README's results table by hand)"


def test_committed_report_is_what_the_generator_makes_of_the_committed_json():
    committed = (RESULTS / "REPORT.md").read_text()
    made = report_text(RESULTS, staleness=False)
    assert without_staleness(committed) == made, f"benchmarks/results/REPORT.md is not generated from the JSON; {FIX}"


def test_every_result_has_an_anchor_and_says_what_it_measured():
    text = report_text(RESULTS, staleness=False)
    for path in sorted(RESULTS.glob("*.json")):
        name = json.loads(path.read_text())["name"]
        assert f'<a id="{name}"></a>\n\n## ' in text, name
        header = text.split(f'<a id="{name}"></a>', 1)[1].split("\n\n")[2]
        assert header.startswith(f"_`{path.name}` — ") and ("measured at " in header or "not recorded" in header)


def test_readme_results_table_is_generated():
    text = README.read_text()
    if TABLE_BEGIN not in text:
        pytest.skip(f"README.md has no {TABLE_BEGIN} block yet")
    block = text.split(TABLE_BEGIN + "\n", 1)[1].split(TABLE_END, 1)[0]
    assert without_staleness(block) == headline_table(RESULTS, staleness=False), \
        f"README.md's results table is not generated from the JSON; {FIX}"


def test_a_table_row_links_to_its_report_section():
    table = headline_table(RESULTS, staleness=False)
    rows = [r for r in table.splitlines()[2:] if r.startswith("| ")]
    assert len(rows) >= 5
    for row in rows:
        name = re.search(r"\[(\w+)\]\(benchmarks/results/REPORT\.md#(\w+)\)", row)
        assert name and name.group(1) == name.group(2) and (RESULTS / f"{name.group(1)}.json").is_file(), row
        assert "not in this result" not in row, row


def _copy(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    out.mkdir()
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, out / path.name)
    return out


def test_a_changed_figure_changes_the_generated_text(tmp_path):
    """A value altered in a result's JSON shows in both generated texts: the committed files, compared with what
    the generator makes, would then differ (a figure cannot move between results or be edited unnoticed)."""
    results = _copy(tmp_path)
    before_report, before_table = report_text(results, staleness=False), headline_table(results, staleness=False)
    path = results / "energon_serve.json"
    data = json.loads(path.read_text())
    for run in data["results"]["runs"]["rate 16/s"]["energon"]:
        run["output_throughput"] *= 1.5
    assert "| rate 16/s |" in data["markdown"]
    data["markdown"] = data["markdown"].replace("| rate 16/s |", "| rate 16/s (edited) |", 1)
    path.write_text(json.dumps(data))
    after_table = headline_table(results, staleness=False)
    assert after_table != before_table
    row = next(r for r in after_table.splitlines() if "#energon_serve" in r)
    rounds = len(data["results"]["runs"]["rate 16/s"]["energon"])
    assert row not in before_table and f"{rounds}/{rounds} rounds" in row  # energon now wins every round
    assert report_text(results, staleness=False) != before_report


def test_report_and_table_follow_the_json_not_the_prose(tmp_path):
    """A section's prose comes from its JSON's markdown; the table's value from its numbers alone."""
    results = _copy(tmp_path)
    path = results / "sky_train.json"
    data = json.loads(path.read_text())
    data["markdown"] = "prose only"
    path.write_text(json.dumps(data))
    assert "prose only" in report_text(results, staleness=False)
    assert headline_table(results, staleness=False) == headline_table(RESULTS, staleness=False)


def test_update_readme_rewrites_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{TABLE_BEGIN}\n| old |\n{TABLE_END}\n\nafter\n")
    assert report.update_readme(readme, RESULTS)
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith(f"{TABLE_END}\n\nafter\n") and "| old |" not in text
    block = text.split(TABLE_BEGIN + "\n", 1)[1].split(TABLE_END, 1)[0]
    assert without_staleness(block) == headline_table(RESULTS, staleness=False)
    plain = tmp_path / "PLAIN.md"
    plain.write_text("# no markers\n")
    assert not report.update_readme(plain, RESULTS) and plain.read_text() == "# no markers\n"


def test_stale_warnings_are_the_only_volatile_part(tmp_path):
    """With staleness on, the report differs from the plain one only by its warning lines and table marks."""
    assert without_staleness(report_text(RESULTS)) == report_text(RESULTS, staleness=False)
    assert without_staleness(headline_table(RESULTS)) == headline_table(RESULTS, staleness=False)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_staleness_checker_flags_a_result_whose_measured_code_changed(tmp_path):
    """The checker itself, on a throwaway repository: current when nothing measured changed (even when other files
    did), stale naming the file and counting the commits once a measured one changes, and a missing commit or a
    dirty run is flagged."""
    from benchmarks.staleness import check_result, git_root

    assert git_root(tmp_path) is None or git_root(tmp_path) != tmp_path
    _git(tmp_path, "init", "-q")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "model.py").write_text("RATE = 1\n")
    (tmp_path / "core" / "other.py").write_text("X = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "code")
    sha = _git(tmp_path, "rev-parse", "HEAD")
    result = tmp_path / "demo.json"

    def record(**commit):
        result.write_text(json.dumps({"name": "demo", "commit": commit}))
        return check_result(result, tmp_path)

    fresh = record(sha=sha, dirty=False, paths=["core/model.py"])
    assert fresh.problem is None and fresh.commits == 0 and not fresh.stale
    (tmp_path / "core" / "other.py").write_text("X = 2\n")  # a file the result did not measure
    _git(tmp_path, "commit", "-qam", "unrelated")
    assert record(sha=sha, dirty=False, paths=["core/model.py"]).problem is None
    for rate in (2, 3):
        (tmp_path / "core" / "model.py").write_text(f"RATE = {rate}\n")
        _git(tmp_path, "commit", "-qam", "the measured code changes")
    verdict = record(sha=sha, dirty=False, paths=["core/model.py"])
    assert verdict.stale and "demo is stale" in verdict.problem and verdict.commits == 2
    assert "core/model.py" in verdict.problem and "make bench-report ONLY=demo" in verdict.problem
    assert "other.py" not in verdict.problem and verdict.changed == ("core/model.py",)
    assert "records no commit" in (record().problem or "")
    assert "uncommitted" in (record(sha=sha, dirty=True, paths=["core/model.py"]).problem or "")
    skipped = record(sha="0" * 40, dirty=False, paths=["core/model.py"])
    assert skipped.problem is None and skipped.skip and "not in this clone's history" in skipped.skip


def test_the_report_header_warns_with_the_commit_count(tmp_path):
    from benchmarks.report import _warning
    from benchmarks.staleness import Verdict

    stale = Verdict("demo", problem="demo is stale", sha="abc1234def", commits=3, changed=("core/x.py",))
    assert _warning(stale) == ("> **Stale:** 3 commits changed the code this measured since abc1234 "
                               "(rerun: `make bench-report ONLY=demo`)")
    assert _warning(Verdict("demo", sha="abc", commits=0)) is None
    assert _warning(None) is None
    assert without_staleness(f"a\n{_warning(stale)}\nb\n") == "a\nb\n"


def test_the_summary_line_counts_stale_results(tmp_path):
    """tests/conftest.py's end-of-run line: how many results are stale, never a failure."""
    from benchmarks.staleness import Verdict
    from tests.helpers.staleness import stale_summary

    verdicts = {"a": Verdict("a", problem="a is stale", commits=1, changed=("x",)), "b": Verdict("b", commits=0),
                "c": Verdict("c", skip="not in history")}
    assert stale_summary(verdicts) == "1 of 3 benchmark results are stale (a): see benchmarks/results/REPORT.md"
    assert stale_summary({"b": Verdict("b", commits=0)}) is None
