"""Models whose windowed and global layers alternate free the windowed layers' KV blocks as their window passes.

Gemma 2 (windowed and global layers in turn), Gemma 3 (``layer_types``) and Qwen 3 with ``max_window_layers`` keep
each kind of layer's keys and values in KV groups with tables of their own (:mod:`energon_infer.scheduling.kv_groups`)
over one pool of pages. The reference is transformers' greedy ``generate`` on tiny random checkpoints (windows of
6 tokens, blocks of 4) with sequences many windows long, in caches too small to hold every sequence's whole context
in every group: only the released windowed pages let them run. The block counts are checked on the scheduler alone
against plain arithmetic (the whole context in a global group, the window's blocks in a windowed one).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.scheduling.blocks import HOLE
from energon_infer.scheduling.kv_groups import KVGroups, kv_layout
from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig
from tests.energon_infer.test_window_blocks import drive, scheduler_for
from tests.energon_infer.tiny import hf_greedy, save_tiny
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

NEW = 40
HYBRID = {"gemma2": (6, 0, 6, 0), "gemma3": (6, 6, 0, 6), "qwen3-window": (0, 6, 6)}  # each layer's window
PROMPTS = [list(range(20, 41)), [5, 6, 7, 8, 9, 10, 11], list(range(60, 90))]
OPTS = dict(block_size=4, progress=False)
#: 16 blocks of every layer: fewer than the longest sequence's 18 blocks of context (70 tokens)
SMALL = 64


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid")
    return {name: str(save_tiny(name, root / name)) for name in HYBRID}


@pytest.fixture(scope="module")
def refs(dirs) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(path, PROMPTS, NEW) for name, path in dirs.items()}


def _whole_context_pages(runner: ModelRunner, lengths) -> int:
    """Pages every sequence's whole context would take in every group (no window released)."""
    return runner.cache.groups * sum(-(-n // runner.cache.block_size) for n in lengths)


@pytest.mark.parametrize("name", list(HYBRID))
def test_long_generations_in_a_cache_too_small_for_their_contexts_equal_transformers(name, dirs, refs):
    """The cache holds 16 blocks of every layer: one table per sequence could not hold the longest (18 blocks of
    context) at all; the groups' pages hold all three, on demand or reserving each one's peak."""
    runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=SMALL, **OPTS)
    assert runner.config.windows == HYBRID[name] and runner.kv_window == 0
    assert runner.cache.group_windows == kv_layout(HYBRID[name]).windows and runner.cache.groups > 1
    lengths = [len(p) + NEW for p in PROMPTS]
    assert max(lengths) > SMALL and _whole_context_pages(runner, lengths) > runner.cache.num_blocks
    # the same bytes: pages of `slots` layers, as many as 16 blocks of every layer make
    assert runner.cache.k.shape[0] * runner.cache.num_blocks == len(HYBRID[name]) * SMALL // 4
    for admission in ("on_demand", "reserve"):
        out = runner.generate(PROMPTS, greedy(), kv_admission=admission)
        assert [g.token_ids for g in out] == refs[name], admission
        assert runner.cache.free_blocks == runner.cache.num_blocks


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_released_windowed_blocks_are_never_read(name, dirs, refs):
    """Pages no table holds are NaN before every step; the windowed groups' tables hold holes where the window
    passed, the global groups' none: a read of a released page would put NaN in the logits."""
    runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=SMALL * 2, **OPTS)
    sched = scheduler_for(runner)
    windows = runner.cache.group_windows
    trimmed = set()

    def check(plan):
        for seq, holes in plan.step.trims.items():
            flat, g = runner.cache.block_table(seq), len(windows)
            for group, window in enumerate(windows):
                table = flat[group::g]
                assert table[:holes] == [HOLE] * holes if window else HOLE not in table
            trimmed.add(seq)

    assert drive(runner, sched, PROMPTS, NEW, poison=True, on_step=check) == refs[name]
    assert len(trimmed) == len(PROMPTS) and runner.cache.free_blocks == runner.cache.num_blocks


@pytest.mark.parametrize("name", list(HYBRID))
def test_preemption_by_swap_and_recompute_keeps_transformers_tokens(name, dirs):
    """Three sequences of 43-50 tokens in 12 blocks' worth of pages: the newest is preempted, recomputed (whole or
    in chunks) or swapped out with each group's pages (holes in the windowed ones) and swapped back in."""
    prompts = [PROMPTS[1], PROMPTS[1][:3], PROMPTS[0][:10]]
    want = hf_greedy(dirs[name], prompts, NEW)
    for preemption, chunked in (("recompute", False), ("recompute", True), ("swap", True)):
        runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=48, swap_space_tokens=128, **OPTS)
        stats: dict[str, int] = {}
        out = runner.generate(prompts, greedy(), kv_admission="on_demand", preemption=preemption, stats=stats,
                              chunked_prefill=chunked)
        assert [g.token_ids for g in out] == want, (preemption, chunked)
        assert stats["preemptions"] > 0 and (stats["swaps"] > 0) == (preemption == "swap"), stats
        assert runner.cache.free_blocks == runner.cache.num_blocks


