"""Continuous batching decisions, without processes: budget, FIFO, KV reservation, groups, stops, aborts."""

from __future__ import annotations

import pytest

from energon_infer.sampling import SamplingParams
from energon_infer.scheduling.scheduler import QueueFullError, Request, Scheduler, SchedulerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=3)


def _sched(**kw) -> Scheduler:
    # Prefix caching off (its default is on, the engine's): these tests count every prompt token a step runs.
    base = dict(kv_blocks=64, block_size=4, max_context=64, max_batch_tokens=16, prefix_caching=False)
    return Scheduler(SchedulerConfig(**{**base, **kw}))


def _req(name: str, n: int, params: SamplingParams = GREEDY) -> Request:
    return Request(name, list(range(1, n + 1)), params)


def _run_step(s: Scheduler, group: int = 0, token: int = 9):
    plan = s.schedule(group)
    assert plan is not None
    return plan, s.complete(plan, [token] * len(plan.items))


def test_new_requests_join_the_running_batch_at_the_next_step():
    s = _sched()
    s.add(_req("a", 5))
    plan, _ = _run_step(s)
    assert [len(t) for _, t in plan.items] == [5]
    s.add(_req("b", 4))  # arrives while "a" is decoding
    plan, events = _run_step(s)
    assert [(len(t)) for _, t in plan.items] == [1, 4]  # a's decode token + b's prompt, packed in one step
    assert [r.request_id for r, _, _ in events] == ["a", "b"]
    plan, events = _run_step(s)  # a finishes (3 tokens), b has 2
    assert [(r.request_id, done) for r, _, done in events] == [("a", True), ("b", False)]
    plan, _ = _run_step(s)
    assert plan.frees == [1]  # a's KV blocks are freed on the workers before this step runs
    assert plan.items == [(2, [9])]


def test_token_budget_and_strict_fifo():
    s = _sched(max_batch_tokens=10)
    for name, n in (("a", 6), ("b", 6), ("c", 2)):
        s.add(_req(name, n))
    plan, _ = _run_step(s)
    # b does not fit the 4 tokens left; c would, but must not overtake b.
    assert [s_ for s_, _ in plan.items] == [1]
    plan, _ = _run_step(s)
    assert [len(t) for _, t in plan.items] == [1, 6, 2]  # 9 tokens <= 10


def test_kv_reservation_keeps_the_cache_from_overflowing():
    # Each request reserves ceil((5 + 3) / 4) = 2 blocks; 5 blocks hold two of them.
    s = _sched(kv_blocks=5)
    for name in "abc":
        s.add(_req(name, 5))
    plan, _ = _run_step(s)
    assert len(plan.items) == 2 and s.reserved == 4
    for _ in range(2):  # c waits while a and b decode, though the step budget has room for it
        plan, _ = _run_step(s)
        assert len(plan.items) == 2 and s.num_waiting == 1
    plan, _ = _run_step(s)  # a and b finished: their blocks are free again
    assert plan.items == [(3, [1, 2, 3, 4, 5])] and s.reserved == 2 and plan.frees == [1, 2]


def test_bounded_queue_raises_queue_full():
    s = _sched(max_queue=2)
    s.add(_req("a", 2))
    s.add(_req("b", 2))
    with pytest.raises(QueueFullError, match=r"2 waiting, max_queue=2"):
        s.add(_req("c", 2))
    _run_step(s)  # admission empties the queue
    s.add(_req("c", 2))


def test_requests_that_can_never_run_are_refused_with_the_fix():
    s = _sched(max_batch_tokens=8, kv_blocks=4)
    with pytest.raises(ValueError, match=r"more than max_batch_tokens=8"):
        s.add(_req("long", 9))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks .* the cache has 4"):
        s.add(_req("big", 4, SamplingParams(max_tokens=16)))
    with pytest.raises(ValueError, match="the prompt is empty"):
        s.add(Request("empty", [], GREEDY))


