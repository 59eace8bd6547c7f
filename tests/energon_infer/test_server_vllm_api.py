"""vLLM's client conventions on the server (127.0.0.1, real workers): ``/tokenize`` and ``/detokenize`` in vLLM's
shapes, the ``/v1/models`` fields its benchmark reads, ``min_tokens``, ``ignore_eos`` and the usage chunk that ends
a stream; each field validated like the others (400, one line naming it). Then vLLM's own client, ``vllm bench
serve`` from the peer environment (``python -m benchmarks.peers`` makes it), run unmodified against the server.
Last, the CPU workers' OpenMP wait policy (passive unless the user chose one), which the serving benchmark measured.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from energon_infer import SamplingParams
from energon_infer.engine.engine import Engine
from energon_infer.serving.server import BackgroundServer, ServerConfig
from tests.helpers.runif import RunIf

pytestmark = RunIf(serve=True)
OPTS = dict(progress=False, threads_per_worker=1, block_size=4, kv_cache_tokens=4096)
PROMPT = "the controller sends a step"


def _write(path, eos: int):
    from energon_infer.demo import write_random_llama

    write_random_llama(path, layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, max_positions=256)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model whose EOS is the first token it generates greedily after PROMPT (so min_tokens has work to do)."""
    path = _write(tmp_path_factory.mktemp("vllmapi") / "tiny-vllm", eos=2)
    with Engine.from_pretrained(path, **OPTS) as eng:
        first = eng.submit(PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)).result(60)
    return _write(path, eos=first.token_ids[0])


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.from_pretrained(model_dir, max_queue=64, **OPTS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(engine, ServerConfig(port=0, max_tokens_limit=64)) as srv:
        yield srv


def _post(server, path, body, status=200):
    reply = httpx.post(server.url + path, json=body, timeout=60)
    assert reply.status_code == status, reply.text
    return reply.json()


def test_tokenize_detokenize_in_vllms_shapes(server, engine):
    ids = engine.encode(PROMPT)
    out = _post(server, "/tokenize", {"model": engine.model_name, "prompt": PROMPT})
    assert out == {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}
    strs = _post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})["token_strs"]
    assert strs == [engine.decode([t]) for t in ids]
    assert _post(server, "/detokenize", {"model": engine.model_name, "tokens": ids}) == {"prompt": engine.decode(ids)}
    # What vLLM's benchmark sends to align prompts: no special tokens (this tokenizer adds none, so the same ids).
    plain = engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert _post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"] == plain
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["count"] == len(chat["tokens"]) > 0


@pytest.mark.parametrize(("path", "body", "says", "param"), [
    ("/tokenize", {}, "'prompt' or 'messages' is required", "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one", "prompt"),
    ("/tokenize", {"prompt": 5}, "'prompt'", "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "'add_special_tokens'", "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "typo": 1}, "'typo'", "typo"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "is not served here", "model"),
    ("/detokenize", {"tokens": [1, True]}, "not booleans", "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "'tokens'", "tokens"),
    ("/detokenize", {"tokens": [1, 999999]}, "outside the vocabulary", "tokens"),
    ("/detokenize", {}, "'tokens' is required", "tokens"),
    ("/v1/completions", {"prompt": "a", "min_tokens": -1}, "'min_tokens'", "min_tokens"),
    ("/v1/completions", {"prompt": "a", "min_tokens": "3"}, "'min_tokens'", "min_tokens"),
    ("/v1/completions", {"prompt": "a", "min_tokens": True}, "'min_tokens'", "min_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "min_tokens": 5}, "min_tokens=5 must be in [0, max_tokens=3]",
     "min_tokens"),
    ("/v1/completions", {"prompt": "a", "ignore_eos": 1}, "'ignore_eos'", "ignore_eos"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}},
     "include_usage", "stream_options"),
])
def test_bad_fields_get_one_line_naming_them(server, path, body, says, param):
    err = _post(server, path, body, status=404 if body.get("model") == "other" else 400)["error"]
    assert says in err["message"] and "\n" not in err["message"]
    assert err["param"] == param


def test_models_has_the_fields_vllms_client_reads(server, engine):
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert model["id"] == model["root"] == engine.model_name
    assert model["max_model_len"] == engine.max_context and model["owned_by"] and model["created"] > 0


def test_min_tokens_holds_the_eos_back(server, engine):
    # Without it the request stops at its first token, the EOS.
    plain = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] == 1
    held = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 5, "temperature": 0})
    assert held["usage"]["completion_tokens"] >= 5
    done = engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=5)).result(60)
    assert engine.eos_token_ids[0] not in done.token_ids[:5] and len(done.token_ids) >= 5
    # The held-back EOS is the raw argmax: the first token differs from it (the next most likely).
    assert done.token_ids[0] != engine.eos_token_ids[0]


def test_ignore_eos_stream_ends_with_usage(server):
    body = {"prompt": PROMPT, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": last["usage"]["prompt_tokens"],
                                                       "completion_tokens": 7,
                                                       "total_tokens": last["usage"]["prompt_tokens"] + 7}
    tokens = [c for e in events[:-2] for c in json.loads(e)["choices"] if c.get("text") is not None]
    assert tokens[-1]["finish_reason"] == "length"


def test_vllm_bench_serve_runs_unmodified(server, model_dir, tmp_path):
    from benchmarks.peers import vllm_cli, vllm_env, vllm_python

    py, why = vllm_python(install=False)
    if py is None:
        pytest.skip(why)
    cmd = vllm_cli(py) + ["bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
                          "--base-url", server.url, "--tokenizer", str(model_dir), "--dataset-name", "random",
                          "--random-input-len", "12", "--random-output-len", "6", "--num-prompts", "4",
                          "--ignore-eos", "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                          "out.json", "--seed", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=vllm_env("0-1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "/tokenize unavailable" not in done.stdout
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * 6


@pytest.mark.parametrize("policy", [None, "PASSIVE"])
def test_cpu_workers_spin_briefly_at_a_barrier_unless_told(model_dir, monkeypatch, policy):
    import os

    from energon_infer.worker.workers import SPIN_COUNT

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    with Engine.from_pretrained(model_dir, **OPTS) as eng:
        (pid,) = eng.health()["pids"]
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    assert env.get("OMP_WAIT_POLICY") == policy
    assert env.get("GOMP_SPINCOUNT") == (str(SPIN_COUNT) if policy is None else None)  # the user's choice is kept
    assert "GOMP_SPINCOUNT" not in os.environ and os.environ.get("OMP_WAIT_POLICY") == policy  # the user's own is kept
