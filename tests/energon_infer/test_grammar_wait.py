"""A structured-output request waits for its grammar; no other request's step waits for it.

The engine's scheduler holds a request whose grammar the rank that samples has not compiled
(:mod:`energon_infer.scheduling.grammar_wait`), asks the rank for it (``CompileGrammars``, compiled on the rank's
grammar thread) and queues the request once the rank answers (``GrammarReady``). Checked on the real engine with a
schema that takes the rank a good fraction of a second to compile, by the order of the commands the controller sends
and the answers it gets (not by timings); and the pieces: the pure wait list, the rank's grammar thread.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest

from energon_infer.sampling import SamplingParams
from energon_infer.structured import ON_RANK, REFUSED, StructuredOutput
from tests.energon_infer.test_structured_outputs import OPTS, write_model
from tests.helpers.runif import RunIf

pytest.importorskip("xgrammar")
pytestmark = RunIf(serve=True)

#: Alternatives of the slow schema: about half a second for the rank to compile on this project's CPU machines, against
#: a few milliseconds for a step of the test model.
SLOW = 600


def slow_schema(nonce: int, n: int = SLOW) -> dict[str, Any]:
    """``{"pick": {"k<i>": "<letters>"}}``, one of ``n`` objects: a short output, a grammar slow to compile.
    ``nonce``: a constraint no other test uses."""
    alts = [{"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{1,{2 + i % 5}}}"}},
             "required": [f"k{i}"], "additionalProperties": False} for i in range(n)]
    return {"type": "object", "properties": {"pick": {"anyOf": alts}}, "required": ["pick"],
            "additionalProperties": False, "description": f"test {nonce}"}


def picked(text: str, n: int = SLOW) -> bool:
    """An independent check of an output of :func:`slow_schema`."""
    value = json.loads(text)
    if set(value) != {"pick"} or not isinstance(value["pick"], dict) or len(value["pick"]) != 1:
        return False
    (key, letters), = value["pick"].items()
    m = re.fullmatch(r"k(\d+)", key)
    return (m is not None and int(m.group(1)) < n and isinstance(letters, str)
            and re.fullmatch(f"[a-z]{{1,{2 + int(m.group(1)) % 5}}}", letters) is not None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("grammar-wait") / "tiny-json")


@pytest.fixture(scope="module")
def engine(model_dir):
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(model_dir, max_queue=64, **OPTS) as eng:
        yield eng


@pytest.fixture
def record(monkeypatch):
    """What the controller sends (steps, grammar requests) and the grammar answers it gets, in its own order."""
    from energon_infer.engine.controller import Controller
    from energon_infer.protocol import CompileGrammars, Step
    from energon_infer.worker.workers import SpawnedWorkerGroup

    events: list[tuple[str, Any]] = []
    lock = threading.Lock()
    send, ready = SpawnedWorkerGroup.send, Controller.grammar_ready

    def sending(self: Any, cmd: Any) -> None:
        if isinstance(cmd, (Step, CompileGrammars)):
            with lock:
                events.append(("step" if isinstance(cmd, Step) else "compile", cmd))
        send(self, cmd)

    def answered(self: Any, msg: Any) -> None:
        with lock:
            events.append(("ready", msg))
        ready(self, msg)

    monkeypatch.setattr(SpawnedWorkerGroup, "send", sending)
    monkeypatch.setattr(Controller, "grammar_ready", answered)
    return events


def _seq_of(events: list[tuple[str, Any]], pick: Any) -> int:
    """The sequence id of the first new sequence whose params ``pick`` accepts."""
    return next(s for kind, cmd in events if kind == "step" for s, p in cmd.new_params.items() if pick(p))


def _steps_holding(events: list[tuple[str, Any]], seq: int) -> list[int]:
    """Positions in ``events`` of the steps that run ``seq``."""
    return [i for i, (kind, cmd) in enumerate(events) if kind == "step" and any(s == seq for s, _ in cmd.items)]


def test_an_unconstrained_request_finishes_while_a_fresh_grammar_compiles(engine, record):
    """Submitted together, the unconstrained request keeps stepping while the other's grammar compiles, and the
    first step of the request whose grammar compiles is sent only after the rank answered; its output validates and equals the output of the
    old path (the rank compiling the grammar in the step that admits it) with the same seed."""
    so = StructuredOutput(json_schema=slow_schema(1))
    constrained = SamplingParams(temperature=1.0, seed=11, max_tokens=200, structured=so)
    fc, fu = engine.submit_all([("the quick", constrained), ("a", SamplingParams(max_tokens=8, ignore_eos=True))])
    held, alone = fc.result(300), fu.result(300)
    assert held.finish_reason == "stop" and picked(held.text), held.text
    assert len(alone.token_ids) == 8
    c = _seq_of(record, lambda p: p.structured is not None)
    u = _seq_of(record, lambda p: p.ignore_eos)
    first_c = _steps_holding(record, c)[0]
    asked = next(i for i, (kind, cmd) in enumerate(record) if kind == "compile" and so in cmd.structured)
    answered = next(i for i, (kind, msg) in enumerate(record) if kind == "ready" and msg.key == so.key)
    assert record[answered][1].error is None
    assert asked < answered < first_c
    # Steps of the other request ran while the rank compiled (the old path compiles inside a step: none could).
    # How many of its 8 fit in the compile depends on the machine's load, so only "some" is asserted.
    assert any(asked < i < answered for i in _steps_holding(record, u)), (asked, answered, _steps_holding(record, u))

    # The old path: nothing held, a constraint the rank has not seen (a description does not change the grammar)
    # compiled on the rank's mask thread in the step that admits it.
    old = StructuredOutput(json_schema={**slow_schema(1), "description": "old path"})
    n = len(record)
    with engine._controller.lock:
        engine.scheduler.grammars.enabled = False
    try:
        again = engine.generate(["the quick"], SamplingParams(temperature=1.0, seed=11, max_tokens=200,
                                                              structured=old))[0]
    finally:
        with engine._controller.lock:
            engine.scheduler.grammars.enabled = True
    assert not [cmd for kind, cmd in record[n:] if kind == "compile"]
    assert again.token_ids == held.token_ids


def test_a_second_identical_schema_does_not_wait(engine, record):
    """A constraint the rank answered for is ready: its next request (keywords in another order) is queued at once,
    with nothing asked of the rank, and no grammar wait is recorded for it."""
    schema = slow_schema(2, n=40)
    first = engine.generate(["a"], SamplingParams(seed=1, max_tokens=200, structured=StructuredOutput(
        json_schema=schema)))[0]
    assert picked(first.text, 40)
    asked = [cmd for kind, cmd in record if kind == "compile"]
    waits = _grammar_waits(engine)
    fut = engine.submit("b", SamplingParams(seed=2, max_tokens=200, structured=StructuredOutput(
        json_schema=dict(reversed(list(schema.items()))))))
    assert engine.scheduler.grammars.num_held == 0  # queued at once
    assert picked(fut.result(300).text, 40)
    assert [cmd for kind, cmd in record if kind == "compile"] == asked
    assert _grammar_waits(engine) == waits


def _grammar_waits(engine: Any) -> float:
    text = engine.metrics.render()
    m = re.search(r'^energon_grammar_wait_seconds_count\{model_name="[^"]*"\} (\S+)$', text, re.M)
    assert m is not None, text
    return float(m.group(1))


def test_a_grammar_that_fails_to_compile_ends_only_its_request(engine, record):
    """A grammar the rank cannot compile (given as checked: the engine does not build it) fails its held request
    with a 400 before any step runs it; the request beside it completes."""
    from energon_infer.engine.delivery import RequestRefusedError
    from energon_infer.serving.http_guard import engine_error

    bad = StructuredOutput(grammar="root ::= no_such_rule", compiled=ON_RANK)
    fb, fu = engine.submit_all([("x", SamplingParams(max_tokens=8, structured=bad)),
                                ("y", SamplingParams(max_tokens=8, ignore_eos=True))])
    with pytest.raises(RequestRefusedError, match="structured output refused: .*no_such_rule") as err:
        fb.result(120)
    assert engine_error(err.value).status == 400
    assert len(fu.result(120).token_ids) == 8
    (answer,) = [msg for kind, msg in record if kind == "ready"]
    assert answer.error is not None and answer.error.startswith(REFUSED)
    assert not [cmd for kind, cmd in record if kind == "step" for p in cmd.new_params.values() if p.structured]
    assert engine.scheduler.grammars.num_held == 0 and engine.health()["status"] == "ready"


def test_aborting_a_held_request_frees_it(engine, record):
    """A request held for its grammar counts as waiting; aborted (its future cancelled), it leaves at once and never
    runs; the rank's answer, when it comes, releases nobody, and the constraint is ready for the next request."""
    so = StructuredOutput(json_schema=slow_schema(3))
    waiting = engine.scheduler.num_waiting
    fut = engine.submit("z", SamplingParams(max_tokens=200, structured=so))
    assert engine.scheduler.grammars.num_held == 1 and engine.scheduler.num_waiting == waiting + 1
    fut.cancel()
    assert engine.scheduler.grammars.num_held == 0 and engine.scheduler.num_waiting == waiting
    out = engine.generate(["z"], SamplingParams(seed=4, max_tokens=200, structured=so))[0]  # asked once, ready
    assert picked(out.text)
    assert len([cmd for kind, cmd in record if kind == "compile"]) == 1
    assert not [cmd for kind, cmd in record if kind == "step" for s, p in cmd.new_params.items()
                if p.structured is not None and p.max_tokens == 200 and p.seed is None]


