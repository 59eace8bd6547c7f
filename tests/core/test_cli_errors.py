"""Every `tightfit` mistake ends in one line naming the value, the rule and the fix, with a documented exit code.

Values are checked when parsed: these cases answer before any profiling (each runs in well under a second
in-process), and none prints a traceback unless --debug is given.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tightfit.cli import build_parser, main
from tightfit.commands.args import EXIT_CODES


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip()


@pytest.mark.parametrize("argv, needle", [
    (["plan", "sky", "--model", "gpt2", "--speeds", "1,1", "--rate", "0"], "--rate: 0 is not > 0"),
    (["plan", "sky", "--layers", "0", "--speeds", "1,1"], "--layers: 0 is below 1"),
    (["plan", "sky", "--layers", "4", "--speeds", "1,1", "--link", "nan"], "--link: 'nan' is not finite"),
    (["plan", "sky", "--layers", "4", "--speeds", "1,1", "--optimizer-state", "-2"], "--optimizer-state: -2 is negative"),
    (["plan", "sky", "--layers", "4", "--speeds", "1,x"], "item 'x'"),
    (["plan", "sky", "--layers", "4", "--speeds", "1,1", "--memory", "4GiB,2GiB,1GiB"], "--memory has 3 sizes for 2"),
    (["plan", "elixir", "--model", "gpt2", "--budget", "abc"], "'abc' is neither a fraction"),
    (["plan", "elixir", "--model", "gpt2", "--budget", "1.5"], "a bare number is a fraction of the device memory"),
    (["plan", "elixir", "--model", "gpt2", "--budget", "-0.5"], "not a fraction in (0, 1]"),
    (["plan", "elixir", "--model", "gpt2", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["plan", "elixir", "--model", "gpt2", "--nodes", "0"], "--nodes: 0 is below 1"),
    (["plan", "elixir", "--model", "gpt2", "--devices", "4", "--nodes", "3"], "cannot be split evenly over --nodes 3"),
    (["plan", "elixir", "--model", "gpt2", "--batch", "0"], "--batch: 0 is below 1"),
    (["plan", "elixir", "--model", "gpt9", "--preset", "a100-40g"], "unknown GPT preset 'gpt9'"),
    (["plan", "elixir", "--model", "gpt2", "--preset", "b200"], "unknown device preset 'b200'"),
    (["plan", "elixir", "--model", "gpt2", "--device-memory", "lots"], "cannot read memory size 'lots'"),
    (["plan", "elixir", "--profile", "/no/such/profile.json"], "is not a file"),
    (["plan"], "name a planner"),
    (["profile", "model", "--model", "gpt2-tiny", "--checkpointing", "x"], "--checkpointing x: no such module"),
    (["profile", "model", "--model", "gpt2-tiny", "--checkpointing", ","], "names no block"),
    (["profile", "model", "--model", "no-such-model"], "is neither a preset"),
    (["profile"], "say what to profile"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["serve", "/tmp", "--tp", "0"], "--tp: 0 is below 1"),
])
def test_user_errors_are_one_line_with_exit_code_2(capsys, argv, needle):
    code, err = _run(capsys, *argv)
    assert code == 2, err
    assert needle in err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("tightfit"), err


def test_bad_profile_files_are_named(tmp_path, capsys):
    not_json = tmp_path / "bad.json"
    not_json.write_text("{ nope")
    code, err = _run(capsys, "plan", "elixir", "--profile", str(not_json), "--preset", "a100-40g")
    assert code == 2 and "is not readable JSON" in err and str(not_json) in err
    wrong = tmp_path / "list.json"
    wrong.write_text(json.dumps([1, 2]))
    code, err = _run(capsys, "plan", "elixir", "--profile", str(wrong), "--preset", "a100-40g")
    assert code == 2 and "not a ModelProfile" in err and "tightfit profile model" in err, err
    assert len(err.splitlines()) == 1


def test_budget_fraction_and_size_are_not_confused():
    from tightfit.commands.args import budget

    assert budget("0.5") == 0.5 and isinstance(budget("0.5"), float)
    assert budget("1") == 1.0
    assert budget("1.5GiB") == int(1.5 * 2**30)
    assert budget("4096B") == 4096


def test_infeasible_plan_exits_3_and_is_documented(capsys):
    code, err = _run(capsys, "plan", "sky", "--layers", "8", "--speeds", "1,1", "--memory", "1MiB")
    assert code == 3 and "tightfit plan sky" in err
    assert 3 in EXIT_CODES
    help_text = build_parser().format_help()
    assert "exit codes:" in help_text and "no plan fits" in help_text
    with pytest.raises(SystemExit):
        main(["plan", "sky", "--help"])
    assert "no plan fits" in capsys.readouterr().out


def test_debug_shows_the_traceback():
    out = subprocess.run([sys.executable, "-m", "tightfit.cli", "--debug", "profile", "model", "--model", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" in out.stderr and "UsageError" in out.stderr
    out = subprocess.run([sys.executable, "-m", "tightfit.cli", "profile", "model", "--model", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_version_and_plain_help(capsys):
    import tightfit

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"tightfit {tightfit.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "serve" in top and "plan" in top and "--verbose" in top and "--quiet" in top
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve_help = capsys.readouterr().out
    assert "``" not in serve_help and "exit codes" in serve_help


def _subparsers(parser):
    import argparse

    for action in parser._actions:  # argparse keeps its sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subparsers(sub):
                    yield f"{name} {inner}", subsub


def test_every_subcommand_and_flag_has_help():
    from energon_infer.serving.serve import build_parser as serve_parser

    missing = []
    for name, sub in [*_subparsers(build_parser()), ("serve", serve_parser())]:
        if not sub.description:
            missing.append(f"{name}: no description")
        for action in sub._actions:
            if action.option_strings and not action.help:
                missing.append(f"{name} {action.option_strings[0]}: no help")
    assert not missing, missing


def test_precision_and_optimizer_lists_match_the_cost_model():
    from tightfit.commands.plan import OPTIMIZERS, PRECISIONS
    from tightfit.planner import cost

    assert set(PRECISIONS) == set(cost.PRECISIONS) and set(OPTIMIZERS) == set(cost.OPTIMIZERS)


@pytest.mark.parametrize("command", [["plugins"], ["doctor"]])
def test_plugins_and_doctor_answer_without_importing_frameworks(command):
    # Timed in a child so the import cost is real: torch alone takes ~3 s on these machines, Lightning ~8 s.
    code = (f"import sys, time; t = time.perf_counter(); from tightfit.cli import main; rc = main({command!r}); "
            "print('HEAVY', sorted(m for m in ('torch', 'lightning', 'torchrec', 'deepspeed') if m in sys.modules)); "
            "raise SystemExit(rc)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
    assert time.perf_counter() - start < 30  # a hang guard, not a timing claim: the check above is the real one


def test_quiet_and_verbose_set_the_log_level(capsys):
    import logging

    from tightfit.console import log

    main(["-q", "plugins"])
    assert log.level == logging.WARNING
    main(["-v", "plugins"])
    assert log.level == logging.DEBUG
    main(["plugins"])
    assert log.level == logging.INFO
    capsys.readouterr()
