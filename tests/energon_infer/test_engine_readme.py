"""The README's engine snippet runs as written (as a script: the workers are spawned and import it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.runif import RunIf

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet() -> str:
    section = README.read_text().split("### EnergonAI serving", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


@RunIf(min_world=2)
def test_readme_engine_snippet_runs_on_two_workers(tmp_path):
    from energon_infer.demo import write_random_llama

    model = write_random_llama(tmp_path / "model", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    code = f"MODEL_DIR = {str(model)!r}\n" + _snippet() + "        assert len(outs) == 2 and outs[0].token_ids\n"
    script = tmp_path / "snippet.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "'stages': [" in out.stdout and "'groups': 1" in out.stdout
