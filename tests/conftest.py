from __future__ import annotations

import os

import pytest

# Kernels run under Triton's interpreter on CPU (set before Triton is imported anywhere).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep caches (device profiles, kernels) out of the user's home during tests.
os.environ.setdefault("TIGHTFIT_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "tightfit"))


@pytest.fixture(autouse=True)
def _destroy_process_group():
    """A test that leaves a process group behind, or a launcher's rank variables in ``os.environ`` (an in-process
    Lightning Trainer sets MASTER_PORT, LOCAL_RANK, WORLD_SIZE...), must not leak them into the next test: a child
    started later would believe it is one rank of a launched group and wait for peers or reuse a taken port."""
    from tests.helpers.multiprocess import LAUNCHER_VARS

    before = {k: v for k, v in os.environ.items() if k.startswith(LAUNCHER_VARS)}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k in [k for k in os.environ if k.startswith(LAUNCHER_VARS) and k not in before]:
        del os.environ[k]
    os.environ.update(before)


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Mount a tmpfs of the given size on a fresh directory: a real small disk that fills up (root only; skipped
    where mounting is refused). Shared by the disk-tier tests of core and the plugins."""
    import subprocess

    mounted: list = []

    def mount(size: str):
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                             text=True)
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip() or out.returncode}): needs root with mount rights")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say once, at the end of the run, how many committed benchmark results measured code that changed since
    (benchmarks/staleness.py): a warning for whoever reruns them, never a failure."""
    try:
        from tests.helpers.staleness import summary_for_checkout

        line = summary_for_checkout()
    except Exception as e:  # the summary must never turn a run red
        line = f"could not check the benchmark results' staleness: {type(e).__name__}: {e}"
    if line:
        terminalreporter.write_sep("-", "benchmark results")
        terminalreporter.write_line(line)