# ---------------------------------------------------------------------- the pieces


def test_the_wait_list_holds_releases_fails_and_asks_again_after_a_restart():
    from energon_infer.scheduling.grammar_wait import GrammarWait
    from energon_infer.scheduling.requests import Request

    clock = [0.0]
    wait = GrammarWait(hold=True, size=1, clock=lambda: clock[0])
    a, b = StructuredOutput(choice=("x",)), StructuredOutput(regex="y+")
    reqs = [Request(name, [1], SamplingParams(structured=so)) for name, so in (("1", a), ("2", b), ("3", a))]
    queue: list[Request] = []
    for r in reqs:
        wait.queue(r, queue)
    assert queue == [] and wait.num_held == 3 and wait.take_asks() == [a, b] and not wait.asking
    wait.restart()  # nothing answered yet: both asked again
    assert wait.take_asks() == [a, b]
    clock[0] = 2.5
    assert [(r.request_id, s) for r, s in wait.release(a.key, None, queue)] == [("1", 2.5), ("3", 2.5)]
    assert queue == [reqs[0], reqs[2]]
    failed = wait.release(b.key, REFUSED + "no", queue)
    assert [r.request_id for r, _ in failed] == ["2"] and reqs[1].finish_reason == "error"
    assert reqs[1].error == REFUSED + "no" and len(queue) == 2
    wait.queue(later := Request("4", [1], SamplingParams(structured=a)), queue)  # ready: queued at once
    assert queue[-1] is later and not wait.asking
    wait.release(b.key, None, queue)  # size 1: b pushes a out
    wait.queue(Request("5", [1], SamplingParams(structured=a)), queue)
    assert wait.num_held == 1 and wait.take_asks() == [a]
    assert wait.remove("5") is not None and wait.num_held == 0 and wait.remove("5") is None
    off = GrammarWait()
    off.queue(unheld := Request("6", [1], SamplingParams(structured=a)), queue)
    assert queue[-1] is unheld and not off.asking


