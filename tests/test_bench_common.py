"""benchmarks/common.py records what a result measured: the project files the benchmark imported (in its own
process and in the ranks it spawned), its script, and the child scripts it names, so a figure goes stale only
when code it measured changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str, file: Path | None) -> types.ModuleType:
    mod = types.ModuleType(name)
    if file is not None:
        mod.__file__ = str(file)
    return mod


def test_imported_sources_keeps_the_projects_files_only(tmp_path):
    from benchmarks.common import imported_sources

    (tmp_path / "core").mkdir()
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    modules = {
        "a": _module("a", tmp_path / "core" / "units.py"),
        "b": _module("b", tmp_path / ".venv" / "lib" / "torch.py"),   # an installed package inside the checkout
        "c": _module("c", tmp_path.parent / "elsewhere.py"),           # outside the checkout
        "d": _module("d", None),                                       # a built-in: no file
        "e": _module("e", tmp_path / "benchmarks" / "demo.py"),
    }
    assert imported_sources(tmp_path, modules) == ["benchmarks/demo.py", "core/units.py"]


def test_imported_sources_include_the_native_kernels_c_files():
    """A figure measured through a native kernel goes stale when its C source (or a header) changes."""
    import tightfit.kernels.sources
    from benchmarks.common import imported_sources

    root = Path(__file__).resolve().parents[1]
    found = imported_sources(root, {"tightfit.kernels.sources": tightfit.kernels.sources})
    assert {"core/kernels/sources.py", "core/kernels/cpu/quant_linear.c", "core/kernels/cpu/quant_a8.h",
            "core/kernels/cpu/tf_fork.h"} <= set(found), found


def test_measured_paths_add_the_script_the_shared_helpers_and_named_children():
    from benchmarks.common import measured_paths

    paths = measured_paths("cost_model", measures=("benchmarks/_offload_children.py",))
    assert {"benchmarks/cost_model.py", "benchmarks/common.py", "benchmarks/_offload_children.py"} <= set(paths)
    assert "core" not in paths and "plugins" not in paths  # no longer the whole tree by default
    assert paths == sorted(set(paths))


def test_write_result_records_the_modules_the_benchmark_imported(tmp_path):
    """A benchmark that imports tightfit.units (and nothing of the plugins) records that file, not the plugins."""
    code = ("import tightfit.units\nfrom benchmarks.common import write_result\n"
            "write_result('demo_bench', title='t', params={}, results={}, markdown='m', "
            "measures=('benchmarks/_elixir_disk_child.py',))\n")
    env = {**os.environ, "TIGHTFIT_BENCH_RESULTS": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    commit = json.loads((tmp_path / "demo_bench.json").read_text())["commit"]
    paths = commit["paths"]
    assert "core/units.py" in paths and "core/__init__.py" in paths and "benchmarks/common.py" in paths
    assert "benchmarks/_elixir_disk_child.py" in paths
    assert not any(p.startswith("plugins/") for p in paths), paths
    assert not any(p.startswith(".") for p in paths), paths


def _rank(rank, world, port, quick, repeats, out_path):
    import tightfit.serde  # noqa: F401  (the parent never imports it: only the ranks' sources can name it)

    if rank == 0:
        Path(out_path).write_text(json.dumps({"world": world}))


def test_run_two_ranks_adds_what_the_ranks_imported(monkeypatch):
    import benchmarks.common as common

    monkeypatch.setattr(common, "_CHILD_SOURCES", set())
    assert common.run_two_ranks(_rank, True, 1) == {"world": 2}
    assert "core/serde.py" in common._CHILD_SOURCES
    assert "core/serde.py" in common.measured_paths("demo_bench")


def test_a_child_reports_the_files_it_imported_and_the_parent_measures_those():
    """A child process tags its result JSON with the project files it imported (benchmarks._child_sources): the
    memory-limit helper it imported is there, a kernel it never imported is not, and collect takes the lists out
    of the outputs."""
    from benchmarks._child_sources import SOURCES_KEY, collect

    code = ("import json, tightfit.units\nfrom benchmarks._child_sources import tag\n"
            "print(json.dumps(tag({'ok': True})))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"core/units.py", "benchmarks/_child_sources.py", "benchmarks/common.py"} <= set(out[SOURCES_KEY])
    assert "core/kernels/quant_linear.py" not in out[SOURCES_KEY]
    measures = collect([[out]], fallback=("core",))
    assert "core/units.py" in measures and "core" not in measures and SOURCES_KEY not in out


def test_a_contender_whose_children_all_died_counts_its_folders_whole():
    """collect per group (the repeats of one contender): one repeat reporting is enough for its group; a group
    where none reported (every child killed before printing) falls back to the folders its code comes from."""
    from benchmarks._child_sources import SOURCES_KEY, collect

    reported = {SOURCES_KEY: ["core/units.py"], "ok": True}
    killed = {"ok": False, "error": "exit -9, no result line"}
    assert collect([[dict(reported), dict(killed)]], fallback=("core",)) == ("core/units.py",)
    assert collect([[dict(reported)], [dict(killed)]], fallback=("core", "plugins/x")) == (
        "core", "core/units.py", "plugins/x")
    assert collect([], fallback=("core",)) == ()


def test_paired_takes_the_median_of_per_round_ratios():
    """A ratio of two contenders is the median of their round-by-round ratios, with wins and the range beside it,
    not a ratio of two separately taken medians (here those would read 1.00x)."""
    from benchmarks.common import format_paired, paired

    a, b = [10.0, 30.0, 20.0, 21.0, 9.0], [20.0, 10.0, 21.0, 20.0, 10.0]
    assert statistics_median_ratio(a, b) == 1.0
    p = paired(a, b)
    assert p["ratios"] == [0.5, 3.0, 20 / 21, 1.05, 0.9]
    assert p["median"] == 20 / 21 and p["min"] == 0.5 and p["max"] == 3.0
    assert p["wins"] == 2 and p["rounds"] == 5 and p["higher_is_better"] is True
    assert format_paired(p) == "0.95x (2/5 rounds, 0.50-3.00x)"


def statistics_median_ratio(a, b):
    import statistics

    return statistics.median(a) / statistics.median(b)


def test_paired_wins_follow_the_direction_of_better():
    """Times: lower wins; a tie is nobody's win."""
    from benchmarks.common import format_paired, paired

    p = paired([1.0, 2.0, 3.0], [2.0, 2.0, 2.0], higher_is_better=False)
    assert p["wins"] == 1 and p["median"] == 1.0
    assert paired([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])["wins"] == 1
    assert format_paired(paired([1.02], [1.0]), digits=3) == "1.020x (1/1 rounds, 1.020-1.020x)"


def test_paired_refuses_unpaired_rounds():
    import pytest

    from benchmarks.common import paired

    with pytest.raises(ValueError, match="3 rounds against 2"):
        paired([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="0 rounds against 0"):
        paired([], [])
    with pytest.raises(ValueError, match="non-zero baseline"):
        paired([1.0], [0.0])
