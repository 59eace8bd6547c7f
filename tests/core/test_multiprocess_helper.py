from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.multiprocess import DistributedTestError, run_distributed
from tests.helpers.runif import RunIf


def _all_reduce(rank: int, world_size: int, base: int) -> float:
    t = torch.tensor([float(base + rank)])
    dist.all_reduce(t)
    return t.item()


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def _hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(600)


@RunIf(min_world=2)
def test_all_ranks_return_their_result():
    assert run_distributed(_all_reduce, 2, args=(10,)) == [21.0, 21.0]


def _tensor_out(rank: int, world_size: int) -> dict:
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    return {"t": t, "rank": rank}


@RunIf(min_world=2)
def test_ranks_can_return_tensors():
    outs = run_distributed(_tensor_out, 2)
    for r, out in enumerate(outs):
        assert out["rank"] == r
        assert torch.equal(out["t"], torch.full((3,), 1.0))


@RunIf(min_world=2)
def test_first_failure_propagates_with_traceback():
    with pytest.raises(DistributedTestError, match=r"(?s)failed on rank 1 of 2.*ValueError: rank one is unhappy"):
        run_distributed(_fails_on_rank_one, 2, timeout=60)


@RunIf(min_world=2)
def test_hang_times_out_instead_of_blocking():
    # Rank 1 sleeps for 600 s, so any timeout well under that shows the run is cut off rather than waited out;
    # a short one keeps the test short (whether the ranks reached the barrier by then does not matter).
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out after 3 s"):
        run_distributed(_hangs, 2, timeout=3)
    assert time.monotonic() - start < 60  # the hung ranks are killed, not joined to the end of their sleep


_KEPT: list = []


def _leaves_gloo_state(rank: int, world_size: int, marker_dir: str) -> int:
    import atexit
    from pathlib import Path

    # State that interpreter finalization would have to tear down in C++: a subgroup kept alive by a
    # Python reference, and a receive no rank will ever match (a gloo thread stays blocked on it).
    sub = dist.new_group([0, 1])
    t = torch.ones(1 << 12)
    dist.all_reduce(t, group=sub)
    _KEPT.extend([sub, dist.irecv(torch.empty(4), src=1 - rank, group=sub)])
    atexit.register(lambda: (Path(marker_dir) / f"finalized-{rank}").write_text("atexit ran"))
    return rank


@RunIf(min_world=2)
def test_ranks_leave_without_interpreter_finalization(tmp_path):
    """Issue 18's flaky abort ("terminate called without an active exception", SIGABRT, once in
    test_collectives_measured_with_a_process_group): libstdc++ raises it when a joinable std::thread is
    destroyed, which happens in C++ destructors run during interpreter finalization (torch's gloo and
    store threads torn down in module-clearing order). Ranks now leave with os._exit once their result is
    delivered and the group destroyed: no atexit hook and no finalization run, whatever gloo state the
    test left alive, and every rank exits with 0."""
    assert run_distributed(_leaves_gloo_state, 2, args=(str(tmp_path),), timeout=120) == [0, 1]
    assert list(tmp_path.iterdir()) == []