def test_the_rank_compiles_on_its_grammar_thread_and_the_step_takes_it(model_dir):
    """In process: asked, the rank compiles on its grammar thread and answers; the step that then admits a sequence
    with that constraint compiles nothing; a grammar that cannot compile is answered with a 400's error."""
    from energon_infer.worker.runtime import ModelRunner

    runner = ModelRunner.from_pretrained(model_dir, progress=False, block_size=4)
    so = StructuredOutput(json_schema=slow_schema(5, n=40), compiled=ON_RANK)
    bad = StructuredOutput(grammar="root ::= nothing_here", compiled=ON_RANK)
    answers: dict[tuple[str, str], tuple[str | None, str]] = {}
    done = threading.Event()

    def answer(key: tuple[str, str], error: str | None) -> None:
        answers[key] = (error, threading.current_thread().name)
        if len(answers) == 2:
            done.set()

    runner.sampler.grammars.compile([so, bad], answer)
    assert done.wait(120)
    assert answers[so.key][0] is None and answers[so.key][1].startswith("energon-grammar")
    assert answers[bad.key][0] is not None and answers[bad.key][0].startswith(REFUSED)
    masks = runner.sampler.grammars.masks
    assert masks is not None and masks.compiles == 2
    res = runner.step([(1, [5, 6, 7])], {1: SamplingParams(max_tokens=8, structured=so)})
    assert not res.errors and masks.compiles == 2
    again: list[tuple[tuple[str, str], str | None]] = []
    runner.sampler.grammars.compile([so], lambda key, error: again.append((key, error)))
    assert again == [(so.key, None)] and masks.compiles == 2  # kept: answered at once


def test_a_released_request_keeps_its_arrival_place_in_the_queue():
    """Held for its grammar, a request rejoins the queue at its arrival place: ahead of the requests queued after it,
    behind the one queued before it and behind a preempted one at the head; two released together keep their order.
    The next step admits in that order (one request a step here)."""
    from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=32, max_batch_tokens=16, max_running=1),
                      hold_grammars=True)
    so = StructuredOutput(choice=("x", "y"))
    plain = SamplingParams(max_tokens=2)
    order = [("first", plain), ("held-1", SamplingParams(max_tokens=2, structured=so)), ("second", plain),
             ("held-2", SamplingParams(max_tokens=2, structured=so)), ("third", plain)]
    reqs = {name: sched.add(Request(name, [1, 2, 3], p)) for name, p in order}
    assert [r.request_id for r in sched.waiting] == ["first", "second", "third"] and sched.grammars.num_held == 2
    sched.waiting.appendleft(old := Request("preempted", [1], plain))  # as Scheduler._preempt puts one back
    sched.grammar_ready(so.key, None)
    assert [r.request_id for r in sched.waiting] == ["preempted", "first", "held-1", "second", "held-2", "third"]
    sched.waiting.popleft()
    assert old.queue_order == 0 and reqs["held-1"].queue_order < reqs["second"].queue_order
    admitted = []
    for _ in range(5):
        plan = sched.schedule(0)
        assert plan is not None
        admitted += [r.request_id for r in plan.requests if r.request_id not in admitted]
        sched.complete(plan, [7] * len(plan.step.items))
    assert admitted[:3] == ["first", "held-1", "second"]
