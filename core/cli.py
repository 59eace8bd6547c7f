"""The ``tightfit`` command.

Core subcommands live in ``tightfit.commands.<name>`` modules (each exposes ``add_arguments(parser)``
and ``run(args) -> int``) and are imported only when used: ``tightfit plugins`` and ``tightfit doctor``
never import torch or Lightning, so they answer in well under 3 s. A plugin can add a subcommand
of its own (``tightfit serve``) by setting ``command``/``cli`` on its :class:`~tightfit.plugins.Plugin`.

Every value is checked when it is parsed (``tightfit.commands.args``); a mistake ends in one line
naming the value, the rule and the fix, with the exit codes of :data:`~tightfit.commands.args.EXIT_CODES`.
Tracebacks are shown only with ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from tightfit import __version__
from tightfit.commands.args import UsageError, exit_codes_help
from tightfit.console import log, setup_logging

__all__ = ["main", "CORE_COMMANDS", "Parser", "HelpFormatter", "build_parser"]

# name -> (module under tightfit.commands, one-line help). Plugins add theirs (`serve`) through discovery.
CORE_COMMANDS: dict[str, tuple[str, str]] = {
    "plugins": ("plugins", "list discovered plugins and their status"),
    "doctor": ("doctor", "show versions of torch, CUDA, Triton, Lightning, TorchRec, DeepSpeed and serving "
                         "packages, and what is usable"),
    "demo": ("demo", "run the tour: each available plugin's demo on embedded defaults"),
    "bench": ("bench", "run the benchmark suite of the current checkout into a run directory"),
    "profile": ("profile", "profile a model on the meta device (`profile model`), this machine's device "
                           "(`profile device`) or a disk directory (`profile disk PATH`)"),
    "plan": ("plan", "compute a plan from profiles (`plan elixir`, `plan sky`; `plan serve` from plugin energon) "
                     "and write the plan file"),
}
# Listed in `tightfit --help` although they come from plugins (the plugin must be installed and usable).
PLUGIN_COMMANDS: dict[str, str] = {
    "serve": "serve a model over an OpenAI-compatible HTTP API (plugin energon; `tightfit serve --help`)",
}
_GLOBAL_FLAGS = ("-v", "--verbose", "-q", "--quiet", "--debug")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Plain text: descriptions and epilogs keep their line breaks; every flag with a default says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" not in text and action.default not in (None, False, argparse.SUPPRESS, [])
                and action.option_strings and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes raise :class:`UsageError` (one line, exit code 2) instead of printing usage."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _plugin_command(name: str, field: str = "command"):
    from tightfit.plugins import discover

    # register=False: finding the command must not import every plugin's host framework (Lightning: ~8 s).
    for result in discover(register=False):
        if result.plugin is not None and getattr(result.plugin, field) == name:
            return result.plugin
    return None


def build_parser() -> Parser:
    """The parser of every core subcommand (their modules import nothing heavy at module level)."""
    parser = Parser(
        prog="tightfit",
        description="Train and serve models larger than your hardware comfortably holds.",
        epilog="plugin commands:\n" + "\n".join(f"  {n:<9} {h}" for n, h in PLUGIN_COMMANDS.items())
        + "\n\n" + exit_codes_help(),
    )
    parser.add_argument("--version", action="version", version=f"tightfit {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more detail (debug log lines)")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="only warnings and errors on stderr")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in CORE_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                           epilog=exit_codes_help())
        importlib.import_module(f"tightfit.commands.{module}").add_arguments(p)
    return parser


def _split_globals(argv: list[str]) -> tuple[list[str], list[str]]:
    """Leading global flags, and the rest (``tightfit -v serve DIR`` -> ``(['-v'], ['serve', 'DIR'])``)."""
    i = 0
    while i < len(argv) and argv[i] in _GLOBAL_FLAGS:
        i += 1
    return argv[:i], argv[i:]


def _exit_code(exc: BaseException) -> int | None:
    """2 for bad input, 3 for an infeasible plan, None for anything else (a bug or a failed run)."""
    from tightfit.planner.errors import PlanInfeasibleError

    if isinstance(exc, PlanInfeasibleError):
        return 3
    if isinstance(exc, (UsageError, argparse.ArgumentTypeError, ValueError, KeyError, OSError)):
        return 2
    return None


def main(argv: list[str] | None = None) -> int:
    """Run ``tightfit ARGV``; returns the exit code (see :data:`~tightfit.commands.args.EXIT_CODES`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere: `tightfit plan elixir ... --debug`
    flags, rest = _split_globals(argv)
    setup_logging(sum(f in ("-v", "--verbose") for f in flags) - sum(f in ("-q", "--quiet") for f in flags))
    command = rest[0] if rest and not rest[0].startswith("-") else None
    try:
        if command is not None and command not in CORE_COMMANDS:
            return _run_plugin_command(command, rest[1:])
        if command == "plan" and len(rest) > 1 and rest[1] in importlib.import_module(
                "tightfit.commands.plan").PLUGIN_PLANNERS:
            return _run_plugin_planner(rest[1], rest[2:])
        parser = build_parser()
        args = parser.parse_args(argv)
        args.debug = debug
        if args.command is None:
            parser.print_help()
            return 0
        module = importlib.import_module(f"tightfit.commands.{CORE_COMMANDS[args.command][0]}")
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        log.error("tightfit: interrupted")
        return 130
    except SystemExit:
        raise
    except Exception as exc:
        if debug:
            raise
        code = _exit_code(exc)
        where = f"tightfit {command}" if command else "tightfit"
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        if not message.startswith("tightfit"):
            message = f"{where}: {message}"
        if code is None:
            log.error("%s (%s; rerun with --debug for the traceback)", message, type(exc).__name__)
            return 1
        log.error("%s", message)
        return code


def _run_plugin_command(command: str, argv: list[str]) -> int:
    plugin = _plugin_command(command)
    if plugin is None:
        known = ", ".join([*sorted(CORE_COMMANDS), *PLUGIN_COMMANDS])
        raise UsageError(f"tightfit: unknown command {command!r}. Commands: {known}; plugins may add more "
                         "(see `tightfit plugins`).")
    if not plugin.is_usable():
        raise UsageError(f"tightfit {command}: plugin {plugin.name!r} is {plugin.status()}")
    assert plugin.cli is not None
    return int(plugin.cli(argv) or 0)


def _run_plugin_planner(planner: str, argv: list[str]) -> int:
    plugin = _plugin_command(planner, "planner")
    if plugin is None or not plugin.is_usable():
        why = "no installed plugin provides it" if plugin is None else f"plugin {plugin.name!r} is {plugin.status()}"
        raise UsageError(f"tightfit plan {planner}: {why} (see `tightfit plugins`)")
    assert plugin.plan_cli is not None
    return int(plugin.plan_cli(argv) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
