"""The expert pool's lookahead (``worker.expert_pool``): before a layer's experts run, the next MoE layer's router is
applied to this layer's input and the predicted disk experts are read ahead. Each test forces every expert to disk,
works out from the loaded model's own routing (forward hooks on the reference, not the pool) which experts must be
read, ahead or on demand and in which order, and checks the pool's record of issued reads and layer runs against it,
the bytes read, the lookahead's accuracy in the snapshot, and the loaded model's logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.loading.safetensors_files import TensorFiles
from energon_infer.worker.expert_pool import ExpertPool, expert_names, moe_layers
from tests.energon_infer.test_expert_pool import OPTS, _plan
from tests.energon_infer.tiny import PROMPTS, save_tiny

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _pooled(path, slots: int, lookahead: int | None) -> tuple[ModelRunner, ExpertPool]:
    """Every expert of every MoE layer on disk, ``slots`` cache slots per layer."""
    meta = ModelRunner.from_pretrained(path, **OPTS)
    n_moe, n_experts = len(moe_layers(meta.stage)), meta.config.n_experts
    plan = _plan([["disk"] * n_experts] * n_moe, [slots] * n_moe, meta.config.experts_per_token)
    runner = ModelRunner.from_pretrained(path, offload=expert_names(meta.stage, plan), **OPTS)
    pool = ExpertPool(runner.stage, runner.config, runner.grid, plan, TensorFiles(path), io_threads=2,
                      lookahead=lookahead)
    return runner, pool


def _routing(runner: ModelRunner) -> list[list[tuple[set[int], list[int]]]]:
    """Per forward call, per MoE layer: (the experts its router picked, the votes the *next* MoE layer's router
    gives each expert on this layer's input: the lookahead's prediction), from the reference model's own modules."""
    calls: list[list[tuple[set[int], list[int]]]] = []
    layers = [moe for _, moe in moe_layers(runner.stage)]

    def hook(index: int):
        def record(module, args, out):
            if index == 0:
                calls.append([])
            _, chosen = module.route(args[0])
            votes = [0] * module.n_experts
            if index + 1 < len(layers):
                _, ahead = layers[index + 1].route(args[0])
                votes = torch.bincount(ahead.reshape(-1), minlength=module.n_experts).tolist()
            calls[-1].append((set(chosen.reshape(-1).tolist()), votes))
        return record

    for i, moe in enumerate(layers):
        moe.register_forward_hook(hook(i))
    return calls


