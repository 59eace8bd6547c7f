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
    with pytest.raises(DistributedTestError, match="timed out after 15 s"):
        run_distributed(_hangs, 2, timeout=15)
