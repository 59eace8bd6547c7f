"""kill -9 in the middle of a streamed optimizer step (write-backs in flight), then resume from the last
checkpoint: the same final weights as an uninterrupted run, bit for bit. Real processes (disk_kill_run.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

RUN = Path(__file__).with_name("disk_kill_run.py")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RUN), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_kill_9_mid_step_then_resume_equals_uninterrupted(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    out = _run(whole, "full")
    assert out.returncode == 0, out.stderr[-3000:]
    # Killed in step 6's streamed update (TinyGPT takes ~43 chunks of 8192 elements a step here), after the
    # step-4 checkpoint: step 5's state and half of step 6's are in the store, neither in a checkpoint.
    out = _run(broken, "full", 6)
    assert out.returncode == -signal.SIGKILL, (out.returncode, out.stderr[-3000:])
    assert (broken / "ckpt" / "s4.ckpt").is_dir() and not (broken / "full.pt").exists()
    out = _run(broken, "resume")  # the store directory the killed process held is opened again
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = torch.load(whole / "full.pt"), torch.load(broken / "resume.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name
