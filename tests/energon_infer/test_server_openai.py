"""The official ``openai`` client against the server (127.0.0.1, real workers): logprobs, n, streaming with usage,
chat through the model's ``chat_template.jinja``, penalties and echo; and the Hugging Face side: an
``AutoTokenizer`` object as the engine's tokenizer, ``generation_config.json`` defaults, ``dtype="auto"``."""

from __future__ import annotations

import json
import math

import pytest

from energon_infer import SamplingParams
from energon_infer.engine.engine import Engine
from energon_infer.loading import hf_files
from energon_infer.loading.hf_files import ChatTemplate, generation_defaults, resolve_dtype
from energon_infer.serving.server import BackgroundServer, ServerConfig
from tests.helpers.runif import RunIf

pytestmark = RunIf(serve=True)
OPTS = dict(progress=False, threads_per_worker=1, block_size=4, kv_cache_tokens=4096)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path_factory.mktemp("openai") / "tiny-chat", layers=2, hidden=32, heads=4,
                              kv_heads=2, intermediate=64, max_positions=256)
    (path / "chat_template.jinja").write_text(TEMPLATE)  # where current transformers saves it
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.from_pretrained(model_dir, max_queue=64, **OPTS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(engine, ServerConfig(port=0, api_key="k", max_tokens_limit=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=60)


def test_docs_openai_snippet_runs(server, capsys):
    import re

    from tests.helpers.docs import python_block

    code = python_block("docs/serving.md", "Call it with the OpenAI client")
    exec(compile(code.replace("http://127.0.0.1:8000", server.url), "docs/serving.md", "exec"),
         {"API_KEY": "k", "MODEL": "tiny-chat"})
    assert re.fullmatch(r"\['.*', '.*'\] \d+\n", capsys.readouterr().out, re.S)


def test_completions_with_logprobs_n_and_echo(engine, client):
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = engine.generate(["the quick brown"], greedy)[0]
    out = client.completions.create(model="tiny-chat", prompt="the quick brown", max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == expected.text and out.usage.completion_tokens == 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) <= 3
        # Greedy: the sampled token is the most likely one, so it leads its top list with the same logprob.
        assert math.isclose(max(top.values()), logprob, rel_tol=1e-5)
        assert top[token] == pytest.approx(logprob, rel=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    many = client.completions.create(model="tiny-chat", prompt=["the quick", "a tiny"], n=3, max_tokens=4,
                                     temperature=1.0, seed=7)
    assert sorted(c.index for c in many.choices) == list(range(6))
    again = client.completions.create(model="tiny-chat", prompt=["the quick", "a tiny"], n=3, max_tokens=4,
                                      temperature=1.0, seed=7)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in many.choices[:3]}) > 1  # the choices of one prompt differ from each other

    echo = client.completions.create(model="tiny-chat", prompt="the quick brown", max_tokens=5, temperature=0,
                                     echo=True, extra_body={"ignore_eos": True})
    assert echo.choices[0].text == "the quick brown" + expected.text


def test_streaming_with_usage(engine, client):
    stream = client.completions.create(model="tiny-chat", prompt="the quick", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = engine.generate(["the quick"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert text == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_uses_the_template_from_chat_template_jinja(engine, client, model_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = ChatTemplate.for_engine(engine).render(messages)
    assert rendered == "<s><|system|>be brief\n<|user|>hi\n<|assistant|>"
    expected = engine.generate([rendered], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    out = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)  # the template's prompt, not "user: hi"
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5, temperature=0,
                                            n=2, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    by_choice: dict[int, str] = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            by_choice[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert by_choice == {0: expected.text, 1: expected.text} and usage.completion_tokens == 10
    # Without max_tokens a chat answer may use the rest of the context (capped by the server's limit, 64).
    free = client.chat.completions.create(model="tiny-chat", messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert free.usage.completion_tokens == 64


def test_penalties_change_greedy_output_as_expected(client):
    plain = client.completions.create(model="tiny-chat", prompt=[5, 5, 5], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    penalised = client.completions.create(model="tiny-chat", prompt=[5, 5, 5], max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 5.0})
    assert plain.choices[0].text != penalised.choices[0].text


def test_an_autotokenizer_object_is_accepted(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with Engine.from_pretrained(model_dir, tokenizer=tok, **OPTS) as engine:
        out = engine.generate(["the quick"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        assert out.prompt_token_ids == tok.encode("the quick") and out.text == tok.decode(out.token_ids,
                                                                                         skip_special_tokens=True)
        assert ChatTemplate.for_engine(engine).hf is tok


def test_generation_config_defaults_and_dtype_auto(tmp_path, monkeypatch):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_new_tokens": 32}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1,
                                             "max_tokens": 32}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert generation_defaults(tmp_path) == {"temperature": 0.0}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    monkeypatch.setattr(hf_files, "cpu_has_native_bf16", lambda: True)  # auto keeps bf16 where the CPU computes in it
    assert resolve_dtype(tmp_path, "auto", "cpu") == "bfloat16" and resolve_dtype(tmp_path, "float16") == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "int8"}))
    with pytest.raises(ValueError, match="dtype 'int8'.*pass dtype='float32'"):
        resolve_dtype(tmp_path, "auto")


def test_generation_config_defaults_reach_the_server(tmp_path):
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "m", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 7}))
    import httpx

    with Engine.from_pretrained(path, **OPTS) as engine, BackgroundServer(engine) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "ignore_eos": True}, timeout=60).json()
        greedy = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
        assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["text"] == greedy.text
        # The Python API too: a request without SamplingParams gets the model's defaults.
        assert engine.default_params == SamplingParams(temperature=0.0, max_tokens=7)
        assert engine.submit([5, 6]).result(timeout=60).token_ids[:1] == greedy.token_ids[:1]
