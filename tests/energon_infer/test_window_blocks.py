"""KV blocks a sliding window has passed are released while a sequence runs (models whose every layer is windowed).

The reference is transformers' greedy ``generate`` on tiny random checkpoints with windows of 6-8 tokens and
blocks of 4, prompts and generations many windows long. The block-level properties (what is held, what a prefix
hit and a swapped-out sequence keep) are checked on the scheduler alone, with hypothesis choosing windows, block
sizes and lengths.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.scheduling.blocks import HOLE, BlockManager
from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig
from tests.energon_infer.tiny import hf_greedy, save_tiny
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

NEW = 40  # generated tokens: several windows past the prompt
#: every layer windowed: Mistral, Phi-3, Qwen2 with use_sliding_window from layer 0
WINDOWED = {
    "mistral-window": {},
    "phi3": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0, "max_position_embeddings": 128},
}
PROMPTS = [list(range(20, 41)), [5, 6, 7, 8, 9, 10, 11], list(range(60, 90))]
OPTS = dict(block_size=4, progress=False)


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("windowed")
    return {name: str(save_tiny(name, root / name, **over)) for name, over in WINDOWED.items()}


@pytest.fixture(scope="module")
def refs(dirs) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(path, PROMPTS, NEW) for name, path in dirs.items()}


def _window(runner: ModelRunner) -> int:
    return max(runner.config.windows)


@pytest.mark.parametrize("name", list(WINDOWED))
def test_long_generations_in_a_cache_smaller_than_their_context_equal_transformers(name, dirs, refs):
    """Three sequences of 47-70 tokens (12-18 blocks each) in a pool of 16 blocks: only freeing serves them, on
    demand or each reserving the most blocks its window makes it hold at once."""
    runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=64, **OPTS)
    assert runner.kv_window == _window(runner) and all(runner.config.windows)
    for admission in ("on_demand", "reserve"):
        out = runner.generate(PROMPTS, greedy(), kv_admission=admission)
        assert [g.token_ids for g in out] == refs[name], admission
        assert runner.cache.free_blocks == runner.cache.num_blocks


def drive(runner: ModelRunner, sched: Scheduler, prompts, n: int, *, poison: bool = False,
           on_step=None) -> list[list[int]]:
    """Run ``prompts`` to the end through ``sched`` and ``runner.run_step``; with ``poison`` every block no table
    holds is filled with NaN before each step (fresh blocks zeroed), so a read of a released block shows."""
    reqs = [sched.add(Request(str(i), list(p), greedy(n))) for i, p in enumerate(prompts)]
    cache, mgr = runner.cache, sched.blocks
    while sched.waiting or sched.running:
        plan = sched.schedule(0)
        assert plan is not None
        if poison:
            held = {b for s in mgr.tables for b in mgr.held(s)}
            free = [b for b in range(cache.num_blocks) if b not in held]
            fresh = [b for blocks in plan.step.blocks.values() for b in blocks if b != HOLE]
            cache.k[:, free] = cache.v[:, free] = float("nan")
            cache.k[:, fresh] = cache.v[:, fresh] = 0.0
        result = runner.run_step(plan.step)
        if on_step is not None:
            on_step(plan)
        sched.complete(plan, result.tokens)
    for seq in sched.take_frees():
        runner.free(seq)
    return [r.generated for r in reqs]


def scheduler_for(runner: ModelRunner, **kw) -> Scheduler:
    cache = runner.cache
    cfg = dict(kv_blocks=cache.num_blocks, block_size=cache.block_size, max_context=runner.max_context,
               max_batch_tokens=64, kv_window=runner.kv_window, kv_groups=cache.group_windows, prefix_caching=False)
    return Scheduler(SchedulerConfig(**{**cfg, **kw}), block_ids=cache.free_block_ids())


@pytest.mark.parametrize("name", ["mistral-window", "phi3"])
def test_released_blocks_are_never_read(name, dirs, refs):
    """Released blocks hold NaN (those another sequence took were rewritten by it) and the workers' tables hold
    holes there: one read would put NaN in the logits or fail on the hole; the tokens stay transformers'."""
    runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=64, **OPTS)
    sched = scheduler_for(runner)
    trimmed = set()

    def check(plan):
        for seq, holes in plan.step.trims.items():
            assert runner.cache.block_table(seq)[:holes] == [HOLE] * holes
            trimmed.add(seq)

    assert drive(runner, sched, PROMPTS, NEW, poison=True, on_step=check) == refs[name]
    assert len(trimmed) == len(PROMPTS)


