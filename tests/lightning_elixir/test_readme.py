"""The README's Elixir snippet runs as written: two CPU processes launched by Lightning itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.runif import RunIf

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    section = text.split("### Elixir training", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


@RunIf(lightning=True, min_world=2)
def test_readme_snippet_trains_on_two_processes(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(_snippet() + "\n    assert trainer.global_step == 20\n    print('PLAN_UNITS', len(trainer.strategy.plan.units))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Elixir plan for LitGPT" in out.stdout and "PLAN_UNITS" in out.stdout
    assert (tmp_path / "lightning_logs" / "version_0" / "plan.json").is_file()


@RunIf(lightning=True)
def test_readme_disk_tier_snippet_trains_with_optimizer_state_on_disk(tmp_path):
    section = README.read_text().split("### Elixir training", 1)[1].split("\n### ", 1)[0]
    first, disk = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    script = tmp_path / "disk_snippet.py"
    script.write_text(first.split('if __name__ == "__main__":')[0] + disk)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "units with optimizer state on disk: (0," in out.stdout
