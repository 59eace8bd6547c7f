"""Run a command under a hard memory limit and read back what it really used (``benchmarks/README.md``, "Beyond memory, proved").

"Larger than memory" is shown under a kernel-enforced limit, never by a budget the code promises to
respect. On these machines that is a cgroup v1 memory group: the child joins the group
before it executes (so every process it spawns, gloo ranks included, is counted), the page cache it
fills counts too (and is reclaimed under pressure), and there is no swap to hide behind. After the
child exits the group's high-water mark and the OOM killer's count are read, and the group removed.

Where no group can be made (not root, no memory controller), :func:`run_limited` still runs the
command, unlimited, and says why in ``LimitedRun.reason``; a report must then say the figure was
not taken under a limit.

Example:
    >>> run = run_limited([sys.executable, "-c", "print('hi')"], 256 << 20, name="doctest")
    >>> run.returncode, run.stdout.strip()
    (0, 'hi')
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["LimitedRun", "limit_unavailable", "run_limited", "drop_page_cache", "last_json_line"]

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True, slots=True)
class LimitedRun:
    """What one command did under its limit.

    Args:
        returncode: the child's exit status (negative: killed by that signal; -9 with ``oom_killed`` is the limit).
        limit_bytes: the limit asked for.
        enforced: whether a kernel limit was in place (False: ran unlimited, see ``reason``).
        peak_bytes: the group's high-water mark (memory.max_usage_in_bytes, page cache included); None unenforced.
        oom_killed: whether the OOM killer fired inside the group.
        wall_seconds: wall time of the child.
        stdout / stderr: what it printed.
        reason: why the limit was not enforced, when it was not.
    """

    returncode: int
    limit_bytes: int
    enforced: bool
    peak_bytes: int | None
    oom_killed: bool
    wall_seconds: float
    stdout: str
    stderr: str
    reason: str | None = None

    def summary(self) -> dict[str, object]:
        """The fields a result JSON records (no captured output)."""
        out = asdict(self)
        out.pop("stdout")
        out["stderr_tail"] = out.pop("stderr")[-2000:]
        return out


def limit_unavailable() -> str | None:
    """None where :func:`run_limited` can enforce a limit here; otherwise why not, in one line."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "memory limits need Linux cgroups; this is not Linux"
    if os.geteuid() != 0:
        return "creating a cgroup needs root; run the benchmark as root to enforce the memory limit"
    if not (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP_V1_MEMORY}; mount it or run where one exists"
    return None


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    # Older kernels have no oom_kill counter; under_oom at exit is the best evidence left.
    return 0


def _remove_group(group: Path) -> None:
    for _ in range(50):
        pids = [p for p in (group / "cgroup.procs").read_text().split() if p]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.05)


def run_limited(
    cmd: list[str], limit_bytes: int, *, name: str, env: dict[str, str] | None = None,
    cwd: str | Path | None = None, timeout: float | None = None,
) -> LimitedRun:
    """Run ``cmd`` with its whole process tree limited to ``limit_bytes`` of memory (page cache included).

    ``name`` makes the group's directory unique among concurrent benchmarks (the pid is appended).
    """
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes={limit_bytes}: a memory limit must be positive; pass the bytes to allow")
    reason = limit_unavailable()
    group = CGROUP_V1_MEMORY / f"tightfit-{name}-{os.getpid()}"
    if reason is None:
        try:
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if (group / "memory.memsw.limit_in_bytes").exists():
                (group / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError as exc:
            reason = f"could not create the cgroup {group}: {exc}"
            if group.exists():
                _remove_group(group)

    procs = str(group / "cgroup.procs")

    def join_group() -> None:  # runs in the child between fork and exec
        with open(procs, "w") as fh:
            fh.write(str(os.getpid()))

    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True,
            preexec_fn=join_group if reason is None else None,
        )
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = -signal.SIGKILL
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = (exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")) + \
            f"\n[memlimit] killed after the {timeout} s timeout"
    except BaseException:  # interrupted (Ctrl-C, SIGTERM, an error): kill what is left of the tree, drop the group
        if reason is None:
            _remove_group(group)
        raise
    wall = time.perf_counter() - start
    if reason is not None:
        return LimitedRun(returncode, limit_bytes, False, None, False, wall, stdout, stderr, reason)
    try:
        peak = _read_int(group / "memory.max_usage_in_bytes")
        oom = _oom_kills(group) > 0
    finally:
        _remove_group(group)
    return LimitedRun(returncode, limit_bytes, True, peak, oom, wall, stdout, stderr)


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only), so the next reader meets the disk, not RAM."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def last_json_line(stdout: str) -> dict:
    """The last line of ``stdout`` that parses as a JSON object: how a limited child hands back its numbers."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError("the child printed no JSON object line; it must print its result as one JSON line last")


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m benchmarks.memlimit BYTES CMD...
    run = run_limited(sys.argv[2:], int(sys.argv[1]), name="cli")
    print(json.dumps(run.summary(), indent=1))
    sys.exit(run.returncode)
