"""The controller/worker messages: typed, frozen, and unchanged by the trip through a process queue."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from energon_infer.protocol import Ping, Pong, PoolInfo, Ready, Step, Stop, Tokens, WorkerInfo
from energon_infer.sampling import SamplingParams


def _info(pool: PoolInfo | None = None) -> WorkerInfo:
    return WorkerInfo(rank=1, pid=42, kv_blocks=8, block_size=4, config={"vocab_size": 100}, eos_token_ids=(2,),
                      device="cpu", weight_bytes=1000, pool=pool)


def test_messages_survive_pickling_and_are_frozen():
    step = Step(7, [3], [(5, [1, 2, 3])], {5: SamplingParams(temperature=0, max_tokens=4)})
    for msg in (step, Stop(), Tokens(7, [9]), Tokens(7, [9, 0], {5: (-0.5, [(9, -0.5)])}, {6: "sampling failed"}),
                Ping(3), Pong(1, 3), Ready(1, _info(PoolInfo(pooled=(0, 2), layers=4, pool_bytes=10,
                                                                           slot_bytes=5, device_bytes=20,
                                                                           layer_bytes=5)))):
        assert pickle.loads(pickle.dumps(msg)) == msg
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.step_id = 8  # type: ignore[misc]


def test_worker_info_reads_like_the_dict_it_replaced():
    info = _info(PoolInfo(pooled=(0, 2), layers=4, pool_bytes=10, slot_bytes=5, device_bytes=20, layer_bytes=5))
    assert info["pool"]["pooled"] == [0, 2] and info["config"]["vocab_size"] == 100
    assert info["eos_token_ids"] == [2] and info.to_dict()["pid"] == 42
    assert _info()["pool"] is None
    with pytest.raises(KeyError):
        info["nope"]
