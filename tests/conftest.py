from __future__ import annotations

import os

import pytest

# Kernels run under Triton's interpreter on CPU (set before Triton is imported anywhere).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep caches (device profiles, kernels) out of the user's home during tests.
os.environ.setdefault("TIGHTFIT_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "tightfit"))
# DeepSpeed's ops JIT-build into torch's extensions folder, one per Python and not per checkout: two checkouts (or
# venvs) take turns rebuilding each other's op there, and a test waits minutes on the other's build lock.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache",
                                                           "torch_extensions"))


# A pytest-xdist worker starts with COLUMNS=80 and LINES=24 in its environment (set for it, not by the user), which the
# CLI's tables and every child a test starts would take for the terminal's size: a worker gets the controller's.
_TERMINAL_VARS = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["tightfit_terminal_env"] = {k: os.environ.get(k) for k in _TERMINAL_VARS}


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers) each worker computes on one intra-op thread, so the workers
    share the cores instead of each spreading over all of them. A test that needs more threads asks for them
    (``tests.helpers.threads.torch_threads``); children a test starts keep torch's default."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    for k, v in worker.get("tightfit_terminal_env", {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    import torch

    torch.set_num_threads(1)


# The longest files (each a minute or more of child processes), handed out first so that neither worker is left
# running one of them alone at the end. Only the suite's wall time depends on this list.
LONGEST_FIRST = (
    "tests/core/test_cli.py", "tests/energon_infer/test_memory_limit.py", "tests/core/test_gpu_benchmarks.py",
    "tests/lightning_elixir/test_deepspeed_nvme.py", "tests/test_memory_limits.py",
    "tests/torchrec_cache/test_disk_memory.py", "tests/core/test_cli_profile.py",
    "tests/lightning_elixir/test_docs_examples.py", "tests/core/test_kernels.py", "tests/core/test_distributed_share.py",
    "tests/core/test_planner_elixir.py", "tests/core/test_cli_bench.py", "tests/core/test_cost_calibration.py",
    "tests/core/test_gpu_check.py", "tests/test_bench_elixir_disk.py", "tests/lightning_elixir/test_fabric.py",
)


def pytest_collection_modifyitems(config, items):
    """The ``LONGEST_FIRST`` files' tests before the rest, each file's in place: `make test` runs ``--dist loadfile
    --no-loadscope-reorder``, which sends whole test files to a worker (a module's fixtures are built once) in
    collection order."""
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept


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


@pytest.fixture(autouse=True)
def _torch_functions_kept():
    """A test that leaves a torch function replaced (DeepSpeed's ZeRO-3 swaps ``torch.nn.functional.linear`` for its
    own, process-wide) changes the arithmetic of every later test in its worker: it fails here, and the next test
    gets torch's own back."""
    import torch.nn.functional as F

    linear = F.linear
    yield
    if F.linear is not linear:
        replaced, F.linear = F.linear, linear
        pytest.fail(f"the test left torch.nn.functional.linear replaced by {replaced!r}", pytrace=False)
