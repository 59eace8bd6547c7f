"""Is a committed benchmark result still about the code in the checkout?

Each ``benchmarks/results/<name>.json`` records ``commit``: the sha it measured, whether the measured paths were
dirty, and those paths (:func:`benchmarks.common.write_result`: the project files the benchmark imported and the
child scripts it names). A result is *stale* when ``git diff --name-only <sha> HEAD -- <paths>`` lists a file: the
code it measured changed since, so its figures may no longer hold. How many commits changed it is
``git rev-list --count <sha>..HEAD -- <paths>``.

Staleness is a warning, never a failure: the report prints it in the section's header
(:mod:`benchmarks.report`) and the test run says once how many results are stale (``tests/conftest.py``).
Standard library only.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Verdict", "check_result", "check_all", "git_root", "rerun_hint"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one result JSON says about the checkout.

    Args:
        name: the result's name (its JSON's ``name``).
        problem: why its figures may not describe this checkout (stale, no commit recorded, dirty), else None.
        skip: why it cannot be checked here (no git, the sha not in this clone's history), else None.
        sha: the commit it measured, when recorded.
        commits: how many commits changed its measured code since ``sha`` (None: not counted).
        changed: the measured files that differ between ``sha`` and HEAD.
    """

    name: str
    problem: str | None = None
    skip: str | None = None
    sha: str | None = None
    commits: int | None = None
    changed: tuple[str, ...] = ()

    @property
    def stale(self) -> bool:
        return self.problem is not None


def rerun_hint(name: str) -> str:
    return f"make bench-report ONLY={name}"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)


def git_root(path: Path) -> Path | None:
    """The work tree holding ``path``, or None when it is not in a git repository (or git is missing)."""
    try:
        out = _git(path, "rev-parse", "--show-toplevel")
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def check_result(result: Path, repo: Path) -> Verdict:
    """The verdict on one result JSON against ``repo``'s HEAD."""
    data = json.loads(result.read_text())
    name = data.get("name", result.stem)
    fix = f"rerun it: `{rerun_hint(name)}`"
    commit = data.get("commit")
    if not isinstance(commit, dict) or not commit.get("sha") or not commit.get("paths"):
        return Verdict(name, problem=f"{result.name} records no commit (measured before results said when); {fix}")
    sha, paths = str(commit["sha"]), [str(p) for p in commit["paths"]]
    if commit.get("dirty"):
        return Verdict(name, sha=sha, problem=f"{result.name} measured uncommitted changes to its code at "
                                              f"{sha[:10]}; commit the code first, then {fix}")
    try:
        known = _git(repo, "cat-file", "-e", f"{sha}^{{commit}}").returncode == 0
    except (OSError, subprocess.SubprocessError) as e:
        return Verdict(name, sha=sha, skip=f"{name}: git failed ({e})")
    if not known:
        return Verdict(name, sha=sha, skip=f"{name}: commit {sha[:10]} is not in this clone's history "
                                           "(a shallow clone?)")
    diff = _git(repo, "diff", "--name-only", sha, "HEAD", "--", *paths)
    if diff.returncode != 0:
        return Verdict(name, sha=sha, skip=f"{name}: git diff failed: {diff.stderr.strip()[:200]}")
    changed = tuple(diff.stdout.split())
    if not changed:
        return Verdict(name, sha=sha, commits=0)
    count = _git(repo, "rev-list", "--count", f"{sha}..HEAD", "--", *paths)
    commits = int(count.stdout.strip()) if count.returncode == 0 and count.stdout.strip().isdigit() else None
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return Verdict(name, sha=sha, commits=commits, changed=changed,
                   problem=f"{name} is stale: measured at {sha[:10]}, and the code it measured changed since "
                           f"({shown}); {fix}")


def check_all(results_dir: Path, repo: Path | None = None) -> dict[str, Verdict]:
    """Every result JSON of ``results_dir`` (by name) against the HEAD of ``repo`` (default: the work tree holding
    ``results_dir``); an empty dict when there is no git work tree to check against."""
    repo = repo or git_root(results_dir)
    if repo is None:
        return {}
    verdicts = [check_result(p, repo) for p in sorted(results_dir.glob("*.json"))]
    return {v.name: v for v in verdicts}
