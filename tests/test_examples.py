"""Every script under examples/ runs end to end at a small size, as a user would start it: it talks (a line
before its heavy imports, progress while it works), ends with a summary naming where its artifacts are, and
writes them under runs/ of the directory it was started in, nothing else.

Sizes are the small ones each script's docstring shows ("seconds (the tests)"). The two Lightning examples
spawn a second process that imports Lightning again, so they take the longest (~15-25 s each on 2 busy cores).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.multiprocess import unlaunched_env

ROOT = Path(__file__).resolve().parents[1]

# script -> (small-size arguments, a progress line's marker that must appear at least twice, files under runs/)
EXAMPLES = {
    "energon_infer/generate.py": (["--max-tokens", "4"], "[generate]",
                                  ["energon_generate/generations.json", "energon_generate/random-llama/config.json"]),
    "torchrec_cache/train_dlrm.py": (["--scale", "0.001", "--steps", "10", "--batch-size", "128",
                                      "--stats-batches", "2"], "step ",
                                     ["torchrec_dlrm/summary.json", "torchrec_dlrm/model.pt",
                                      "torchrec_dlrm/frequencies.safetensors"]),
    "lightning_elixir/train_gpt.py": (["--steps", "4", "--hidden", "32", "--layers", "2", "--seq", "32",
                                       "--batch", "4"], "step ",
                                      ["elixir_demo/summary.json", "elixir_demo/model.safetensors",
                                       "elixir_demo/plan.json", "elixir_demo/config.json"]),
    "lightning_elixir/fabric_finetune.py": (["--steps", "2", "--device-profile", "a100-40g"], "[fabric_finetune] ",
                                            ["elixir_fabric/summary.json", "elixir_fabric/plan.json",
                                             "elixir_fabric/ckpt/meta.pt"]),
    "sky_strategy/train_hetero.py": (["--steps", "4"], "[train_hetero] step",
                                     ["sky_hetero/last.ckpt"]),
}
NEEDS = {"torchrec_cache/train_dlrm.py": "torchrec", "lightning_elixir/train_gpt.py": "lightning",
         "lightning_elixir/fabric_finetune.py": "transformers",
         "sky_strategy/train_hetero.py": "lightning"}


def _run_timed(argv: list[str], cwd: Path, timeout: float) -> tuple[int, list[tuple[float, str]]]:
    """Run, reading stdout+stderr line by line as it arrives: (exit code, [(seconds since start, line)])."""
    # A user's shell has no rendezvous variables; earlier in-process Lightning tests leave MASTER_PORT etc. in this
    # process's environment. Start the example as a user would.
    env = unlaunched_env(PYTHONUNBUFFERED="1", COLUMNS="120")
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{argv[1]} still running after {timeout} s")
        return proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start))), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_small_talks_and_writes_under_runs(script, tmp_path):
    if script in NEEDS:
        pytest.importorskip(NEEDS[script])
    args, marker, artifacts = EXAMPLES[script]
    code, lines = _run_timed([sys.executable, str(ROOT / "examples" / script), *args], tmp_path, timeout=300)
    text = "\n".join(line for _, line in lines)
    assert code == 0, f"{script} exited with {code}:\n{text[-4000:]}"
    gaps = [b[0] - a[0] for a, b in zip(lines, lines[1:])]
    # Not asserted (a busy machine is slow, not wrong); shown with -s so the talkativeness can be checked.
    worst = max(range(len(gaps)), key=gaps.__getitem__, default=0)
    print(f"{script}: {len(lines)} lines in {lines[-1][0]:.1f} s; first after {lines[0][0]:.1f} s; longest "
          f"silence {max(gaps, default=0):.1f} s, after {lines[worst][1][:80]!r}")
    assert lines and "importing" in lines[0][1], f"{script} does not say what it does first: {lines[0][1]!r}"
    assert sum(marker in line for _, line in lines) >= 2, f"{script} printed no progress ({marker!r}):\n{text[-3000:]}"
    last = [line for _, line in lines if line.strip()][-3:]
    assert any("runs/" in line for line in last), f"{script}'s summary does not say where its artifacts are: {last}"
    for rel in artifacts:
        assert (tmp_path / "runs" / rel).is_file(), f"{script} did not write runs/{rel}"
    stray = sorted(p.name for p in tmp_path.iterdir() if p.name != "runs")
    assert not stray, f"{script} wrote outside runs/: {stray}"
    assert "weights_only" not in text, f"{script} prints a torch.load weights_only warning"


def test_every_example_is_run():
    scripts = {str(p.relative_to(ROOT / "examples")) for p in (ROOT / "examples").rglob("*.py")}
    assert scripts == set(EXAMPLES), f"examples not run by tests/test_examples.py: {sorted(scripts - set(EXAMPLES))}"

