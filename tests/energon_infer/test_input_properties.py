"""Property-based checks of energon's inputs (issue 18): ``SamplingParams`` and ``config.json`` parsing.
Random valid input never raises; random invalid input raises the library's own error type (``ValueError`` /
``ConfigError``), never a bare ``TypeError``, ``KeyError`` or ``ZeroDivisionError``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer import SamplingParams
from energon_infer.loading.config import ConfigError, UnsupportedModelError, config_from_hf
from energon_infer.sampling import MIN_TEMPERATURE, SEED_MAX, SEED_MIN

FAST = settings(max_examples=80, deadline=None)
JUNK = st.one_of(st.none(), st.text(max_size=4), st.lists(st.integers(), max_size=2), st.booleans(),
                 st.sampled_from([float("nan"), float("inf"), -float("inf")]))


@FAST
@given(temperature=st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, 5.0)), top_k=st.integers(0, 1000), top_p=st.floats(0.001, 1.0),
       seed=st.one_of(st.none(), st.integers(SEED_MIN, SEED_MAX)), max_tokens=st.integers(1, 4096),
       stop_token_ids=st.lists(st.integers(0, 2**31), max_size=4),
       stop=st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3)))
def test_valid_sampling_params(temperature, top_k, top_p, seed, max_tokens, stop_token_ids, stop):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens,
                       stop_token_ids=stop_token_ids, stop=stop)
    assert p.max_tokens == max_tokens and all(isinstance(t, int) for t in p.stop_token_ids)


@FAST
@given(st.sampled_from(["temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids", "stop"]), st.data())
def test_invalid_sampling_params_raise_value_error(field, data):
    bad = {
        "temperature": st.one_of(JUNK, st.floats(max_value=-1e-9, allow_nan=False),
                                 st.floats(min_value=1e-300, max_value=MIN_TEMPERATURE, exclude_max=True)),
        "top_k": st.one_of(JUNK, st.integers(max_value=-1), st.just(2.5)),
        "top_p": st.one_of(JUNK, st.floats(max_value=0.0, allow_nan=False), st.floats(min_value=1.001, max_value=9)),
        "seed": st.one_of(st.text(max_size=3), st.booleans(), st.integers(max_value=SEED_MIN - 1), st.just(1.5),
                          st.integers(min_value=SEED_MAX + 1)),
        "max_tokens": st.one_of(JUNK, st.integers(max_value=0), st.just(3.5)),
        "stop_token_ids": st.one_of(st.just("abc"), st.just(7), st.lists(st.integers(max_value=-1), min_size=1,
                                                                           max_size=2), st.just([1.5]), st.just([None])),
        "stop": st.one_of(st.just(""), st.just([""]), st.just(5), st.just([None]), st.just([1])),
    }[field]
    with pytest.raises(ValueError):
        SamplingParams(**{field: data.draw(bad)})


def _gpt2(**over):
    return {"model_type": "gpt2", "vocab_size": 101, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
            **over}


def _llama(**over):
    return {"model_type": "llama", "vocab_size": 101, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "max_position_embeddings": 64, **over}


@FAST
@given(st.integers(1, 8), st.integers(1, 16), st.integers(1, 6), st.integers(1, 100_000), st.integers(1, 4096),
       st.floats(1e-12, 1e-1), st.booleans())
def test_valid_configs_parse(heads, head_dim, layers, vocab, positions, eps, llama):
    kv = max(1, heads // 2) if heads % max(1, heads // 2) == 0 else heads
    raw = (_llama(hidden_size=heads * head_dim * 2, num_attention_heads=heads, num_key_value_heads=kv,
                  num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=positions, rms_norm_eps=eps)
           if llama else _gpt2(n_embd=heads * head_dim, n_head=heads, n_layer=layers, vocab_size=vocab,
                               n_positions=positions, layer_norm_epsilon=eps))
    cfg = config_from_hf(raw)
    assert cfg.n_layers == layers and cfg.vocab_size == vocab and cfg.n_heads * cfg.head_dim > 0


@FAST
@given(st.sampled_from(["vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "layer_norm_epsilon", "n_inner",
                        "eos_token_id"]), st.data(), st.booleans())
def test_invalid_configs_raise_config_error(field, data, llama):
    llama_name = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                  "n_positions": "max_position_embeddings", "layer_norm_epsilon": "rms_norm_eps",
                  "n_inner": "intermediate_size"}.get(field, field)
    def still_valid(v) -> bool:
        if field == "n_inner":
            return v in (None, 0, False, [])  # null / 0 means 4 * hidden
        if field == "layer_norm_epsilon":
            return v == 2.5
        if field == "eos_token_id":
            ids = v if isinstance(v, list) else [v]
            return v is None or all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        return False

    bad = data.draw(st.one_of(JUNK, st.integers(max_value=0), st.just(2.5), st.just("2"), st.just({"a": 1}))
                    .filter(lambda v: not still_valid(v)))
    raw = _llama(**{llama_name: bad}) if llama else _gpt2(**{field: bad})
    with pytest.raises(ConfigError):
        config_from_hf(raw)


@FAST
@given(st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=5), st.integers(), st.none()))
def test_a_config_that_is_not_an_object_raises_config_error(raw):
    with pytest.raises(ConfigError, match="not an object"):
        config_from_hf(raw)


def test_unknown_model_types_raise_unsupported_model_error():
    for model_type in (None, 3, "bert", ["gpt2"]):
        with pytest.raises(UnsupportedModelError):
            config_from_hf(_gpt2(model_type=model_type))


@FAST
@given(st.sampled_from(["tp", "pp", "block_size", "kv_cache_tokens", "microbatches", "max_batch_tokens", "seed"]),
       st.one_of(JUNK, st.just(1.5)))
def test_invalid_runtime_config_numbers_raise_value_error(field, bad):
    from energon_infer.worker.runtime import RuntimeConfig

    with pytest.raises(ValueError, match=field):
        RuntimeConfig(**{field: bad})


@FAST
@given(max_tokens=st.integers(1, 4096), data=st.data())
def test_min_tokens_up_to_max_tokens_is_valid_and_beyond_raises(max_tokens, data):
    good = data.draw(st.integers(0, max_tokens))
    assert SamplingParams(max_tokens=max_tokens, min_tokens=good).min_tokens == good
    bad = data.draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=max_tokens + 1), JUNK))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=max_tokens, min_tokens=bad)


BODY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3)), max_leaves=8)


@FAST
@given(st.dictionaries(st.sampled_from(["model", "prompt", "messages", "tokens", "add_special_tokens",
                                        "return_token_strs", "add_generation_prompt", "x"]), BODY, max_size=4))
def test_tokenize_bodies_validate_or_name_the_field(body):
    from pydantic import ValidationError

    from energon_infer.serving.api_schema import DetokenizeRequest, TokenizeRequest, describe_errors

    for model in (TokenizeRequest, DetokenizeRequest):
        try:
            model.model_validate(body)
        except ValidationError as exc:  # the server's 400: one line, naming a field when there is one
            message, _ = describe_errors(list(exc.errors()))
            assert message and "\n" not in message
