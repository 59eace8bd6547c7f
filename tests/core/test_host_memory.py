"""``host_available_bytes``: MemAvailable bounded by the memory cgroup limits above the process (v1 and v2), read
from the kernel's files (here crafted ones in a temporary tree, and the real ones under a real limit)."""

from __future__ import annotations

import sys

import pytest

from tightfit.profiler.host_memory import host_available_bytes

MiB, GiB = 1 << 20, 1 << 30


def _tree(tmp_path, cgroup: str, files: dict[str, str], available: int = 8 * GiB):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {16 * GiB // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, root


def test_a_v2_limit_bounds_it_and_inactive_file_pages_count_as_free(tmp_path):
    proc, root = _tree(tmp_path, "0::/a/b\n", {
        "a/b/memory.max": f"{GiB}\n", "a/b/memory.current": f"{600 * MiB}\n",
        "a/b/memory.stat": f"anon {500 * MiB}\ninactive_file {100 * MiB}\n",
        "a/memory.max": "max\n", "a/memory.current": f"{700 * MiB}\n"})
    assert host_available_bytes(proc, root) == GiB - 600 * MiB + 100 * MiB


def test_the_tightest_group_above_the_process_wins(tmp_path):
    proc, root = _tree(tmp_path, "0::/a/b\n", {
        "a/b/memory.max": "max\n", "a/b/memory.current": f"{600 * MiB}\n",
        "a/memory.max": f"{800 * MiB}\n", "a/memory.current": f"{700 * MiB}\n"})
    assert host_available_bytes(proc, root) == 100 * MiB


def test_a_v1_memory_group_bounds_it_and_its_no_limit_value_does_not(tmp_path):
    cgroup = "9:name=systemd:/\n4:memory:/job\n0::/\n"
    limited = {"memory/job/memory.limit_in_bytes": f"{2 * GiB}\n", "memory/job/memory.usage_in_bytes": f"{GiB}\n",
               "memory/job/memory.stat": f"cache {300 * MiB}\ntotal_inactive_file {200 * MiB}\n",
               "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"}
    proc, root = _tree(tmp_path, cgroup, limited)
    assert host_available_bytes(proc, root) == GiB + 200 * MiB
    proc, root = _tree(tmp_path / "unlimited", cgroup, {**limited, "memory/job/memory.limit_in_bytes": "9223372036854771712\n"})
    assert host_available_bytes(proc, root) == 8 * GiB  # MemAvailable alone


def test_without_cgroup_files_it_is_mem_available_and_without_meminfo_none(tmp_path):
    proc, root = _tree(tmp_path, "", {}, available=3 * GiB)
    assert host_available_bytes(proc, root) == 3 * GiB
    (proc / "meminfo").unlink()
    assert host_available_bytes(proc, root) is None


def test_under_a_real_limit_it_reports_what_the_limit_leaves():
    from benchmarks.memlimit import last_json_line, limit_unavailable, run_limited

    if limit_unavailable() is not None:
        pytest.skip(str(limit_unavailable()))
    code = ("import json; from tightfit.profiler.host_memory import host_available_bytes as h; "
            "print(json.dumps({'free': h()}))")
    run = run_limited([sys.executable, "-c", code], 300 * MiB, name="test-host-memory")
    assert run.returncode == 0, run.stderr[-2000:]
    free = last_json_line(run.stdout)["free"]
    assert 0 < free < 300 * MiB  # the interpreter itself took some of the 300 MiB
