"""Typed planner errors, shared by every planner and by the runtimes that apply plans.

Example:
    >>> err = PlanInfeasibleError("nothing fits", needed_bytes=2**30, budget_bytes=2**29)
    >>> err.needed_bytes > err.budget_bytes
    True
"""

from __future__ import annotations

__all__ = ["TIERS", "PlanError", "PlanInfeasibleError", "PlanMismatchError"]

TIERS = ("device", "host", "disk")
"""The three memory tiers every memory planner sees (docs/architecture.md)."""


class PlanError(ValueError):
    """Base class of planner errors (a ``ValueError``: the inputs cannot give a plan)."""


class PlanInfeasibleError(PlanError):
    """No plan in the search space fits the memory budget.

    Args:
        message: the full explanation (numbers, the smallest budget that fits, the cheapest change).
        needed_bytes: the smallest budget of ``tier`` under which some plan fits (0 when unknown).
        budget_bytes: the budget of ``tier`` that was given.
        suggestions: changes that would make a plan fit, cheapest first (one sentence each).
        tier: the memory tier that is short: ``"device"`` (per device), ``"host"`` or ``"disk"``.
    """

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int,
                 suggestions: tuple[str, ...] = (), tier: str = "device") -> None:
        super().__init__(message)
        if tier not in TIERS:
            raise ValueError(f"PlanInfeasibleError: tier={tier!r} must be one of {TIERS}")
        self.needed_bytes = int(needed_bytes)
        self.budget_bytes = int(budget_bytes)
        self.suggestions = tuple(suggestions)
        self.tier = tier

    @property
    def short_bytes(self) -> int:
        """How many bytes the tier is short by."""
        return max(0, self.needed_bytes - self.budget_bytes)


class PlanMismatchError(PlanError):
    """A plan was made for another model, world size or precision than the one it is applied to.

    Args:
        message: what differs and how to fix it.
        field: the identity field that differs (``"world_size"``, ``"param_numel"``, ``"blocks"``...).
        expected: the plan's value; actual: the value found at apply time.
    """

    def __init__(self, message: str, *, field: str, expected: object, actual: object) -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.actual = actual
