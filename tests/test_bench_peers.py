"""benchmarks/peers.py's idle wait (a peer's run returns once the peer's process tree has stopped using the CPU) and
benchmarks/proc_tree.py's walk of a process tree, which it and the offload children sum their counters over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.peers import tree_cpu_seconds, wait_until_idle
from benchmarks.proc_tree import descendants, stat_fields

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

# A parent that starts a child spinning for a while, then both sleep: the CPU is the grandchild's.
_SPIN_THEN_SLEEP = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import time\\nend = time.time() + float(__import__(\"sys\").argv[1])\\nwhile time.time() < end: pass\\n"
    "time.sleep(60)', sys.argv[1]])\n"
    "print('started', flush=True)\n"
    "time.sleep(60)\n"
)


def _spinner(seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SPIN_THEN_SLEEP, str(seconds)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the grandchild too
    proc.wait()


def test_tree_cpu_seconds_counts_the_children_and_says_none_for_a_gone_process():
    proc = _spinner(0.6)
    try:
        first = tree_cpu_seconds(proc.pid)
        time.sleep(0.4)
        later = tree_cpu_seconds(proc.pid)
        assert first is not None and later is not None
        assert later - first > 0.1  # the grandchild's spinning counts toward the parent's tree
    finally:
        _stop(proc)
    assert tree_cpu_seconds(proc.pid) is None


def test_wait_until_idle_waits_out_a_busy_tree_and_returns_at_once_for_an_idle_one():
    proc = _spinner(1.0)
    try:
        waited = wait_until_idle(proc.pid, max_wait_s=5.0)
        assert 0.5 < waited < 4.0  # the ~1 s of spinning, not the 5 s cap
        assert wait_until_idle(proc.pid, max_wait_s=5.0) < 0.5  # idle now: one window
    finally:
        _stop(proc)
    assert wait_until_idle(proc.pid) < 0.5  # gone: nothing to wait for


def test_descendants_walks_the_whole_tree_from_its_root():
    proc = _spinner(0.0)
    try:
        tree = descendants(proc.pid)
        assert tree is not None and tree[0] == proc.pid and len(tree) == 2  # the parent, then the grandchild
        child = tree[1]
        fields = stat_fields(child)
        assert fields is not None and int(fields[1]) == proc.pid
        assert descendants(child) == [child]
        mine = descendants(os.getpid())
        assert mine is not None and proc.pid in mine and child in mine  # started by this process: below it too
    finally:
        _stop(proc)
    assert descendants(proc.pid) is None and stat_fields(proc.pid) is None
