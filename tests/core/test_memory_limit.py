"""``tightfit.memory_limit.read_memory``: the machine's memory and the tightest memory cgroup limit above the process
(v1 and v2, nested groups, "max", v1's no-limit value, unreadable files), read from crafted trees and, under a real
cgroup v1 limit, from the kernel's own files; and no other module of tightfit reads those files itself."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit.memory_limit import NO_LIMIT, MemoryReading, read_memory

MiB, GiB = 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parents[2]


def _tree(base: Path, cgroup: str, files: dict[str, str], total: int = 16 * GiB, available: int = 8 * GiB,
          meminfo: str | None = None) -> tuple[Path, Path]:
    proc, root = base / "proc", base / "cgroup"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    text = meminfo if meminfo is not None else f"MemTotal: {total // 1024} kB\nMemAvailable: {available // 1024} kB\n"
    (proc / "meminfo").write_text(text)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "statm").write_text("1000 250 10 1 0 100 0\n")
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return proc, root


def test_no_cgroup_is_the_machine_and_the_resident_set_is_read(tmp_path):
    proc, root = _tree(tmp_path, "0::/\n", {}, total=16 * GiB, available=3 * GiB)
    r = read_memory(proc, root)
    assert (r.total, r.available, r.limit, r.capacity, r.free, r.limited) == (16 * GiB, 3 * GiB, None, 16 * GiB,
                                                                              3 * GiB, False)
    assert r.resident == 250 * os.sysconf("SC_PAGE_SIZE")
    assert "no memory limit" in r.describe()


def test_v2_limit_names_its_file_and_counts_inactive_file_pages_as_free(tmp_path):
    proc, root = _tree(tmp_path, "0::/job/step\n", {
        "job/step/memory.max": f"{GiB}\n", "job/step/memory.current": f"{600 * MiB}\n",
        "job/step/memory.stat": f"anon {500 * MiB}\ninactive_file {100 * MiB}\n",
        "job/memory.max": "max\n", "job/memory.current": f"{700 * MiB}\n"})
    r = read_memory(proc, root)
    assert (r.limit, r.usage, r.reclaimable, r.capacity) == (GiB, 600 * MiB, 100 * MiB, GiB)
    assert r.free == GiB - 600 * MiB + 100 * MiB and r.limited
    assert r.limit_file == str(root / "job" / "step" / "memory.max")
    assert "memory limit 1.00 GiB" in r.describe() and r.limit_file in r.describe()


def test_v1_limit_and_its_no_limit_value(tmp_path):
    cgroup = "9:name=systemd:/\n4:memory:/slurm/job\n0::/\n"
    files = {"memory/slurm/job/memory.limit_in_bytes": f"{2 * GiB}\n",
             "memory/slurm/job/memory.usage_in_bytes": f"{GiB}\n",
             "memory/slurm/job/memory.stat": f"cache {300 * MiB}\ntotal_inactive_file {200 * MiB}\n",
             "memory/slurm/memory.limit_in_bytes": "9223372036854771712\n",
             "memory/slurm/memory.usage_in_bytes": f"{GiB}\n"}
    r = read_memory(*_tree(tmp_path / "a", cgroup, files))
    assert (r.limit, r.free, r.limit_file.endswith("job/memory.limit_in_bytes")) == (2 * GiB, GiB + 200 * MiB, True)
    unlimited = {**files, "memory/slurm/job/memory.limit_in_bytes": "9223372036854771712\n"}
    assert read_memory(*_tree(tmp_path / "b", cgroup, unlimited)).limit is None


def test_a_limit_above_the_machine_is_no_limit_and_capacity_is_the_machine(tmp_path):
    proc, root = _tree(tmp_path, "0::/big\n", {"big/memory.max": f"{64 * GiB}\n", "big/memory.current": f"{GiB}\n"},
                       total=16 * GiB, available=15 * GiB)
    r = read_memory(proc, root)
    assert r.limit == 64 * GiB and r.capacity == 16 * GiB and not r.limited and r.free == 15 * GiB


def test_unreadable_files_are_left_out_never_raised(tmp_path):
    proc, root = _tree(tmp_path, "0::/g\n", {"g/memory.max": "garbage\n", "g/memory.current": f"{GiB}\n"},
                       meminfo="MemTotal: lots\n")
    (root / "g" / "memory.current").unlink()
    (root / "g" / "memory.current").mkdir()  # a directory where a file should be: read fails
    r = read_memory(proc, root)
    assert (r.total, r.available, r.limit) == (0, 0, None)
    assert read_memory(tmp_path / "nothing", tmp_path / "none") == MemoryReading(total=0, available=0)


_GROUP = st.tuples(st.one_of(st.none(), st.integers(1, 1 << 40), st.just(NO_LIMIT), st.just(-1)),  # limit
                   st.integers(0, 1 << 40),  # usage
                   st.integers(0, 1 << 38))  # inactive file pages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=st.lists(_GROUP, min_size=1, max_size=4), v1=st.booleans(),
       total=st.integers(1 << 20, 1 << 42), available=st.integers(0, 1 << 42))
def test_any_nested_tree_gives_the_tightest_group_or_none(tmp_path_factory, groups, v1, total, available):
    """Whatever the files hold (numbers, "max", v1's no-limit value, a negative or missing value): the reading is
    the group that leaves the least free, MemAvailable bounds free, capacity never exceeds the machine."""
    base = tmp_path_factory.mktemp("tree")
    names = [f"g{i}" for i in range(len(groups))]
    files: dict[str, str] = {}
    top = "memory/" if v1 else ""
    limit_name, usage_name, key = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") if v1
                                   else ("memory.max", "memory.current", "inactive_file"))
    expect: list[tuple[int, int]] = []
    for depth, (limit, usage, inactive) in enumerate(groups):
        d = top + "/".join(names[:depth + 1])
        if limit is None:
            continue  # no files: not a group with a limit
        files[f"{d}/{limit_name}"] = "max\n" if limit == NO_LIMIT and not v1 else f"{limit}\n"
        files[f"{d}/{usage_name}"] = f"{usage}\n"
        files[f"{d}/memory.stat"] = f"{key} {inactive}\n"
        if 0 < limit < NO_LIMIT:
            expect.append((max(0, limit - usage + inactive), limit))
    cgroup = f"4:memory:/{'/'.join(names)}\n" if v1 else f"0::/{'/'.join(names)}\n"
    r = read_memory(*_tree(base, cgroup, files, total=total // 1024 * 1024, available=available // 1024 * 1024))
    if not expect:
        assert r.limit is None and r.free == r.available and r.capacity == r.total
        return
    free, limit = min(expect)
    assert r.limit == limit
    assert r.free == (min(r.available, free) if r.available else free)
    assert r.capacity == min(limit, r.total) and r.capacity <= r.total
    assert 0 <= r.free and r.share(3) == r.capacity // 3


def test_under_a_real_limit_a_child_reads_it():
    from benchmarks.memlimit import last_json_line, limit_unavailable, run_limited

    if limit_unavailable() is not None:
        pytest.skip(str(limit_unavailable()))
    code = ("import json; from tightfit.memory_limit import read_memory; r = read_memory(); "
            "print(json.dumps(r.to_dict()))")
    run = run_limited([sys.executable, "-c", code], 300 * MiB, name="test-memory-reading")
    assert run.returncode == 0, run.stderr[-2000:]
    got = last_json_line(run.stdout)
    assert got["limit_bytes"] == 300 * MiB and got["capacity_bytes"] == 300 * MiB
    assert "tightfit-test-memory-reading" in got["limit_file"] and got["limit_file"].endswith("limit_in_bytes")
    assert 0 < got["free_bytes"] < 300 * MiB and 0 < got["usage_bytes"] < 300 * MiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_a_settled_reading_does_not_count_freed_heap_pages_as_held():
    """Freed allocations below the heap's top stay resident until trimmed: a planner reading what the process holds
    right after a measurement would count them as its reserve. ``settle=True`` gives them back first."""
    code = ("import json; from tightfit.memory_limit import read_memory\n"
            "blocks = [bytearray(8192) for _ in range(12000)]; top = bytearray(8192); del blocks\n"
            "print(json.dumps([read_memory().resident, read_memory(settle=True).resident]))")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    held, settled = json.loads(out.splitlines()[-1])
    assert held - settled > 12000 * 8192 // 2, (held, settled)


_READERS = re.compile(r"meminfo|\bmemory\.(max|limit_in_bytes|current|usage_in_bytes)\b|SC_AVPHYS_PAGES|MemAvailable")


def _literals(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module that are not docstrings (a docstring may name the files)."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_module_but_core_s_reading_reads_the_memory_files():
    """One reading of memory: every profiler and planner goes through tightfit.memory_limit, so no other source
    file of core or the plugins names /proc/meminfo, a cgroup's memory files or the free-pages sysconf in code."""
    allowed = {ROOT / "core" / "memory_limit.py"}
    offenders = []
    for folder in ("core", "plugins"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in allowed:
                continue
            for node in _literals(ast.parse(path.read_text())):
                if _READERS.search(node.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:80]!r}")
    assert not offenders, "read memory through tightfit.memory_limit.read_memory():\n" + "\n".join(offenders)


def test_the_check_finds_a_reader_where_there_is_one():
    tree = ast.parse('"""Reads /proc/meminfo."""\nopen("/proc/meminfo")\nos.sysconf("SC_AVPHYS_PAGES")\n')
    assert [n.value for n in _literals(tree) if _READERS.search(n.value)] == ["/proc/meminfo", "SC_AVPHYS_PAGES"]
