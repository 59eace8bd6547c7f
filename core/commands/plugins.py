"""``tightfit plugins``: the table of discovered plugins with their status.

Plugins are loaded without registering them (no host framework is imported), so this answers in
well under 3 s even where Lightning takes 8 s to import.
"""

from __future__ import annotations

import argparse

from tightfit.console import terminal_width
from tightfit.plugins import discover
from tightfit.units import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", "-v", action="store_true", help="print the traceback of plugins that failed")


def run(args: argparse.Namespace) -> int:
    results = discover(register=False)
    if not results:
        print("no plugins found in the entry-point group 'tightfit.plugins' (is tightfit installed?)")
        return 1
    rows = []
    for r in results:
        kind = r.plugin.kind if r.plugin else "?"
        summary = r.plugin.summary if r.plugin else r.target
        command = r.plugin.command or "" if r.plugin else ""
        rows.append((r.name, kind, r.distribution, r.status(), f"{summary} [tightfit {command}]" if command else summary))
    print(format_table(rows, ("plugin", "kind", "from", "status", "summary"), max_width=terminal_width()))
    if args.verbose:
        for r in results:
            if not r.ok:
                print(f"\n--- {r.name} ({r.target}) ---\n{r.traceback}")
    return 0
