"""Predicted vs measured step time and peak memory, reported once per fit after warm-up.

:class:`tightfit.planner.check.StepMonitor` does the timing and the comparison; this adapter feeds
it the start of every training step, reads the device's peak (``torch.cuda.max_memory_allocated``;
nothing on a CPU, where host and device share the process's memory), prints the record on rank 0,
logs it through the Lightning logger (``elixir/predicted_step_s``, ``elixir/measured_step_s``, ...)
and warns with what to do when an error is beyond the tolerance.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tightfit.planner.check import PredictionRecord, StepMonitor

__all__ = ["make_monitor", "on_step_start"]


def make_monitor(plan: Any, device: torch.device, *, planner: str = "elixir", tolerance: float = 0.25,
                 warmup: int = 2, steps: int = 5) -> StepMonitor:
    """A monitor for ``plan`` (anything with ``step_time_s``, ``peak_bytes`` and ``cost_model``) on ``device``."""
    peak = None
    if device.type == "cuda":
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
    if verbose and rank0:
        print(record.summary(), flush=True)
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
