"""Checkpoints saved already quantized by torchao (transformers' ``TorchAoConfig`` + ``save_pretrained``).

A tiny random LLaMA is quantized by transformers with torchao's ``Int8WeightOnlyConfig`` and saved (safetensors,
sharded); energon loads that directory as it is: its int8 weights are torchao's bytes, its logits those of
transformers' quantized model (the reference: the fp32 model with each projection replaced by torchao's
dequantisation of it), at tp=1 and tp=2. Only int8 is tested: transformers cannot write an int4 torchao
checkpoint on a CPU-only install (each of Int4WeightOnlyConfig's packings needs CUDA or the ``mslk`` package).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.energon_infer.tiny import PROMPTS, save_tiny
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

pytest.importorskip("torchao", reason="torchao-quantized checkpoints need torchao to be written (transformers)")

TOL = 2e-4  # relative to the logits' scale: another summation order, not another weight
PROJ = {"qkv": ("self_attn", "qkv"), "o": ("self_attn", "o"), "up": ("mlp", ("gate", "up")), "down": ("mlp", "down")}



@pytest.fixture(autouse=True)
def _fp32_activations(monkeypatch):
    """These tests compare with torchao's and transformers' own models to fp32 rounding: the fp32-activation
    kernels (the int8-activation ones, tightfit.kernels.quant_linear_a8, are held to their bound elsewhere). Set in
    the environment, so the spawned tensor-parallel ranks inherit it."""
    from tightfit.kernels.quant_linear_a8 import A8_ENV_VAR

    monkeypatch.setenv(A8_ENV_VAR, "fp32")

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    root = tmp_path_factory.mktemp("torchao_ckpt")
    fp = save_tiny("llama", root / "fp", hidden_size=64, intermediate_size=128)
    model = AutoModelForCausalLM.from_pretrained(fp, dtype=torch.float32,
                                                 quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    q8 = root / "q8"
    model.save_pretrained(q8, max_shard_size="40KB")
    shutil.copy(fp / "tokenizer.json", q8 / "tokenizer.json")
    return {"fp": fp, "q8": q8}


def _torchao_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _dequantised(path: Path):
    """transformers' model of ``path`` with each projection weight torchao's dequantisation of what was saved."""
    model = _torchao_model(path)
    for layer in model.model.layers:
        for lin in (*[getattr(layer.self_attn, f"{x}_proj") for x in "qkvo"],
                    *[getattr(layer.mlp, f"{x}_proj") for x in ("gate", "up", "down")]):
            lin.weight = torch.nn.Parameter(lin.weight.dequantize(), requires_grad=False)
    return model


@torch.no_grad()
def _hf_logits(model) -> torch.Tensor:
    return torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS])


def _logits(runner) -> torch.Tensor:
    out = runner.forward(list(enumerate(PROMPTS)), all_logits=True, broadcast=True)
    return torch.cat(list(out.values())) if isinstance(out, dict) else out


def test_the_checkpoint_is_what_transformers_writes(dirs):
    raw = json.loads((dirs["q8"] / "config.json").read_text())["quantization_config"]
    assert raw["quant_method"] == "torchao" and raw["quant_type"]["default"]["_type"] == "Int8WeightOnlyConfig"
    keys = _safetensors(dirs["q8"])
    assert "model.layers.0.self_attn.q_proj._weight_qdata" in keys and "model.layers.0.self_attn.q_proj.weight" \
        not in keys and "model.embed_tokens.weight" in keys
    assert len(list(dirs["q8"].glob("*.safetensors"))) > 1  # sharded: the metadata of every shard is read


def test_int8_weights_are_torchaos_bytes_and_logits_its_models(dirs):
    from energon_infer import ModelRunner, SamplingParams

    runner = ModelRunner.from_pretrained(dirs["q8"], block_size=4, progress=False, packed_weights=False)
    assert runner.weights_format == "int8"
    saved = _safetensors(dirs["q8"])
    for i, block in runner.stage.layers.items():
        pre = f"model.layers.{i}."
        for name, (sub, parts) in PROJ.items():
            parts = parts if isinstance(parts, tuple) else (parts,)
            srcs = [f"{pre}{sub}.{x}_proj" for x in (("q", "k", "v") if parts == ("qkv",) else parts)]
            want_q = torch.cat([saved[s + "._weight_qdata"] for s in srcs])
            want_s = torch.cat([saved[s + "._weight_scale"].reshape(-1) for s in srcs])
            module = getattr(block, name)
            assert module.qweight.dtype == torch.int8 and torch.equal(module.qweight, want_q), f"{i} {name}"
            assert torch.equal(module.qscale, want_s), f"{i} {name}"
    ref = _dequantised(dirs["q8"])
    got = _logits(runner)
    assert _rel(got, _hf_logits(ref)) <= TOL
    assert _rel(got, _hf_logits(_torchao_model(dirs["q8"]))) <= TOL  # torchao's own int8 linear
    tokens = [g.token_ids for g in runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                                           ignore_eos=True))]
    for p, t in zip(PROMPTS, tokens):
        ids = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert ids[0, len(p):].tolist() == t
    # The same as asking for it: quantization='int8' agrees with the checkpoint.
    again = ModelRunner.from_pretrained(dirs["q8"], block_size=4, progress=False, packed_weights=False,
                                        quantization="int8")
    assert torch.equal(_logits(again), got)


def _tp2(rank: int, world: int, path: str) -> list[float]:
    from energon_infer import ModelRunner

    return _logits(ModelRunner.from_pretrained(path, tp=2, block_size=4, progress=False)).tolist()


@RunIf(min_world=2)
def test_tp2_ranks_read_their_row_slices(dirs):
    out = run_distributed(_tp2, 2, args=(str(dirs["q8"]),), timeout=600)
    got = torch.tensor(out[0])
    assert out[0] == out[1]
    assert _rel(got, _hf_logits(_dequantised(dirs["q8"]))) <= TOL


def test_conflicts_and_unreadable_formats_are_refused_in_one_line(dirs, tmp_path):
    from energon_infer import Engine, ModelRunner
    from energon_infer.loading.quantization import QuantizationError

    with pytest.raises(QuantizationError, match=r"^quantization='int4' conflicts with .*q8, saved quantized by "
                                                r"torchao's Int8WeightOnlyConfig \('int8'\); drop quantization="):
        ModelRunner.from_pretrained(dirs["q8"], progress=False, quantization="int4", group_size=32)
    with pytest.raises(QuantizationError, match=r"conflicts with"):
        Engine.from_pretrained(dirs["q8"], quantization="int4", group_size=32)
    # An int4 packing (what a CUDA machine writes): named, and the fix.
    int4 = tmp_path / "int4"
    shutil.copytree(dirs["q8"], int4)
    raw = json.loads((int4 / "config.json").read_text())
    raw["quantization_config"]["quant_type"]["default"]["_type"] = "Int4WeightOnlyConfig"
    (int4 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantizationError, match=r"saved quantized by torchao's Int4WeightOnlyConfig, a format energon "
                                                r"cannot read .*save the model unquantized") as err:
        ModelRunner.from_pretrained(int4, progress=False)
    assert "\n" not in str(err.value)
    # Asymmetric int8 (non-zero zero points) is not energon's format: refused, naming the weight.
    skewed = tmp_path / "skewed"
    shutil.copytree(dirs["q8"], skewed)
    _edit_tensor(skewed, "model.layers.1.mlp.down_proj._weight_zero_point", lambda z: z + 1)
    with pytest.raises(QuantizationError, match=r"^model.layers.1.mlp.down_proj.weight: torchao Int8Tensor has "
                                                r"non-zero zero points"):
        ModelRunner.from_pretrained(skewed, progress=False)
    # A pickled torchao checkpoint is never unpickled.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(dirs["q8"] / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match=r"pickled weights are never loaded"):
        ModelRunner.from_pretrained(pickled, progress=False)


def _edit_tensor(path: Path, name: str, change) -> None:
    """Rewrite the shard holding ``name`` with ``change(tensor)`` in its place, keeping the header's metadata."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            if name not in h.keys():
                continue
            tensors = {k: h.get_tensor(k) for k in h.keys()}
            meta = h.metadata()
        tensors[name] = change(tensors[name])
        save_file(tensors, str(f), metadata=meta)
        return
    raise AssertionError(f"{name} is in no shard of {path}")


def test_engine_serves_the_checkpoint_as_saved(dirs):
    from energon_infer import Engine, ModelRunner, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    runner = ModelRunner.from_pretrained(dirs["q8"], block_size=4, progress=False)
    want = [g.token_ids for g in runner.generate(PROMPTS, params)]
    with Engine.from_pretrained(dirs["q8"], max_restarts=0) as engine:  # no quantization=: the checkpoint's int8
        got = [c.token_ids for c in engine.generate(PROMPTS, params)]
        rank = engine.memory_report()["ranks"][0]
    assert got == want and rank["weights"] == "int8"
