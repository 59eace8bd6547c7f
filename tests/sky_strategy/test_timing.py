"""Sky's clocks: link bandwidth includes the wait for the transfer; stage compute never waits on the device.

On a GPU, NCCL's send/recv return once queued and kernels run asynchronously, so both measurements
hinge on *when* the clock is read. Here the asynchronous completion is played by an injected wait
(``sync``) and by intervals that resolve only when read (what CUDA events do); the pipeline and the
gloo ranks are real.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.multiprocess import free_port, run_distributed
from tests.helpers.runif import RunIf

DELAY = 0.05


def _links_with_a_slow_completion(rank: int, world: int) -> list[list[float]]:
    from sky_strategy.profiling import measure_links

    def sync() -> None:  # the transfer "completes" only when waited for, as a queued NCCL op does
        time.sleep(DELAY)

    return measure_links(4096, device=torch.device("cpu"), repeats=2, sync=sync)


@RunIf(min_world=2)
def test_measure_links_times_until_the_transfer_completes():
    """The wait after the exchange is inside the timed region: a 4 KiB ping-pong that completes only
    after a 50 ms wait cannot report more than 4096 / 25 ms (one way), whatever the send/recv calls cost."""
    for links in run_distributed(_links_with_a_slow_completion, 2, timeout=120):
        assert links[0][0] == links[1][1] == float("inf")
        assert all(0 < links[a][b] <= 4096 / (DELAY / 2) * 1.001 for a, b in ((0, 1), (1, 0))), links


class _LazyInterval:
    """A CUDA-event-like interval: its time is known only when read (``seconds`` would block on a GPU)."""

    def __init__(self, log: list[str], seconds: float) -> None:
        self.log, self._s = log, seconds

    def seconds(self) -> float:
        self.log.append("read")
        return self._s


class _LazyTimer:
    def __init__(self) -> None:
        self.log: list[str] = []

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, token: float) -> _LazyInterval:
        self.log.append("chunk")
        return _LazyInterval(self.log, 0.01)


def _one_stage(slowdown: float):
    from torch.distributed.pipelining import ScheduleGPipe

    from sky_strategy.layers import TimedStage

    timer = _LazyTimer()
    stage = TimedStage(nn.Sequential(nn.Linear(4, 4)), 0, 1, torch.device("cpu"), slowdown=lambda: slowdown,
                       timer=timer)
    sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean())
    sched.step(torch.randn(4, 4), target=torch.randn(4, 4))
    return stage, timer


def test_timed_stage_reads_its_intervals_once_per_step_not_per_chunk():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    stage, timer = _one_stage(1.0)
    assert stage.chunks_run == 2 and timer.log == ["chunk"] * 4  # 2 forward + 2 backward, none read yet
    assert abs(stage.busy_s - 0.04) < 1e-12                      # read now, once each
    assert timer.log == ["chunk"] * 4 + ["read"] * 4
    stage.busy_s = 0.0
    assert stage.busy_s == 0.0

    slowed, timer = _one_stage(3.0)  # a slowed rank must know each chunk's time to sleep 2x it
    assert timer.log == ["chunk", "read"] * 4
    assert abs(slowed.busy_s - 3 * 0.04) < 1e-12


def test_stage_timer_uses_cuda_events_on_a_gpu_only():
    from sky_strategy.layers import EventTimer, HostTimer, stage_timer

    assert isinstance(stage_timer(torch.device("cpu")), HostTimer)
    assert isinstance(stage_timer(torch.device("cuda", 0)), EventTimer)  # constructing it needs no GPU
    t = HostTimer()
    token = t.start()
    time.sleep(0.01)
    assert t.stop(token).seconds() >= 0.009
