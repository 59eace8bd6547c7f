"""The serving path's time account (energon_infer.engine.account): each request's parts add up to its wall time,
the server's wall time is the client's less a little ("other"), at low load and with many concurrent requests; a
step's parts add up to its wall; the prompt is encoded once; the text no longer needs the controller's lock."""

from __future__ import annotations

import json
import threading
import time

import pytest

from energon_infer import SamplingParams
from energon_infer.engine.account import (
    REQUEST_PARTS,
    STEP_PARTS,
    RequestStamps,
    ServingAccount,
    StepStamps,
    request_parts,
    step_parts,
)
from energon_infer.engine.engine import Encoded, Engine
from tests.helpers.runif import RunIf

OPTS = dict(progress=False, threads_per_worker=1, block_size=4, kv_cache_tokens=4096)
# What the client's own side of a request may add to the server's wall time: its HTTP stack, and its thread's turn
# on a shared 2-core machine where the server runs in the same process (BackgroundServer).
OTHER_S, OTHER_SHARE = 0.05, 0.25


# ---------------------------------------------------------------------- the pure parts


def test_request_parts_add_up_and_are_in_order():
    s = RequestStamps(received=100, tokenize_start=130, tokenized=170, queued=180, admitted=260, last_token=900,
                      done=950)
    s.ran(260, (270, 280, 500, 520))  # its first step: 10 ns queued on the worker behind another
    s.ran(500, (520, 525, 800, 820))  # the next, planned ahead: sent while the first ran, no wait
    p = request_parts(s)
    assert list(p) == list(REQUEST_PARTS)
    assert sum(p.values()) == s.done - s.received
    assert p == {"http": 30, "tokenize": 40, "submit": 10, "queue": 80, "prepare": 15, "forward": 495,
                 "sample": 40, "wait_worker": 10, "loop": 80, "stream_out": 50}


def test_request_parts_never_negative_when_clocks_disagree():
    s = RequestStamps(received=0, tokenize_start=0, tokenized=0, queued=0, admitted=10, last_token=20, done=20)
    s.ran(10, (0, 5, 100, 120))  # the worker's sums exceed the run: scaled down to it
    p = request_parts(s)
    assert min(p.values()) >= 0 and sum(p.values()) == 20
    assert request_parts(RequestStamps(received=5))["http"] == 0  # a request that never got further


def test_step_parts_add_up_and_merged_late_steps_count_the_worker_once():
    st = StepStamps(plan_start=0, planned=10, sent=12, timing=(20, 25, 80, 90), received=95, completed=99, handed=110)
    p = step_parts(st)
    assert list(p) == list(STEP_PARTS) and sum(p.values()) == 110
    assert (p["worker_wait"], p["forward"], p["sample"], p["reply"]) == (8, 55, 10, 5)
    acc = ServingAccount()
    acc.add_step(st, 4)
    late = StepStamps(plan_start=13, planned=14, sent=15, timing=(20, 25, 80, 90), received=96, completed=97,
                      handed=98)
    parts = acc.add_step(late, 2)
    assert acc.merged == 1 and parts["forward"] == 0 and parts["worker_wait"] == 96 - 15
    view = acc.view(reset=True)
    assert view["steps"]["count"] == 2 and view["steps"]["mean_s"]["forward"] == pytest.approx(55 / 2 / 1e9)
    assert acc.view()["steps"]["count"] == 0


