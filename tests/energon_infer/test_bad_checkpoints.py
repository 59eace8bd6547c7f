"""Hostile or broken model directories (issue 18): every error names the file; nothing loads silently wrong."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from energon_infer import ModelRunner, WeightError
from energon_infer.loading.config import ConfigError, config_from_hf
from energon_infer.loading.weights import ModelTooLargeError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_truncated_or_garbage_shard_is_named(tiny_dirs, tmp_path, damage):
    path = _copy(tiny_dirs["gpt2"], tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07garbage" * 64)
    with pytest.raises(WeightError, match=rf"{shard.name}.*(truncated or corrupt|copy it again)"):
        ModelRunner.from_pretrained(path, progress=False)


def test_a_shard_path_outside_the_model_directory_is_refused(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["gpt2"], tmp_path / "a" / "b" / "m")
    # A real, loadable model elsewhere: the old reader would have loaded it.
    other = _copy(tiny_dirs["gpt2"], tmp_path / "other")
    index = _index(path)
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../../other/" + index["weight_map"][first]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert (path / index["weight_map"][first]).resolve().is_file()  # the target exists: refused for its place
    with pytest.raises(WeightError, match=r"maps tensor .* to '\.\./\.\./\.\./other/.*outside the model directory"):
        ModelRunner.from_pretrained(path, progress=False)
    index["weight_map"][first] = str((other / "model-00001-of-00002.safetensors").resolve())
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match="outside the model directory"):
        ModelRunner.from_pretrained(path, progress=False)


def test_a_non_json_index_is_named(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["llama"], tmp_path / "m")
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        ModelRunner.from_pretrained(path, progress=False)
    (path / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(WeightError, match=r"index\.json has no \"weight_map\" object"):
        ModelRunner.from_pretrained(path, progress=False)


@pytest.mark.parametrize("changes,match", [
    (dict(n_head=0), r"config\.json: n_head=0 must be a whole number >= 1"),
    (dict(n_layer="2"), r"config\.json: n_layer='2' must be a whole number >= 1"),
    (dict(n_embd=30), r"config\.json: n_embd=30 is not divisible by n_head=4"),
    (dict(layer_norm_epsilon=-1), r"config\.json: layer_norm_epsilon=-1 must be a finite "
                                  r"number > 0"),
    (dict(vocab_size=None), r"vocab_size=None must be a whole number"),
    (dict(n_positions=2.5), r"n_positions=2\.5 must be a whole number"),
])
def test_config_json_values_are_checked_naming_the_file(tiny_dirs, tmp_path, changes, match):
    path = _copy(tiny_dirs["gpt2"], tmp_path / "m")
    _edit_config(path, **changes)
    with pytest.raises(ConfigError, match=match):
        ModelRunner.from_pretrained(path, progress=False)


def test_config_json_that_is_not_an_object_or_not_json(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["gpt2"], tmp_path / "m")
    (path / "config.json").write_text(json.dumps([{"model_type": "gpt2"}]))
    with pytest.raises(ConfigError, match=r"config\.json: config\.json holds a list, not an object"):
        ModelRunner.from_pretrained(path, progress=False)
    (path / "config.json").write_text("{'model_type': 'gpt2'}")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        ModelRunner.from_pretrained(path, progress=False)
    with pytest.raises(ConfigError, match=r"config\.json has no 'num_hidden_layers'"):
        config_from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2,
                        "intermediate_size": 8, "max_position_embeddings": 8})


def test_a_billion_layers_fail_before_allocating(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["gpt2"], tmp_path / "m")
    _edit_config(path, n_layer=10**9)
    start = time.perf_counter()
    with pytest.raises(ModelTooLargeError, match=r"n_layers=1000000000.*needs at least .* GiB on this rank.*"
                                                 r"available; check config\.json"):
        ModelRunner.from_pretrained(path, progress=False)
    assert time.perf_counter() - start < 5.0  # refused from arithmetic, not after allocating


def _poison(path, value):
    """Write ``value`` into one element of the first layer's c_fc weight; returns the tensor's name."""
    from safetensors.torch import load_file, save_file

    index = _index(path)
    name = next(k for k in index["weight_map"] if k.endswith("h.0.mlp.c_fc.weight"))
    shard = path / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name][3, 5] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_warn_naming_the_tensor_or_fail_when_strict(tiny_dirs, tmp_path, value):
    path = _copy(tiny_dirs["gpt2"], tmp_path / "m")
    name = _poison(path, value)
    with pytest.warns(RuntimeWarning, match=rf"'{name}' holds 1 non-finite value\(s\)"):
        ModelRunner.from_pretrained(path, progress=False)
    with pytest.raises(WeightError, match=rf"'{name}' holds 1 non-finite value"):
        ModelRunner.from_pretrained(path, progress=False, nonfinite_weights="error")


def test_a_truncated_gpt_checkpoint_is_named(tmp_path):
    from energon_infer.worker.gpt_checkpoint import read_gpt_checkpoint

    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model.wte.weight": torch.zeros(4, 2)}}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"last\.ckpt is not a readable torch checkpoint .*truncated or corrupt"):
        read_gpt_checkpoint(ckpt)
    st = tmp_path / "model.safetensors"
    st.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        read_gpt_checkpoint(st)
