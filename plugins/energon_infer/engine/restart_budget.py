"""How many worker-group restarts the engine may still make: ``max_restarts`` per sliding ``window_s``.

A budget for the engine's life let a long-running server die of three unrelated failures weeks
apart; a budget per window lets one that fails now and then recover, and still stops one that keeps
failing (a model that crashes every step) from restarting forever. A pure state machine with an
injectable clock, so its tests need no processes.

Example:
    >>> t = [0.0]
    >>> b = RestartBudget(max_restarts=2, window_s=60, clock=lambda: t[0])
    >>> b.take(), b.take(), b.take()     # two restarts within a minute, not a third
    (True, True, False)
    >>> t[0] = 61.0; b.left              # a minute later the budget is back
    2
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["RestartBudget"]


class RestartBudget:
    """Restarts allowed per sliding window.

    Args:
        max_restarts: restarts allowed within any ``window_s`` seconds (0: never restart).
        window_s: the window; ``float("inf")``: ``max_restarts`` over the engine's life.
        clock: time source (seconds).
    """

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        if max_restarts < 0 or not window_s > 0:
            raise ValueError(f"max_restarts={max_restarts} must be >= 0 and window_s={window_s} > 0")
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._times: deque[float] = deque()

    def _expire(self) -> None:
        now = self.clock()
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()

    @property
    def used(self) -> int:
        """Restarts made within the current window."""
        self._expire()
        return len(self._times)

    @property
    def left(self) -> int:
        return self.max_restarts - self.used

    def take(self) -> bool:
        """Spend one restart if the window has one left; False when the budget is spent."""
        if self.left <= 0:
            return False
        self._times.append(self.clock())
        return True

    def describe(self) -> str:
        window = "the engine's life" if self.window_s == float("inf") else f"{self.window_s:g} s"
        return f"{self.used} of {self.max_restarts} restart(s) used within {window}"
