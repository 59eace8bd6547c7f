"""tightfit.distributed.decide_on_rank0: one rank decides, every rank gets the same JSON-decoded result."""

from __future__ import annotations

import json

import pytest

from tests.helpers.multiprocess import DistributedTestError, run_distributed
from tests.helpers.runif import RunIf
from tightfit.distributed import broadcast_text, decide_on_rank0
from tightfit.planner.errors import PlanInfeasibleError


def _decide(rank: int, world_size: int) -> tuple[dict, int]:
    calls = []

    def decide() -> dict:
        calls.append(rank)
        return {"rank_that_decided": rank, "units": [1, 2, 3], "text": "é ✓"}

    out = decide_on_rank0(decide, encode=json.dumps, decode=json.loads)
    return out, len(calls)


@RunIf(min_world=2)
def test_rank0_decides_and_every_rank_gets_its_result():
    outs = run_distributed(_decide, 2)
    assert outs[0][0] == outs[1][0]
    assert outs[0][0] == {"rank_that_decided": 0, "units": [1, 2, 3], "text": "é ✓"}
    assert [calls for _, calls in outs] == [1, 0]  # only rank 0 ran the decision


def _infeasible(rank: int, world_size: int) -> tuple[str, int, int, tuple]:
    def decide() -> dict:
        raise PlanInfeasibleError("needs 3 GiB", needed_bytes=3 << 30, budget_bytes=1 << 30,
                                  suggestions=("offload", "recompute"))

    try:
        decide_on_rank0(decide, encode=json.dumps, decode=json.loads)
    except PlanInfeasibleError as exc:
        return type(exc).__name__, exc.needed_bytes, exc.budget_bytes, exc.suggestions
    return "no error", 0, 0, ()


@RunIf(min_world=2)
def test_planner_error_on_rank0_is_raised_on_every_rank_with_its_numbers():
    outs = run_distributed(_infeasible, 2)
    assert outs == [("PlanInfeasibleError", 3 << 30, 1 << 30, ("offload", "recompute"))] * 2


def _plugin_subclass(rank: int, world_size: int) -> tuple[str, str, int, str]:
    """A plugin's subclass of a planner error (Elixir's MemoryLimitError) raised on rank 0 reaches the other ranks
    as that subclass, so ``except MemoryLimitError`` behaves alike on every rank."""
    from lightning_elixir.memory_budget import MemoryLimitError

    def decide() -> dict:
        raise MemoryLimitError("needs 2 GiB under a 1 GiB limit", needed_bytes=2 << 30, budget_bytes=1 << 30,
                               tier="host")

    try:
        decide_on_rank0(decide, encode=json.dumps, decode=json.loads)
    except PlanInfeasibleError as exc:
        return type(exc).__module__, type(exc).__name__, exc.needed_bytes, exc.tier
    return "", "no error", 0, ""


@RunIf(min_world=2, lightning=True)
def test_a_plugins_subclass_of_a_planner_error_keeps_its_class_on_every_rank():
    outs = run_distributed(_plugin_subclass, 2)
    assert outs == [("lightning_elixir.memory_budget", "MemoryLimitError", 2 << 30, "host")] * 2


def _other_error(rank: int, world_size: int) -> None:
    def decide() -> dict:
        raise KeyError("boom")

    decide_on_rank0(decide, encode=json.dumps, decode=json.loads)


@RunIf(min_world=2)
def test_other_errors_reach_every_rank_instead_of_a_hang():
    with pytest.raises(DistributedTestError, match="KeyError"):
        run_distributed(_other_error, 2, timeout=120)


def test_world_of_one_round_trips_through_the_codec():
    out = decide_on_rank0(lambda: (1, 2), encode=lambda t: json.dumps(list(t)), decode=lambda s: tuple(json.loads(s)))
    assert out == (1, 2)
    assert broadcast_text("plain") == "plain"
    with pytest.raises(ValueError, match="must pass the text"):
        broadcast_text(None)
