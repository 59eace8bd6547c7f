"""Small shared helpers: byte sizes in and out, and plain-text tables.

Example:
    >>> parse_bytes("20GiB")
    21474836480
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

__all__ = ["parse_bytes", "format_bytes", "format_table", "format_ratio"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """``"20GiB"``, ``"1.5 GB"``, ``"512MiB"``, ``4096`` -> bytes (int).

    Decimal suffixes (KB, MB, GB, TB) are powers of 10; binary ones (KiB, MiB, GiB, TiB) powers of 2.
    A size without a unit must be whole bytes: ``1.5`` or ``"0.5"`` (a fraction, or a unit left out) raises
    instead of being read as 1 or 0 bytes, as do NaN, infinities and negative sizes.
    """
    if isinstance(value, bool):
        raise ValueError(f"memory size {value!r} is a bool; give bytes or a string like '20GiB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"memory size {value!r} is not a finite number; give bytes or a string like '20GiB'")
        if value < 0:
            raise ValueError(f"memory size {value!r} is negative; give a size >= 0 such as '20GiB'")
        if value != int(value):
            raise ValueError(f"memory size {value!r} is not a whole number of bytes; add a unit ('{value}GiB') "
                             "or, where a fraction of the device is meant, give it as a number in (0, 1]")
        return int(value)
    match = _PATTERN.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read memory size {value!r}: write a number and a unit such as '24GiB', '40GB', "
            f"'512MiB' (units: {', '.join(u for u in ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB', 'TB'))})"
        )
    exact = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not match.group(2) and exact != int(exact):  # with a unit, '1.3GiB' rounds down to whole bytes
        raise ValueError(f"memory size {value!r} is not a whole number of bytes; add a unit ('{value}GiB') "
                         "or, where a fraction of the device is meant, give it as a number in (0, 1]")
    return int(exact)


def format_bytes(n: float) -> str:
    """Bytes -> a short binary-unit string (``'3.00 GiB'``)."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_ratio(ratios: Sequence[float], what: str = "") -> str:
    """A headline ratio from interleaved repeats: the median and the spread, or "inconclusive" when the
    spread crosses 1.0 (one repeat says faster, another slower: a busy machine, not a result).

        >>> format_ratio([1.4, 1.6, 1.5], "the samples/s")
        '1.50x the samples/s (median of 3 interleaved repeats, 1.40-1.60x)'
        >>> format_ratio([0.9, 1.5, 1.2])
        'inconclusive on a busy machine (3 interleaved repeats span 0.90-1.50x)'
    """
    if not ratios:
        raise ValueError("format_ratio needs at least one measured ratio")
    ordered = sorted(ratios)
    lo, hi = ordered[0], ordered[-1]
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                   + ordered[len(ordered) // 2]) / 2
    n = len(ordered)
    if lo < 1.0 < hi:
        return f"inconclusive on a busy machine ({n} interleaved repeats span {lo:.2f}-{hi:.2f}x)"
    label = f" {what}" if what else ""
    if n == 1:
        return f"{median:.2f}x{label} (one run: not a median)"
    return f"{median:.2f}x{label} (median of {n} interleaved repeats, {lo:.2f}-{hi:.2f}x)"


def format_table(rows: Iterable[Sequence[object]], headers: Sequence[str], *, align: str | None = None,
                 max_width: int | None = None) -> str:
    """A plain-text table; ``align`` is one character per column (``'l'`` or ``'r'``; default: left).

    ``max_width`` (columns): the widest left-aligned columns are wrapped onto continuation lines
    until every line fits (numbers, right-aligned, are never cut). Example:

        >>> print(format_table([("a", "one two three four")], ("k", "what"), max_width=12))
        k  what
        -  ---------
        a  one two
           three
           four
    """
    body = [[str(c) for c in row] for row in rows]
    cols = len(headers)
    widths = [len(h) for h in headers]
    for row in body:
        if len(row) != cols:
            raise ValueError(f"table row {row!r} has {len(row)} cells; the header has {cols}")
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    align = align or "l" * cols
    if max_width is not None:
        widths = _fit(widths, list(headers), align, max_width)

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    def lines_of(cells: Sequence[str]) -> list[str]:
        wrapped = [_wrap(c, w) if len(c) > w else [c] for c, w in zip(cells, widths)]
        height = max(len(w) for w in wrapped)
        return [fmt([w[i] if i < len(w) else "" for w in wrapped]) for i in range(height)]

    lines = lines_of(list(headers)) + ["  ".join("-" * w for w in widths)]
    for r in body:
        lines += lines_of(r)
    return "\n".join(lines)


def _fit(widths: list[int], headers: list[str], align: str, max_width: int) -> list[int]:
    """Narrow the widest wrappable (left-aligned) columns until the table fits ``max_width``."""
    widths = list(widths)
    floor = [max(8, len(h)) for h in headers]  # a wrapped column keeps at least 8 characters (or its header)
    while sum(widths) + 2 * (len(widths) - 1) > max_width:
        wrappable = [i for i, a in enumerate(align) if a != "r" and widths[i] > floor[i]]
        if not wrappable:
            break
        i = max(wrappable, key=lambda j: widths[j])
        excess = sum(widths) + 2 * (len(widths) - 1) - max_width
        widths[i] = max(floor[i], widths[i] - excess)
    return widths


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]
