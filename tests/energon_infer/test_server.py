"""The OpenAI-compatible server on 127.0.0.1 with a real HTTP client (httpx): endpoints, streaming, limits,
errors, 200 concurrent requests (none lost, none duplicated), 429 on a full queue, graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import httpx
import pytest

from energon_infer import SamplingParams
from energon_infer.engine import Engine
from energon_infer.server import BackgroundServer, ServerConfig, chat_prompt
from tests.helpers.runif import RunIf

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPTS = dict(progress=False, threads_per_worker=1, block_size=4, kv_cache_tokens=4096)
pytestmark = RunIf(serve=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from energon_infer.demo import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("server") / "tiny-llama", layers=2, hidden=32, heads=4,
                              kv_heads=2, intermediate=64, max_positions=128)


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.from_pretrained(model_dir, max_queue=256, max_running=64, **OPTS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    cfg = ServerConfig(port=0, api_key=KEY, max_tokens_limit=64, max_request_bytes=4096)
    with BackgroundServer(engine, cfg) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def _sse(response: httpx.Response) -> list:
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_binds_loopback_and_reports_health_models_and_metrics(server, client):
    assert server.url.startswith("http://127.0.0.1:")
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ready" and health.json()["alive"] == 1
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-llama" and models["data"][0]["max_model_len"] == 128
    client.post("/v1/completions", json={"prompt": "every rank", "max_tokens": 2})
    text = client.get("/metrics").text
    for name in ("energon_queue_depth", "energon_tokens_per_second", 'energon_request_latency_seconds{quantile="0.99"}',
                 'energon_time_to_first_token_seconds{quantile="0.5"}', 'energon_requests_total{status="ok"}'):
        assert name in text


def test_completions_equal_the_engine(engine, client):
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = engine.generate(["every rank holds", "the controller", [5, 6, 7]], greedy)
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": ["every rank holds", "the controller"],
                                             **params})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["text"] for c in body["choices"]] == [c.text for c in expected[:2]]
    assert [(c["index"], c["finish_reason"]) for c in body["choices"]] == [(0, "length"), (1, "length")]
    prompt_tokens = sum(len(c.prompt_token_ids) for c in expected[:2])
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12}
    tokens = client.post("/v1/completions", json={"prompt": [5, 6, 7], **params}).json()
    assert tokens["choices"][0]["text"] == expected[2].text and tokens["usage"]["prompt_tokens"] == 3


def test_completions_stream_server_sent_events(client):
    req = {"prompt": "the controller sends", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**req, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r)
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert "".join(c["text"] for c in choices) == whole
    assert [c["finish_reason"] for c in choices][-1] == "length" and all(c["finish_reason"] is None for c in choices[:-1])


def test_chat_completions_and_chat_streaming(engine, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "every rank"}]
    prompt = chat_prompt(messages)
    assert prompt == "system: be brief\nuser: every rank\nassistant:"
    expected = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].text
    req = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    body = client.post("/v1/chat/completions", json=req).json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                       "content": expected}
    with client.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        chunks = _sse(r)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_template_from_tokenizer_config():
    cfg = {"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}"}
    assert chat_prompt([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], cfg) == "<user>hi<assistant>"


@pytest.mark.parametrize("payload,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"prompt": "hi", "max_tokens": 65}, 400, "between 1 and 64"),
    ({"prompt": "hi", "max_tokens": "9"}, 400, "'max_tokens' must be int"),
    ({"prompt": "hi", "n": 2}, 400, "'n'=2 is not supported"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature=-1.0 must be >= 0"),
    ({"prompt": ""}, 400, "the prompt is empty"),
    ({"prompt": [1, 999]}, 400, r"outside the vocabulary"),
    ({"prompt": 5}, 400, "'prompt' must be"),
    ({"prompt": ["a", "b"], "stream": True}, 400, "one prompt per request"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "is not served here"),
    ({"prompt": "x" * 5000}, 413, "at most 4096"),
])
def test_malformed_requests_get_4xx_with_the_reason(client, payload, status, needle):
    kwargs = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    r = client.post("/v1/completions", **kwargs)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_api_key_is_required(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_200_concurrent_requests_none_lost_none_duplicated(engine, server):
    prompts = [[1 + i, 2 + i, 3 + (i * 7) % 50] for i in range(20)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [c.text for c in engine.generate(prompts, greedy)]
    ok0 = engine.metrics.requests["ok"]

    async def run():
        limits = httpx.Limits(max_connections=32)  # bounded: 32 connections carry the 200 requests
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as c:
            async def one(i: int):
                r = await c.post("/v1/completions", json={"prompt": prompts[i % 20], "max_tokens": 4,
                                                          "temperature": 0, "ignore_eos": True, "user": str(i)})
                return i, r.status_code, r.json()
            return await asyncio.gather(*(one(i) for i in range(200)))

    results = asyncio.run(run())
    assert [s for _, s, _ in results] == [200] * 200
    assert len({body["id"] for _, _, body in results}) == 200  # one distinct completion per request
    for i, _, body in results:
        assert body["choices"][0]["text"] == expected[i % 20]  # each answer is its own prompt's
    assert Counter(body["choices"][0]["text"] for _, _, body in results) == Counter(expected * 10)
    assert engine.metrics.requests["ok"] - ok0 == 200


@pytest.fixture()
def small_server(model_dir):
    engine = Engine.from_pretrained(model_dir, max_queue=2, max_running=2, **OPTS)
    srv = BackgroundServer(engine, ServerConfig(port=0, drain_timeout_s=30), owns_engine=True).start()
    yield engine, srv
    srv.stop()
    engine.shutdown(timeout=10)


def test_full_queue_gets_429_and_shutdown_drains_in_flight_requests(small_server):
    engine, srv = small_server
    req = {"prompt": [5, 6, 7], "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=req) for _ in range(20)))

    replies = asyncio.run(burst())
    codes = Counter(r.status_code for r in replies)
    assert set(codes) == {200, 429} and codes[200] >= 2 and sum(codes.values()) == 20
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and "max_queue=2" in refused.json()["error"]["message"]
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in replies if r.status_code == 200)

    # Graceful shutdown: a stream that is running when the server is told to stop still completes.
    chunks: list[str] = []
    first = threading.Event()

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json={**req, "max_tokens": 64, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    srv.stop(timeout=60)  # stop accepting; wait for the stream; then the engine drains and stops
    t.join(60)
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"
    assert engine.health()["status"] == "stopped"
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)