def _expected_events(call: list[tuple[set[int], list[int]]], lookahead: int) -> list[tuple]:
    """The reads one forward issues with every expert on disk and no cache slot (every use is read): a layer reads on
    demand what the previous layer did not predict, then issues the next layer's predicted experts (most votes
    first, up to ``lookahead``) before its own experts run."""
    events: list[tuple] = []
    ahead: set[int] = set()
    for li, (used, _) in enumerate(call):
        events += [("read", li, e, "demand") for e in sorted(used - ahead)]
        if li + 1 < len(call):
            votes = call[li][1]
            want = sorted((e for e, v in enumerate(votes) if v), key=lambda e: (-votes[e], e))[:lookahead]
            events += [("read", li + 1, e, "ahead") for e in want]
            ahead = set(want)
        events += [("ready", li), ("ran", li)]
    return events


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_predicted_experts_are_read_before_the_previous_layer_runs_and_logits_stay_exact(tmp_path, family):
    path = save_tiny(family, tmp_path / family, shard=None)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    routing = _routing(ref)
    n_experts = ref.config.n_experts
    runner, pool = _pooled(path, slots=0, lookahead=n_experts)
    items = list(enumerate(PROMPTS))
    assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    events = list(pool.events)
    assert events == _expected_events(routing[0], n_experts)
    # A correctly predicted expert was read (issued) before the previous layer's experts ran, never again on demand.
    right = 0
    for li, (used, _) in enumerate(routing[0]):
        for e in used:
            ahead = ("read", li, e, "ahead")
            if ahead in events:
                right += 1
                assert events.index(ahead) < events.index(("ran", li - 1)) < events.index(("ready", li))
                assert ("read", li, e, "demand") not in events
    assert right > 0  # the lookahead buffer path ran
    snap = pool.snapshot()
    routed = sum(len(used) for used, _ in routing[0][1:])
    predicted = sum(sum(1 for v in votes if v) for _, votes in routing[0][:-1])
    assert snap["expert_lookahead_correct"] == right and snap["expert_lookahead_routed"] == routed
    assert snap["expert_lookahead_predicted"] == predicted
    assert snap["expert_lookahead_accuracy"] == pytest.approx(right / routed)
    assert snap["expert_prefetches_used"] == right
    assert snap["expert_prefetches"] == sum(1 for ev in events if ev[-1] == "ahead")
    # Every use was served by a read (no slot), early or on demand; every read issued, used or not, costs its bytes.
    assert snap["expert_reads"] == snap["expert_uses"] == sum(len(used) for used, _ in routing[0])
    expert_bytes = sum(p.numel() * 4 for p in moe_layers(ref.stage)[0][1].experts["0"].parameters())
    assert snap["expert_bytes_read"] == sum(1 for ev in events if ev[0] == "read") * expert_bytes
    assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == \
        [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    pool.close()


def test_a_small_lookahead_reads_the_most_voted_experts_first(tmp_path):
    path = save_tiny("qwen3_moe", tmp_path / "m", shard=None, num_experts=8)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    routing = _routing(ref)
    runner, pool = _pooled(path, slots=0, lookahead=1)
    items = list(enumerate(PROMPTS))
    assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    assert list(pool.events) == _expected_events(routing[0], 1)
    assert sum(1 for ev in pool.events if ev[-1] == "ahead") == len(routing[0]) - 1  # one per layer with a next


def test_lookahead_leaves_the_caches_decisions_and_the_tokens_unchanged(tmp_path):
    """With cache slots, an expert read ahead and admitted is copied into its slot (then hit, never read again):
    the cache sees the lookups it sees without lookahead, so hits, loads and streams are the same."""
    path = save_tiny("mixtral", tmp_path / "m", shard=None)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    snaps, pools = [], []
    for lookahead in (0, None):
        runner, pool = _pooled(path, slots=2, lookahead=lookahead)
        assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == want
        snaps.append(pool.snapshot())
        pools.append(pool)
    off, on = snaps
    assert pools[1].lookahead == ref.config.experts_per_token and pools[0].lookahead == 0
    for key in ("expert_uses", "expert_cache_hits", "expert_loads", "expert_streamed", "expert_reads",
                "expert_belady_hits"):
        assert on[key] == off[key], key
    assert off["expert_prefetches"] == 0 and on["expert_prefetches_used"] > 0
    assert on["expert_prefetches_used"] <= on["expert_prefetches"]
    # Reads on demand plus reads ahead: a read ahead that was used replaced a read on demand.
    demand = sum(1 for ev in pools[1].events if ev[-1] == "demand")
    assert demand + on["expert_prefetches_used"] == off["expert_reads"]
    assert on["expert_bytes_read"] >= off["expert_bytes_read"]
    for pool in pools:
        pool.close()


def test_a_bad_lookahead_is_refused(tmp_path):
    path = save_tiny("mixtral", tmp_path / "m", shard=None)
    with pytest.raises(ValueError, match=r"lookahead=-1 must be an int >= 0 .*give 0 to turn lookahead off"):
        _pooled(path, slots=0, lookahead=-1)


def _disk(path):
    from tightfit.profiler.types import DiskProfile

    return DiskProfile(path=str(path), free_bytes=10**12, read_fit=(1e-4, 2e9))


def test_the_engine_reads_ahead_within_its_plan_and_reports_the_lookaheads_accuracy(tmp_path):
    """``Engine.from_pretrained(DIR, memory_pool=MemoryPoolConfig(memory_budget=...))``: the serving plan holds two
    lookahead buffers of one token's picks (a line of its own), the greedy tokens equal the all-in-memory runner's,
    and the memory report and ``/metrics`` carry the lookahead's accuracy and the share of reads ahead used."""
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    path = save_tiny("qwen3_moe", tmp_path / "m", shard=None, num_experts=16, num_hidden_layers=4)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    total = sum(p.numel() * 4 for p in ref.stage.parameters())
    pool = MemoryPoolConfig(memory_budget=int(total * 0.9), disk=_disk(path))
    with Engine.from_pretrained(path, memory_pool=pool, progress=False, threads_per_worker=1, block_size=4,
                                packed_weights=False, kv_cache_tokens=512) as engine:
        lines = dict(engine.memory_plan.lines[0])
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        report = engine.memory_report()
        metrics = engine.render_metrics()
    assert got == want
    k = ref.config.experts_per_token
    ahead = lines[f"lookahead buffers (2 x {k} expert(s) of the next layer, read ahead)"]
    assert ahead == 2 * k * sum(p.numel() * 4 for p in moe_layers(ref.stage)[0][1].experts["0"].parameters())
    rank = report["ranks"][0]
    assert rank["expert_prefetches"] >= rank["expert_prefetches_used"] > 0
    assert report["expert_lookahead_accuracy"] == rank["expert_lookahead_correct"] / rank["expert_lookahead_routed"]
    assert 0 < report["expert_lookahead_accuracy"] <= 1
    assert report["expert_prefetch_precision"] == rank["expert_prefetches_used"] / rank["expert_prefetches"]
    assert "energon_pool_expert_lookahead_accuracy" in metrics and "energon_pool_expert_prefetch_precision" in metrics


def test_the_plan_falls_back_to_no_lookahead_where_its_buffers_do_not_fit_and_keeps_a_given_one(tmp_path):
    from energon_infer.engine.engine_config import engine_config
    from energon_infer.engine.memory_plan import fit_memory
    from energon_infer.loading.config import load_config
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    path = save_tiny("qwen3_moe", tmp_path / "m", shard=None)  # 3 of 6 experts a token: two buffers are a layer
    ref = ModelRunner.from_pretrained(path, **OPTS)
    total = sum(p.numel() * 4 for p in ref.stage.parameters())

    def plan(**kw):
        cfg = engine_config(None, block_size=4, packed_weights=False, kv_cache_tokens=512)
        return fit_memory(path, load_config(path), cfg, MemoryPoolConfig(memory_budget=int(total * 0.95),
                                                                          disk=_disk(path), **kw),
                          given=frozenset({"kv_cache_tokens"}))

    _, pool, served = plan()
    assert pool.experts is not None and pool.expert_lookahead == 0  # the experts placed, without lookahead
    assert "lookahead buffers (2 x 0 expert(s) of the next layer, read ahead)" in dict(served.lines[0])
    _, pool, served = plan(expert_lookahead=1)  # given: kept, the experts placed around it
    assert pool.expert_lookahead == 1 and "lookahead buffers (2 x 1 expert(s) of the next layer, read ahead)" in \
        dict(served.lines[0])
    with pytest.raises(ValueError, match=r"expert_lookahead=-2 must be None or an int >= 0 .*give 0 to turn"):
        MemoryPoolConfig(memory_budget=1 << 30, expert_lookahead=-2)
