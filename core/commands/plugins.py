"""``tightfit plugins``: the table of discovered plugins with their status."""

from __future__ import annotations

import argparse

from tightfit.plugins import discover
from tightfit.units import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", "-v", action="store_true", help="print the traceback of plugins that failed")


def run(args: argparse.Namespace) -> int:
    results = discover()
    if not results:
        print("no plugins found in the entry-point group 'tightfit.plugins' (is tightfit installed?)")
        return 1
    rows = []
    for r in results:
        kind = r.plugin.kind if r.plugin else "?"
        summary = r.plugin.summary if r.plugin else r.target
        rows.append((r.name, kind, r.distribution, r.status(), summary))
    print(format_table(rows, ("plugin", "kind", "from", "status", "summary")))
    if args.verbose:
        for r in results:
            if not r.ok:
                print(f"\n--- {r.name} ({r.target}) ---\n{r.traceback}")
    return 0
