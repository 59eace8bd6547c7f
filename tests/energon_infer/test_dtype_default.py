"""``dtype="auto"`` is the default of the Engine, ModelRunner and ``tightfit serve``: the checkpoint's own dtype where
the device computes in it natively (bf16 on a CPU with bf16 matrix instructions), else float32, said at start."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.demo import write_random_llama
from energon_infer.engine.engine import Engine
from energon_infer.loading import hf_files
from energon_infer.loading.hf_files import auto_dtype, cpu_has_native_bf16
from energon_infer.worker.runtime_config import RuntimeConfig

X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbogomips\t: 4000\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve {extra}\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize(("text", "native"), [
    (X86.format(extra="avx512_bf16"), True), (X86.format(extra="amx_bf16 amx_tile"), True),
    (X86.format(extra="avx512_vnni"), False), (ARM.format(extra="bf16 i8mm"), True), (ARM.format(extra="i8mm"), False),
    ("", False),
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, text, native):
    (tmp_path / "cpuinfo").write_text(text)
    assert cpu_has_native_bf16(tmp_path / "cpuinfo") is native


def test_an_unreadable_cpuinfo_means_no_native_bf16(tmp_path):
    assert cpu_has_native_bf16(tmp_path / "missing") is False


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_any_cpuinfo_text_gives_an_answer(text):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "cpuinfo").write_text(text)
        assert cpu_has_native_bf16(Path(d) / "cpuinfo") in (True, False)


def _checkpoint(tmp_path, dtype: str):
    path = write_random_llama(tmp_path / "m", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("native", [True, False])
def test_auto_keeps_bf16_only_where_the_cpu_computes_in_it(tmp_path, monkeypatch, native):
    monkeypatch.setattr(hf_files, "cpu_has_native_bf16", lambda: native)
    path = _checkpoint(tmp_path, "bfloat16")
    dtype, why = auto_dtype(path, "cpu")
    assert dtype == ("bfloat16" if native else "float32")
    assert ("bf16 matrix instructions" in why) and (native or "--dtype bfloat16" in why)


def test_auto_runs_a_float16_checkpoint_in_float32_on_a_cpu(tmp_path):
    dtype, why = auto_dtype(_checkpoint(tmp_path, "float16"), "cpu")
    assert dtype == "float32" and "--dtype float16" in why


def test_auto_is_the_default_and_model_runner_takes_it(tmp_path, monkeypatch, capfd):
    assert RuntimeConfig().dtype == "auto"
    monkeypatch.setattr(hf_files, "cpu_has_native_bf16", lambda: True)
    path = _checkpoint(tmp_path, "bfloat16")
    runner = ModelRunner.from_pretrained(path, kv_cache_tokens=64, block_size=4)
    assert runner.runtime.dtype == "bfloat16" and str(runner.dtype) == "torch.bfloat16"
    assert "energon: dtype bfloat16: the checkpoint's dtype" in capfd.readouterr().err
    explicit = ModelRunner.from_pretrained(path, dtype="auto", kv_cache_tokens=64, block_size=4, progress=False)
    assert explicit.runtime.dtype == "bfloat16"
    assert ModelRunner.from_pretrained(path, dtype="float32", kv_cache_tokens=64, block_size=4,
                                       progress=False).runtime.dtype == "float32"


def test_engine_and_model_runner_choose_the_same_dtype(tmp_path, capfd):
    path = _checkpoint(tmp_path, "bfloat16")
    expected = auto_dtype(path, "cpu")[0]
    runner = ModelRunner.from_pretrained(path, kv_cache_tokens=64, block_size=4, progress=False)
    want = [g.token_ids for g in runner.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=4,
                                                                                ignore_eos=True))]
    with Engine.from_pretrained(path, kv_cache_tokens=64, max_batch_tokens=32) as engine:
        assert engine.config.runtime.dtype == runner.runtime.dtype == expected
        got = [g.token_ids for g in engine.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=4,
                                                                                  ignore_eos=True))]
    assert got == want
    assert f"energon: dtype {expected}:" in capfd.readouterr().err
