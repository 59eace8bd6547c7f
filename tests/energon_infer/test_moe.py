"""The native Mixture-of-Experts families (Mixtral, Qwen 2 MoE, Qwen 3 MoE) against transformers (fp32).

Every checkpoint of :data:`tests.energon_infer.tiny.MOE` gives transformers' logits at every prompt position
(within ``TOL``) and its greedy tokens, at tp=1 and tp=2 (experts split whole across the ranks where 2 divides
their count, sliced otherwise; Qwen 2 MoE's dense middle layer also over two pipeline stages). Each expert runs
once per layer over the tokens transformers' own router sends it; the router's options change transformers'
logits and are followed; MoE layers stream from disk and a host pool exactly; what the MoE path does not run is
refused in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from energon_infer import ModelRunner
from tests.energon_infer.conftest import GREEDY_TOKENS
from tests.energon_infer.test_families import GREEDY, OPTS, TOL, _check
from tests.energon_infer.tiny import (
    MOE,
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
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return save_all(MOE, tmp_path_factory.mktemp("moe_families"))


@pytest.fixture(scope="module")
def moe_refs(moe_dirs) -> dict[str, dict]:
    return references(moe_dirs, GREEDY_TOKENS)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_family_equals_transformers(name, moe_dirs, moe_refs):
    runner = ModelRunner.from_pretrained(moe_dirs[name], **OPTS)
    assert runner.config.model_type == MOE[name][0]
    sparse = [block.moe is not None for block in runner.stage.layers.values()]
    assert sparse == ([True, False, True] if name == "qwen2_moe" else [True] * 3)  # mlp_only_layers=[1]
    _check(runner, moe_refs[name], name)
    assert runner.cache.free_blocks == runner.cache.num_blocks


def _parallel(rank: int, world: int, dirs: dict, refs: dict) -> dict:
    report = {}
    for name, path in dirs.items():
        for tp, pp in [(2, 1)] + ([(1, 2)] if name == "qwen2_moe" else []):
            runner = ModelRunner.from_pretrained(path, tp=tp, pp=pp, microbatches=2 if pp > 1 else 0, **OPTS)
            _check(runner, refs[name], f"{name} tp={tp} pp={pp}")
            if tp == 2:
                moe = runner.stage.layers["0"].moe
                report[name] = (sorted(moe.experts, key=int), tuple(moe.experts[next(iter(moe.experts))].gate_up.shape))
    return report


@RunIf(min_world=2)
def test_moe_at_tp2_equals_transformers_with_whole_experts_where_2_divides_them(moe_dirs, moe_refs):
    out = run_distributed(_parallel, 2, args=(moe_dirs, moe_refs), timeout=900)
    # expert parallelism: each rank holds half the experts, whole (gate/up rows 2 x intermediate_size 64 or 2 x 16)
    assert [out[r]["mixtral"] for r in (0, 1)] == [(["0", "1"], (128, 32)), (["2", "3"], (128, 32))]
    assert [out[r]["qwen3_moe"] for r in (0, 1)] == [(["0", "1", "2"], (32, 32)), (["3", "4", "5"], (32, 32))]
    # 3 and 5 experts: every rank holds every expert's half of the intermediate dimension
    assert out[0]["mixtral-sliced"] == out[1]["mixtral-sliced"] == (["0", "1", "2"], (64, 32))
    assert out[0]["qwen2_moe"] == out[1]["qwen2_moe"] == (["0", "1", "2", "3", "4"], (16, 32))


def _hf_routing(path: str, top_k: int) -> dict[int, torch.Tensor]:
    """Tokens per expert of each MoE layer that transformers' own router chooses over PROMPTS."""
    model, counts = hf_model(path), {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: counts.update({i: counts.get(i, 0) + torch.bincount(
            out[2].reshape(-1), minlength=mod.num_experts)}))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        for p in PROMPTS:
            model(torch.tensor([p]))
    for hook in hooks:
        hook.remove()
    assert all(int(c.sum()) == top_k * sum(map(len, PROMPTS)) for c in counts.values())
    return counts


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_each_layer_sends_each_expert_the_tokens_transformers_routes_to_it(name, moe_dirs):
    # the experts then run grouped over those tokens (tightfit.kernels.grouped_experts, tested against a per-token loop)
    runner = ModelRunner.from_pretrained(moe_dirs[name], **OPTS)
    got: dict[int, torch.Tensor] = {}
    for i, block in runner.stage.layers.items():
        if block.moe is not None:
            def spy(x, i=int(i), moe=block.moe, route=block.moe.route):
                weights, chosen = route(x)
                got[i] = got.get(i, 0) + torch.bincount(chosen.reshape(-1), minlength=moe.n_experts)
                return weights, chosen
            block.moe.route = spy
    runner.forward(list(enumerate(PROMPTS)), all_logits=True)  # one packed step of all four prompts
    want = _hf_routing(moe_dirs[name], runner.config.experts_per_token)
    assert sorted(got) == sorted(want)
    for i, counts in want.items():
        assert got[i].tolist() == counts.tolist(), f"layer {i}"


