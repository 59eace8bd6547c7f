"""README snippets that must run as scripts (their engines spawn workers that import the script)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_block(heading: str) -> str:
    """The first ```python block of the README section whose heading starts with ``heading``."""
    section = README.read_text().split(heading, 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def run_script(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Write ``code`` to ``cwd/snippet.py`` and run it there; asserts it exited 0 (its output tails if not)."""
    script = cwd / "snippet.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out
