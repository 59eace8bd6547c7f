"""The structured-outputs section of benchmarks/energon_serve.py (benchmarks/_serve_structured.py) against a real
energon server on a random model: every workload runs, the grammar makes every output valid by the benchmark's own
Pydantic validators, and the summary and report come out of its rounds. (vLLM's side needs the peer environment:
``python -m benchmarks.energon_serve --smoke --sections structured``.)"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.runif import RunIf

pytest.importorskip("xgrammar")
pytestmark = RunIf(serve=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from benchmarks._serve_structured import add_chat_template
    from energon_infer.demo import write_random_llama
    from energon_infer.engine.engine import Engine
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    path = write_random_llama(tmp_path_factory.mktemp("bench") / "m", vocab=320, layers=2, hidden=32, heads=4,
                              kv_heads=2, intermediate=64, max_positions=4096)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"city": "Paris", "unit": "celsius"}'] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    add_chat_template(path)
    with Engine.from_pretrained(path, progress=False, threads_per_worker=1, block_size=16,
                                kv_cache_tokens=32768) as eng, BackgroundServer(eng, ServerConfig(port=0)) as srv:
        yield srv


def test_every_workload_runs_and_the_grammar_makes_every_output_valid(server):
    from benchmarks._serve_structured import markdown, run_round, run_schema_validity, summarize

    row = run_round(server.url, 2, seed=3, large_fields=8, max_tokens=2000)  # ~1 token a byte
    assert row["schema"]["valid"] == 2 and not row["schema"]["errors"], row["schema"]
    assert row["tools"]["valid"] == 2 and not row["tools"]["errors"], row["tools"]
    assert row["schema"]["tok_s"] > 0 and row["unconstrained"]["tok_s"] > 0
    assert all(math.isfinite(row[k]) for k in ("fresh_ms", "cached_ms"))
    assert not row["stall"]["large_error"] and row["stall"]["large_ttft_ms"] > 0
    summary = summarize({"energon": [row], "vllm": [row]})
    assert summary["energon"]["schema_valid"] == 1.0 and summary["paired"]["schema_vs_vllm"]["median"] == 1.0
    alone = run_schema_validity(server.url, 2, seed=3, max_tokens=2000)  # the note's run: the schema workload only
    assert (alone["valid"], alone["n"], alone["finish_length"]) == (2, 2, 0) and alone["tok_s"] > 0
    text = markdown({"shape": "tiny", "vocab": 320, "layers": 2, "n": 2, "rounds": 1, "large_fields": 8,
                     "summary": summary, "vllm_default": alone})
    assert "| schema outputs valid | 100% | 100% |" in text and "target >= 0.9x" in text
    assert '"backend": "xgrammar", "disable_any_whitespace": true' in text and "the schema workload once: 2/2 outputs valid" in text


def test_the_validators_refuse_what_breaks_the_schema():
    from benchmarks._serve_structured import Invoice, fresh_schema, schema_valid, tools_valid

    good = {"number": 7, "issued": "2024-05-01", "currency": "EUR", "paid": True, "notes": "", "total_cents": 5,
            "customer": {"id": 1, "name": "A", "email": "a@b", "vip": False,
                         "address": {"street": "s", "city": "c", "postcode": "12345", "country": "DE"}},
            "items": [{"sku": "ABC-1234", "description": "d", "quantity": 1, "unit_cents": 5}]}
    assert schema_valid({"text": json.dumps(good)})
    assert not schema_valid({"text": json.dumps({**good, "extra": 1})})  # strict: no property not listed
    assert not schema_valid({"text": json.dumps({**good, "items": []})})
    assert not schema_valid({"text": json.dumps(good)[:-1]})  # cut short
    call = {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    assert tools_valid({"tool_calls": [call]}, None) and not tools_valid({"tool_calls": [call]}, "create_ticket")
    assert not tools_valid({"tool_calls": []}, None)
    assert not tools_valid({"tool_calls": [{**call, "arguments": '{"city": "Oslo", "unit": "kelvin"}'}]}, None)
    assert fresh_schema(1) != fresh_schema(2) and len(Invoice.model_json_schema()["properties"]) == 8
