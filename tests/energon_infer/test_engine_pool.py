"""Peer memory pooling: the plan, the device bytes it saves, and outputs identical to the unpooled model."""

from __future__ import annotations

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.worker.memory_pool import (
    LayerPool,
    MemoryPoolConfig,
    apply_memory_pool,
    stage_layer_bytes,
)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 60)), [50]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from energon_infer.demo import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("pool") / "m", layers=6, hidden=32, heads=4, kv_heads=2,
                              intermediate=64, max_positions=128)


def _runner(path) -> ModelRunner:
    # Plain F.linear everywhere: a pooled layer runs F.linear (its weights move), so bitwise equality with the
    # unpooled model holds only without oneDNN-packed copies (test_packed_weights.py covers those).
    return ModelRunner.from_pretrained(path, progress=False, block_size=4, packed_weights=False)


def test_stage_layer_bytes_is_the_runtime_profile(model_dir):
    runner = _runner(model_dir)
    layers, resident = stage_layer_bytes(runner.stage)
    total = sum(p.numel() * 4 for p in runner.stage.parameters())
    assert len(layers) == 6 and sum(layers) + resident == total
    assert len(set(layers)) == 1 and resident == 2 * 256 * 32 * 4 + 32 * 4  # embed + head + final norm


@pytest.mark.parametrize("fraction,lookahead", [(0.5, 2), (1.0, 1), (1.0, 0)])
def test_pooled_model_gives_identical_outputs(model_dir, fraction, lookahead):
    ref = _runner(model_dir)
    ref_logits = ref.forward(list(enumerate(PROMPTS)), all_logits=True)
    ref_gen = [g.token_ids for g in ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]

    runner = _runner(model_dir)
    pool, plan = apply_memory_pool(runner, MemoryPoolConfig(fraction=fraction, lookahead=lookahead))
    assert len(plan.pooled) == round(6 * fraction)
    pooled_block = runner.stage.layers[str(plan.pooled[0])]
    assert pooled_block.qkv.weight.device.type == "meta"  # the weights left the device
    logits = runner.forward(list(enumerate(PROMPTS)), all_logits=True)
    assert torch.equal(logits, ref_logits)
    gen = [g.token_ids for g in runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    assert gen == ref_gen
    # Each pooled layer is copied in once per forward: the forward above + 1 prefill + 5 decode steps = 7,
    # plus the copies already prefetched for the next step.
    assert len(plan.pooled) * 7 <= pool.copies <= len(plan.pooled) * 7 + pool.lookahead + 1
    device = sum(p.numel() * p.element_size() for p in runner.stage.parameters() if p.device.type != "meta")
    assert device + pool.slot_bytes == plan.device_bytes
    assert pool.pool_bytes == plan.pool_bytes and pool.slot_bytes == min(lookahead + 1, len(plan.pooled)) * plan.slot_bytes
    pool.close()


def test_prefetch_recovers_from_an_interrupted_step(model_dir):
    expected = _runner(model_dir).forward([(0, PROMPTS[2])])
    runner = _runner(model_dir)
    pool = LayerPool(runner.stage, [1, 3, 5], lookahead=1)

    def fail(*_):
        raise RuntimeError("a step dies inside layer 3")

    handle = runner.stage.layers["3"].register_forward_pre_hook(fail)  # runs after the pool bound layer 3
    with pytest.raises(RuntimeError, match="dies inside layer 3"):
        runner.forward([(7, PROMPTS[2])])
    handle.remove()
    runner.cache.free(7)
    # The next steps start from layer 0 with layer 3's slot still taken and stale prefetches queued.
    for seq in (0, 1):
        assert torch.equal(runner.forward([(seq, PROMPTS[2])]), expected)
        runner.cache.free(seq)
    assert len(pool._free_slots) + len(pool._loaded) == 2 and not pool._bound
    pool.close()


def test_pool_config_is_validated():
    with pytest.raises(ValueError, match=r"fraction=1.5 must be in \[0, 1\]"):
        MemoryPoolConfig(fraction=1.5)
    assert MemoryPoolConfig(device_budget="1KiB").device_budget == 1024


def test_engine_plans_the_pool_from_a_device_budget(model_dir):
    from energon_infer.engine.engine import Engine
    from tightfit.planner.errors import PlanInfeasibleError

    runner = _runner(model_dir)
    layers, resident = stage_layer_bytes(runner.stage)
    # Room for the resident weights and 5 layers' worth: with 2 slots (lookahead 1), pooling 3 of the 6 layers
    # keeps 3 + 2 slots = 5; pooling 2 would keep 4 + 2 = 6, too many.
    budget = resident + 5 * layers[0]
    with Engine.from_pretrained(model_dir, memory_pool=MemoryPoolConfig(device_budget=budget, lookahead=1),
                                progress=False, threads_per_worker=1, block_size=4) as engine:
        pool = engine.worker_info[0]["pool"]
        assert pool["pooled"] == [0, 2, 4] and pool["device_bytes"] <= budget
        out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out[0].token_ids == runner.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4,
                                                                           ignore_eos=True))[0].token_ids
    # Refused in this process before any worker starts (issue 52), with the planner's own line.
    with pytest.raises(PlanInfeasibleError, match=r"^the stage needs at least .* raise the budget"):
        Engine.from_pretrained(model_dir, memory_pool=f"{resident // 1024}KiB", progress=False, threads_per_worker=1)
