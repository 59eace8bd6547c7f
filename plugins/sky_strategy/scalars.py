"""The numbers a step returns and logs, as they cross pipeline ranks (a handful of floats, never the output).

:class:`~sky_strategy.step.PipelineStep` reads a step's numbers with :func:`scalars` and
:func:`logged_value`, takes what a rank's own parameters add with :func:`minus` / :func:`delta`, and
puts the pipeline's numbers back into a rank's result with :func:`with_values` (keeping that rank's
own graph for the backward).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

__all__ = ["delta", "minus", "scalars", "logged_value", "with_values"]


def delta(with_own: float, without: float) -> float:
    """What a rank's own parameters add to a number. Equal values (the same NaN or infinity from the
    stand-in output included) add nothing; a NaN that appears only with the parameters is kept.

    >>> delta(3.0, 1.0), delta(float("nan"), float("nan")), delta(float("inf"), float("inf"))
    (2.0, 0.0, 0.0)
    """
    if with_own == without or (math.isnan(with_own) and math.isnan(without)):
        return 0.0
    return with_own - without


def minus(numbers: dict[str, float] | None, base: dict[str, float] | None) -> dict[str, float] | None:
    """:func:`delta` per key (a key missing from ``base`` counts as 0)."""
    if numbers is None:
        return None
    return {k: delta(v, (base or {}).get(k, 0.0)) for k, v in numbers.items()}


def scalars(result: Any) -> dict[str, float] | None:
    """The numbers a step returned: a loss tensor, or a dict's one-element tensors (``None``: no result)."""
    if result is None:
        return None
    if isinstance(result, torch.Tensor):
        return {"": float(result.detach())} if result.numel() == 1 else {}
    if isinstance(result, Mapping):
        return {str(k): float(v.detach()) for k, v in result.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
    return {}


def logged_value(name: str, value: Any) -> float:
    """A value given to ``self.log(name, value)`` as a number, or an error saying what to log instead."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    raise MisconfigurationException(
        f"SkyStrategy: self.log({name!r}, ...) got a {type(value).__name__}; only the last stage sees the model "
        "output, so logged values are shared from it as numbers: log a number or a one-element tensor (for a "
        "torchmetrics Metric, log `metric.compute()`)")


class _ValueOf(torch.autograd.Function):
    """``value`` in the forward, gradient straight to ``loss`` in the backward: a rank's loss carries the
    last stage's number (what the user sees) and this rank's own graph (what reaches its parameters)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _with_value(tensor: torch.Tensor, number: float) -> torch.Tensor:
    value = torch.tensor(number, dtype=tensor.dtype, device=tensor.device).reshape(tensor.shape)
    if tensor.requires_grad:
        return _ValueOf.apply(tensor, value)  # type: ignore[no-any-return]
    return value


def with_values(result: Any, numbers: dict[str, float] | None) -> Any:
    """A rank's step result carrying the pipeline's numbers (its graph kept for the backward)."""
    if numbers is None or result is None:
        return None
    if isinstance(result, torch.Tensor):
        return _with_value(result, numbers[""]) if "" in numbers else result
    if isinstance(result, Mapping):
        return {k: _with_value(v, numbers[str(k)]) if str(k) in numbers and isinstance(v, torch.Tensor) else v
                for k, v in result.items()}
    return result
