"""`tightfit profile model|device` end to end."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from tests.helpers.runif import RunIf
from tightfit.cli import main
from tightfit.models import gpt_config
from tightfit.profiler import DeviceProfile, ModelProfile


def test_profile_gpt2_20b_without_allocating_it(tmp_path):
    out = tmp_path / "g20.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "profile", "model", "--model", "gpt2-20b",
                           "--batch", "8", "--seq", "1024", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    peak_rss = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    prof = ModelProfile.from_json(out)
    assert prof.param_numel == gpt_config("gpt2-20b").num_params() == 19_750_019_072
    assert prof.param_bytes > 70 * 2**30 and prof.activation_peak_bytes > 50 * 2**30
    assert peak_rss < 4 * 2**30  # 73 GiB of parameters and ~100 GiB of activations never existed
    assert "gpt2-20b: 19,750.0 M parameters" in proc.stdout and "blocks.23" in proc.stdout
    assert "[profile_model]" in proc.stderr  # progress


def test_profile_model_from_config_files(tmp_path, capsys):
    ours = tmp_path / "tiny.json"
    ours.write_text(json.dumps({"vocab_size": 128, "n_positions": 64, "hidden": 32, "layers": 3, "heads": 2}))
    assert main(["profile", "model", "--model", str(ours), "--batch", "2", "--quiet", "--checkpointing",
                 "blocks.0,blocks.2"]) == 0
    text = capsys.readouterr().out
    assert "tiny:" in text and "inputs arg0[2, 64]" in text and "with 2 blocks checkpointed" in text
    hf = tmp_path / "config.json"  # a Hugging Face GPT-2 config
    hf.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 100, "n_positions": 32, "n_embd": 48,
                              "n_layer": 2, "n_head": 4}))
    out = tmp_path / "p.json"
    assert main(["profile", "model", "--model", str(hf), "--batch", "1", "--seq", "16", "--quiet",
                 "--dtype", "bf16", "--json", str(out)]) == 0
    prof = ModelProfile.from_json(out)
    assert prof.param_dtype == "bfloat16" and prof.inputs == {"arg0": [1, 16]}
    capsys.readouterr()
    assert main(["profile", "model", "--model", "gpt5"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["profile", "model", "--model", "gpt2-tiny", "--seq", "4096"]) == 2


@RunIf(transformers=True)
def test_profile_model_from_a_llama_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "max_position_embeddings": 64}))
    assert main(["profile", "model", "--model", str(cfg), "--batch", "2", "--seq", "16", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("llama:") and "model.layers.1" in text


def test_profile_device(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "dev.json"
    assert main(["profile", "device", "--quick", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "matmul float32" in captured.out and "[profile_device]" in captured.err
    assert DeviceProfile.from_json(out).source == "measured"
    assert list((tmp_path / "cache").glob("device-*.json"))
    assert main(["profile", "device", "--preset", "h100-80g"]) == 0
    assert "datasheet:h100-80g" in capsys.readouterr().out
    assert main(["profile", "device", "--list-presets"]) == 0
    assert "rtx4090-24g" in capsys.readouterr().out
    assert main(["profile", "device", "--preset", "tpu-v9"]) == 2
    assert "unknown device preset 'tpu-v9'" in capsys.readouterr().err


def test_docs_profiling_snippet_runs(monkeypatch):
    from tests.helpers.docs import python_block

    monkeypatch.delenv("TIGHTFIT_README_MODEL", raising=False)  # as written: gpt2-xl, profiled on meta
    code = python_block("docs/profiling.md", "Profiling a model from Python")
    scope: dict = {}
    exec(compile(code, "docs/profiling.md: Profiling a model from Python", "exec"), scope)
    prof = scope["prof"]
    assert prof.param_numel == 1_557_611_200
    assert prof.estimate_peak(["blocks.0", "blocks.1"]).activation_bytes < prof.activation_peak_bytes
