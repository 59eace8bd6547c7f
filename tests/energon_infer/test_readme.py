"""docs/energon.md's "Generate in your process" block and the example script run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_generate_snippet_runs(tiny_dirs, capsys):
    from tests.helpers.docs import python_block

    code = python_block("docs/energon.md", "Generate in your process")
    exec(compile(code, "docs/energon.md", "exec"), {"MODEL_DIR": tiny_dirs["llama"]})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(re.search(r" (stop|length) \[\d+", ln) for ln in lines), lines


def test_example_script_generates(tiny_dirs):
    out = subprocess.run([sys.executable, str(ROOT / "examples/energon_infer/generate.py"), "--model",
                          tiny_dirs["opt"], "--prompt", "the quick brown fox", "--max-tokens", "5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'the quick brown fox' -> " in out.stdout and "on tp=1 x pp=1" in out.stdout
