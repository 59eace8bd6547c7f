"""gpt-oss, native, against transformers' ``GptOssForCausalLM`` (fp32).

The tiny checkpoints of :data:`tests.energon_infer.tiny.GPT_OSS` carry everything that sets gpt-oss apart: attention
sinks, q/k/v/o biases, sliding-window and full layers in turn, yarn, a router with a bias (top-k of the logits, a
softmax over those k) and experts with biases and the clamped SwiGLU (its clamps binding). Each gives transformers'
logits at every prompt position (within ``TOL``) and its greedy tokens at tp=1, tp=2 (4 experts split whole over
the ranks, 3 sliced) and pp=2, and through the engine's spawned tp=2 workers; each of those features, removed, moves
transformers' logits and energon follows; config values a user's file may hold load or are refused in one line; an
MXFP4-quantized checkpoint is refused naming ``quantization_config`` and the fix; its layers stream from disk and a
host pool exactly, and bf16 tracks transformers' bf16.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner
from energon_infer.loading.config import ConfigError, UnsupportedModelError, config_from_hf
from tests.energon_infer.conftest import GREEDY_TOKENS
from tests.energon_infer.test_families import GREEDY, OPTS, TOL, _check, chunked_matches_one_shot
from tests.energon_infer.tiny import (
    GPT_OSS,
    PROMPTS,
    hf_logits,
    hf_model,
    references,
    save_all,
    save_tiny,
)
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf


@pytest.fixture(scope="module")
def oss_dirs(tmp_path_factory) -> dict[str, str]:
    return save_all(GPT_OSS, tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def oss_refs(oss_dirs) -> dict[str, dict]:
    return references(oss_dirs, GREEDY_TOKENS)


@pytest.mark.parametrize("name", list(GPT_OSS))
def test_gpt_oss_equals_transformers(name, oss_dirs, oss_refs):
    runner = ModelRunner.from_pretrained(oss_dirs[name], **OPTS)
    cfg = runner.config
    assert (cfg.model_type, cfg.windows, cfg.rope.kind, cfg.router) == ("gpt_oss", (6, 0, 6), "yarn", "topk_softmax")
    assert all(block.moe is not None and block.sinks is not None for block in runner.stage.layers.values())
    _check(runner, oss_refs[name], name)
    assert runner.cache.free_blocks == runner.cache.num_blocks


def test_chunks_and_decode_steps_with_sinks_past_the_window_match_one_shot(oss_dirs, oss_refs):
    """The 21-token prompt in chunks and then one token a step (past the 6-token window, the decode path's sinks),
    beside another sequence."""
    chunked_matches_one_shot(ModelRunner.from_pretrained(oss_dirs["gpt_oss"], **OPTS), oss_refs["gpt_oss"]["logits"])


def _parallel(rank: int, world: int, dirs: dict, refs: dict) -> dict:
    report = {}
    # sliding and full layers over two pipeline stages
    _check(ModelRunner.from_pretrained(dirs["gpt_oss"], pp=2, microbatches=2, **OPTS), refs["gpt_oss"], "pp=2")
    for name, path in dirs.items():
        runner = ModelRunner.from_pretrained(path, tp=2, **OPTS)
        _check(runner, refs[name], f"{name} tp=2")
        moe = runner.stage.layers["0"].moe
        first = moe.experts[next(iter(moe.experts))]
        report[name] = (sorted(moe.experts, key=int), tuple(first.gate_up.shape), first.down_bias is not None,
                        tuple(runner.stage.layers["0"].sinks.shape))
    return report


@RunIf(min_world=2)
def test_gpt_oss_at_tp2_and_pp2_equals_transformers(oss_dirs, oss_refs):
    out = run_distributed(_parallel, 2, args=(oss_dirs, oss_refs), timeout=900)
    # 4 experts: each rank holds 2, whole (gate/up rows 2 x 24), and adds their down biases; 2 of the 4 sinks
    assert [out[r]["gpt_oss"] for r in (0, 1)] == [(["0", "1"], (48, 32), True, (2,)), (["2", "3"], (48, 32), True,
                                                                                          (2,))]
    # 3 experts: every rank holds every expert's half of the width; rank 0 alone adds the down biases
    assert [out[r]["gpt_oss-sliced"] for r in (0, 1)] == [(["0", "1", "2"], (24, 32), True, (2,)),
                                                          (["0", "1", "2"], (24, 32), False, (2,))]


def _zero(*suffixes: str) -> Callable[[torch.nn.Module], None]:
    def edit(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(suffixes):
                    p.zero_()
    return edit


# Each feature, taken away (in the weights, or in config.json): transformers' logits move, so a runtime that ignored
# it would fail test_gpt_oss_equals_transformers; energon follows each change.
CHANGES: dict[str, Callable[[torch.nn.Module], None] | dict] = {
    "sinks": _zero("self_attn.sinks"),
    "attention biases": _zero("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"),
    "router bias": _zero("router.bias"),
    "expert biases": _zero("gate_up_proj_bias", "down_proj_bias"),
    "clamp": dict(swiglu_limit=7.0),
    "sigmoid gain": dict(swiglu_alpha=1.0),
    "windows": dict(layer_types=["full_attention"] * 3),
    "yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_each_gpt_oss_feature_changes_transformers_logits_and_energon_follows(what, oss_dirs, oss_refs, tmp_path):
    change, out = CHANGES[what], tmp_path / "changed"
    if isinstance(change, dict):
        shutil.copytree(oss_dirs["gpt_oss"], out)
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, **change}))
    else:
        model = hf_model(Path(oss_dirs["gpt_oss"]))
        change(model)
        model.save_pretrained(out)
    ref = torch.cat(hf_logits(out, PROMPTS))
    assert (ref - torch.cat(oss_refs["gpt_oss"]["logits"])).abs().max().item() > 1e-2
    got = ModelRunner.from_pretrained(str(out), **OPTS).forward(list(enumerate(PROMPTS)), all_logits=True)
    assert (got - ref).abs().max().item() <= TOL


def test_the_experts_and_layers_are_transformers_own():
    """Parameter counts of an MoE layer and which layers are windowed, against transformers' model on meta."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    hf = GptOssConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=12, num_local_experts=5, num_experts_per_tok=3, vocab_size=11,
                      max_position_embeddings=64)
    cfg = config_from_hf(hf.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    layer = model.model.layers[0]
    assert cfg.mlp_params(True) == sum(p.numel() for p in layer.mlp.parameters())
    assert cfg.windows == tuple(128 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert (cfg.rope.kind, cfg.rope.theta, cfg.rope.factor, cfg.rope.truncate) == ("yarn", 150000.0, 32.0, False)


_BASE = {"model_type": "gpt_oss", "vocab_size": 11, "hidden_size": 16, "num_hidden_layers": 2, "head_dim": 8,
         "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8, "max_position_embeddings": 32,
         "num_local_experts": 4, "num_experts_per_tok": 2}
_FIELDS = ["num_local_experts", "num_experts_per_tok", "intermediate_size", "swiglu_limit", "swiglu_alpha",
           "sliding_window", "layer_types"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 9), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=3), st.lists(st.sampled_from(["full_attention", "sliding_attention", "x", 1]),
                                                  max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(_FIELDS), value=_VALUES)
def test_any_gpt_oss_field_value_loads_or_is_refused_in_one_line_naming_it(field, value):
    try:
        cfg = config_from_hf({**_BASE, field: value})
    except (ConfigError, UnsupportedModelError) as err:
        assert "\n" not in str(err)
        assert field in str(err), str(err)
        return
    assert 1 <= cfg.experts_per_token <= cfg.n_experts and cfg.swiglu_limit > 0 and cfg.swiglu_alpha > 0
    assert len(cfg.windows) in (0, cfg.n_layers)


MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens",
                                                              "lm_head"]}
