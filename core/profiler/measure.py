"""Ground truth for the model profiler: the memory peak of a real step, measured by ``torch.profiler``.

The profiler's allocator events (``profile_memory=True``) give every allocation and free of the
step on the device, independently of tightfit's own bookkeeping; the peak is the maximum of their
running sum, plus the bytes alive before the step (parameters and buffers). Used by the accuracy
tests and the profiler benchmark; handy to check a profile on a small batch of your own model.

Example:
    >>> import torch
    >>> from tightfit.models import build_gpt
    >>> model = build_gpt("gpt2-tiny")
    >>> measure_step_peak(model, torch.zeros(2, 16, dtype=torch.long)).total_bytes > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MeasuredPeak", "measure_step_peak", "run_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredPeak:
    """Measured memory of one real step.

    Args:
        baseline_bytes: parameters and buffers alive before the step.
        peak_delta_bytes: the highest the step's allocations rose above the baseline.
        end_delta_bytes: what the step left allocated (parameter gradients, for a training step).
        total_bytes: ``baseline_bytes + peak_delta_bytes``.
    """

    baseline_bytes: int
    peak_delta_bytes: int
    end_delta_bytes: int
    total_bytes: int


def run_step(model: nn.Module, example_inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
             step: str = "train") -> None:
    """One step as :func:`~tightfit.profiler.profile_model` traces it: forward, loss, drop the output, backward."""
    from tightfit.profiler.model import default_loss, split_inputs

    args, kwargs = split_inputs(example_inputs)
    if step == "forward":
        with torch.no_grad():
            model(*args, **kwargs)
        return
    out = model(*args, **kwargs)
    loss = (loss_fn or default_loss)(out)
    del out
    loss.backward()


def measure_step_peak(model: nn.Module, example_inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                      step: str = "train", drop_grads: bool = False) -> MeasuredPeak:
    """Run one real step of ``model`` and measure its memory with ``torch.profiler`` allocator events.

    ``drop_grads=True`` frees each parameter gradient as soon as it is accumulated, so the peak is
    the activations' (plus at most one gradient in flight). Existing ``.grad`` are cleared first.
    """
    from torch.profiler import ProfilerActivity, profile

    device = next(iter(model.parameters())).device
    model.zero_grad(set_to_none=True)
    seen: set[int] = set()
    baseline = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            baseline += t.untyped_storage().nbytes()
    hooks = []
    if drop_grads:
        def drop(p: torch.Tensor) -> None:
            p.grad = None

        hooks = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities, profile_memory=True) as prof:
            run_step(model, example_inputs, loss_fn=loss_fn, step=step)
    finally:
        for h in hooks:
            h.remove()
    want = torch._C._autograd.DeviceType.CUDA if device.type == "cuda" else torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == want]
    events.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    model.zero_grad(set_to_none=True)
    return MeasuredPeak(baseline_bytes=baseline, peak_delta_bytes=peak, end_delta_bytes=level,
                        total_bytes=baseline + peak)
