"""``tightfit demo`` for Elixir: train the byte-level GPT of ``examples/lightning_elixir/train_gpt.py``
briefly on 2 CPU processes (or the GPUs), under a budget that forces a mixed plan.

The example runs as its own process: Lightning starts the second rank by re-running the script it
was launched from, which must be the example, not ``tightfit demo``. Its outputs stay in
``runs/elixir_demo/`` (``last.ckpt``, ``model.safetensors`` + ``config.json``, ``plan.json``): the
energon_infer demo can serve that model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["DEMO_DIR", "example_script", "run_demo"]

DEMO_DIR = Path("runs/elixir_demo")


def example_script() -> Path:
    """``examples/lightning_elixir/train_gpt.py`` of this source checkout."""
    here = Path(__file__).resolve().parent  # plugins/lightning_elixir
    script = here.parent.parent / "examples" / "lightning_elixir" / "train_gpt.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the Elixir demo runs the example of a source checkout "
                                "(git clone the repository and run `make demo` there)")
    return script


def _short(path: str) -> str:
    """``path`` relative to the current directory when it is below it (else as it is)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def run_demo(quick: bool = True, out: str | Path = DEMO_DIR) -> str:
    """Train, print the plan and the falling loss, keep the checkpoint; returns a one-line summary."""
    out = Path(out)
    steps = 60 if quick else 300
    cmd = [sys.executable, str(example_script()), "--steps", str(steps), "--budget", "mixed", "--out", str(out)]
    shown = ["python", _short(cmd[1])] + cmd[2:]  # the command a reader would type, not this venv's path
    print("$ " + " ".join(shown), flush=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(cmd, env=env, timeout=600 if quick else 1800)
    if result.returncode != 0:
        raise RuntimeError(f"the Elixir example exited with code {result.returncode} (command: {' '.join(cmd)})")
    s = json.loads((out / "summary.json").read_text())
    losses = s["losses"]
    return (f"{steps} steps on {s['devices']} processes, loss {losses[0]:.2f} -> {losses[-1]:.2f}; plan "
            f"{s['units']} units ({s['offloaded_units']} offloaded, {s['resharded_units']} resharded, "
            f"{s['checkpointed_blocks']} blocks recomputed); checkpoint kept at {s['checkpoint']}")
