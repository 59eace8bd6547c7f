"""Code blocks of the README and of ``docs/*.md``, found by page and section, for the tests that run them.

Every Python block of a page runs in the test suite: ``tests/test_docs.py`` runs a section's blocks in one
namespace, unless the section is listed in its ``ELSEWHERE`` (a block that needs a model directory, spawns
processes or runs as a script), where the named test reads the block through :func:`python_block` and runs it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

__all__ = ["PAGES", "ROOT", "blocks", "page_text", "prose_figures", "python_block", "python_blocks", "run_script",
           "section", "sections", "strip_generated"]

ROOT = Path(__file__).resolve().parents[2]
_GENERATED = re.compile(r"^<!-- generated: (\S+) -->\n.*?^<!-- end generated: \1 -->\n?", re.S | re.M)


def pages() -> list[Path]:
    """The README and every Markdown page under docs/ (the API pages hold only mkdocstrings directives)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


PAGES = pages()


def page_text(page: str | Path) -> str:
    """The text of ``page``: a path relative to the repository root (``"docs/serving.md"``) or absolute."""
    path = Path(page)
    return (path if path.is_absolute() else ROOT / path).read_text()


def sections(text: str) -> list[tuple[str, str]]:
    """(heading line without its #s, body up to the next heading of any level) for every heading, in order."""
    text = re.sub(r"^```.*?^```", lambda m: m.group().replace("\n#", "\n\0"), text, flags=re.S | re.M)
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.M)
    return [(parts[i].lstrip("#").strip(), parts[i + 1].replace("\0", "#")) for i in range(1, len(parts) - 1, 2)]


def section(page: str | Path, heading: str) -> str:
    """The body of the first section of ``page`` whose heading starts with ``heading`` (no #s), up to the next
    heading of any level."""
    for title, body in sections(page_text(page)):
        if title.startswith(heading):
            return body
    raise AssertionError(f"{page} has no section whose heading starts with {heading!r}")


def blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of ``lang`` in ``text``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def python_blocks(page: str | Path, heading: str) -> list[str]:
    found = blocks(section(page, heading), "python")
    assert found, f"{page}, section {heading!r}, lost its Python block"
    return found


def python_block(page: str | Path, heading: str, index: int = 0) -> str:
    """The ``index``-th ```python block of that section."""
    return python_blocks(page, heading)[index]


def strip_generated(text: str) -> str:
    """``text`` without its generated blocks (``<!-- generated: NAME -->`` ... ``<!-- end generated: NAME -->``)."""
    return _GENERATED.sub(lambda m: "\n" * m.group().count("\n"), text)


def run_script(code: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None,
               args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Write ``code`` to ``cwd/snippet.py`` and run it there with ``args``; asserts it exited 0 (its output tails
    if not)."""
    script = cwd / "snippet.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script), *(args or [])], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def prose_figures(page: str | Path) -> list[str]:
    """Where ``page`` states a measured-looking figure in prose or a table outside a generated block
    (``tests/helpers/figures.py`` finds them: ratios, %, times, sizes, rates, decimals, "a vs b", table cells).
    Measured figures belong in benchmarks/results/REPORT.md; settings belong in code spans."""
    from tests.helpers.figures import figures

    rel = Path(page).relative_to(ROOT) if Path(page).is_absolute() else Path(page)
    return [f"{rel}:{f.line} [{f.section}] {f.text!r} in: ...{f.context}..."
            for f in figures(strip_generated(page_text(page)), set())]
