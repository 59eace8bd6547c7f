"""Is a committed benchmark result still about the code in the checkout? The check lives in
``benchmarks/staleness.py`` (the report prints its warnings); this module re-exports it for the tests and words the
test run's one summary line (``tests/conftest.py``). Staleness is a warning, never a test failure."""

from __future__ import annotations

from pathlib import Path

from benchmarks.staleness import Verdict, check_all, check_result, git_root

__all__ = ["Verdict", "check_all", "check_result", "git_root", "stale_summary", "summary_for_checkout"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def stale_summary(verdicts: dict[str, Verdict]) -> str | None:
    """``"N of M benchmark results are stale (names): see benchmarks/results/REPORT.md"``, or None when none is."""
    stale = sorted(name for name, v in verdicts.items() if v.stale)
    if not stale:
        return None
    return (f"{len(stale)} of {len(verdicts)} benchmark results are stale ({', '.join(stale)}): "
            "see benchmarks/results/REPORT.md")


def summary_for_checkout() -> str | None:
    """The summary line for this checkout's committed results (None outside a git work tree or when all are
    current)."""
    repo = git_root(ROOT)
    if repo is None or repo.resolve() != ROOT.resolve():
        return None
    return stale_summary(check_all(RESULTS, repo))
