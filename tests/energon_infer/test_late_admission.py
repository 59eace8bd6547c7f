"""Late admission: a request that arrives while both steps of a group are in flight (``depth=2``) is admitted at
once in a late, admissions-only step, which a single worker runs together with the step planned ahead when that
one has not started (``energon_infer.worker.late_steps``), and right after it otherwise. Outputs equal the
runtime's either way."""

from __future__ import annotations

import queue
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.protocol import Free, Ping, Step, Tokens
from energon_infer.scheduling.scheduler import PLACEHOLDER, Request, Scheduler, SchedulerConfig
from energon_infer.worker.late_steps import merge, poller, split, take_late
from energon_infer.worker.workers import StageTimer, serve_commands

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _two_in_flight(prompt=(5, 6, 7), **config):
    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=64, depth=2, **config))
    a = s.add(Request("a", list(prompt), GREEDY))
    first, second = s.schedule(0), s.schedule(0)
    return s, a, first, second


def test_an_arrival_while_both_steps_fly_is_admitted_in_a_late_step_and_decodes_with_the_next():
    s, a, first, second = _two_in_flight()
    b = s.add(Request("b", [9, 10, 11, 12, 13], GREEDY))
    assert s.schedule(0) is None  # both slots busy
    late = s.schedule_late(0)
    assert late.late and late.send_back and not late.take_back and not late.frees
    assert late.items == [(b.seq_id, [9, 10, 11, 12, 13])] and b.seq_id in late.new_params and b.state == "running"
    assert s.schedule_late(0) is None  # nothing waiting
    c = s.add(Request("c", [30, 31], GREEDY))  # arrives while the first late step is in flight: a second one
    later = s.schedule_late(0)
    assert later.late and later.items == [(c.seq_id, [30, 31])] and s.late_steps == 2
    s.complete(first, [20])
    third = s.schedule(0)  # b's and c's first tokens count as the step planned ahead's: fed as placeholders
    assert third.items == [(a.seq_id, [PLACEHOLDER]), (b.seq_id, [PLACEHOLDER]), (c.seq_id, [PLACEHOLDER])]
    assert third.take_back
    s.complete(second, [21])
    s.complete(late, [40])
    s.complete(later, [60])
    s.complete(third, [22, 41, 61])
    assert a.generated == [20, 21, 22] and b.generated == [40, 41] and c.generated == [60, 61]


def test_no_late_step_when_it_could_touch_what_a_step_in_flight_writes():
    s, a, first, second = _two_in_flight(late_admission=False)
    s.add(Request("b", [9, 10], GREEDY))
    assert s.schedule_late(0) is None  # switched off

    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=64, depth=1))
    s.add(Request("a", [5, 6, 7], GREEDY))
    s.schedule(0)
    s.add(Request("b", [9, 10], GREEDY))
    assert s.schedule_late(0) is None  # nothing planned ahead: the next step takes it as soon

    s, a, first, second = _two_in_flight()
    x = s.add(Request("x", [8, 8, 8], SamplingParams(temperature=0, max_tokens=1)))
    s.add(Request("y", [70, 71, 72, 73, 74], GREEDY))
    late = s.schedule_late(0)
    assert [seq for seq, _ in late.items] == [x.seq_id, x.seq_id + 1]
    s.complete(first, [20])
    third = s.schedule(0)
    s.complete(second, [21])
    s.complete(late, [2, 3])  # x finishes: its blocks are freed, the free is not sent yet
    s.add(Request("z", [60, 61], GREEDY))
    assert s.schedule_late(0) is None  # a step in flight may still write x's blocks
    s.complete(third, [1] * len(third.items))

    s, a, first, second = _two_in_flight(prompt=(5, 6, 7, 8, 9))
    s.add(Request("p", [5, 6, 7, 8, 42], GREEDY))  # a prefix hit on a block the first step in flight fills
    assert s.schedule_late(0) is None
    s.waiting[0].prompt = [1, 2, 3, 4, 42]  # no shared block: admitted
    assert s.schedule_late(0) is not None


def test_a_refused_late_step_takes_no_step_id():
    s, a, first, second = _two_in_flight(prompt=(5, 6, 7, 8, 9))
    s.add(Request("p", [5, 6, 7, 8, 42], GREEDY))  # a prefix hit: refused, turn after turn
    assert s.schedule_late(0) is None and s.schedule_late(0) is None
    s.waiting[0].prompt = [1, 2, 3, 4, 42]
    assert s.schedule_late(0).step_id == second.step_id + 1


def test_the_late_budget_is_what_the_step_planned_ahead_leaves():
    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=64, depth=2, max_batch_tokens=8))
    s.add(Request("a", [5, 6, 7], GREEDY))
    s.schedule(0), s.schedule(0)  # the second carries one decode token
    s.add(Request("b", list(range(10, 18)), GREEDY))  # 8 tokens: with the decode, 9 > 8
    assert s.schedule_late(0) is None
    s.add(Request("c", [1], GREEDY))  # FIFO: c does not pass b
    assert s.schedule_late(0) is None


def test_late_steps_together_stay_within_the_budget_of_the_step_planned_ahead():
    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=64, depth=2, max_batch_tokens=8))
    s.add(Request("a", [5, 6, 7], GREEDY))
    s.schedule(0), s.schedule(0)  # the second carries one decode token: 7 left
    b = s.add(Request("b", [10, 11, 12, 13], GREEDY))
    assert s.schedule_late(0).items == [(b.seq_id, [10, 11, 12, 13])]  # 3 left
    s.add(Request("c", [20, 21, 22, 23], GREEDY))  # 4 > 3: waits for the group's next step
    assert s.schedule_late(0) is None
    s.waiting[0].prompt = [20, 21, 22]
    assert s.schedule_late(0) is not None and s.late_steps == 2  # exactly the 3 left