@pytest.mark.parametrize("name", ["gemma2", "qwen3-window"])
def test_prefix_hits_hold_only_the_windowed_blocks_their_window_reaches(name, dirs):
    """Prompts sharing a 24-token prefix, two running at a time: the later ones hit the prefix the first named;
    at its start a hit holds the whole prefix in each global group and at most window / block + 2 pages in each
    windowed one."""
    runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=256, **OPTS)
    shared = list(range(20, 44))
    prompts = [shared + [1], shared + [7, 8, 9], shared[:-2] + [3, 4, 5], shared + [1]]
    sched = scheduler_for(runner, prefix_caching=True, max_running=2)
    windows = runner.cache.group_windows
    starts = []

    def check(plan):
        fed = dict(plan.step.items)
        for seq, flat in plan.step.blocks.items():
            if plan.step.starts.get(seq, 0) > 6:
                held = [sum(b != HOLE for b in flat[g::len(windows)]) for g in range(len(windows))]
                starts.append((plan.step.starts[seq], len(fed[seq]), held))

    assert drive(runner, sched, prompts, 12, on_step=check) == hf_greedy(dirs[name], prompts, 12)
    assert sched.blocks.hit_tokens >= 2 * 20 and len(starts) >= 2
    for start, n_fed, held in starts:  # the step's tokens and the window before them, and one block more
        for window, n in zip(windows, held):
            assert n <= -(-(n_fed + 6 - 1) // 4) + 1 if window else n == -(-(start + n_fed) // 4), (start, held)


def test_the_engine_serves_a_hybrid_model_with_swaps_and_steps_planned_ahead(dirs):
    """The served path (two steps in flight at pp=1, chunked prefill, swap preemption): the workers report the
    groups, the steps carry each group's pages and releases, and the tokens stay transformers'."""
    from energon_infer.engine.engine import Engine

    name = "gemma2"
    prompts = [PROMPTS[1], PROMPTS[1][:3], PROMPTS[0][:10], PROMPTS[0][3:9]]
    with Engine.from_pretrained(dirs[name], block_size=4, kv_cache_tokens=40, swap_space_tokens=128,
                                preemption="swap", chunked_prefill=True, max_batch_tokens=16, progress=False,
                                threads_per_worker=1) as engine:
        assert engine.scheduler.config.kv_groups == (6, 0) and engine.scheduler.config.depth == 2
        out = [c.token_ids for c in engine.generate(prompts, greedy())]
        assert out == hf_greedy(dirs[name], prompts, NEW)
        assert engine.scheduler.swap.swaps == engine.scheduler.preemptions > 0 and engine.scheduler.blocks.used == 0


def _tp2(rank: int, world: int, path: str) -> list[list[int]]:
    runner = ModelRunner.from_pretrained(path, tp=2, kv_cache_tokens=SMALL, **OPTS)
    return [g.token_ids for g in runner.generate(PROMPTS, greedy(), kv_admission="on_demand")]


@RunIf(min_world=2)
def test_hybrid_generation_at_tp2_equals_transformers(dirs, refs):
    out = run_distributed(_tp2, 2, args=(dirs["gemma2"],), timeout=600)
    assert out[0] == out[1] == refs["gemma2"]


def test_pipeline_stages_keep_one_group():
    """At pp > 1 a stage would hold pages for groups whose layers are all on the other stage: one group there."""
    from energon_infer.worker.kv_cache import KVCache

    cache = KVCache(n_layers=2, num_blocks=16, block_size=4, n_kv_heads=1, head_dim=2, dtype=torch.float32,
                    layer_windows=HYBRID["gemma2"])
    assert cache.groups == 1 and cache.group_windows == (0,) and cache.num_blocks == 16


# ---------------------------------------------------------------------- the groups alone


def test_layouts_group_each_kind_of_layer_in_pages_of_equal_slots():
    gemma2 = kv_layout((6, 0, 6, 0))  # in turn: the two windowed layers share pages, the two global ones too
    assert (gemma2.windows, gemma2.slots, gemma2.group_of, gemma2.slot_of) == ((6, 0), 2, (0, 1, 0, 1), (0, 0, 1, 1))
    gemma3 = kv_layout((6, 6, 6, 6, 6, 0) * 2)  # five windowed layers to one global: 2 per page, 6 groups
    assert gemma3.slots == 2 and gemma3.windows == (6,) * 5 + (0,)
    assert [gemma3.group_of[i] for i in (5, 11)] == [5, 5] and {gemma3.slot_of[5], gemma3.slot_of[11]} == {0, 1}
    for windows in ((6, 6, 6), (0, 0), ()):  # every layer alike: one group, as before
        assert not kv_layout(windows, 3).hybrid
    with pytest.raises(ValueError, match="windows=.*>= 0"):
        kv_layout((6, -1))


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 16), block=st.sampled_from([1, 2, 4, 8]), prompt=st.integers(1, 40),
       new=st.integers(1, 80), chunked=st.booleans(), groups=st.sampled_from([(1, 1), (2, 1), (1, 2)]))
