"""The one place the cache reads device values on the host, so the reads can be counted.

Every device -> host synchronisation in the cache's per-batch path goes through :func:`read_host`;
the path makes two per forward (the batch's sizes, then what to load and spill) and none in the
backward. Tests count them with :data:`SYNCS` on the CPU and with ``torch.cuda.set_sync_debug_mode``
on a GPU.

Example:
    >>> import torch
    >>> SYNCS.reset(); read_host(torch.tensor([3, 4])).tolist(), SYNCS.count
    ([3, 4], 1)
"""

from __future__ import annotations

import threading

import torch

__all__ = ["SyncCounter", "SYNCS", "read_host", "StepClock"]


class SyncCounter:
    """How many device -> host reads each thread has made (the prefetch thread counts apart)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def count(self) -> int:
        return getattr(self._local, "count", 0)

    def reset(self) -> None:
        self._local.count = 0

    def add(self) -> None:
        self._local.count = self.count + 1


SYNCS = SyncCounter()


def read_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, counted as one synchronisation (a CPU tensor is returned as it is)."""
    SYNCS.add()
    return t if t.device.type == "cpu" else t.to("cpu")


class StepClock:
    """A step number other threads can wait for (the cache's last step whose lookup has read its rows)."""

    def __init__(self) -> None:
        self.step = 0
        self._cv = threading.Condition()

    def advance(self, step: int) -> None:
        with self._cv:
            self.step = max(self.step, step)
            self._cv.notify_all()

    def wait(self, step: int, stop: threading.Event) -> None:
        """Block until the clock reaches ``step`` or ``stop`` is set (then :meth:`wake`)."""
        with self._cv:
            self._cv.wait_for(lambda: self.step >= step or stop.is_set())

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()