# ---------------------------------------------------------------------- the worker side


def _step(step_id: int, *, late: bool = False, seqs: tuple[int, ...] = (1,)) -> Step:
    return Step(step_id, [], [(s, [s, s]) for s in seqs], {s: GREEDY for s in seqs}, blocks={s: [s] for s in seqs},
                starts={s: 0 for s in seqs}, send_back=True, late=late)


def test_poller_answers_at_once():
    q: queue.Queue = queue.Queue()
    poll = poller(q)
    assert poll() is None
    q.put(Ping(4))
    assert poll() == Ping(4) and poll() is None


def test_take_late_takes_only_late_steps_of_the_group_right_behind():
    queued = deque([_step(2, late=True, seqs=(5,)), _step(3, late=True, seqs=(6,)), Ping(1), _step(4, late=True)])
    held: deque = deque()
    got = take_late(_step(1), lambda: queued.popleft() if queued else None, held)
    assert [s.step_id for s in got] == [2, 3] and list(held) == [Ping(1)]
    assert take_late(_step(1), lambda: None, held) == [] and list(held) == [Ping(1)]  # held first: still blocks
    held = deque([Free([3])])
    assert take_late(_step(1), lambda: _step(9, late=True), held) == [] and list(held) == [Free([3])]
    other = Step(7, [], [(8, [1])], {}, group=1, late=True)
    held = deque()
    assert take_late(_step(1), lambda: other, held) == [] and list(held) == [other]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_split_gives_each_part_its_own_tokens_and_results(sizes, data):
    parts, next_seq = [], 1
    for i, n in enumerate(sizes):
        parts.append(_step(i + 1, late=i > 0, seqs=tuple(range(next_seq, next_seq + n))))
        next_seq += n
    run = merge(parts)
    assert [s for s, _ in run.items] == list(range(1, next_seq)) and set(run.new_params) == set(run.blocks)
    tokens = data.draw(st.lists(st.integers(0, 100), min_size=len(run.items), max_size=len(run.items)))
    failed = data.draw(st.sets(st.integers(1, next_seq - 1)))
    replies = split(parts, tokens, {s: (0.5, []) for s in range(1, next_seq)}, {s: "x" for s in failed})
    assert [r.step_id for r in replies] == [p.step_id for p in parts]
    assert [t for r in replies for t in r.tokens] == tokens
    for r, p in zip(replies, parts):
        ids = {s for s, _ in p.items}
        assert len(r.tokens) == len(p.items) and set(r.logprobs) == ids and set(r.errors) == ids & failed


PROMPTS = [[5, 6, 7, 8, 9], [12, 13], list(range(20, 31)), [50, 51, 52]]


@pytest.fixture(scope="module")
def runner(tiny_dirs):
    return ModelRunner.from_pretrained(tiny_dirs["llama"], progress=False, block_size=4)


@pytest.fixture(scope="module")
def reference(runner):
    return [g.token_ids for g in runner.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("merged", [True, False], ids=["merged into the step ahead", "run after it"])
def test_late_arrivals_equal_the_runtime_through_the_worker_loop(runner, reference, merged):
    # The controller's part played in line: replies complete steps and plan the next ones, as the engine does.
    s = Scheduler(SchedulerConfig(kv_blocks=runner.cache.num_blocks, block_size=4, max_context=128, depth=2))
    reqs = [s.add(Request("r0", PROMPTS[0], GREEDY))]
    inflight = {p.step_id: p for p in (s.schedule(0), s.schedule(0))}
    queue = deque(p.step for p in inflight.values())
    reqs += [s.add(Request(f"r{i}", p, GREEDY)) for i, p in enumerate(PROMPTS[1:3], 1)]  # while both fly
    late = s.schedule_late(0)
    assert late is not None and len(late.items) == 2
    reqs += [s.add(Request(f"r{i}", p, GREEDY)) for i, p in enumerate(PROMPTS[3:], 3)]  # and while it is queued
    later = s.schedule_late(0)
    assert later is not None and len(later.items) == len(PROMPTS) - 3
    for plan in (late, later):
        inflight[plan.step_id] = plan
        queue.append(plan.step)
    runs: list[int] = []
    run_step = runner.run_step

    def counted(step, items=None, **kw):
        runs.append(step.step_id)
        return run_step(step, items, **kw)

    def reply(msg):
        assert isinstance(msg, Tokens)
        s.complete(inflight.pop(msg.step_id), msg.tokens, msg.logprobs, msg.errors)
        for g in s.idle_groups():
            while (plan := s.schedule(g)) is not None:
                inflight[plan.step_id] = plan
                queue.append(plan.step)

    runner.run_step = counted
    try:
        serve_commands(runner, StageTimer(runner.stage, runner.device), 0, lambda: queue.popleft() if queue else None,
                       reply, (lambda: queue.popleft() if queue else None) if merged else None)
    finally:
        del runner.run_step
        for r in reqs:
            if r.seq_id in runner.cache:
                runner.free(r.seq_id)
    assert [r.generated for r in reqs] == reference
    # merged: both ran as part of the step planned ahead; else each alone, after it
    assert (late.step_id in runs) is not merged and (later.step_id in runs) is not merged
    assert not inflight and s.num_running == 0
