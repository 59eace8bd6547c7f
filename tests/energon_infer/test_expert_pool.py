"""Experts placed one by one (``worker.expert_pool``): the experts an :class:`ExpertPlan` puts on disk are never
loaded, are read from the checkpoint when the router picks them, and give the loaded model's logits bit for bit.
Each test checks which experts were read and how many bytes against the router's own choices, counted by a plain
forward hook on the loaded model (the reference), and the expert cache's admissions against its policy."""

from __future__ import annotations

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.loading.safetensors_files import TensorFiles
from energon_infer.worker.expert_pool import ExpertPool, expert_names, moe_layers
from tests.energon_infer.tiny import PROMPTS, save_tiny
from tightfit.planner.experts import ExpertPlan
from tightfit.policy.experts import belady_hits

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
OPTS = dict(progress=False, block_size=4, packed_weights=False)


def _plan(placement: list[list[str]], slots: list[int], k: int) -> ExpertPlan:
    return ExpertPlan(placement=tuple(map(tuple, placement)), slots=tuple(slots), slot_bytes=(0,) * len(slots),
                      experts_per_token=k, unified=True, budget_bytes=0, host_budget_bytes=None, dense_bytes=0,
                      device_bytes=0, host_bytes=0, served=(1.0, 0.0, 0.0), batches=(1,), tokens_per_s=(1.0,),
                      disk_bytes_per_token=(0.0,), host_bytes_per_token=(0.0,))


def _routed(runner: ModelRunner) -> list[list[set[int]]]:
    """Per forward call, per MoE layer, the experts its router picked (the loaded model's own router)."""
    calls: list[list[set[int]]] = []
    layers = moe_layers(runner.stage)

    def hook(index: int):
        def record(module, args, out):
            if index == 0:
                calls.append([])
            _, chosen = module.route(args[0])
            calls[-1].append(set(chosen.reshape(-1).tolist()))
        return record

    for i, (_, moe) in enumerate(layers):
        moe.register_forward_hook(hook(i))
    return calls


