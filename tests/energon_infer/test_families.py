"""The native rotary families against transformers on tiny random checkpoints (fp32).

Every checkpoint of :data:`tests.energon_infer.tiny.NATIVE` (Llama 3.x with each rope scaling, Qwen 3, OLMo 2,
Granite, Gemma 1 / 2 / 3, Mistral and Qwen 3 with windows, Phi-3 and Phi-4-mini) gives transformers' logits at
every prompt position (within ``TOL``) and its greedy tokens, at tp=1 and tp=2 (and pp=2 for the layered ones);
its int8 / int4 weights give the logits of the same model with torchao's dequantised weights; its layers stream
from disk exactly. A second group checks that each option the tests rely on changes transformers' own logits (so
equality means the option is implemented), and that what a family does not run is refused by name.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.loading.config import UnsupportedModelError, config_from_hf, load_config
from tests.energon_infer.conftest import GREEDY_TOKENS
from tests.energon_infer.tiny import NATIVE, PROMPTS, hf_logits, references, save_all, save_tiny
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
OPTS = dict(block_size=4, progress=False)
#: families whose layers differ from one another (windows, local rope): also run split over two pipeline stages
LAYERED = ("gemma2", "gemma3", "qwen3-window")


@pytest.fixture(scope="module")
def native_dirs(tmp_path_factory) -> dict[str, str]:
    return save_all(NATIVE, tmp_path_factory.mktemp("native_families"))


@pytest.fixture(scope="module")
def native_refs(native_dirs) -> dict[str, dict]:
    return references(native_dirs, GREEDY_TOKENS)


def _check(runner: ModelRunner, ref: dict, what: str) -> float:
    logits = runner.forward(list(enumerate(PROMPTS)), all_logits=True, broadcast=True)
    err = (logits - torch.cat(ref["logits"])).abs().max().item()
    assert err <= TOL, f"{what}: logits differ by {err}"
    for seq in range(len(PROMPTS)):
        runner.free(seq)
    gens = runner.generate(PROMPTS, GREEDY)
    assert [g.token_ids for g in gens] == ref["greedy"], what
    return err


@pytest.mark.parametrize("name", list(NATIVE))
def test_family_equals_transformers(name, native_dirs, native_refs):
    runner = ModelRunner.from_pretrained(native_dirs[name], **OPTS)
    assert runner.config.model_type == NATIVE[name][0]
    _check(runner, native_refs[name], name)
    assert runner.cache.free_blocks == runner.cache.num_blocks


def _parallel(rank: int, world: int, dirs: dict, refs: dict) -> dict:
    report = {}
    for name, path in dirs.items():
        for tp, pp in [(2, 1)] + ([(1, 2)] if name in LAYERED else []):
            runner = ModelRunner.from_pretrained(path, tp=tp, pp=pp, microbatches=2 if pp > 1 else 0, **OPTS)
            report[(name, tp, pp)] = _check(runner, refs[name], f"{name} tp={tp} pp={pp}")
    return report


@RunIf(min_world=2)
def test_families_at_tp2_and_pp2_equal_transformers(native_dirs, native_refs):
    out = run_distributed(_parallel, 2, args=(native_dirs, native_refs), timeout=900)
    assert out[0] == out[1]
    assert len(out[0]) == len(NATIVE) + len(LAYERED)


@pytest.mark.parametrize("name", list(NATIVE))
def test_packed_weights_agree_with_plain(name, native_dirs, monkeypatch):
    monkeypatch.setattr("tightfit.kernels.packed_linear.MIN_NUMEL", 0)  # tiny weights: pack them anyway
    plain = ModelRunner.from_pretrained(native_dirs[name], packed_weights=False, **OPTS)
    packed = ModelRunner.from_pretrained(native_dirs[name], **OPTS)
    assert packed.stage.layers["0"].qkv.packed is not None
    items = list(enumerate(PROMPTS))
    torch.testing.assert_close(packed.forward(items, all_logits=True), plain.forward(items, all_logits=True),
                               rtol=0, atol=TOL)


@pytest.mark.parametrize("method,group", [("int8", None), ("int4", 32)])
@pytest.mark.parametrize("name", list(NATIVE))
def test_quantized_weights_give_the_dequantised_models_logits(name, method, group, native_dirs, monkeypatch):
    pytest.importorskip("torchao")
    from energon_infer.loading.quantization import (
        PROJECTIONS,
        QuantSpec,
        quantize_weight,
        reference_dequantize,
    )
    from energon_infer.worker.quantization_quality import dequantise_head
    from tightfit.kernels.quant_linear_a8 import A8_ENV_VAR

    monkeypatch.setenv(A8_ENV_VAR, "fp32")  # fp32 activations: the dequantised weights, to rounding
    path, spec = native_dirs[name], QuantSpec(method=method, group_size=group)
    want = ModelRunner.from_pretrained(path, packed_weights=False, **OPTS)
    with torch.no_grad():
        for block in want.stage.layers.values():
            for proj in PROJECTIONS:
                w = getattr(block, proj).weight
                w.copy_(reference_dequantize(quantize_weight(w, spec), spec, w.dtype))
        dequantise_head(want.stage, spec)
    quant = ModelRunner.from_pretrained(path, quantization=method, group_size=group, **OPTS)
    assert "weight" not in quant.stage.layers["0"].qkv._parameters
    items = list(enumerate(PROMPTS))
    got, ref = quant.forward(items, all_logits=True), want.forward(items, all_logits=True)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 2e-4


@pytest.mark.parametrize("name", ["phi4-mini", "gemma2", "olmo2"])
def test_layers_stream_from_disk_exactly(name, tmp_path):
    """Fused checkpoint tensors (Phi's qkv_proj / gate_up_proj), sandwich norms and q/k norms read from disk."""
    from tests.energon_infer.test_disk_pool import _budget, _tiered

    path = save_tiny(name, tmp_path / name, num_hidden_layers=5)
    ref = ModelRunner.from_pretrained(path, progress=False, block_size=4, packed_weights=False)
    budget, _, _ = _budget(path, keep=1)
    runner, pool, plan = _tiered(path, budget)
    try:
        assert len(plan.disk_layers) == 4
        items = list(enumerate(PROMPTS))
        assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    finally:
        pool.close()


def test_chunks_and_decode_steps_of_windowed_soft_capped_layers_match_one_shot(native_dirs, native_refs):
    """The 21-token prompt in chunks and single tokens (past the 6-token window), beside another sequence."""
    chunked_matches_one_shot(ModelRunner.from_pretrained(native_dirs["gemma2"], **OPTS), native_refs["gemma2"]["logits"])


def chunked_matches_one_shot(runner: ModelRunner, ref: list[torch.Tensor]) -> None:
    """PROMPTS[2] in two chunks (the second beside PROMPTS[0]'s first tokens), then one token a step: every position's
    logits within TOL of ``ref`` (transformers' one-shot logits of each prompt)."""
    long, short = PROMPTS[2], PROMPTS[0]
    got = [runner.forward([(0, long[:9])], all_logits=True)]
    got.append(runner.forward([(0, long[9:17]), (1, short[:3])], all_logits=True)[:8])
    for t in long[17:]:
        rest = [(1, short[3:])] if runner.cache.length(1) == 3 else []
        got.append(runner.forward([(0, [t]), *rest], all_logits=True)[:1])
    assert (torch.cat(got) - ref[2]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["gemma2", "llama-dynamic", "phi4-mini"])
def test_padded_decode_steps_equal_the_eager_ones(name, native_dirs):
    """The CUDA-graph decode path without the capture: padding rows (one token of context in the scratch block)
    through the masked decode of windowed, soft-capped layers, and the per-sequence rope lengths."""
    from tests.energon_infer.test_cuda_graphs import STEPS, _pair, run_both

    eager, padded = _pair(native_dirs[name])
    for i, (want, got) in enumerate(run_both(eager, padded, STEPS)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"step {i}")


@pytest.mark.parametrize("name", list(NATIVE))
def test_bfloat16_tracks_transformers_in_bfloat16(name, native_dirs):
    """bf16 rounds differently from fp32 by a few percent here (random weights scaled up); transformers in bf16
    rounds the same way, so that is the reference (a summation order apart, not another bf16 rounding rule)."""
    from transformers import AutoModelForCausalLM

    items = list(enumerate(PROMPTS))
    half = ModelRunner.from_pretrained(native_dirs[name], dtype="bfloat16", **OPTS).forward(items, all_logits=True)
    assert half.dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(native_dirs[name], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([p])).logits[0].float() for p in PROMPTS])
    assert (half.float() - ref).abs().max().item() <= 0.03 * ref.abs().max().item()
    assert (half.float().argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_a_window_is_a_mask_not_a_context_cap(native_dirs):
    cfg = load_config(native_dirs["mistral-window"])
    assert cfg.windows == (6, 6, 6) and cfg.max_positions == 128
    gemma3 = load_config(native_dirs["gemma3"])
    assert gemma3.windows == (6, 6, 0, 6) and gemma3.local_rope is not None and gemma3.local_rope.theta == 10000.0
    assert (gemma3.rope.kind, gemma3.rope.factor, gemma3.rope.theta) == ("linear", 8.0, 1e6)


def _edit(path, tmp_path, **changes) -> str:
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(path, out)
    raw = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


# Each option and a config.json without it (or with it off): transformers' logits change, so a runtime that
# ignored the option would fail test_family_equals_transformers.
OPTIONS = {
    "llama3-tied": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "llama-linear": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama-dynamic": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama-yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3-window": dict(use_sliding_window=False, layer_types=["full_attention"] * 3),
    "granite": dict(residual_multiplier=1.0),
    "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=None),
    "gemma3": dict(layer_types=["full_attention"] * 4),
    "mistral-window": dict(sliding_window=None),
    "phi4-mini": dict(original_max_position_embeddings=64),  # long factors never used
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_changes_transformers_logits(name, native_dirs, native_refs, tmp_path):
    edited = _edit(native_dirs[name], tmp_path, **OPTIONS[name])
    plain = torch.cat(hf_logits(edited, PROMPTS))
    assert (plain - torch.cat(native_refs[name]["logits"])).abs().max().item() > 1e-2


_LLAMA = {"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 8, "max_position_embeddings": 64}


@pytest.mark.parametrize("raw,match", [
    ({**_LLAMA, "rope_parameters": {"rope_type": "su_yarn_v9", "factor": 4.0}},
     r"llama: rope_type='su_yarn_v9' is not supported; use a checkpoint whose rope_type is one of default, linear, "
     r"dynamic, yarn, llama3, longrope, or serve this one through the transformers fallback"),
    ({**_LLAMA, "partial_rotary_factor": 0.5}, r"llama: partial_rotary_factor=0.5 is not supported; this family"),
    ({**_LLAMA, "model_type": "gemma", "use_bidirectional_attention": True},
     r"gemma: use_bidirectional_attention=True is not supported; energon serves causal"),
    ({**_LLAMA, "model_type": "gemma2", "layer_types": ["sliding_attention", "chunked_attention"]},
     r"gemma2: layer_types='chunked_attention' is not supported"),
])
def test_an_option_a_family_does_not_run_is_refused_by_name(raw, match):
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_hf(raw)


def test_checkpoints_saved_by_transformers_4_read_as_transformers_5_writes_them():
    """Hub checkpoints carry rope_scaling / rope_theta at the top level (Gemma 3: rope_local_base_freq; Phi-3:
    original_max_position_embeddings and the old name "su"); each reads as its transformers 5 form."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    old = config_from_hf({**_LLAMA, "rope_theta": 500.0, "rope_scaling": llama3})
    new = config_from_hf({**_LLAMA, "rope_parameters": {**llama3, "rope_theta": 500.0}})
    assert old == new and new.rope.kind == "llama3" and new.rope.theta == 500.0
    gemma3 = {**_LLAMA, "model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window": 4,
              "sliding_window_pattern": 2}
    old = config_from_hf({**gemma3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    new = config_from_hf({**gemma3, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert old == new and new.windows == (4, 0) and new.local_rope is not None and new.local_rope.theta == 1e4
    phi = {**_LLAMA, "model_type": "phi3", "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}
    factors = {"short_factor": [1.0, 1.0], "long_factor": [2.0, 3.0]}
    old = config_from_hf({**phi, "rope_scaling": {"type": "su", **factors}})
    new = config_from_hf({**phi, "rope_parameters": {"rope_type": "longrope", **factors}})
    assert old == new and new.rope.kind == "longrope" and new.rotary_dim == 4
    assert new.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))


def test_gemma_gelu_means_the_tanh_approximation():
    gemma = {**_LLAMA, "model_type": "gemma", "hidden_act": "gelu"}
    assert config_from_hf(gemma).activation == "gelu_pytorch_tanh"  # as transformers rewrites it
    assert config_from_hf({**gemma, "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh"}).activation \
        == "gelu_pytorch_tanh"


def test_the_docs_declaration_is_the_code():
    """docs/model-families.md shows Gemma 2's declaration: every line of it is in energon_infer.loading.families."""
    from pathlib import Path

    import energon_infer.loading.families as families
    from tests.helpers.docs import blocks, section

    body = section("docs/model-families.md", "Adding a family")
    source = Path(families.__file__).read_text()
    lines = [line.strip() for line in blocks(body, "text")[0].splitlines() if line.strip()]
    assert lines and all(line in source for line in lines), [line for line in lines if line not in source]


@RunIf(min_world=2)
def test_the_engine_serves_a_family_on_two_ranks(native_dirs, native_refs):
    """The served path: spawned tp=2 workers report the config (rope, windows) to the controller and generate,
    the 21-token prompt in chunks of at most 16 tokens."""
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(native_dirs["gemma3"], tp=2, dtype="float32", block_size=4, progress=False,
                                max_batch_tokens=16, chunked_prefill=True, threads_per_worker=1) as engine:
        assert engine.max_context == 128
        out = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == native_refs["gemma3"]["greedy"]
