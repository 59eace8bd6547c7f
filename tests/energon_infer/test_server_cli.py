"""``tightfit serve PATH`` as a user runs it: a real process, core's CLI dispatching to the plugin, SIGTERM drains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.helpers.multiprocess import free_port
from tests.helpers.runif import RunIf


@RunIf(serve=True)
def test_tightfit_serve_answers_then_stops_gracefully_on_sigterm(tmp_path):
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "demo-model", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    port = free_port()
    env = {**os.environ, "ENERGON_API_KEY": "k", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tightfit.cli", "serve", str(path), "--port", str(port),
                             "--max-tokens-limit", "32", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer k"}  # --api-key defaulted from $ENERGON_API_KEY
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(url + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"] == "demo-model"
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"prompt": "every rank", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        # uvicorn drains, runs the shutdown hooks, then re-raises the signal so process managers see it.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "serving 'demo-model'" in log and f"127.0.0.1:{port}" in log
    assert "energon: stopped; 1 request(s) served, 0 failed, 0 rejected; workers stopped" in log
