"""Host memory of the streamed optimizer step, measured: the resident set grows by the staging sets (plus a
stated margin), not by the optimizer state, which a step all in RAM holds whole (RSS sampled every ~0.5 ms
from /proc/self/statm while the streamed step runs)."""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

from lightning_elixir.disk_state import DiskOptimizerState
from lightning_elixir.step import ElixirOptimizer
from tightfit.storage import TensorStore

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2**20
# The stated margin over the staging sets: each store worker's two aligned buffers of one extent (bounce and
# merge scratch, allocated once: tightfit.storage.engine), plus 8 MiB for views, futures, allocator slack and
# the store's index.
WORKERS, EXTENT = 2, MiB


def margin() -> int:
    return WORKERS * 2 * EXTENT + 8 * MiB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _peak_during(fn) -> int:
    """Peak RSS growth over the value before ``fn`` runs."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], _rss()) - base


def _give_back_free_heap() -> None:
    """glibc's ``malloc_trim(0)``: free heap pages go back to the kernel (a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _model() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(n, generator=g)) for n in (3_000_001, 2_500_000, 2_000_000, 1_000_003)]


def _grads(params: list[nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_streamed_step_grows_host_memory_by_the_staging_area_only(tmp_path):
    torch.set_num_threads(1)
    chunk = 2**18  # 1 MiB per state tensor per staging set: 4 MiB of staging for AdamW
    params = _model()
    opt = torch.optim.AdamW(params, lr=1e-3)
    with TensorStore(tmp_path, workers=WORKERS, extent_bytes=EXTENT) as store:
        state = DiskOptimizerState(opt, [(0, params[:2]), (1, params[2:])], store, chunk_elements=chunk)
        stepper = ElixirOptimizer(opt, disk=state)
        _grads(params, 1)
        stepper.step()  # the first step initialises the state (chunk by chunk) and starts the store's workers
        for seed in (2, 3):
            _grads(params, seed)
            grown = _peak_during(stepper.step)
            assert grown <= state.staging_bytes + margin(), (grown, state.staging_bytes)
            print(f"streamed step: RSS +{grown / MiB:.1f} MiB, staging {state.staging_bytes / MiB:.1f} MiB")
        assert state.staging_bytes == 2 * 2 * chunk * 4
        io = state.last_step
        assert io is not None and io.bytes_read == io.bytes_written == state.disk_bytes()
        assert io.chunks == len(state.chunks) and 0 < io.wait_seconds <= io.seconds and io.bytes_per_s > 0
        on_disk = state.disk_bytes()
    # The same model all in RAM: its first step alone allocates the whole state (8 bytes per element). The heap
    # memory freed above would otherwise be reused without RSS growing: give it back to the kernel first.
    ram_params = _model()
    ram = torch.optim.AdamW(ram_params, lr=1e-3)
    _grads(ram_params, 1)
    _give_back_free_heap()
    grown_ram = _peak_during(ram.step)
    print(f"RAM step: RSS +{grown_ram / MiB:.1f} MiB")
    numel = sum(p.numel() for p in ram_params)
    assert grown_ram >= 0.9 * numel * 8 and on_disk >= numel * 8
    # And the streamed steps gave the RAM run's numbers.
    for seed in (2, 3):
        _grads(ram_params, seed)
        ram.step()
    for a, b in zip(params, ram_params):
        assert a.detach().equal(b.detach())