# ---------------------------------------------------------------------- a served model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path_factory.mktemp("account") / "tiny", layers=2, hidden=32, heads=4,
                              kv_heads=2, intermediate=64, max_positions=256)
    with Engine.from_pretrained(path, max_queue=256, **OPTS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    with BackgroundServer(engine, ServerConfig(port=0, max_tokens_limit=64)) as srv:
        yield srv


def _post(url: str, body: dict, out: list, i: int, ready: threading.Barrier) -> None:
    import httpx

    with httpx.Client(timeout=120) as client:  # made before the clock starts: its set-up is not the request's
        ready.wait()
        t0 = time.monotonic_ns()
        if body.get("stream"):
            with client.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                text = "".join(r.iter_text())
            assert text.rstrip().endswith("data: [DONE]")
        else:
            r = client.post(url, json=body)
            assert r.status_code == 200, r.text
        out[i] = time.monotonic_ns() - t0


def _served(server, bodies: list[dict]) -> tuple[list[int], list[dict]]:
    """Send ``bodies`` at once (a thread each); the client's wall times and the server's records of them."""
    import httpx

    httpx.get(server.url + "/v1/account?reset=true")
    walls: list = [0] * len(bodies)
    ready = threading.Barrier(len(bodies))
    threads = [threading.Thread(target=_post, args=(server.url + "/v1/completions", b, walls, i, ready))
               for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    account = httpx.get(server.url + "/v1/account").json()
    return walls, account["recent"]


def _check(walls: list[int], recent: list[dict]) -> None:
    assert len(recent) == len(walls)
    for r in recent:
        parts = r["parts_ns"]
        assert set(parts) == set(REQUEST_PARTS) and min(parts.values()) >= 0
        assert sum(parts.values()) == r["wall_ns"]  # the parts add up to the server's wall time
        assert parts["forward"] > 0 and parts["tokenize"] > 0
    # Paired by rank: each client wall time holds its server's, and what is left ("other") is small. Pointwise
    # bounds hold for the sorted lists too, so no request ids are needed.
    for client, srv in zip(sorted(walls), sorted(r["wall_ns"] for r in recent)):
        other = client - srv
        assert 0 <= other <= OTHER_S * 1e9 + OTHER_SHARE * client, (client, srv)


@RunIf(serve=True)
def test_parts_add_up_to_the_wall_time_at_low_load(server):
    body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        walls, recent = _served(server, [{**body, "stream": stream}])
        _check(walls, recent)


@RunIf(serve=True)
def test_parts_add_up_to_the_wall_time_with_many_concurrent_requests(server, engine):
    bodies = [{"prompt": f"request {i} " * (1 + i % 5), "max_tokens": 4 + i % 8, "temperature": 0,
               "ignore_eos": True, "stream": i % 2 == 0} for i in range(24)]
    walls, recent = _served(server, bodies)
    _check(walls, recent)
    steps = engine.account()["steps"]
    assert steps["count"] > 0 and sum(steps["share"].values()) == pytest.approx(1.0)
    # Requests queued behind each other: some wait in the queue, and the account says so.
    assert max(r["parts_ns"]["queue"] for r in recent) > 0


@RunIf(serve=True)
def test_account_in_metrics_and_explain(server, engine):
    import httpx

    httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    text = httpx.get(server.url + "/metrics").text
    assert 'energon_request_part_seconds_count{model_name="tiny",part="forward"}' in text
    assert 'energon_step_part_seconds_count{model_name="tiny",part="schedule"}' in text
    explained = engine.explain()
    assert "time account:" in explained and "forward" in explained and "worker idle" in explained


@RunIf(serve=True)
def test_docs_account_snippet_runs(engine, capsys):
    from tests.helpers.docs import python_block

    engine.generate(["hi"], SamplingParams(temperature=0, max_tokens=2))
    exec(compile(python_block("docs/serving.md", "The time account"), "docs/serving.md", "exec"), {"engine": engine})
    printed = capsys.readouterr().out
    assert "token budget (fixed)" in printed and "time account:" in printed and "stream_out" in printed


@RunIf(serve=True)
def test_each_prompt_is_encoded_once(engine, monkeypatch):
    calls = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, *a, **k: calls.append(text) or real(text, *a, **k))
    ids = engine.encode("the quick brown fox")
    assert isinstance(ids, Encoded) and calls == ["the quick brown fox"]
    assert engine.encode(ids) is ids  # encoded ids pass as they are
    out = engine.submit_all([(ids, SamplingParams(temperature=0, max_tokens=2))])[0].result(60)
    assert calls == ["the quick brown fox"] and out.prompt_token_ids == list(ids)
    with pytest.raises(Exception, match="outside the vocabulary"):
        engine.encode([engine.vocab_size])


@RunIf(serve=True)
def test_text_is_decoded_outside_the_lock_and_equals_a_full_decode(engine):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = engine.generate(["the quick brown fox", "jumps over"], greedy)
    for c in got:
        assert c.text == engine.decode(c.token_ids)
    # A request with a stop string is still cut by the scheduler's stop rule (which decodes it under the lock).
    full = got[0].text
    cut = next((full[:i] for i in range(2, len(full)) if full[i - 1] not in " \ufffd" and full[:i].strip()), None)
    assert cut is not None, f"the fixture's greedy text {full!r} has no usable stop string"
    stop = cut[-1]
    stopped = engine.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                      stop=(stop,)))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text and full.startswith(stopped.text)
    streamed = []
    engine.submit("the quick brown fox", greedy, listener=lambda ev: streamed.append(ev.text)).result(60)
    assert "".join(streamed) == full
    assert json.dumps(engine.account()["requests"])  # JSON-able


# ---------------------------------------------------------------------- the token budget from measured step costs


