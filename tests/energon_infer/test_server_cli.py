"""``tightfit serve PATH`` as a user runs it: a real process, core's CLI dispatching to the plugin, SIGTERM drains;
a busy port fails before anything loads; a model without a tokenizer says so at start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

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
        # Drained (nothing in flight here), the shutdown hooks ran, the workers stopped: a clean stop is exit 0.
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "serving 'demo-model' (llama, float32" in log and f"127.0.0.1:{port}" in log
    assert "only token-id prompts work" in log
    assert "energon: stopped; 1 request(s) served, 0 failed, 0 rejected; workers stopped" in log
    assert "leaked semaphore" not in log and "Traceback" not in log


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


# ---------------------------------------------------------------------------- stopping with requests in flight

LONG = 1500  # tokens of the request in flight when the signal arrives: seconds of decoding on the tiny model


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    from tests.energon_infer.tiny import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("serve_signals") / "llama", max_position_embeddings=2048)


def _start(path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``tightfit serve`` in its own session (a signal to its group reaches it and its workers, as Ctrl-C on a
    terminal does), once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tightfit.cli", "serve", str(path), "--port", str(port),
                             "--max-tokens-limit", str(LONG), "--log-level", "warning", "--no-packed-weights",
                             *flags], env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the server did not come up")
        time.sleep(0.2)


def _stream_then_signal(proc: subprocess.Popen, url: str, sig: int, group: bool = False) -> tuple[int, int, list[dict]]:
    """Stream a LONG-token completion, send ``sig`` after its fifth token, read the stream to its end: (tokens
    before the signal, tokens in all, the events after the last token). SIGINT goes to the server's process group
    (Ctrl-C on a terminal reaches the workers too); SIGTERM to the server's process (``kill PID``, Kubernetes), or
    with ``group`` to the whole group (systemd's ``KillMode=control-group``)."""
    tokens, at_signal, tail = 0, -1, []
    body = {"prompt": [5, 6, 7], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            choice = (event.get("choices") or [{}])[0]
            if "error" in event or choice.get("finish_reason"):
                tail.append(event)
            elif choice.get("text") is not None:
                tokens += 1
            if tokens == 5 and at_signal < 0:
                at_signal = tokens
                os.killpg(proc.pid, sig) if sig == signal.SIGINT or group else proc.send_signal(sig)
    return at_signal, tokens, tail


@RunIf(serve=True)
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGTERM-to-the-group", "ctrl-c"])
def test_a_signal_drains_the_request_in_flight_and_exits_0(long_llama, sig, group):
    """SIGTERM (systemd, Kubernetes) and Ctrl-C (SIGINT to the terminal's whole process group): the server stops
    taking requests, the one in flight runs to its last token, the workers stop, and the process exits 0 with
    no leaked-semaphore warning (it used to die by the re-raised signal: -15, or 130 for Ctrl-C)."""
    proc, url = _start(long_llama)
    try:
        at_signal, tokens, tail = _stream_then_signal(proc, url, sig, group)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert at_signal == 5 and tokens >= LONG - 1, (tokens, log)  # in flight at the signal, and finished
    assert tail and tail[-1]["choices"][0]["finish_reason"] == "length", tail
    assert code == 0, log
    assert "energon: stopped; 1 request(s) served, 0 failed" in log
    assert "leaked semaphore" not in log and "Traceback" not in log


@RunIf(serve=True)
def test_a_drain_cut_short_by_its_timeout_ends_the_stream_with_an_error_and_exits_143(long_llama):
    proc, url = _start(long_llama, "--drain-timeout", "0")
    try:
        at_signal, tokens, tail = _stream_then_signal(proc, url, signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert at_signal == 5 and tokens < LONG, log
    assert tail and "did not finish within drain_timeout_s=0 s" in tail[-1]["error"]["message"], tail
    assert code == 128 + signal.SIGTERM, log
    assert "leaked semaphore" not in log and "Traceback" not in log


# ---------------------------------------------------------------------------- budgets no plan fits

@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """1.8M parameters: its least-memory plans need a few MiB, far above 400 KiB."""
    from tests.energon_infer.tiny import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("serve_budget") / "llama", hidden_size=256,
                     intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, shard="400KB")


@RunIf(serve=True)
@pytest.mark.parametrize("flag, says", [
    ("--memory-budget", r"--memory-budget 400\.00 KiB is too small: the least-memory plan .* needs at least "),
    ("--memory-pool", r"the stage needs at least .* but the budget is 400\.00 KiB; raise the budget"),
])
def test_serve_refuses_a_budget_below_the_least_memory_plan_in_one_line_with_exit_3(wide_llama, flag, says):
    import re

    out = subprocess.run([sys.executable, "-m", "tightfit.cli", "serve", str(wide_llama), flag, "400KiB",
                          "--port", "0"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in out.stderr.splitlines() if not _library_noise(line)]
    assert out.returncode == 3, out.stderr
    assert len(lines) == 1 and lines[0].startswith("tightfit serve: ") and re.search(says, lines[0]), lines
    assert "Traceback" not in out.stderr and "starting" not in out.stderr  # decided before any worker started


def _library_noise(line: str) -> bool:
    """torchao's import-time messages on a CPU-only machine (not the command's output)."""
    return line.startswith(("Failed to load ", "W1", "W0")) or "register_constant" in line


@RunIf(serve=True)
def test_engine_raises_the_planners_line_before_any_worker_starts(wide_llama, monkeypatch):
    import multiprocessing

    from energon_infer.engine import engine as engine_module
    from tightfit.planner.errors import PlanInfeasibleError

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker group was started for a budget no plan fits")

    monkeypatch.setattr(engine_module, "start_group", no_workers)
    with pytest.raises(PlanInfeasibleError, match=r"^the stage needs at least [0-9.]+ MiB on the device with every "
                                                  r"layer pooled .* but the budget is 300\.00 KiB; raise the budget, "
                                                  r"lower lookahead, or split the model over more ranks \(tp/pp\)$"):
        engine_module.Engine.from_pretrained(wide_llama, memory_pool="300KiB", progress=False)
    assert multiprocessing.active_children() == []
