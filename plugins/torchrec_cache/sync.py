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

__all__ = ["SyncCounter", "SYNCS", "read_host"]


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
