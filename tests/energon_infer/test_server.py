"""The OpenAI-compatible server on 127.0.0.1 with a real HTTP client (httpx): endpoints, streaming, limits,
errors, 200 concurrent requests (none lost, none duplicated), 429 on a full queue, graceful shutdown.
Hostile clients, abandoned work and the official ``openai`` client: test_server_hostile.py, test_server_openai.py."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import httpx
import pytest

from energon_infer import SamplingParams
from energon_infer.engine.engine import Engine
from energon_infer.loading.hf_files import ChatTemplate
from energon_infer.serving.server import BackgroundServer, ServerConfig
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
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict:
        text = client.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    before = samples()
    r = client.post("/v1/completions", json={"prompt": "every rank", "max_tokens": 3, "ignore_eos": True})
    after = samples()
    model = (("model_name", "tiny-llama"),)
    for name in ("energon_e2e_request_latency_seconds_count", "energon_time_to_first_token_seconds_count"):
        assert after[(name, model)] == before[(name, model)] + 1
    assert after[("energon_inter_token_latency_seconds_count", model)] == before[
        ("energon_inter_token_latency_seconds_count", model)] + 2  # one per token after the first
    assert after[("energon_generation_tokens_total", model)] - before[("energon_generation_tokens_total", model)] == 3
    assert after[("energon_prompt_tokens_total", model)] - before[("energon_prompt_tokens_total", model)] == \
        r.json()["usage"]["prompt_tokens"]
    assert after[("energon_requests_total", (("model_name", "tiny-llama"), ("status", "ok")))] == \
        before[("energon_requests_total", (("model_name", "tiny-llama"), ("status", "ok")))] + 1
    for gauge in ("energon_num_requests_waiting", "energon_num_requests_running", "energon_kv_cache_usage_ratio",
                  "energon_kv_cache_blocks_total", "energon_up"):
        assert (gauge, model) in after
    assert after[("energon_kv_cache_blocks_total", model)] == 4096 / 4  # kv_cache_tokens / block_size (OPTS)
    assert any(name == "process_resident_memory_bytes" for name, _ in after)


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
    prompt = ChatTemplate(None).render(messages)  # this model has no chat template
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


@pytest.mark.parametrize("payload,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"prompt": "hi", "max_tokens": 65}, 400, "between 1 and 64"),
    ({"prompt": "hi", "max_tokens": "9"}, 400, "'max_tokens': Input should be a valid integer"),
    ({"prompt": "hi", "temperature": -1}, 400, "'temperature': Input should be greater than or equal to 0"),
    ({"prompt": ""}, 400, "'prompt' must be a non-empty string"),
    ({"prompt": [1, 999]}, 400, r"outside the vocabulary"),
    ({"prompt": 5}, 400, "'prompt' must be"),
    ({}, 400, "'prompt' is required"),
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


def test_docs_show_the_request_schemas(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions"} <= set(schemas)
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]
    assert "0.01" in temperature["description"]
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest")
    assert httpx.get(server.url + "/docs", timeout=10).status_code == 200
