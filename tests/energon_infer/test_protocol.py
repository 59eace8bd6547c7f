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


def test_both_worker_groups_implement_the_declared_protocol():
    from energon_infer.protocol import WorkerGroup
    from energon_infer.worker.runtime import RuntimeConfig
    from energon_infer.worker.torchrun import TorchrunWorkerGroup
    from energon_infer.worker.workers import ModelSource, SpawnedWorkerGroup

    source, runtime = ModelSource("pretrained", "/nowhere"), RuntimeConfig(tp=1, pp=1, progress=False)
    spawned = SpawnedWorkerGroup(source, runtime, backend="gloo")
    for group in (spawned, TorchrunWorkerGroup(source, runtime)):
        assert isinstance(group, WorkerGroup) and group.world == 1
    spawned.kill()  # closes its queues


def test_a_planned_step_is_the_message_the_workers_get():
    from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(kv_blocks=8, block_size=4, max_context=32, max_batch_tokens=16))
    req = s.add(Request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3)))
    plan = s.schedule(0)
    assert isinstance(plan.step, Step) and pickle.loads(pickle.dumps(plan.step)) == plan.step
    assert plan.items is plan.step.items == [(req.seq_id, [1, 2, 3, 4, 5])]
    assert plan.step.blocks == {req.seq_id: [0, 1]} and plan.step.new_params == {req.seq_id: req.params}
