"""``model_impl``: which path a checkpoint takes, chosen by energon (``auto``) or insisted on by the user
(``native`` / ``transformers``), the same for ``ModelRunner``, the ``Engine`` and ``tightfit serve``.

The reference is transformers' own ``generate`` on the same directory (:func:`tests.energon_infer.tiny.hf_greedy`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, TransformersRunner
from energon_infer.loading.backend import MODEL_IMPLS, choose_backend
from energon_infer.loading.config import UnsupportedModelError
from energon_infer.sampling import SamplingParams
from energon_infer.worker.runtime_config import RuntimeConfig
from tests.energon_infer.test_transformers_backend import FALLBACK, _save
from tests.energon_infer.tiny import PROMPTS, hf_greedy, save_tiny

TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
OPTS = dict(progress=False, block_size=4, kv_cache_tokens=512, dtype="float32")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("impl") / "llama", shard=None)


@pytest.fixture(scope="module")
def phi_dir(tmp_path_factory):
    model_type, overrides = FALLBACK["phi"]
    return _save(model_type, tmp_path_factory.mktemp("impl") / "phi", **overrides)


def test_auto_takes_the_native_family_and_transformers_where_asked(llama_dir, phi_dir):
    assert choose_backend(llama_dir)[0] == "native"
    backend, why = choose_backend(llama_dir, "transformers")
    assert backend == "transformers" and why == ("llama runs through transformers' modeling code "
                                                 "(model_impl='transformers' asked for it)")
    assert choose_backend(phi_dir, "transformers")[0] == choose_backend(phi_dir)[0] == "transformers"
    assert choose_backend(llama_dir, "native")[0] == "native"


def test_native_refuses_what_no_native_family_reads_in_one_line(llama_dir, phi_dir, tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"model_type 'phi' has no native energon family .* "
                                                    r"model_impl='native' rules out .* leave model_impl at 'auto'"):
        choose_backend(phi_dir, "native")
    # A native family that refuses one option: auto falls back (tested in test_transformers_backend), native says
    # the family's own refusal instead.
    raw = json.loads((llama_dir / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "su_yarn_v9", "factor": 2.0}
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(raw))
    assert choose_backend(odd)[0] == "transformers"
    with pytest.raises(UnsupportedModelError, match=r"rope_type='su_yarn_v9' is not supported") as err:
        choose_backend(odd, "native")
    assert "\n" not in str(err.value)


@settings(max_examples=30, deadline=None)
@given(st.one_of(st.text(max_size=12), st.integers(), st.none()))
def test_any_other_model_impl_is_refused_naming_the_choices(value):
    if value in MODEL_IMPLS:
        return
    with pytest.raises(ValueError, match=r"model_impl=.* is not a model implementation; use 'auto' .* 'native' or "
                                         r"'transformers'"):
        RuntimeConfig(model_impl=value)


def test_model_runner_points_to_the_runner_of_the_path_the_engine_takes(llama_dir, phi_dir):
    """``ModelRunner`` runs the native families; a model on the transformers path (its type, or
    ``model_impl="transformers"``) is refused in one line naming ``TransformersRunner``, which gives transformers'
    greedy tokens for both."""
    for path, kw in ((phi_dir, {}), (llama_dir, {"model_impl": "transformers"})):
        with pytest.raises(UnsupportedModelError, match=r"runs through transformers' modeling code .* load it with "
                                                        r"TransformersRunner\.from_pretrained") as err:
            ModelRunner.from_pretrained(path, **OPTS, **kw)
        assert "\n" not in str(err.value)
        runner = TransformersRunner.from_pretrained(path, **OPTS)
        assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == hf_greedy(path, PROMPTS, TOKENS)
    native = ModelRunner.from_pretrained(llama_dir, **OPTS)
    assert type(native) is ModelRunner
    assert [g.token_ids for g in native.generate(PROMPTS, GREEDY)] == hf_greedy(llama_dir, PROMPTS, TOKENS)


def test_engine_runs_a_native_family_through_transformers_when_asked(llama_dir, capfd):
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(llama_dir, progress=True, threads_per_worker=1, block_size=4, kv_cache_tokens=512,
                                dtype="float32", model_impl="transformers") as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        assert engine.worker_info[0]["config"]["family"] == "transformers"
    assert [o.token_ids for o in outs] == hf_greedy(llama_dir, PROMPTS, TOKENS)
    assert "energon: llama runs through transformers' modeling code (model_impl='transformers' asked for it)" \
        in capfd.readouterr().err


def test_serve_refuses_an_unknown_model_impl_before_loading(llama_dir):
    out = subprocess.run([sys.executable, "-m", "tightfit.cli", "serve", str(llama_dir), "--model-impl", "hf"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--model-impl: invalid choice: 'hf'" in out.stderr and "auto" in out.stderr
