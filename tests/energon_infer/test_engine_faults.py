"""A worker killed mid-request: the running request fails with a clear error (no hang), the waiting one is
kept and served after the worker group restarts; with no restarts left the engine fails closed."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from energon_infer import ModelRunner, SamplingParams
from energon_infer.engine.engine import Engine, EngineClosedError, WorkerFailedError
from tests.helpers.runif import RunIf

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _wait(predicate, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _kill_while_running(engine: Engine, rank: int, request_id: str):
    started = threading.Event()
    fut = engine.submit([5, 6, 7], LONG, request_id=request_id, listener=lambda e: started.set())
    assert started.wait(60), "the request never produced a token"
    os.kill(engine.health()["pids"][rank], signal.SIGKILL)
    return fut


@RunIf(min_world=2)
def test_killed_worker_fails_running_requests_then_the_group_restarts(tmp_path):
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "m", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    expected = ModelRunner.from_pretrained(path, progress=False).generate([[9, 8, 7]], SHORT)[0].token_ids
    engine = Engine.from_pretrained(path, tp=2, max_running=1, max_restarts=1, progress=False, threads_per_worker=1)
    try:
        old_pids = engine.health()["pids"]
        running = _kill_while_running(engine, 1, "victim")
        waiting = engine.submit([9, 8, 7], SHORT)  # max_running=1: queued behind the victim
        with pytest.raises(WorkerFailedError, match=r"worker 1 exited with code -9 \(signal 9\).*restarting"):
            running.result(timeout=120)  # an error, not a hang
        # The waiting request was not lost: it runs on the restarted group.
        assert waiting.result(timeout=180).token_ids == expected
        health = engine.health()
        # Serving again, and saying truthfully that it failed within the restart window (1 of 1 restarts used).
        assert health["status"] == "degraded" and health["restarts"] == 1 and health["worker_failures"] == 1
        assert health["restarts_left"] == 0 and "1 of 1 restart(s) used" in health["restart_budget"]
        assert set(health["pids"]).isdisjoint(old_pids) and "worker 1 exited" in health["last_error"]
        assert engine.generate([[9, 8, 7]], SHORT)[0].token_ids == expected
        assert 'energon_worker_restarts_total{model_name="m"} 1.0' in engine.render_metrics()

        # No restarts left: the engine fails closed instead of hanging or accepting work it cannot do.
        doomed = _kill_while_running(engine, 0, "victim-2")
        with pytest.raises(WorkerFailedError, match="worker 0 exited .*no workers left"):
            doomed.result(timeout=120)
        assert _wait(lambda: engine.health()["status"] == "failed")
        with pytest.raises(EngineClosedError, match="has no workers"):
            engine.submit([1, 2])
        assert 'energon_up{model_name="m"} 0.0' in engine.render_metrics()
        import httpx

        from energon_infer.serving.server import BackgroundServer

        with BackgroundServer(engine) as server:  # the HTTP view of the same state
            health = httpx.get(server.url + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "failed"
            refused = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2]}, timeout=10)
            assert refused.status_code == 503 and "has no workers" in refused.json()["error"]["message"]
    finally:
        engine.shutdown(timeout=30)
    assert not any(p.is_alive() for p in engine._group.procs)


def test_hung_worker_times_out_instead_of_hanging(tmp_path):
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "m", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    engine = Engine.from_pretrained(path, step_timeout_s=3.0, progress=False, threads_per_worker=1)
    try:
        started = threading.Event()
        fut = engine.submit([5, 6, 7], LONG, listener=lambda e: started.set())
        assert started.wait(60)
        pid = engine.health()["pids"][0]
        os.kill(pid, signal.SIGSTOP)  # alive but frozen: only the step timeout can notice
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"no answer within step_timeout_s=3 s \(a worker hangs\)"):
            fut.result(timeout=120)
        assert time.monotonic() - t0 < 60
        assert _wait(lambda: engine.health()["status"] == "degraded" and engine.health()["pids"][0] != pid)
        assert len(engine.generate([[9, 8, 7]], SHORT)[0].token_ids) == 6
    finally:
        engine.shutdown(timeout=30)


def test_a_request_that_fails_inside_a_worker_fails_alone(tmp_path):
    from energon_infer.demo import write_random_llama
    from energon_infer.engine.engine import RequestFailedError

    path = write_random_llama(tmp_path / "m", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    engine = Engine.from_pretrained(path, progress=False, threads_per_worker=1)
    try:
        expected = engine.generate([[9, 8, 7]], SHORT)[0].token_ids
        bad = SamplingParams(temperature=1.0, max_tokens=4)
        object.__setattr__(bad, "temperature", 1e-40)  # past the validation, as a bug could: it reaches a worker
        for _ in range(4):  # four times took the server down for good before
            good, doomed = engine.submit([9, 8, 7], SHORT), engine.submit([5, 6, 7], bad)
            with pytest.raises(RequestFailedError, match="probabilities are not finite.*other requests were not"):
                doomed.result(timeout=60)
            assert good.result(timeout=60).token_ids == expected  # its batch-mate is unaffected
        health = engine.health()
        assert health["status"] == "ready" and health["worker_failures"] == 0 and health["restarts"] == 0
        assert engine.metrics.requests["error"] == 4
    finally:
        engine.shutdown(timeout=30)
