"""Argument types for the ``tightfit`` subcommands: each value is checked when it is parsed.

A bad value stops the command before any profiling starts, with one line that names the value,
the rule and the fix (``--rate 0: must be a number > 0 (FLOP/s of a speed-1.0 device), e.g. 1e14``).
argparse calls these as ``type=``; they raise :class:`argparse.ArgumentTypeError`, which the
``tightfit`` parser prints as that one line and exit code 2.

Example:
    >>> positive_int("4")
    4
    >>> budget("0.9"), budget("38GiB")
    (0.9, 40802189312)
    >>> budget("1.5")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: '1.5' is a bare number above 1: a bare number is a fraction of the device memory in (0, 1]; for a size write a unit, e.g. '1.5GiB'
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from tightfit.units import parse_bytes

__all__ = ["UsageError", "EXIT_CODES", "exit_codes_help", "positive_int", "nonnegative_int", "positive_float",
           "nonnegative_float", "byte_size", "budget", "json_file", "float_list", "size_list", "DISK_PRESETS",
           "add_disk_arguments"]

# The datasheet disk presets' names (tightfit.profiler.disk_presets.DISK_DATASHEETS), kept here so the parsers
# build without importing the profiler (which imports torch); tests/core/test_disk_cli.py holds the two equal.
DISK_PRESETS = ("nvme-gen4", "nvme-gen3", "sata-ssd", "hdd")


def add_disk_arguments(parser: argparse.ArgumentParser) -> None:
    """``--disk-dir/--disk-preset/--disk-space``: the disk tier of the hosts to plan for (absent: none);
    :func:`tightfit.profiler.disk_presets.disk_from_args` reads them."""
    g = parser.add_argument_group("disk tier (absent: none)")
    g.add_argument("--disk-dir", default=None, metavar="DIR",
                   help="a local directory (NVMe/SSD) the plan may spill to: measured once with "
                        "`tightfit profile disk DIR --quick` and cached (default: no disk tier)")
    g.add_argument("--disk-preset", default=None, metavar="NAME",
                   help=f"typical disk speed instead of measuring: one of {', '.join(DISK_PRESETS)} (with "
                        "--disk-dir, its free space; else give --disk-space)")
    g.add_argument("--disk-space", default=None, metavar="SIZE",
                   help="disk budget per host, overriding the free space, e.g. 500GiB")


class UsageError(ValueError):
    """A value the user gave breaks a rule; the message names the value, the rule and the fix (exit code 2)."""


# Exit codes of every `tightfit` subcommand (printed by `tightfit --help`).
EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "the work itself failed (a demo, a benchmark, an unexpected error: rerun with --debug for the traceback)",
    2: "bad input: a value, a file or a combination of flags breaks a rule (the message says which and the fix)",
    3: "no plan fits: the planner found nothing within the memory (the message names what would fit)",
    130: "interrupted (Ctrl-C)",
}


def exit_codes_help() -> str:
    return "exit codes:\n" + "\n".join(f"  {code:<4} {text}" for code, text in EXIT_CODES.items())


def _number(text: str, what: str, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; {what}, e.g. {example}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite; {what}, e.g. {example}")
    return value


def _integer(text: str, what: str, example: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; {what}, e.g. {example}") from None


def positive_int(text: str) -> int:
    value = _integer(text, "give a whole number >= 1", "4")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1; give a whole number >= 1, e.g. 4")
    return value


def nonnegative_int(text: str) -> int:
    value = _integer(text, "give a whole number >= 0", "0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give a whole number >= 0, e.g. 0")
    return value


def positive_float(text: str) -> float:
    value = _number(text, "give a finite number > 0", "1e14")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not > 0; give a finite number > 0, e.g. 1e14")
    return value


def nonnegative_float(text: str) -> float:
    value = _number(text, "give a finite number >= 0", "2")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; give a finite number >= 0, e.g. 2")
    return value


def byte_size(text: str) -> int:
    """A memory size with its unit ('40GiB', '512MB'); must be > 0."""
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is {value} bytes; give a size > 0 such as '40GiB'")
    return value


def budget(text: str) -> float | int:
    """A memory budget: a fraction of the device memory in (0, 1] (a bare number) or a size with a unit.

    A bare number is always a fraction, so ``1.5`` (no unit) cannot silently mean 1 byte.
    """
    try:
        value = float(text)
    except ValueError:
        try:
            return byte_size(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction of the device memory in (0, 1] (e.g. "
                                             "0.9) nor a size with a unit (e.g. '38GiB', '40GB', '512MiB')") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]; give e.g. 0.9 for 90% of the "
                                         "device memory, or a size with a unit such as '38GiB'")
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is a bare number above 1: a bare number is a fraction of the "
                                         f"device memory in (0, 1]; for a size write a unit, e.g. '{text}GiB'")
    return value


def json_file(text: str) -> Path:
    """An existing, readable file holding JSON (read here, so a bad file stops the command at once)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file; give the path of a JSON file written by "
                                         "tightfit (`--json PATH` of `tightfit profile`)")
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not readable JSON ({e}); regenerate it with the command "
                                         "that wrote it (`--json PATH`)") from None
    return path


def float_list(text: str) -> list[float]:
    """Comma-separated finite numbers > 0 ('1,0.33,1')."""
    values = []
    for part in text.split(","):
        try:
            values.append(positive_float(part.strip()))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: item {part.strip()!r}: {e}") from None
    return values


def size_list(text: str) -> list[int]:
    """Comma-separated memory sizes ('80GiB' or '40GiB,16GiB')."""
    values = []
    for part in text.split(","):
        try:
            values.append(byte_size(part.strip()))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: item {part.strip()!r}: {e}") from None
    return values