def test_fit_costs_recovers_a_line_and_needs_two_token_counts():
    from energon_infer.scheduling.budget import fit_costs

    samples = [(n, 0.01 + 0.0005 * n) for n in (1, 8, 64, 200)]
    costs = fit_costs(samples)
    assert costs is not None
    assert costs.fixed_s == pytest.approx(0.01) and costs.per_token_s == pytest.approx(0.0005)
    assert fit_costs([(4, 0.1), (4, 0.2)]) is None
    assert fit_costs([(1, 0.5), (100, 0.1)]).per_token_s == 0.0  # a falling slope is noise: no negative cost


def test_choose_budget_properties():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from energon_infer.scheduling.budget import StepCosts, choose_budget

    @settings(max_examples=300, deadline=None)
    @given(fixed=st.floats(0, 1), per=st.floats(0, 0.01), decode=st.integers(0, 512), most=st.integers(1, 8192),
           min_prefill=st.integers(0, 4096), target=st.floats(0, 2), more=st.floats(0, 2))
    def check(fixed, per, decode, most, min_prefill, target, more):
        costs = StepCosts(fixed, per)
        b = choose_budget(costs, decode_tokens=decode, max_batch_tokens=most, min_prefill=min_prefill,
                          tpot_target_s=target)
        room = max(0, most - decode)
        assert b.tokens == decode + b.prefill_tokens  # every decode is in the step: never starved
        assert 0 <= b.prefill_tokens <= room  # never past max_batch_tokens beside the decodes
        assert b.prefill_tokens >= min(min_prefill, room)  # the head of the queue always fits when it can
        if decode and per > 0 and target:  # within the target unless the floor (min_prefill) asked for more
            assert (b.prefill_tokens <= max(min_prefill, 0) or
                    costs.seconds(decode + b.prefill_tokens) <= max(target, costs.seconds(decode)) + 1e-9)
        looser = choose_budget(costs, decode_tokens=decode, max_batch_tokens=most, min_prefill=min_prefill,
                               tpot_target_s=target + more if target else 0.0)
        assert looser.prefill_tokens >= b.prefill_tokens  # more TPOT slack admits more prefill, never less

    check()


def test_choose_budget_without_costs_or_decodes_is_max_batch_tokens():
    from energon_infer.scheduling.budget import StepCosts, TokenBudget, choose_budget

    assert choose_budget(None, decode_tokens=3, max_batch_tokens=100, min_prefill=10).tokens == 100
    assert choose_budget(StepCosts(0.1, 0.01), decode_tokens=0, max_batch_tokens=100, min_prefill=10).tokens == 100
    with pytest.raises(ValueError, match="max_batch_tokens=0 >= 1"):
        choose_budget(None, decode_tokens=0, max_batch_tokens=0, min_prefill=0)
    fixed = TokenBudget("fixed", 64)
    for n in (1, 50):
        fixed.observe(n, 0.01 + 0.001 * n)
    assert fixed.choose(8, 4) == 64 and fixed.costs is None  # fixed: the constant, whatever was measured
    measured = TokenBudget("measured", 4096)
    for n in (1, 8, 100, 400):
        measured.observe(n, 0.02 + 0.001 * n)
    assert measured.choose(8, 16) == 8 + 28 and "28 prefill tokens" in measured.last.why


@RunIf(serve=True)
def test_measured_budget_in_an_engine_shows_in_explain_and_metrics(tmp_path):
    from energon_infer.demo import write_random_llama
    from energon_infer.scheduling.scheduler_config import SchedulerConfig
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    with pytest.raises(Exception, match="token_budget"):
        SchedulerConfig(token_budget="adaptive")
    with pytest.raises(Exception, match="tpot_target_s=-1"):
        SchedulerConfig(tpot_target_s=-1)
    path = write_random_llama(tmp_path / "tiny", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["the quick brown fox", "a b c", "jumps over the lazy dog again"]
    with Engine.from_pretrained(path, token_budget="measured", **OPTS) as eng:
        measured = [c.token_ids for c in eng.generate(prompts, greedy)]
        explained = eng.explain()
        with BackgroundServer(eng, ServerConfig(port=0)) as srv:
            import httpx

            metrics = httpx.get(srv.url + "/metrics").text
    with Engine.from_pretrained(path, **OPTS) as eng:
        fixed = [c.token_ids for c in eng.generate(prompts, greedy)]
    assert measured == fixed  # the budget changes when prompts join, never what greedy decoding gives
    assert "token budget (measured):" in explained
    assert 'energon_step_token_budget{model_name="tiny"}' in metrics
    assert 'energon_step_prefill_budget{model_name="tiny"}' in metrics
