"""Predicted vs measured, at run time: time the first steps after warm-up and compare them with the plan.

A planner is only as good as the error of its predictions, so both strategies (Elixir, Sky) put the
prediction beside the measurement on every run: :class:`StepMonitor` is told when each step
starts; it skips ``warmup`` steps (allocator growth, first collectives, lazy initialisation), times
the next ``steps`` (from one step's start to the next's: forward, backward, optimizer and the data
loader's share) and then hands back one :class:`PredictionRecord` with the median, the errors and,
when an error is beyond ``tolerance``, what to do about it.

:class:`StepMonitor` is pure (the clock and the peak reading are injected); :func:`make_monitor` and
:func:`on_step_start` are what the strategies call (a CUDA peak reader; print, log through any
Lightning-style ``trainer.logger``, warn) and import no framework.

Example:
    >>> ticks = iter([0.0, 1.0, 2.0, 3.1, 4.2, 5.3])
    >>> mon = StepMonitor(planner="elixir", predicted_step_s=1.0, predicted_peak_bytes=0, warmup=2, steps=3,
    ...                   clock=lambda: next(ticks))
    >>> records = [mon.step_started() for _ in range(6)]
    >>> rec = records[-1]
    >>> round(rec.measured_step_s, 2), rec.within_tolerance
    (1.1, True)
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tightfit.console import reporter

_log = logging.getLogger(__name__)

__all__ = ["PredictionRecord", "StepMonitor", "make_monitor", "on_step_start"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictionRecord:
    """One comparison of a plan's predictions with the run.

    Args:
        planner: ``"elixir"`` or ``"sky"``.
        cost_model: how the prediction was made (``"measured block timings; ..."`` or ``"FLOPs / rate"``).
        predicted_step_s: the plan's seconds per step.
        measured_step_s: the median seconds per step over the ``steps`` timed.
        predicted_peak_bytes: the plan's device peak.
        measured_peak_bytes: the device peak of the run (0: not available, e.g. on a CPU).
        steps: how many steps were timed.
        time_error: ``predicted_step_s / measured_step_s - 1``.
        peak_error: ``predicted_peak_bytes / measured_peak_bytes - 1`` (``None``: no measured peak).
        tolerance: the allowed relative error.
        within_tolerance: both errors inside it.
        advice: what to do when not within tolerance (empty otherwise).
    """

    planner: str
    cost_model: str
    predicted_step_s: float
    measured_step_s: float
    predicted_peak_bytes: int
    measured_peak_bytes: int
    steps: int
    time_error: float
    peak_error: float | None
    tolerance: float
    within_tolerance: bool
    advice: str = ""

    def metrics(self, prefix: str | None = None) -> dict[str, float]:
        """Flat numbers for a logger (``trainer.logger.log_metrics``)."""
        p = f"{prefix or self.planner}/"
        out = {p + "predicted_step_s": self.predicted_step_s, p + "measured_step_s": self.measured_step_s,
               p + "step_time_error": self.time_error}
        if self.measured_peak_bytes > 0:
            out |= {p + "predicted_peak_bytes": float(self.predicted_peak_bytes),
                    p + "measured_peak_bytes": float(self.measured_peak_bytes),
                    p + "peak_error": float(self.peak_error or 0.0)}
        return out

    def summary(self) -> str:
        line = (f"[{self.planner}] predicted vs measured over {self.steps} steps: step {self.predicted_step_s * 1e3:.1f} ms "
                f"vs {self.measured_step_s * 1e3:.1f} ms ({self.time_error * 100:+.0f}%)")
        if self.measured_peak_bytes > 0:
            line += (f", peak {self.predicted_peak_bytes / 2**20:.1f} MiB vs {self.measured_peak_bytes / 2**20:.1f} MiB "
                     f"({(self.peak_error or 0.0) * 100:+.0f}%)")
        return line + f"; cost model: {self.cost_model}"


class StepMonitor:
    """Times steps ``warmup + 1 .. warmup + steps`` and compares them with a prediction.

    Args:
        planner: name for messages and metrics.
        predicted_step_s: the plan's seconds per step.
        predicted_peak_bytes: the plan's device peak.
        cost_model: how they were made (the plan's ``cost_model``).
        warmup: steps skipped before timing.
        steps: steps timed (the median is compared).
        tolerance: relative error beyond which the record carries advice (0.25: 25%).
        clock: returns seconds (``time.perf_counter``).
        peak: returns the bytes the device peaked at so far (``None``: not measured).
        refresh_hint: the call that re-measures the device (quoted in the advice).
    """

    def __init__(self, *, planner: str, predicted_step_s: float, predicted_peak_bytes: int, cost_model: str = "",
                 warmup: int = 2, steps: int = 5, tolerance: float = 0.25,
                 clock: Callable[[], float] = time.perf_counter, peak: Callable[[], int] | None = None,
                 refresh_hint: str = "profile_device(refresh=True)") -> None:
        if warmup < 0 or steps < 1:
            raise ValueError(f"StepMonitor(warmup={warmup}, steps={steps}): need warmup >= 0 and steps >= 1")
        if not tolerance > 0:
            raise ValueError(f"StepMonitor(tolerance={tolerance}): must be > 0, e.g. 0.25 for 25%")
        self.planner, self.cost_model = planner, cost_model
        self.predicted_step_s, self.predicted_peak_bytes = predicted_step_s, predicted_peak_bytes
        self.warmup, self.steps, self.tolerance = warmup, steps, tolerance
        self.clock, self.peak, self.refresh_hint = clock, peak, refresh_hint
        self._starts: list[float] = []
        self.record: PredictionRecord | None = None

    @property
    def done(self) -> bool:
        return self.record is not None

    def step_started(self) -> PredictionRecord | None:
        """Call at the start of every step; returns the record once (when the last timed step has ended)."""
        if self.record is not None:
            return None
        self._starts.append(self.clock())
        if len(self._starts) < self.warmup + self.steps + 1:
            return None
        starts = self._starts[self.warmup:]
        durations = [b - a for a, b in zip(starts, starts[1:])]
        self.record = self._compare(statistics.median(durations), len(durations))
        return self.record

    def _compare(self, measured: float, steps: int) -> PredictionRecord:
        peak = int(self.peak()) if self.peak is not None else 0
        t_err = self.predicted_step_s / measured - 1 if measured > 0 else 0.0
        p_err = self.predicted_peak_bytes / peak - 1 if peak > 0 else None
        within = abs(t_err) <= self.tolerance and (p_err is None or abs(p_err) <= self.tolerance)
        advice = ""
        if not within:
            fixes = []
            if abs(t_err) > self.tolerance:
                fixes.append(f"the step took {measured * 1e3:.1f} ms, predicted {self.predicted_step_s * 1e3:.1f} ms "
                             f"({t_err * 100:+.0f}%)")
            if p_err is not None and abs(p_err) > self.tolerance:
                fixes.append(f"the device peaked at {peak / 2**20:.1f} MiB, predicted "
                             f"{self.predicted_peak_bytes / 2**20:.1f} MiB ({p_err * 100:+.0f}%)")
            advice = ("; ".join(fixes) + f". Re-measure the device ({self.refresh_hint}; the cached profile may be "
                      "from other hardware or a loaded machine), time the blocks (tightfit.profiler.time_blocks) "
                      "and calibrate (tightfit.profiler.calibrate_device) so the plan is priced from measurements, "
                      "or pass replan=True to re-plan from this measurement at the next checkpoint")
            if "FLOPs" in self.cost_model:
                advice += "; this plan was priced from FLOPs / rate, which leaves out every non-matmul op"
        return PredictionRecord(planner=self.planner, cost_model=self.cost_model,
                                predicted_step_s=self.predicted_step_s, measured_step_s=measured,
                                predicted_peak_bytes=int(self.predicted_peak_bytes), measured_peak_bytes=peak,
                                steps=steps, time_error=t_err, peak_error=p_err, tolerance=self.tolerance,
                                within_tolerance=within, advice=advice)


def make_monitor(plan: Any, device: Any, *, planner: str = "elixir", tolerance: float = 0.25,
                 warmup: int = 2, steps: int = 5) -> StepMonitor:
    """A monitor for ``plan`` (anything with ``step_time_s``, ``peak_bytes`` and ``cost_model``) on ``device``."""
    peak: Callable[[], int] | None = None
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        def peak() -> int:
            return int(torch.cuda.max_memory_allocated(device))
    return StepMonitor(planner=planner, predicted_step_s=float(plan.step_time_s),
                       predicted_peak_bytes=int(getattr(plan, "peak_bytes", 0)),
                       cost_model=str(getattr(plan, "cost_model", "")), warmup=warmup, steps=steps,
                       tolerance=tolerance, peak=peak)


def on_step_start(monitor: StepMonitor | None, trainer: Any, *, verbose: bool = True) -> PredictionRecord | None:
    """Tell ``monitor`` a step starts; when its record is ready, print, log and (beyond tolerance) warn."""
    if monitor is None or monitor.done:
        return None
    record = monitor.step_started()
    if record is None:
        return None
    rank0 = getattr(trainer, "global_rank", 0) == 0
    if verbose and rank0:  # an INFO record (stderr when the application configured no logging)
        reporter(_log, record.planner)(record.summary().removeprefix(f"[{record.planner}] "))
    logger = getattr(trainer, "logger", None)
    if logger is not None:
        try:
            logger.log_metrics(record.metrics(), step=int(getattr(trainer, "global_step", 0)))
        except Exception as e:  # noqa: BLE001 - a logger failing must not stop training
            warnings.warn(f"[{record.planner}] could not log the prediction record: {e}", stacklevel=2)
    if not record.within_tolerance and rank0:
        warnings.warn(f"[{record.planner}] prediction off by more than {record.tolerance:.0%}: {record.advice}",
                      stacklevel=2)
    return record
