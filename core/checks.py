"""Checks of user-given numbers, shared by configs, profiles and planners.

Every check raises the caller's own error type (``PlanError``, ``ProfileError``, ``ValueError``...)
with a message naming the value, the rule and the fix, so a NaN, an infinity, a negative size, a
zero where a division follows or ``2.5`` microbatches fail at construction instead of giving a
plan with free communication or a ``ZeroDivisionError`` minutes later.

Example:
    >>> check_number(4, "microbatches", integer=True, low=1, where="SkyStrategy")
    4
    >>> try:
    ...     check_number(2.5, "microbatches", integer=True, low=1, where="SkyStrategy", fix="give a whole count")
    ... except ValueError as err:
    ...     print(err)
    SkyStrategy: microbatches=2.5 must be a whole number >= 1; give a whole count
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_number"]


def _rule(integer: bool, low: float | None, low_open: bool, high: float | None) -> str:
    kind = "a whole number" if integer else "a finite number"
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"<= {high:g}")
    return kind + (" " + " and ".join(bounds) if bounds else "")


def check_number(value: Any, name: str, *, where: str, integer: bool = False, low: float | None = None,
                 low_open: bool = False, high: float | None = None, fix: str = "",
                 error: type[Exception] = ValueError) -> Any:
    """Return ``value`` if it is a real, finite number in range, else raise ``error``.

    Args:
        value: what the user gave.
        name: the argument's name as the user wrote it (``"microbatches"``).
        where: the object or command it belongs to (``"SkyStrategy"``, ``"device 'rank1'"``).
        integer: it must be a whole number (``2.0`` passes, ``2.5`` and ``True`` do not).
        low / low_open: the lower bound, and whether the bound itself is excluded (``> 0``).
        high: the upper bound (included).
        fix: what to do instead, appended to the message.
        error: the exception type to raise (the library's own family for the caller).
    """
    rule = _rule(integer, low, low_open, high)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        # Integers compare exactly (float(2**63 - 1) rounds up past a bound of 2**63 - 1).
        v: float | int = int(value) if isinstance(value, numbers.Integral) else float(value)
        ok = math.isfinite(v)
        if ok and integer:
            ok = v == int(v)
        if ok and low is not None:
            ok = v > low if low_open else v >= low
        if ok and high is not None:
            ok = v <= high
    if not ok:
        raise error(f"{where}: {name}={value!r} must be {rule}" + (f"; {fix}" if fix else ""))
    return value
