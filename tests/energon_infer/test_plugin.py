from __future__ import annotations

import json

import torch

from tightfit.plugins import PluginRegistry, discover


def test_discovered_and_available():
    found = {r.name: r for r in discover(into=PluginRegistry())}
    assert found["energon"].ok and found["energon"].status() == "available"
    assert found["energon"].plugin.kind == "inference-backend"
    assert found["energon"].plugin.demo is not None


def test_demo_generates_from_a_saved_directory(capsys):
    from energon_infer import plugin

    summary = plugin.demo(True)
    assert "generated" in summary and "packed prefill 17 vs padded 27 tokens" in summary
    out = capsys.readouterr().out
    assert out.count(" -> ") == 3


def test_random_checkpoint_writer_round_trips(tmp_path):
    from energon_infer import ModelRunner
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path, layers=2)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) == 21
    runner = ModelRunner.from_pretrained(path, progress=False)
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(path / index[name]), "pt") as f:
        q = f.get_tensor(name)
    assert torch.equal(runner.stage.layers["0"].qkv.weight[: q.shape[0]], q)
