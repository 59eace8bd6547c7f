"""The hard memory limit the "larger than memory" benchmarks stand on: it must really bind."""

from __future__ import annotations

import sys

import pytest

from benchmarks.memlimit import last_json_line, limit_unavailable, run_limited

pytestmark = pytest.mark.skipif(limit_unavailable() is not None, reason=str(limit_unavailable()))

MiB = 1 << 20


def _allocate(mib: int) -> list[str]:
    # Touch every page so the memory is really charged, then report it.
    code = f"b = bytearray({mib} * {MiB}); b[::4096] = b'x' * len(b[::4096]); print('{{\"ok\": {mib}}}')"
    return [sys.executable, "-c", code]


def test_a_child_under_its_limit_runs_and_its_peak_is_measured():
    run = run_limited(_allocate(64), 256 * MiB, name="test-under")
    assert run.enforced and run.returncode == 0 and not run.oom_killed
    assert last_json_line(run.stdout) == {"ok": 64}
    assert 64 * MiB <= run.peak_bytes <= 256 * MiB


def test_a_child_over_its_limit_is_killed_and_the_kill_is_reported():
    run = run_limited(_allocate(320), 128 * MiB, name="test-over")
    assert run.enforced and run.oom_killed and run.returncode == -9
    assert run.peak_bytes <= 128 * MiB


def test_children_of_the_child_are_limited_too():
    code = f"import subprocess; subprocess.run({_allocate(320)!r}, check=True)"
    run = run_limited([sys.executable, "-c", code], 128 * MiB, name="test-tree")
    assert run.oom_killed and run.returncode != 0


def test_streaming_a_file_larger_than_the_limit_works(tmp_path):
    # Page cache counts against the limit but is reclaimed, so reading a big file through it is fine.
    big = tmp_path / "big.bin"
    with open(big, "wb") as fh:
        for _ in range(160):
            fh.write(b"\1" * MiB)
    code = f"f = open({str(big)!r}, 'rb'); n = 0\nwhile (c := f.read(1 << 20)): n += len(c)\nprint('{{\"n\": %d}}' % n)"
    run = run_limited([sys.executable, "-c", code], 96 * MiB, name="test-stream")
    assert run.returncode == 0 and not run.oom_killed, run.stderr
    assert last_json_line(run.stdout) == {"n": 160 * MiB}


def test_bad_limit_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="limit_bytes=0: a memory limit must be positive"):
        run_limited(["true"], 0, name="test-bad")


def test_an_interrupted_run_leaves_no_group_and_no_process_behind(tmp_path):
    import os
    import signal
    import time

    from benchmarks.memlimit import CGROUP_V1_MEMORY

    pid_file = tmp_path / "grandchild"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(Interrupted):
            run_limited([sys.executable, "-c", code], 256 * MiB, name="test-interrupted")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not (CGROUP_V1_MEMORY / f"tightfit-test-interrupted-{os.getpid()}").exists()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{grandchild}") and \
            open(f"/proc/{grandchild}/stat").read().split()[2] != "Z":
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{grandchild}") or open(f"/proc/{grandchild}/stat").read().split()[2] == "Z"
