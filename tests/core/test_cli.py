from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tightfit.cli import main


def _tightfit(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "tightfit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_console_script_installed():
    import shutil

    exe = shutil.which("tightfit") or str(__import__("pathlib").Path(sys.executable).parent / "tightfit")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for cmd in ("plugins", "doctor", "demo", "bench"):
        assert cmd in out.stdout


def test_plugins_table(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header.split()[:4] == ["plugin", "kind", "from", "status"]
    for name in ("elixir", "energon", "torchrec_cache", "sky"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), out


def test_unknown_command_names_the_known_ones(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "plugins" in err and "doctor" in err


def test_doctor_json_reports_versions():
    out = _tightfit("doctor", "--json", "--imports")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["torch"].startswith("2.")
    assert report["gloo"] is True
    from tightfit.kernels.packed_linear import packing_available

    assert report["onednn_packing"] is packing_available()
    assert report["torch"] and report["Lightning"]["usable"] in (True, False)
    assert "importing torch" in out.stderr  # progress is shown while it probes
    fast = _tightfit("doctor", "--json")
    assert fast.returncode == 0, fast.stderr
    quick = json.loads(fast.stdout)
    assert quick["torch"] == report["torch"] and quick["imports_checked"] is False
    assert quick["tokenizers"]["version"] and quick["Jinja2"]["version"]
    # With --imports the native kernels are built, as a first call would; a C compiler is on these machines.
    from tightfit.kernels.varlen_attention_cpu import native_attention_error

    assert report["C compiler"]["usable"] is (native_attention_error() == ""), report["C compiler"]


def test_doctor_probe_reports_a_crash_a_hang_and_an_error_and_goes_on_after_each(tmp_path, monkeypatch):
    """``--imports`` imports the packages in one child in order; one that kills the child, hangs (printing all the
    while) or raises is reported by name, and a new child imports the ones after it."""
    from tightfit.commands.doctor import _probe

    bodies = {"p_fine": "", "p_crash": "import os\nos._exit(7)", "p_hang": "import time\nwhile True:\n    print('still here', flush=True)\n    time.sleep(0.2)",
              "p_raise": "raise ImportError('p_raise needs a library this machine lacks')", "p_after": "print('hi')"}
    for name, body in bodies.items():
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    started: list[str] = []
    got = _probe(list(bodies), 2.0, started.append)
    assert started == list(bodies)
    assert got["p_fine"] == (True, "imports") and got["p_after"] == (True, "imports")  # printing is no answer
    assert got["p_crash"] == (False, "import exited with code 7")
    assert got["p_hang"] == (False, "import did not finish in 2 s")
    assert got["p_raise"] == (False, "ImportError: p_raise needs a library this machine lacks")


def test_doctor_says_why_the_native_kernels_are_off():
    missing = json.loads(_tightfit("doctor", "--json", env={"CC": "no-such-cc"}).stdout)["C compiler"]
    assert missing["usable"] is False and "no-such-cc not found" in missing["detail"]
    off = json.loads(_tightfit("doctor", "--json", env={"TIGHTFIT_NATIVE": "0"}).stdout)["C compiler"]
    assert off["usable"] is False and "TIGHTFIT_NATIVE=0" in off["detail"]


def test_demo_runs_the_tour_within_120_columns():
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # not a terminal: tables fit 120 columns
    # From the checkout, as `make demo` runs it (its runs/ is git-ignored; paths printed are as long as there).
    out = subprocess.run([sys.executable, "-m", "tightfit.cli", "demo"], capture_output=True, text=True,
                         timeout=1800, env=env, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Tour summary" in out.stdout
    for name in ("elixir", "energon", "torchrec_cache", "sky"):
        assert f"== {name}" in out.stdout
    # `make demo` fits a 120-column terminal: ours, the plugins' and the frameworks' lines alike.
    wide = [f"{stream} ({len(line)} columns): {line[:150]}" for stream, text in (("stdout", out.stdout),
                                                                                ("stderr", out.stderr))
            for line in text.splitlines() if len(line) > 120]
    assert not wide, "make demo lines wider than 120 columns:\n" + "\n".join(wide)


def test_demo_rejects_unknown_only(capsys):
    assert main(["demo", "--only", "nope"]) == 2
    assert "unknown plugin(s) for --only: nope" in capsys.readouterr().out


@pytest.mark.parametrize("value,expected", [("20GiB", 20 * 2**30), ("1.5 GB", 1_500_000_000), ("512MiB", 2**29),
                                            (4096, 4096), ("7", 7)])
def test_parse_bytes(value, expected):
    from tightfit.units import parse_bytes

    assert parse_bytes(value) == expected


def test_parse_bytes_errors():
    from tightfit.units import parse_bytes

    with pytest.raises(ValueError, match="cannot read memory size '20 gigs'.*'24GiB'"):
        parse_bytes("20 gigs")
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-1)


def test_format_table_rejects_ragged_rows():
    from tightfit.units import format_table

    assert "a" in format_table([("1", "2")], ("a", "b"))
    with pytest.raises(ValueError, match="has 1 cells; the header has 2"):
        format_table([("1",)], ("a", "b"))
