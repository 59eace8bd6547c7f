"""``tightfit serve --help`` shows the real defaults: each one is the default of the config field it sets."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from energon_infer.engine.engine_config import FaultConfig, LaunchConfig
from energon_infer.scheduling.scheduler_config import SchedulerConfig
from energon_infer.serving.serve import build_parser
from energon_infer.serving.server_config import ServerConfig
from energon_infer.worker.runtime import RuntimeConfig

# flag -> (config class, field) it sets
FLAGS = {
    "--tp": (RuntimeConfig, "tp"), "--pp": (RuntimeConfig, "pp"), "--dtype": (RuntimeConfig, "dtype"),
    "--kv-cache-tokens": (RuntimeConfig, "kv_cache_tokens"),
    "--max-batch-tokens": (SchedulerConfig, "max_batch_tokens"), "--max-running": (SchedulerConfig, "max_running"),
    "--max-queue": (SchedulerConfig, "max_queue"),
    "--max-restarts": (FaultConfig, "max_restarts"), "--restart-window": (FaultConfig, "restart_window_s"),
    "--step-timeout": (FaultConfig, "step_timeout_s"), "--launcher": (LaunchConfig, "launcher"),
    "--host": (ServerConfig, "host"), "--port": (ServerConfig, "port"),
    "--max-tokens-limit": (ServerConfig, "max_tokens_limit"), "--max-request-bytes": (ServerConfig, "max_request_bytes"),
    "--max-n": (ServerConfig, "max_n"), "--drain-timeout": (ServerConfig, "drain_timeout_s"),
}


def _default(kind: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(kind) if f.name == name)


def test_the_help_text_shows_each_flags_config_default():
    parser = build_parser()
    text = " ".join(parser.format_help().split("options:", 1)[1].split())  # past the usage; argparse wraps lines
    shown = {}
    for flag, (kind, name) in FLAGS.items():
        action = next(a for a in parser._actions if flag in a.option_strings)
        metavar = "{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper()
        found = re.search(re.escape(f"{flag} {metavar} ") + r".*?\(default: ([^)]+)\)", text)
        shown[flag] = found.group(1) if found else None
        assert shown[flag] == str(_default(kind, name)), (flag, shown[flag], _default(kind, name))
        assert action.default == _default(kind, name), flag
    assert shown["--max-batch-tokens"] == "4096"  # the engine's budget (the help once said 4096 where it ran 2048)


_HELP_WITHOUT_TORCH = """
import sys
from tightfit.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "lightning", "torchrec") if m in sys.modules)
print("IMPORTED", ",".join(heavy) or "-")
"""


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]], ids=["tightfit", "serve"])
def test_help_imports_no_framework(argv):
    """``--help`` answers without importing torch (the seconds a user waits on a help text are torch's import)."""
    out = subprocess.run([sys.executable, "-c", _HELP_WITHOUT_TORCH, *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout and "IMPORTED -" in out.stdout, out.stdout[-2000:]
