"""The restart budget: N restarts per sliding window, on a scripted clock."""

from __future__ import annotations

import pytest

from energon_infer.engine.restart_budget import RestartBudget


def test_budget_is_per_window_and_recovers_as_failures_age():
    t = [0.0]
    b = RestartBudget(max_restarts=3, window_s=100, clock=lambda: t[0])
    for when in (0.0, 10.0, 20.0):
        t[0] = when
        assert b.take()
    assert b.left == 0 and not b.take()
    t[0] = 99.9
    assert b.left == 0  # the first restart is still inside the window
    t[0] = 100.0
    assert b.left == 1 and b.take() and b.left == 0
    t[0] = 1000.0
    assert b.used == 0 and b.describe() == "0 of 3 restart(s) used within 100 s"


def test_failures_spread_out_never_exhaust_it_but_a_burst_does():
    t = [0.0]
    b = RestartBudget(max_restarts=2, window_s=60, clock=lambda: t[0])
    for i in range(50):  # one failure every 31 s: at most 2 in any minute
        t[0] = 31.0 * i
        assert b.take(), i
    burst = RestartBudget(max_restarts=2, window_s=60, clock=lambda: t[0])
    assert [burst.take() for _ in range(3)] == [True, True, False]


def test_zero_means_never_and_infinity_means_per_life():
    assert not RestartBudget(0, 60).take()
    life = RestartBudget(1, float("inf"))
    assert life.take() and not life.take() and "the engine's life" in life.describe()
    with pytest.raises(ValueError, match="window_s=0"):
        RestartBudget(1, 0)