def _pooled(path, plan: ExpertPlan) -> tuple[ModelRunner, ExpertPool]:
    meta = ModelRunner.from_pretrained(path, **OPTS)  # for the expert names only
    runner = ModelRunner.from_pretrained(path, offload=expert_names(meta.stage, plan), **OPTS)
    pool = ExpertPool(runner.stage, runner.config, runner.grid, plan, TensorFiles(path), io_threads=2, lookahead=0)
    return runner, pool


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_disk_experts_are_read_when_routed_and_give_the_loaded_models_logits(tmp_path, family):
    path = save_tiny(family, tmp_path / family, shard=None)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    routed = _routed(ref)
    n_moe, n_experts, k = len(moe_layers(ref.stage)), ref.config.n_experts, ref.config.experts_per_token
    # Half of each layer's experts on disk, the odd ones; one cache slot per layer.
    placement = [["disk" if e % 2 else "device" for e in range(n_experts)] for _ in range(n_moe)]
    runner, pool = _pooled(path, _plan(placement, [1] * n_moe, k))
    for _, moe in moe_layers(runner.stage):
        for e, expert in moe.experts.items():  # never loaded: the shared zero expert stands in
            assert (expert.gate_up.data_ptr() == pool._zeros.data_ptr()) == (int(e) % 2 == 1)
    items = list(enumerate(PROMPTS))
    assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    snap = pool.snapshot()
    used = [e for layer in routed[0] for e in layer]
    disk_used = [e for e in used if e % 2]
    assert snap["expert_uses"] == len(used) and snap["expert_uses_in_memory"] == len(used) - len(disk_used)
    # A first step reads every disk expert it routes to (nothing cached yet), each once.
    assert snap["expert_reads"] == len(disk_used) and snap["expert_cache_hits"] == 0
    expert_bytes = sum(p.numel() * 4 for p in moe_layers(ref.stage)[0][1].experts["1"].parameters())
    assert snap["expert_bytes_read"] == len(disk_used) * expert_bytes
    assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == \
        [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    # Every routed use is served from memory, the cache or a read; the arena's experts go back to the zero expert.
    snap = pool.snapshot()
    assert snap["expert_uses"] == snap["expert_uses_in_memory"] + snap["expert_cache_hits"] + snap["expert_reads"]
    cached = {(i, e) for i, slots in enumerate(pool._slot_of) for e in slots}
    for layer, (_, moe) in enumerate(moe_layers(runner.stage)):
        for e in range(1, n_experts, 2):
            unused = moe.experts[str(e)].gate_up.data_ptr() == pool._zeros.data_ptr()
            assert unused == ((layer, e) not in cached)


def test_the_cache_keeps_what_its_policy_admits_and_hits_it_next_step(tmp_path):
    path = save_tiny("mixtral", tmp_path / "m", shard=None)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    routed = _routed(ref)
    n_moe, n_experts = len(moe_layers(ref.stage)), ref.config.n_experts
    runner, pool = _pooled(path, _plan([["disk"] * n_experts] * n_moe, [n_experts] * n_moe, 2))  # room for all
    prompt = [(0, PROMPTS[2])]
    ref.forward(prompt)
    runner.forward(prompt)
    first = pool.snapshot()
    assert first["expert_reads"] == sum(len(layer) for layer in routed[0])  # all read, all admitted (free slots)
    assert first["expert_loads"] == first["expert_reads"] and first["expert_streamed"] == 0
    ref.forward([(1, PROMPTS[2])])
    runner.forward([(1, PROMPTS[2])])
    second = pool.snapshot()
    again = sum(len(now & before) for now, before in zip(routed[1], routed[0]))
    assert second["expert_cache_hits"] == again  # the same prompt routes the same: every expert it reuses is a hit
    assert second["expert_reads"] - first["expert_reads"] == sum(len(layer) for layer in routed[1]) - again
    # With a slot for every expert nothing is evicted: the offline optimum gets the same hits.
    assert second["expert_belady_hits"] == second["expert_cache_hits"]


def test_the_belady_yardstick_bounds_the_caches_hits(tmp_path):
    path = save_tiny("qwen3_moe", tmp_path / "m", shard=None)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    n_moe, n_experts = len(moe_layers(ref.stage)), ref.config.n_experts
    runner, pool = _pooled(path, _plan([["disk"] * n_experts] * n_moe, [2] * n_moe, 3))
    runner.generate(PROMPTS, GREEDY)
    snap = pool.snapshot()
    assert snap["expert_cache_hits"] <= snap["expert_belady_hits"]
    assert snap["expert_belady_hits"] == sum(belady_hits(list(t), 2) for t in pool.trace)  # core's optimum


def test_an_expert_plan_for_another_model_is_refused(tmp_path):
    path = save_tiny("mixtral", tmp_path / "m", shard=None)
    runner = ModelRunner.from_pretrained(path, **OPTS)
    with pytest.raises(ValueError, match="the expert plan places 1 MoE layers; this stage has"):
        ExpertPool(runner.stage, runner.config, runner.grid, _plan([["device"] * 4], [0], 2), TensorFiles(path))


def test_the_engine_places_experts_within_a_weights_budget_and_reports_their_tiers(tmp_path):
    """``Engine.from_pretrained(..., memory_pool=MemoryPoolConfig(memory_budget=...))`` on an MoE model whose weights
    exceed the budget: the serving plan places experts one by one (its lines say how many are kept), the greedy
    tokens equal the all-in-memory engine's, the memory report and ``/metrics`` carry the expert hit rates, and the
    routing counted while serving is saved beside the model for the next plan."""
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from tightfit.profiler.types import DiskProfile

    path = save_tiny("qwen3_moe", tmp_path / "m", shard=None)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    total = sum(p.numel() * 4 for p in ref.stage.parameters())
    disk = DiskProfile(path=str(path), free_bytes=10**12, read_fit=(1e-4, 2e9))
    pool = MemoryPoolConfig(memory_budget=int(total * 0.95), disk=disk)  # a tiny model: its dense parts are most
    with Engine.from_pretrained(path, memory_pool=pool, progress=False, threads_per_worker=1, block_size=4,
                                packed_weights=False, kv_cache_tokens=512) as engine:
        lines = dict(engine.memory_plan.lines[0])
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        report = engine.memory_report()
        metrics = engine.render_metrics()
    assert got == want
    kept = next(w for w in lines if w.endswith("experts kept in memory"))
    n_kept, n_all = int(kept.split()[0]), int(kept.split()[2])
    assert 0 < n_kept < n_all and any(w.endswith("read from disk when routed)") for w in lines)
    rank = report["ranks"][0]
    assert rank["experts_on_disk"] == n_all - n_kept and rank["expert_reads"] > 0
    assert rank["expert_uses"] == rank["expert_uses_in_memory"] + rank["expert_cache_hits"] + rank["expert_reads"]
    assert 0 < report["expert_hit_rate"] < 1 and "energon_pool_expert_hit_rate" in metrics
    assert report["disk_bytes_per_token"] > 0
    # What serving routed is saved beside the model when the engine stops: every token's pick counted (a step's
    # distinct experts are its uses, so the counts are at least those).
    from tightfit.profiler.experts import ExpertPopularity

    saved = ExpertPopularity.load(path, num_experts=ref.config.n_experts)
    assert sum(sum(saved.counts(layer)) for layer in range(saved.num_layers)) >= rank["expert_uses"]
