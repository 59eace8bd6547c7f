"""``tightfit demo``: the tour ``make demo`` runs.

It lists the plugins, then runs each usable plugin's demo on embedded defaults (tiny models, data
generated or bundled in the repository; nothing is downloaded) and prints what each showed. The
tour order makes later parts reuse earlier ones: Elixir trains a checkpoint that the inference demo serves.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import time
import traceback
import warnings

from tightfit.console import fit_text, log, terminal_width
from tightfit.plugins import discover
from tightfit.units import format_table

TOUR_ORDER = ("elixir", "energon", "torchrec_cache", "sky")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", action="append", default=[], metavar="PLUGIN",
                        help="run only this plugin's part (repeatable)")
    parser.add_argument("--full", action="store_true", help="longer runs than the quick default")


# Notices about the frameworks' own internals that a reader of the tour cannot act on, each one line of 200-290
# characters: Lightning's pytree check under torch 2.13, and torch.fx's note printed when TorchRec imports.
# Message prefixes (no commas: PYTHONWARNINGS is comma-separated).
_FRAMEWORK_NOTICES = ("`isinstance(treespec",)
_FRAMEWORK_LOGGERS = ("torch.fx._symbolic_trace",)


def _quiet_framework_notices() -> None:
    for message in _FRAMEWORK_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(message))
    # Processes the demos start (Lightning's second rank, the examples) read the same filters from the environment.
    extra = ",".join(f"ignore:{m}" for m in _FRAMEWORK_NOTICES)
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS", ""), extra]))
    for name in _FRAMEWORK_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _order(name: str) -> tuple[int, str]:
    return (TOUR_ORDER.index(name) if name in TOUR_ORDER else len(TOUR_ORDER), name)


def run(args: argparse.Namespace) -> int:
    print("tightfit tour: models larger than the hardware comfortably holds\n")
    _quiet_framework_notices()
    results = sorted(discover(), key=lambda r: _order(r.name))
    print(format_table(
        [(r.name, r.plugin.kind if r.plugin else "?", r.status()) for r in results],
        ("plugin", "kind", "status"), max_width=terminal_width(),
    ))
    unknown = [n for n in args.only if n not in {r.name for r in results}]
    if unknown:
        print(f"\nunknown plugin(s) for --only: {', '.join(unknown)}; known: {', '.join(r.name for r in results)}")
        return 2
    failures = 0
    ran = []
    for r in results:
        if args.only and r.name not in args.only:
            continue
        plugin = r.plugin
        if plugin is None or plugin.demo is None or not plugin.is_usable():
            why = r.status() if plugin is None or not plugin.is_usable() else "it has no demo yet"
            print(f"\n== {r.name}: skipped ({why})")
            continue
        print("\n" + fit_text(f"== {r.name}: {plugin.summary}"), flush=True)
        start = time.perf_counter()
        try:
            summary = plugin.demo(not args.full)
        except Exception as exc:
            failures += 1
            if getattr(args, "debug", False):
                print(f"-- {r.name} demo FAILED:\n{traceback.format_exc()}")
            else:
                log.error("-- %s demo FAILED: %s: %s (rerun with --debug for the traceback)", r.name,
                          type(exc).__name__, exc)
            continue
        seconds = time.perf_counter() - start
        ran.append((r.name, f"{seconds:.1f} s", summary))
        print(fit_text(f"-- {r.name}: {summary} ({seconds:.1f} s)"))
    print("\nTour summary:")
    if ran:
        print(format_table(ran, ("plugin", "time", "what it showed"), max_width=terminal_width()))
    else:
        print("no plugin demo ran yet: the plugins above say why.")
    return 1 if failures else 0
