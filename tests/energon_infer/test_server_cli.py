"""``tightfit serve PATH`` as a user runs it: a real process, core's CLI dispatching to the plugin, SIGTERM drains;
a busy port fails before anything loads; a model without a tokenizer says so at start-up."""

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
    (path / "tokenizer.json").unlink()  # token-id prompts only: the server must say so at start-up
    port = free_port()
    env = {**os.environ, "ENERGON_API_KEY": "k", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tightfit.cli", "serve", str(path), "--port", str(port),
                             "--max-tokens-limit", "32", "--log-level", "warning", "--step-timeout", "30",
                             "--dtype", "auto", "--no-packed-weights"],
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
                       json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        text = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={"prompt": "every rank"})
        assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        # uvicorn drains, runs the shutdown hooks, then re-raises the signal so process managers see it.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "serving 'demo-model' (llama, float32" in log and f"127.0.0.1:{port}" in log
    assert "only token-id prompts work" in log
    assert "energon: stopped; 1 request(s) served, 0 failed, 0 rejected; workers stopped" in log


@RunIf(serve=True)
def test_a_busy_port_fails_before_the_model_loads(tmp_path):
    import socket

    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "demo-model", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "tightfit.cli", "serve", str(path), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "pick another --port" in out.stderr
    assert "energon: starting" not in out.stderr and "serving" not in out.stderr  # no worker was started


def test_connections_on_the_bound_socket_send_small_writes_at_once():
    """Nagle's algorithm is off on every connection the server accepts: with it on, each response after a
    keep-alive connection's first waited for the client's delayed ACK (40 ms a request on Linux)."""
    import asyncio
    import socket

    from energon_infer.serving.serve import bind_socket

    async def main() -> int:
        sock = bind_socket("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)  # as uvicorn serves a socket it is given
        async with server:
            _, w = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            flag = await asyncio.wait_for(seen, 10)
            w.close()
        return flag

    assert asyncio.run(main()) != 0