REFUSAL = (r"gpt_oss: quantization_config quant_method='mxfp4' is not supported; energon runs gpt-oss's experts "
           r"unquantized: dequantize once with transformers .*Mxfp4Config\(dequantize=True\).* then save_pretrained")


def test_an_mxfp4_checkpoint_is_refused_in_one_line_naming_quantization_config(oss_dirs, tmp_path):
    from energon_infer.engine.engine import Engine
    from energon_infer.loading.quantization import QuantizationError

    with pytest.raises(ConfigError, match=REFUSAL):
        config_from_hf({**_BASE, "quantization_config": MXFP4})
    out = tmp_path / "mxfp4"
    shutil.copytree(oss_dirs["gpt_oss"], out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": MXFP4}))
    with pytest.raises(ConfigError, match=REFUSAL):  # not the transformers fallback either
        ModelRunner.from_pretrained(str(out), **OPTS)
    with pytest.raises((ConfigError, QuantizationError), match=r"quantization_config quant_method='mxfp4'") as err:
        Engine.from_pretrained(str(out), dtype="float32", progress=False)
    assert "\n" not in str(err.value) and "Mxfp4Config(dequantize=True)" in str(err.value)  # the fix that applies


def test_gpt_oss_layers_stream_from_disk_and_a_host_pool_exactly(tmp_path):
    """A gpt-oss layer (sinks, biases, the router and every expert sliced out of the fused tensors) is one unit of
    the disk tier and of the host pool, its values bitwise the loaded ones."""
    from energon_infer.worker.memory_pool import MemoryPoolConfig, apply_memory_pool
    from tests.energon_infer.test_disk_pool import _budget, _tiered

    path = save_tiny("gpt_oss", tmp_path / "gpt_oss", num_hidden_layers=5)
    items = list(enumerate(PROMPTS))
    want = ModelRunner.from_pretrained(path, packed_weights=False, **OPTS).forward(items, all_logits=True)
    budget, _, _ = _budget(path, keep=1)
    runner, pool, plan = _tiered(path, budget)
    try:
        assert len(plan.disk_layers) == 4
        assert runner.stage.layers[str(plan.disk_layers[0])].sinks.device.type == "meta"
        assert torch.equal(runner.forward(items, all_logits=True), want)
        # Every checkpoint tensor of a streamed layer is read once a pass, the fused experts tensors included.
        from energon_infer.loading.safetensors_files import TensorFiles
        from energon_infer.worker.disk_pool import pool_snapshot

        files = TensorFiles(path)
        try:
            per_layer = {i: sum(e.nbytes for name, e in files.extents.items() if name.startswith(f"model.layers.{i}."))
                         for i in plan.disk_layers}
        finally:
            files.close()
        snap = pool_snapshot(pool, plan)
        assert snap["disk_bytes_read"] == sum(n * per_layer[i] for i, n in snap["disk_reads"].items())
    finally:
        pool.close()
    runner = ModelRunner.from_pretrained(path, packed_weights=False, **OPTS)
    pool, plan = apply_memory_pool(runner, MemoryPoolConfig(fraction=0.6))
    try:
        assert plan.pooled
        assert torch.equal(runner.forward(items, all_logits=True), want)
    finally:
        pool.close()


def test_bfloat16_tracks_transformers_in_bfloat16(oss_dirs):
    """In bf16 the router's top-k softmax and the expert products round in bf16 as transformers' do; the norms'
    weights, which transformers keeps in fp32 (``_keep_in_fp32_modules``), are held in bf16 here, so the bound is
    the dense families' bf16 bound (test_families), not the other MoE families' exact argmax."""
    from transformers import AutoModelForCausalLM

    items = list(enumerate(PROMPTS))
    half = ModelRunner.from_pretrained(oss_dirs["gpt_oss"], dtype="bfloat16", **OPTS).forward(items, all_logits=True)
    model = AutoModelForCausalLM.from_pretrained(oss_dirs["gpt_oss"], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([p])).logits[0].float() for p in PROMPTS])
    err = (half.float() - ref).abs().max().item() / ref.abs().max().item()
    agree = (half.float().argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert err <= 0.03 and agree >= 0.9


@RunIf(min_world=2)
def test_the_engine_serves_gpt_oss_on_two_ranks(oss_dirs, oss_refs):
    """The served path: spawned tp=2 workers split the experts and generate, the 21-token prompt in chunks of at
    most 16 tokens."""
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(oss_dirs["gpt_oss"], tp=2, dtype="float32", block_size=4, progress=False,
                                max_batch_tokens=16, chunked_prefill=True, threads_per_worker=1) as engine:
        out = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == oss_refs["gpt_oss"]["greedy"]