def test_a_long_generation_holds_a_bounded_number_of_blocks(dirs, refs):
    """One sequence decoding 100 tokens past its prompt: without freeing it would hold 31 blocks, it holds at
    most window / block_size + 2 (the pool has 8)."""
    runner = ModelRunner.from_pretrained(dirs["mistral-window"], kv_cache_tokens=32, **OPTS)
    sched = scheduler_for(runner)
    bound = _window(runner) // runner.cache.block_size + 2
    most = []
    out = drive(runner, sched, PROMPTS[:1], 100, on_step=lambda plan: most.append(sched.blocks.used))
    assert max(most[1:]) <= bound and len(most) == 100
    assert out[0][:NEW] == refs["mistral-window"][0]


def test_prefix_hits_on_a_windowed_model_equal_transformers(dirs):
    """Prompts sharing a 21-token prefix (five blocks, three windows), two running at a time: the later ones hit
    the chain the first ones named (a divergent last block and a fully cached prompt copied on write), holding
    only the blocks their window reaches, while the others keep generating and releasing their own."""
    name = "mistral-window"
    runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=256, **OPTS)
    shared = PROMPTS[0]
    prompts = [shared, shared + [7, 8, 9], shared[:-1] + [3], shared]
    sched = scheduler_for(runner, prefix_caching=True, max_running=2)
    held_at_start = []

    def check(plan):
        for seq, table in plan.step.blocks.items():
            if seq in plan.step.starts and plan.step.starts[seq] > runner.kv_window:
                held_at_start.append(sum(b != HOLE for b in table))

    assert drive(runner, sched, prompts, 12, on_step=check) == hf_greedy(dirs[name], prompts, 12)
    assert sched.blocks.hit_tokens >= 2 * 20 and sched.blocks.evictions == 0
    assert held_at_start and max(held_at_start) <= runner.kv_window // 4 + 2


def test_preemption_of_windowed_sequences_keeps_transformers_tokens(dirs):
    """A pool of 7 blocks for three sequences of 43-50 tokens: the newest is preempted, recomputed or swapped out
    with holes in its table and swapped back into only the blocks its window reaches."""
    name = "mistral-window"
    prompts = [PROMPTS[1], PROMPTS[1][:3], PROMPTS[0][:10]]
    want = hf_greedy(dirs[name], prompts, NEW)
    for preemption, chunked in (("recompute", False), ("recompute", True), ("swap", True)):
        runner = ModelRunner.from_pretrained(dirs[name], kv_cache_tokens=28, swap_space_tokens=64, **OPTS)
        stats: dict[str, int] = {}
        out = runner.generate(prompts, greedy(), kv_admission="on_demand", preemption=preemption, stats=stats,
                              chunked_prefill=chunked)
        assert [g.token_ids for g in out] == want, preemption
        assert stats["preemptions"] > 0 and (stats["swaps"] > 0) == (preemption == "swap")


def test_the_engine_frees_swaps_and_shares_windowed_blocks(dirs):
    """The served path: the workers report the window, steps planned ahead carry the releases, a preempted
    sequence is swapped out with holes in its table and back, and the tokens stay transformers'."""
    from energon_infer.engine.engine import Engine

    name = "mistral-window"
    prompts = [PROMPTS[1], PROMPTS[1][:3], PROMPTS[0][:10], PROMPTS[0][3:9]]  # 6 blocks for 4 x 2-3 held
    with Engine.from_pretrained(dirs[name], block_size=4, kv_cache_tokens=24, swap_space_tokens=64,
                                preemption="swap", chunked_prefill=True, max_batch_tokens=16, progress=False,
                                threads_per_worker=1) as engine:
        assert engine.scheduler.config.kv_window == 6
        out = [c.token_ids for c in engine.generate(prompts, greedy())]
        assert out == hf_greedy(dirs[name], prompts, NEW)
        assert engine.scheduler.swap.swaps == engine.scheduler.preemptions > 0 and engine.scheduler.blocks.used == 0


def _tp2(rank: int, world: int, path: str) -> list[list[int]]:
    runner = ModelRunner.from_pretrained(path, tp=2, kv_cache_tokens=64, **OPTS)
    return [g.token_ids for g in runner.generate(PROMPTS, greedy(), kv_admission="on_demand")]


@RunIf(min_world=2)
def test_windowed_generation_at_tp2_equals_transformers(dirs, refs):
    out = run_distributed(_tp2, 2, args=(dirs["phi3"],), timeout=600)
    assert out[0] == out[1] == refs["phi3"]


# ---------------------------------------------------------------------- the blocks alone


@settings(max_examples=80, deadline=None)
@given(window=st.integers(1, 24), block=st.sampled_from([1, 2, 3, 4, 8, 16]), prompt=st.integers(1, 60),
       new=st.integers(1, 60), chunk=st.integers(1, 32), chunked=st.booleans())
