"""Is a committed benchmark result still about the code in the checkout?

Each ``benchmarks/results/<name>.json`` records ``commit``: the sha it measured, whether the measured paths were
dirty, and those paths (benchmarks/common.py ``write_result``: the project files the benchmark imported and the
child scripts it names). A result is *stale* when ``git diff --name-only <sha> HEAD -- <paths>`` lists a file:
the code it measured changed since, so its figures may no longer hold.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Verdict", "check_result", "git_root"]


@dataclass(frozen=True, slots=True)
class Verdict:
    name: str
    problem: str | None = None   # why the result cannot be trusted (stale, no commit recorded, dirty)
    skip: str | None = None      # why it cannot be checked here (no git, sha not in this clone's history)


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
    fix = f"rerun it: `make bench-report ONLY={name}`, then update the README from the report"
    commit = data.get("commit")
    if not isinstance(commit, dict) or not commit.get("sha") or not commit.get("paths"):
        return Verdict(name, problem=f"{result.name} records no commit (measured before results said when); {fix}")
    sha, paths = str(commit["sha"]), [str(p) for p in commit["paths"]]
    if commit.get("dirty"):
        return Verdict(name, problem=f"{result.name} measured uncommitted changes to its code at {sha[:10]}; "
                                     f"commit the code first, then {fix}")
    if _git(repo, "cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        return Verdict(name, skip=f"{name}: commit {sha[:10]} is not in this clone's history (a shallow clone?)")
    diff = _git(repo, "diff", "--name-only", sha, "HEAD", "--", *paths)
    if diff.returncode != 0:
        return Verdict(name, skip=f"{name}: git diff failed: {diff.stderr.strip()[:200]}")
    changed = diff.stdout.split()
    if changed:
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        return Verdict(name, problem=f"{name} is stale: measured at {sha[:10]}, and the code it measured changed "
                                     f"since ({shown}); {fix}")
    return Verdict(name)