def test_groups_split_the_work_and_run_concurrently():
    s = _sched(groups=2, max_batch_tokens=64)
    for name in "abcd":
        s.add(_req(name, 3))
    p0 = s.schedule(0)
    p1 = s.schedule(1)
    assert p0 is not None and p1 is not None
    assert len(p0.items) == 2 and len(p1.items) == 2  # each group takes its share, both in flight
    assert s.schedule(0) is None and s.in_flight == 2
    s.complete(p1, [5, 5])
    nxt = s.schedule(1)  # group 1 goes on while group 0 is still in flight
    assert nxt is not None and [t for _, t in nxt.items] == [[5], [5]]


def test_static_batching_waits_for_the_whole_batch():
    s = _sched(policy="static")
    s.add(_req("a", 2, SamplingParams(temperature=0, max_tokens=1)))
    s.add(_req("b", 2, SamplingParams(temperature=0, max_tokens=3)))
    _run_step(s)  # a finishes at once, b runs on
    s.add(_req("c", 2))
    plan, _ = _run_step(s)
    assert len(plan.items) == 1  # c waits for b although there is room
    _run_step(s)
    plan, _ = _run_step(s)
    assert [len(t) for _, t in plan.items] == [2]


def test_stop_tokens_eos_and_context_end_requests():
    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=8, max_batch_tokens=16), eos_token_ids=(2,))
    s.add(Request("eos", [1, 1], SamplingParams(temperature=0, max_tokens=10)))
    s.add(Request("ignore", [1, 1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    s.add(Request("ctx", [1] * 6, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    plan = s.schedule(0)
    events = s.complete(plan, [3, 3, 3])
    assert not any(done for _, _, done in events)
    events = s.complete(s.schedule(0), [2, 2, 2])  # EOS; "ctx" reaches 6 + 2 tokens of an 8-token context
    assert [(r.request_id, r.finish_reason) for r, _, done in events if done] == [("eos", "stop")]
    events = s.complete(s.schedule(0), [4, 4])
    assert [(r.request_id, r.finish_reason) for r, _, done in events if done] == [("ctx", "length")]


def test_stop_strings_cut_the_text():
    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=64), decode=lambda ids: "".join(map(chr, ids)))
    s.add(Request("a", [65], SamplingParams(temperature=0, max_tokens=10, stop=("cd",))))
    for ch in "abcd":
        plan = s.schedule(0)
        events = s.complete(plan, [ord(ch)])
    req, _, done = events[0]
    assert done and req.finish_reason == "stop" and req.text == "ab"


def test_abort_waiting_running_and_in_flight():
    s = _sched()
    s.add(_req("a", 2, SamplingParams(temperature=0, max_tokens=50)))
    s.add(_req("b", 2))
    plan = s.schedule(0)
    assert s.abort("a") is None  # in flight: it leaves when its tokens arrive
    events = s.complete(plan, [4, 4])
    assert [(r.request_id, tok, done, r.finish_reason) for r, tok, done in events][0] == ("a", None, True, "abort")
    s.add(_req("c", 2))
    gone = s.abort("c")
    assert gone is not None and gone.finish_reason == "abort" and s.num_waiting == 0
    assert s.abort("b").finish_reason == "abort"  # running, not in flight: leaves now
    assert s.num_running == 0 and s.reserved == 0 and sorted(s.take_frees()) == [1, 2]


def test_fail_running_keeps_the_waiting_requests():
    s = _sched(max_running=1)
    s.add(_req("a", 2))
    s.add(_req("b", 2))
    s.schedule(0)
    lost = s.fail_running()
    assert [r.request_id for r in lost] == ["a"] and s.num_waiting == 1 and s.in_flight == 0
    plan = s.schedule(0)
    assert plan is not None and plan.frees == [] and [len(t) for _, t in plan.items] == [2]


def test_config_is_validated():
    with pytest.raises(ValueError, match="policy='greedy' must be one of"):
        SchedulerConfig(kv_blocks=1, block_size=1, max_context=1, policy="greedy")
    with pytest.raises(ValueError, match="groups=0 must be >= 1"):
        SchedulerConfig(kv_blocks=1, block_size=1, max_context=1, groups=0)
