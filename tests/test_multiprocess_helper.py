"""The gloo test harness survives a rendezvous port that another process took between choosing and listening."""

from __future__ import annotations

import socket

import pytest

from tests.helpers import multiprocess


def _world(rank: int, world_size: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return world_size, int(t)


def _fails_inside(rank: int, world_size: int) -> None:
    raise RuntimeError("EADDRINUSE said by the function itself, after the group formed")


@pytest.fixture
def taken_port():
    """A port held by a listening socket of this process, as another process would hold it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def test_a_taken_port_is_retried_on_a_new_one(monkeypatch, taken_port):
    real, chosen = multiprocess.free_port, []

    def first_taken() -> int:
        chosen.append(taken_port if not chosen else real())
        return chosen[-1]

    monkeypatch.setattr(multiprocess, "free_port", first_taken)
    assert multiprocess.run_distributed(_world, world_size=2, timeout=120) == [(2, 3), (2, 3)]
    assert len(chosen) == 2 and chosen[0] == taken_port != chosen[1]


def test_a_port_taken_every_time_fails_with_the_reason(monkeypatch, taken_port):
    monkeypatch.setattr(multiprocess, "free_port", lambda: taken_port)
    with pytest.raises(multiprocess.DistributedTestError, match=r"(?s)port was taken 4 times.*EADDRINUSE"):
        multiprocess.run_distributed(_world, world_size=1, timeout=120)


def test_a_failure_inside_the_function_is_not_retried(monkeypatch):
    calls = []
    real = multiprocess.free_port
    monkeypatch.setattr(multiprocess, "free_port", lambda: calls.append(1) or real())
    with pytest.raises(multiprocess.DistributedTestError, match="after the group formed"):
        multiprocess.run_distributed(_fails_inside, world_size=1, timeout=120)
    assert len(calls) == 1
