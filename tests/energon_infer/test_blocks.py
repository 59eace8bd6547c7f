"""The scheduler's block allocator and preemption, without processes: reference counts, LRU eviction of cached
prefix blocks, copy-on-write, the off switch, and which request is preempted and how it comes back."""

from __future__ import annotations

from energon_infer.sampling import SamplingParams
from energon_infer.scheduling.blocks import BlockManager
from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig


def _run(m: BlockManager, seq: int, tokens: list[int]):
    hit = m.start(seq, tokens)
    m.grow(seq, len(tokens))
    m.commit(seq, tokens)
    return hit


def test_shared_blocks_are_counted_and_cached_after_release():
    m = BlockManager(6, 2)
    a = _run(m, 1, [1, 2, 3, 4, 5])  # blocks [1,2] [3,4] named, [5] not (partial)
    b = _run(m, 2, [1, 2, 3, 4, 9])
    assert (a.start, b.start) == (0, 4) and b.table[:2] == m.tables[1][:2]
    assert m.used == 4 and m.num_free == 2  # two shared blocks + one tail each
    m.free(1)
    assert m.used == 3  # the shared two still held by 2; 1's tail back on the free list
    m.free(2)
    assert m.used == 0 and m.num_free == 6  # named blocks stay cached but count as free


def test_least_recently_released_cached_block_is_evicted_first():
    m = BlockManager(4, 2)
    _run(m, 1, [1, 2, 0])
    _run(m, 2, [3, 4, 0])
    old, new = m.tables[1][0], m.tables[2][0]
    m.free(1)
    m.free(2)
    # Four free blocks, two of them cached ([1,2] released first). Taking three evicts only [1,2].
    _run(m, 3, [7, 7, 7, 7, 7, 7])
    assert old in m.tables[3] and new not in m.tables[3] and m.evictions == 1
    assert m.start(4, [3, 4, 1]).start == 2 and m.start(5, [1, 2, 1]).start == 0


def test_copy_on_write_for_a_fully_cached_prompt_and_a_divergent_block():
    m = BlockManager(8, 4)
    _run(m, 1, list(range(8)))
    full = m.start(2, list(range(8)))  # all cached: the last token recomputed into a copy of its block
    assert full.start == 7 and full.copies == [(m.tables[1][1], full.table[1])]
    assert full.table[0] == m.tables[1][0] and full.table[1] != m.tables[1][1]
    part = m.start(3, [0, 1, 2, 3, 4, 5, 99])  # diverges at the 3rd token of block 2: keep 2 of its tokens
    assert part.start == 6 and part.copies == [(m.tables[1][1], part.table[1])]


def test_off_switch_shares_nothing():
    m = BlockManager(8, 2, prefix_caching=False)
    _run(m, 1, [1, 2, 3, 4])
    assert m.start(2, [1, 2, 3, 4]).start == 0 and m.hit_tokens == 0


def test_preemption_takes_the_newest_request_which_resumes_first_with_its_tokens():
    s = Scheduler(SchedulerConfig(kv_blocks=5, block_size=2, max_context=64, max_batch_tokens=32, prefix_caching=False))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    a = s.add(Request("a", [1, 2, 3], greedy))
    b = s.add(Request("b", [4, 5, 6], greedy))
    plan = s.schedule(0)
    assert [len(t) for _, t in plan.items] == [3, 3] and s.blocks.num_free == 1
    s.complete(plan, [7, 8])
    s.complete(s.schedule(0), [7, 8])  # 4 tokens each: still two blocks each
    plan = s.schedule(0)  # both need a third block, one is free: b (newer) is preempted, a grows
    assert [sid for sid, _ in plan.items] == [a.seq_id] and plan.frees == [b.seq_id]
    assert s.preemptions == 1 and s.waiting[0] is b and b.computed == 0 and b.generated == [8, 8]
    s.complete(plan, [9])
    while a.state != "finished":
        plan = s.schedule(0)
        s.complete(plan, [9] * len(plan.items))
    plan = s.schedule(0)  # b comes back: its prompt and its generated token are recomputed
    assert plan.items == [(b.seq_id, [4, 5, 6, 8, 8])] and plan.new_params == {b.seq_id: greedy}
    assert plan.frees == [a.seq_id]


def test_reserve_admission_never_preempts():
    s = Scheduler(SchedulerConfig(kv_blocks=4, block_size=2, max_context=64, kv_admission="reserve"))
    for name in "ab":
        s.add(Request(name, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4)))
    while s.has_work():
        plan = s.schedule(0)
        if plan is None:
            break
        assert len(plan.items) == 1  # 4 blocks reserved for one request
        s.complete(plan, [9] * len(plan.items))
    assert s.preemptions == 0
