"""A rank's stage timing: its busy share (``Engine.pipeline_stats``) and the host stamps of its latest forward (the
step's time account, :mod:`energon_infer.engine.account`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StageTimer"]


class StageTimer:
    """Busy time of a rank's stage: from each stage forward's start to its end.

    Both ends of every span come from one clock: CUDA events on a GPU (a forward's kernels run after
    the host call returns, so host time would measure launch, not work), ``time.perf_counter`` on a
    CPU. Utilisation is busy time over the span from the first forward's start to the last one's
    end, so the time a stage waits for its inputs or for the controller counts as idle.

    ``mark``/``elapsed`` (optional) replace the clock: ``mark()`` a timestamp, ``elapsed(a, b)`` seconds between.
    """

    def __init__(self, stage: torch.nn.Module, device: torch.device, *, mark: Callable[[], Any] | None = None,
                 elapsed: Callable[[Any, Any], float] | None = None, report: Callable[[], dict[str, Any]] | None = None):
        self.report = report  # more to report with the times (the memory pool's counters)
        self.cuda = device.type == "cuda" and mark is None
        self.mark: Callable[[], Any] = mark or (self._cuda_mark if self.cuda else time.perf_counter)
        self.elapsed: Callable[[Any, Any], float] = elapsed or (self._cuda_elapsed if self.cuda else _subtract)
        self.open: Any = None
        self.spans: list[tuple[Any, Any]] = []  # (start, end) marks not yet summed
        self.busy = 0.0
        self.first: Any = None  # the first start mark since the last reset
        self.last: Any = None  # the latest end mark
        self.span_before = 0.0  # span already summed when the marks were folded (CUDA events are freed)
        self.steps = 0
        self.open_ns = 0
        self.forward_ns = (0, 0)
        stage.register_forward_pre_hook(lambda *_: self.start())
        stage.register_forward_hook(lambda *_: self.stop())

    @staticmethod
    def _cuda_mark() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def _cuda_elapsed(a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3

    def start(self) -> None:
        self.open = self.mark()
        self.open_ns = time.monotonic_ns()
        if self.first is None:
            self.first = self.open

    def stop(self) -> None:
        self.steps += 1
        end = self.mark()
        self.spans.append((self.open, end))
        self.last = end
        # Host stamps of the latest forward, for the step's time account (energon_infer.engine.account): on a GPU
        # they bound the launch, and the sampling that follows waits for the kernels.
        self.forward_ns = (self.open_ns, time.monotonic_ns())

    def snapshot(self, reset: bool = False) -> dict[str, Any]:
        if self.cuda and self.spans:
            torch.cuda.synchronize()
        for start, end in self.spans:
            self.busy += self.elapsed(start, end)
        self.spans.clear()
        span = self.elapsed(self.first, self.last) if self.first is not None and self.last is not None else 0.0
        out: dict[str, Any] = {"busy_s": self.busy, "span_s": span, "steps": float(self.steps),
                               "utilisation": self.busy / span if span > 0 else 0.0}
        if self.report is not None:
            out.update(self.report())
        if reset:
            self.busy, self.first, self.last, self.steps = 0.0, None, None, 0
        return out


def _subtract(a: float, b: float) -> float:
    return b - a
