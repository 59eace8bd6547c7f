"""StageTimer: busy time and span come from one clock (CUDA events on a GPU, perf_counter on a CPU)."""

from __future__ import annotations

import time

import torch
from torch import nn

from energon_infer.worker.workers import StageTimer


def test_busy_span_and_utilisation_from_one_clock():
    # Marks from a scripted clock: forwards run 10..13, 20..21 and 30..36; the waits between are idle.
    marks = iter([10.0, 13.0, 20.0, 21.0, 30.0, 36.0, 50.0, 52.0])
    stage = nn.Linear(2, 2)
    timer = StageTimer(stage, torch.device("cpu"), mark=lambda: next(marks), elapsed=lambda a, b: b - a)
    x = torch.zeros(1, 2)
    for _ in range(3):
        stage(x)
    out = timer.snapshot(reset=True)
    assert out == {"busy_s": 10.0, "span_s": 26.0, "steps": 3.0, "utilisation": 10.0 / 26.0}
    stage(x)  # after the reset only the new forward counts
    assert timer.snapshot() == {"busy_s": 2.0, "span_s": 2.0, "steps": 1.0, "utilisation": 1.0}


def test_cpu_timer_measures_with_perf_counter():
    stage = nn.Sequential(nn.Linear(4, 4))
    timer = StageTimer(stage, torch.device("cpu"))
    assert timer.snapshot() == {"busy_s": 0.0, "span_s": 0.0, "steps": 0.0, "utilisation": 0.0}
    before = time.perf_counter()
    stage(torch.zeros(1, 4))
    time.sleep(0.05)  # idle between forwards
    stage(torch.zeros(1, 4))
    wall = time.perf_counter() - before
    out = timer.snapshot()
    assert out["steps"] == 2.0 and 0.05 <= out["span_s"] <= wall
    assert 0 < out["busy_s"] < out["span_s"] and 0 < out["utilisation"] < 1