def _edit(path: str, tmp_path, **changes) -> str:
    out = tmp_path / "edited"
    shutil.copytree(path, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:  # None: the field left out
        del raw[key]
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


# Each router option, changed: transformers' logits change with it, and energon follows.
OPTIONS = {
    "mixtral": dict(num_experts_per_tok=1),
    "qwen2_moe": dict(norm_topk_prob=True),
    "qwen3_moe": dict(norm_topk_prob=False),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_router_option_changes_transformers_logits_and_energon_follows(name, moe_dirs, moe_refs, tmp_path):
    edited = _edit(moe_dirs[name], tmp_path, **OPTIONS[name])
    ref = torch.cat(hf_logits(edited, PROMPTS))
    assert (ref - torch.cat(moe_refs[name]["logits"])).abs().max().item() > 1e-2
    got = ModelRunner.from_pretrained(edited, **OPTS).forward(list(enumerate(PROMPTS)), all_logits=True)
    assert (got - ref).abs().max().item() <= TOL


# Sliding windows by each MoE family's rule: Mixtral windows every layer where sliding_window is set, Qwen 3 MoE
# every layer with use_sliding_window, Qwen 2 MoE (without layer_types in config.json) the even layers before
# max_window_layers.
WINDOWS = {
    "mixtral": (dict(sliding_window=6), (6, 6, 6)),
    "qwen3_moe": (dict(use_sliding_window=True, sliding_window=6), (6, 6, 6)),
    "qwen2_moe": (dict(use_sliding_window=True, sliding_window=6, max_window_layers=2, layer_types=None), (6, 0, 0)),
}


@pytest.mark.parametrize("name", list(WINDOWS))
def test_sliding_windows_follow_each_moe_familys_rule(name, moe_dirs, moe_refs, tmp_path):
    from energon_infer.loading.config import load_config

    changes, windows = WINDOWS[name]
    edited = _edit(moe_dirs[name], tmp_path, **changes)
    ref = torch.cat(hf_logits(edited, PROMPTS))
    assert (ref - torch.cat(moe_refs[name]["logits"])).abs().max().item() > 1e-2  # the 21-token prompt passes 6
    assert load_config(edited).windows == windows
    got = ModelRunner.from_pretrained(edited, **OPTS).forward(list(enumerate(PROMPTS)), all_logits=True)
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", list(MOE))
def test_bfloat16_tracks_transformers_in_bfloat16(name, moe_dirs):
    """In bf16 the routing weights scale the experts' outputs in fp32 (Mixtral) or bf16 (Qwen) and a token's expert
    outputs sum in fp32, as transformers' do: the same roundings, so no routing decision differs (a flipped one
    moves a logit by far more than 1%), only the summation order."""
    from transformers import AutoModelForCausalLM

    items = list(enumerate(PROMPTS))
    half = ModelRunner.from_pretrained(moe_dirs[name], dtype="bfloat16", **OPTS).forward(items, all_logits=True)
    model = AutoModelForCausalLM.from_pretrained(moe_dirs[name], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([p])).logits[0].float() for p in PROMPTS])
    assert (half.float() - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
    assert torch.equal(half.float().argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral-sliced"])
def test_moe_layers_stream_from_disk_and_a_host_pool_exactly(name, tmp_path):
    """A whole MoE layer (router, every expert, the shared expert) is one unit of the disk tier and of the pool."""
    from energon_infer.worker.memory_pool import MemoryPoolConfig, apply_memory_pool
    from tests.energon_infer.test_disk_pool import _budget, _tiered

    path = save_tiny(name, tmp_path / name, num_hidden_layers=5)
    items = list(enumerate(PROMPTS))
    want = ModelRunner.from_pretrained(path, packed_weights=False, **OPTS).forward(items, all_logits=True)
    budget, _, _ = _budget(path, keep=1)
    runner, pool, plan = _tiered(path, budget)
    try:
        assert len(plan.disk_layers) == 4
        assert runner.stage.layers[str(plan.disk_layers[0])].moe.router.weight.device.type == "meta"
        assert torch.equal(runner.forward(items, all_logits=True), want)
    finally:
        pool.close()
    runner = ModelRunner.from_pretrained(path, packed_weights=False, **OPTS)
    pool, plan = apply_memory_pool(runner, MemoryPoolConfig(fraction=0.6))
    try:
        assert plan.pooled
        assert torch.equal(runner.forward(items, all_logits=True), want)
    finally:
        pool.close()


def test_int4_groups_that_do_not_tile_an_experts_width_are_refused_in_one_line_before_loading(moe_dirs):
    """Quantized experts (tests/energon_infer/test_moe_quantized.py) take int4 groups that tile each expert's
    input widths: qwen3_moe's experts here are 16 wide, below every int4 group size."""
    from energon_infer.engine.engine import Engine
    from energon_infer.loading.quantization import QuantizationError

    match = (r"group_size=32 does not divide the 16 inputs of the expert down projection of this qwen3_moe model "
             r"\(per rank at tp=1\); .* use quantization='int8'")
    with pytest.raises(QuantizationError, match=match):
        ModelRunner.from_pretrained(moe_dirs["qwen3_moe"], quantization="int4", group_size=32, **OPTS)
    with pytest.raises(QuantizationError, match=match):  # in the caller's process, before any worker starts
        Engine.from_pretrained(moe_dirs["qwen3_moe"], quantization="int4", group_size=32, dtype="float32",
                               progress=False)


def test_cuda_graphs_are_refused_for_moe_models(moe_dirs):
    with pytest.raises(ValueError, match=r"cuda_graphs=True: this mixtral model's Mixture-of-Experts layers .* "
                                         r"leave cuda_graphs=None"):
        ModelRunner.from_pretrained(moe_dirs["mixtral"], cuda_graphs=True, **OPTS)


@RunIf(min_world=2)
def test_the_engine_serves_an_moe_family_on_two_ranks(moe_dirs, moe_refs):
    """The served path: the caller's process checks the layout and plans memory for the MoE stages, spawned tp=2
    workers split the experts and generate, the 21-token prompt in chunks of at most 16 tokens."""
    from energon_infer.engine.engine import Engine

    with Engine.from_pretrained(moe_dirs["qwen3_moe"], tp=2, dtype="float32", block_size=4, progress=False,
                                max_batch_tokens=16, chunked_prefill=True, threads_per_worker=1) as engine:
        out = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == moe_refs["qwen3_moe"]["greedy"]
