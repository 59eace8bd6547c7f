"""The ``tightfit`` command.

Core subcommands live here or in ``tightfit.commands.<name>`` modules (each exposes
``add_arguments(parser)`` and ``run(args) -> int``) and are imported only when used, so
``tightfit --help`` stays fast. A plugin can add a subcommand of its own (``tightfit serve``) by
setting ``command``/``cli`` on its :class:`~tightfit.plugins.Plugin`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "CORE_COMMANDS"]

# name -> (module under tightfit.commands, one-line help). Later issues add rows here.
CORE_COMMANDS: dict[str, tuple[str, str]] = {
    "plugins": ("plugins", "list discovered plugins and their status"),
    "doctor": ("doctor", "show torch / CUDA / Triton / Lightning / TorchRec / DeepSpeed versions and what is usable"),
    "demo": ("demo", "run the tour: each available plugin's demo on embedded defaults"),
    "bench": ("bench", "run the benchmark suite of a source checkout (same as `make bench`)"),
    "profile": ("profile", "profile a model on the meta device (`profile model`) or this machine's device"),
    "plan": ("plan", "compute a plan from profiles (`tightfit plan elixir ...`) and write the plan file"),
}


def _plugin_command(name: str):
    from tightfit.plugins import discover

    for result in discover():
        if result.plugin is not None and result.plugin.command == name:
            return result.plugin
    return None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tightfit",
        description="Train and serve models larger than your hardware comfortably holds.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in CORE_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"tightfit.commands.{module}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in CORE_COMMANDS:
        plugin = _plugin_command(argv[0])
        if plugin is None:
            known = ", ".join(sorted(CORE_COMMANDS))
            print(
                f"tightfit: unknown command {argv[0]!r}. Core commands: {known}; plugins may add more "
                "(see `tightfit plugins`).",
                file=sys.stderr,
            )
            return 2
        if not plugin.is_usable():
            print(f"tightfit {argv[0]}: plugin {plugin.name!r} is {plugin.status()}", file=sys.stderr)
            return 2
        assert plugin.cli is not None
        return int(plugin.cli(argv[1:]) or 0)

    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(f"tightfit.commands.{CORE_COMMANDS[args.command][0]}")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