def test_a_sequence_holds_exactly_the_blocks_its_window_reaches(window, block, prompt, new, chunk, chunked):
    """Whatever the window, block size and chunking: at every step the sequence holds the blocks from its next
    query's window on, never more than ``peak`` (what admission reserves), and gives every block back at the end."""
    cfg = SchedulerConfig(kv_blocks=256, block_size=block, max_context=256, max_batch_tokens=chunk if chunked else 64,
                          chunked_prefill=chunked, kv_window=window, prefix_caching=False)
    s = Scheduler(cfg)
    req = s.add(Request("a", list(range(prompt)), greedy(new)))
    while s.running or s.waiting:
        before = req.computed
        plan = s.schedule(0)
        assert plan is not None
        table, mgr = s.blocks.tables[req.seq_id], s.blocks
        holes = mgr.holes(req.seq_id)
        assert holes == max(0, before - window + 1) // block  # every block wholly before the window released
        assert all(b != HOLE for b in table[holes:]) and len(table) == -(-req.computed // block)
        assert mgr.used == len(table) - holes <= req.reserve
        s.complete(plan, [1] * len(plan.step.items))
    assert s.blocks.used == 0 and s.blocks.num_free == cfg.kv_blocks


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 16), block=st.sampled_from([1, 2, 4, 8]),
       prompts=st.lists(st.integers(1, 24), min_size=2, max_size=4), new=st.integers(1, 40), spare=st.integers(0, 3),
       chunked=st.booleans(), preemption=st.sampled_from(["recompute", "swap"]), shared=st.booleans())
# The pool is exactly the 9-token prompt's peak, and its prefix match (the 1-token prompt's block) would need one more
@example(window=1, block=2, prompts=[1, 9], new=2, spare=0, chunked=True, preemption="recompute", shared=True)
def test_requests_longer_than_the_pool_all_finish(window, block, prompts, new, spare, chunked, preemption, shared):
    """A pool only just large enough for the largest request's peak: requests preempt one another, are recomputed
    (in steps no larger than their prompt) or swapped, share prefixes, and every one finishes with every block back;
    no request ever holds a block before the window of its next token."""
    probe = BlockManager(1, block, window=window)
    steps = [min(p, 8) if chunked else p for p in prompts]
    blocks = max(probe.peak(p + new, n) for p, n in zip(prompts, steps)) + spare
    cfg = SchedulerConfig(kv_blocks=blocks, block_size=block, max_context=256, max_batch_tokens=8 if chunked else 32,
                          chunked_prefill=chunked, kv_window=window, prefix_caching=shared, preemption=preemption,
                          host_blocks=64)
    s = Scheduler(cfg)
    reqs = [s.add(Request(str(i), [7] * p if shared else list(range(i, i + p)), greedy(new)))
            for i, p in enumerate(prompts)]
    for _ in range(4000):
        if not (s.running or s.waiting):
            break
        plan = s.schedule(0)
        assert plan is not None
        for r, (seq, fed) in zip(plan.requests, plan.step.items):  # released: all before the first fed token's window
            assert s.blocks.holes(seq) == s.blocks.unneeded(r.computed - len(fed))
        assert s.blocks.used <= blocks
        s.complete(plan, [1] * len(plan.step.items))
    assert all(len(r.generated) == new for r in reqs)
    assert s.blocks.used == 0 and s.swap.num_free == 64


def test_a_prefix_hit_holds_only_its_window_and_needs_the_whole_chain():
    m = BlockManager(16, 2, window=3)
    tokens = list(range(10))
    m.start(1, tokens)
    m.grow(1, 10)
    m.commit(1, tokens)
    first = list(m.tables[1])
    assert m.trim(1, 10) == 4 and m.used == 1  # a query at 10 reads keys from 8 on: blocks 0-3 released, named
    hit = m.start(2, tokens[:9] + [99])  # the chain is cached: 8 tokens shared and 1 copied, starts at 9
    assert (hit.start, hit.table[:3]) == (9, [HOLE] * 3)  # keys from 7 on: block 3 held again, 0-2 are holes
    assert hit.table[3] == first[3] and hit.copies == [(first[4], hit.table[4])] and m.used == 3
    m.free(2)
    m.free(1)
    m.start(3, [50] * 31)
    m.grow(3, 31)  # every block taken: the released chain is evicted
    assert m.evictions > 0 and m.start(4, tokens).start == 0


def test_a_swapped_out_sequence_comes_back_into_the_blocks_its_window_reaches():
    m = BlockManager(8, 2, window=3)
    # 10 tokens (5 blocks), 3 swapped out: a query at 10 reads keys from 8 on, so only the last one comes back
    assert m.resume_cost(10, 11, 3) == 2  # that block and one to grow into
    new = m.resume(1, 10, 3)
    assert len(new) == 1 and m.tables[1] == [HOLE] * 4 + new and m.used == 1
    assert m.grow(1, 11) and m.used == 2
