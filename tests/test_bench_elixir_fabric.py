"""benchmarks/elixir_fabric.py's shape on a tiny LLaMA: both contenders train in interleaved rounds on 2 gloo ranks, Elixir
under a budget where its plan offloads, and the result carries each contender's repeats, the paired ratio and the plan
(never timed here: the lead times it on a quiet machine)."""

from __future__ import annotations

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

TINY = {"vocab": 256, "hidden": 64, "layers": 2, "batch": 2, "seq": 16}


def _measure(rank: int, world: int) -> dict:
    from benchmarks.elixir_fabric import measure
    from tests.lightning_elixir.common import cpu_device

    return measure(rank, repeats=2, steps=4, size=TINY, device=cpu_device())


@RunIf(lightning=True, min_world=2)
def test_elixir_fabric_rounds_pair_both_contenders_and_the_plan_offloads():
    pytest.importorskip("transformers")
    from benchmarks.elixir_fabric import markdown, results_of

    data = run_distributed(_measure, 2, timeout=400, env={"GROUP_RANK": "0"})[0]
    assert set(data["times"]) == {"peer", "elixir"} and all(len(t) == 2 for t in data["times"].values())
    assert all(s > 0 for t in data["times"].values() for s in t)
    assert "CPUOffloadPolicy" in data["peer"]  # no GPU here: Fabric's FSDP2 with CPU offload
    units = data["plan"]["units"]
    assert any(u["offload"] for u in units) and data["plan"]["runtime"] == "FSDP2", data["plan"]
    r = results_of(data)
    assert r["elixir_over_peer"]["rounds"] == 2 and r["elixir"]["n"] == 2 and r["peer"]["repeats"]
    text = markdown(data, 2)
    assert "| peer ms | Elixir ms | Elixir / peer (steps/s) |" in text and "rounds" in text