def test_a_long_sequence_holds_its_window_in_windowed_groups_and_its_context_in_global_ones(
        window, block, prompt, new, chunked, groups):
    """At every step: each windowed group holds the blocks from its next query's window on (at most
    window / block + 2), each global group ``ceil(context / block)``; all come back at the end."""
    windows = (window,) * groups[0] + (0,) * groups[1]
    cfg = SchedulerConfig(kv_blocks=1024, block_size=block, max_context=256, max_batch_tokens=8 if chunked else 64,
                          chunked_prefill=chunked, kv_groups=windows, prefix_caching=False)
    s = Scheduler(cfg)
    req = s.add(Request("a", list(range(prompt)), greedy(new)))
    while s.running or s.waiting:
        before = req.computed
        plan = s.schedule(0)
        assert plan is not None
        held = [len(h) for h in s.blocks.held_groups(req.seq_id)]
        whole = -(-req.computed // block)
        first = max(0, before - window + 1) // block  # the first block the next query's window reaches
        for w, n in zip(windows, held):
            assert n == (whole - first if w else whole)
        if not chunked and before >= prompt:  # a decode step
            assert max(n for w, n in zip(windows, held) if w) <= window // block + 2
        assert s.blocks.used == sum(held) <= req.reserve
        s.complete(plan, [1] * len(plan.step.items))
    assert s.blocks.used == 0 and s.blocks.num_free == cfg.kv_blocks


@settings(max_examples=60, deadline=None)
@given(block=st.sampled_from([1, 2, 4]), prompts=st.lists(st.integers(1, 24), min_size=2, max_size=4),
       new=st.integers(1, 30), chunked=st.booleans(), preemption=st.sampled_from(["recompute", "swap"]),
       shared=st.booleans(), switch=st.sampled_from([0, 12]))
def test_requests_on_a_pool_barely_larger_than_one_request_all_finish(block, prompts, new, chunked, preemption,
                                                                      shared, switch):
    """Pages for about the largest request's peak: requests preempt one another (recomputed or swapped with each
    group's pages), share prefixes, pass a longrope switch (recomputed once, long), and every one finishes with
    every page and host block back."""
    windows = (4, 0)
    probe = KVGroups(1, block, windows)
    steps = [min(p, 8) if chunked else p for p in prompts]
    pages = max(probe.peak(p + new, n) for p, n in zip(prompts, steps)) + 2
    cfg = SchedulerConfig(kv_blocks=pages, block_size=block, max_context=256, max_batch_tokens=8 if chunked else 32,
                          chunked_prefill=chunked, kv_groups=windows, prefix_caching=shared, preemption=preemption,
                          host_blocks=128, rope_switch=switch)
    s = Scheduler(cfg)
    reqs = [s.add(Request(str(i), [7] * p if shared else list(range(i, i + p)), greedy(new)))
            for i, p in enumerate(prompts)]
    for _ in range(4000):
        if not (s.running or s.waiting):
            break
        plan = s.schedule(0)
        assert plan is not None
        for seq in plan.step.blocks:  # every group's table covers the same blocks of tokens
            assert len({len(s.blocks.group_table(seq, g)) for g in range(2)}) == 1
        assert s.blocks.used <= pages
        s.complete(plan, [1] * len(plan.step.items))
    assert all(len(r.generated) == new for r in reqs)
    assert s.blocks.used == 0 and s.swap.num_free == 128


def test_a_prefix_hit_needs_only_the_windowed_pages_its_window_reaches():
    """The first sequence's early windowed pages were released and evicted; a second sequence with its prompt
    still hits the prefix: the global group's chain is whole and the windowed group's reaches back far enough."""
    kv = KVGroups(11, 2, (3, 0))  # 5 blocks of 10 tokens in each group, and one page more
    tokens = list(range(10))
    kv.start(1, tokens)
    kv.grow(1, 10)
    kv.commit(1, tokens)
    assert kv.trim(1, 10) == 4 and [len(h) for h in kv.held_groups(1)] == [1, 5]
    kv.free(1)
    kv.start(3, [50] * 4)
    kv.grow(3, 4)  # 4 pages: the free one and the 3 released first (the windowed group's blocks 0-2) evicted
    assert kv.evictions == 3
    prompt = tokens[:8] + [99, 98]
    assert kv.groups[0].lookup(prompt)[0] == []  # one table's chain of names is broken at its first block
    hit = kv.start(2, prompt)  # 8 tokens shared: a query at 8 reads keys from 6 on (block 3, still cached)
    assert hit.start == 8 and kv.group_table(2, 0)[:3] == [HOLE] * 3 and HOLE not in kv.group_table(2, 1)
    assert [len(h) for h in kv.held_groups(2)] == [1, 4]
