"""Quantized Mixture-of-Experts models (int8 / int4 experts) against torchao and transformers, the independent references.

Each MoE family of :data:`tests.energon_infer.tiny.MOE` (and gpt-oss), with expert widths of 32 so that int4 groups
of 32 tile every projection, is loaded with ``quantization=``. Every expert's ``gate_up`` and ``down`` must hold
torchao's quantization of the checkpoint's weight (``Int8Tensor.from_hp(w, PerRow())``, ``Int4OpaqueTensor.from_hp(w,
[1, g])``): its scales (and int4 zero points) bit for bit, its product equal to ``F.linear`` on torchao's tensor,
its bytes the quantized ones. The whole model's logits and greedy tokens must equal those of transformers' own model
whose quantized weights (attention, experts, shared expert, head) are replaced by torchao's dequantised ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from energon_infer import ModelRunner
from tests.energon_infer.conftest import GREEDY_TOKENS
from tests.energon_infer.test_families import GREEDY
from tests.energon_infer.test_quantization_torchao import TOL, torchao_quantized
from tests.energon_infer.tiny import MOE, PROMPTS, hf_model, save_tiny
from tests.helpers.runif import RunIf

pytest.importorskip("torchao", reason="quantization needs torchao (scripts/setup.sh installs it)")

# The MoE fixtures with every expert (and shared expert) 32 wide, so groups of 32 tile each projection's inputs.
FAMILIES = {**{name: dict(moe_intermediate_size=32, shared_expert_intermediate_size=32) if name == "qwen2_moe"
               else dict(moe_intermediate_size=32) if name == "qwen3_moe" else {} for name in MOE},
            "gpt_oss": dict(intermediate_size=32)}
SPECS = [("int8", None), ("int4", 32)]
OPTS = dict(block_size=4, progress=False)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_quantized")
    return {name: str(save_tiny(name, root / name, **kw)) for name, kw in FAMILIES.items()}


@pytest.fixture(autouse=True)
def _fp32_activations(monkeypatch):
    from tightfit.kernels.quant_linear_a8 import A8_ENV_VAR

    monkeypatch.setenv(A8_ENV_VAR, "fp32")  # the attention's fp32-activation kernels: torchao's weight-only product


def _hf_expert(mlp, e: int, part: str) -> torch.Tensor:
    """Expert ``e``'s ``part`` of transformers' MoE block as an ``(out, in)`` weight in energon's row order (gate
    rows, then up rows)."""
    experts = mlp.experts
    if hasattr(experts, "gate_up_proj_bias"):  # gpt-oss: (in, out), gate and up columns interleaved
        w = getattr(experts, f"{part}_proj")[e].t()
        return torch.cat([w[0::2], w[1::2]]) if part == "gate_up" else w
    return getattr(experts, f"{part}_proj")[e]  # (E, out, in)


def _set_hf_expert(mlp, e: int, part: str, value: torch.Tensor) -> None:
    experts = mlp.experts
    target = getattr(experts, f"{part}_proj")
    if hasattr(experts, "gate_up_proj_bias"):
        if part == "gate_up":
            half = value.shape[0] // 2
            value = torch.stack([value[:half], value[half:]], dim=1).reshape(value.shape)  # interleave back
        target.data[e] = value.t()
    else:
        target.data[e] = value


def _dequantized_reference(path: str, method: str, group: int | None):
    """transformers' model of ``path`` with every weight energon quantizes replaced by torchao's dequantised one."""
    model = hf_model(path)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w = getattr(layer.self_attn, proj).weight
                w.copy_(torchao_quantized(w, method, group)[3])
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                for e in range(mlp.experts.gate_up_proj.shape[0]):
                    for part in ("gate_up", "down"):
                        _set_hf_expert(mlp, e, part, torchao_quantized(_hf_expert(mlp, e, part), method, group)[3])
            shared = getattr(mlp, "shared_expert", None) or (None if hasattr(mlp, "experts") else mlp)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if shared is not None:
                    w = getattr(shared, proj).weight
                    w.copy_(torchao_quantized(w, method, group)[3])
        model.lm_head.weight.copy_(torchao_quantized(model.lm_head.weight, method, group)[3])
    return model


@torch.no_grad()
def _hf_outputs(model) -> tuple[torch.Tensor, list[list[int]]]:
    logits = torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS])
    greedy = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False,
                             pad_token_id=0)
        greedy.append(ids[0, len(p):].tolist())
    return logits, greedy


@pytest.mark.parametrize("method,group", SPECS, ids=["int8", "int4-g32"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_quantized_experts_are_torchaos_and_the_model_equals_transformers_on_torchaos_weights(dirs, name, method,
                                                                                             group):
    from tightfit.kernels.grouped_quant_experts import quant_linear

    runner = ModelRunner.from_pretrained(dirs[name], quantization=method, group_size=group, **OPTS)
    model = hf_model(dirs[name])
    x = torch.randn(5, runner.config.hidden_size, generator=torch.Generator().manual_seed(0))
    checked = 0
    for i, block in runner.stage.layers.items():
        if block.moe is None:
            continue
        mlp = model.model.layers[int(i)].mlp
        for e, expert in block.moe.experts.items():
            assert expert.quant == method and "gate_up" not in expert._parameters, f"layer {i} expert {e}"
            for part in ("gate_up", "down"):
                w = _hf_expert(mlp, int(e), part).detach()
                held = expert.quant_weight(part)
                ao, scale, zero, _ = torchao_quantized(w, method, group)
                what = f"{name} layer {i} expert {e} {part}"
                # torchao's scales and zero points, bit for bit; the bytes are the quantized ones
                assert torch.equal(held.scale, scale.float()), f"{what}: scales differ from torchao's"
                if zero is not None:
                    assert torch.equal(held.zero, zero.float()), f"{what}: zero points differ from torchao's"
                n, k = w.shape
                assert sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor)) == (
                    n * k + 4 * n if method == "int8" else n * k // 2 + 8 * n * (k // group)), what
                rows = x if k == x.shape[1] else torch.randn(5, k, generator=torch.Generator().manual_seed(1))
                torch.testing.assert_close(quant_linear(rows, held), F.linear(rows, ao)[:, :n], atol=1e-4,
                                           rtol=1e-4, msg=f"{what}: product")
                checked += 1
    n_moe = sum(block.moe is not None for block in runner.stage.layers.values())
    assert checked == 2 * runner.config.n_experts * n_moe
    # End to end: transformers' model on torchao's dequantised weights gives the same logits and greedy tokens.
    want, greedy = _hf_outputs(_dequantized_reference(dirs[name], method, group))
    got = runner.forward(list(enumerate(PROMPTS)), all_logits=True)
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOL
    for seq in range(len(PROMPTS)):
        runner.free(seq)
    assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == greedy


POOLED = {"qwen2_moe": dict(FAMILIES["qwen2_moe"], num_hidden_layers=4),  # a dense layer and a shared expert
          "gpt_oss": dict(FAMILIES["gpt_oss"], num_hidden_layers=4)}  # experts sliced from one fused tensor


@pytest.mark.parametrize("name,method,group", [("qwen2_moe", "int8", None), ("gpt_oss", "int4", 32)])
def test_quantized_moe_layers_pool_on_the_host_and_stream_from_disk_exactly(tmp_path, name, method, group):
    """Whole quantized MoE layers (router, every expert, shared expert) held packed in a host pool, and written
    once to the quantized store and read from it each pass: the in-memory quantized model's logits and tokens,
    with the quantized bytes read (int8 under 1/3, int4 under 1/4 of the fp32 layers': the routers, norms and
    gpt-oss's expert biases stay fp32)."""
    from energon_infer.worker.disk_pool import pool_snapshot
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from energon_infer.worker.quantized_pool import apply_quantized_pool, packed_layer_bytes
    from tests.energon_infer.test_quantized_pool import (
        _fp32_layers,
        _opts,
        _same_as_in_memory,
        _tiered,
        _unified_budget,
    )

    path = save_tiny(name, tmp_path / name, **POOLED[name])
    ref = ModelRunner.from_pretrained(path, **_opts(method, group))
    runner = ModelRunner.from_pretrained(path, **_opts(method, group))
    layers, resident = packed_layer_bytes(runner.stage)
    pool, plan = apply_quantized_pool(runner, MemoryPoolConfig(device_budget=resident + 3 * max(layers), lookahead=1))
    assert plan.pooled == (0, 1, 2)
    assert runner.stage.layers["0"].moe.experts["0"].gate_up_qweight.device.type == "meta"  # held by the pool only
    _same_as_in_memory(runner, ref)
    pool.close()
    budget, layers = _unified_budget(path, method, group, keep=1)
    runner, pool, plan = _tiered(path, method, group, budget)
    try:
        assert plan.disk_layers == (0, 1, 2)
        fp32 = _fp32_layers(path)
        assert plan.disk_bytes == sum(layers[i] for i in plan.disk_layers)
        assert plan.disk_bytes <= {"int8": 1 / 3, "int4": 1 / 4}[method] * sum(fp32[i] for i in plan.disk_layers)
        _same_as_in_memory(runner, ref)
        snap = pool_snapshot(pool, plan)
        assert snap["disk_layers_written"] == 3
        assert snap["disk_bytes_read"] == sum(n * layers[i] for i, n in snap["disk_reads"].items()) > 0
    finally:
        pool.close()


def test_the_engine_serves_a_quantized_moe_model_beyond_its_budget(tmp_path):
    """The served path: the caller's process plans a quantized qwen3_moe model under a budget that holds none of
    its layers, so whole quantized layers stream from the store (the expert-level plan is for unquantized models),
    and the spawned worker's tokens are the in-memory quantized model's."""
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from tests.energon_infer.test_quantized_pool import _disk, _opts, _unified_budget

    path = save_tiny("qwen3_moe", tmp_path / "m", **FAMILIES["qwen3_moe"])
    ref = ModelRunner.from_pretrained(path, **_opts("int8", None))
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    budget, layers = _unified_budget(path, "int8", None, keep=0)
    pool = MemoryPoolConfig(memory_budget=budget, disk=_disk(path), lookahead=1, quantized_dir=str(tmp_path / "q"))
    with Engine.from_pretrained(path, memory_pool=pool, quantization="int8", progress=False, threads_per_worker=1,
                                block_size=4, packed_weights=False, kv_cache_tokens=512) as engine:
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        rank = engine.memory_report()["ranks"][0]
    assert got == want
    assert rank["weights"] == "int8" and rank["tiers"] == {i: "disk" for i in range(len(layers))}
    assert rank["disk_layer_bytes"] == dict(enumerate(layers))
    assert rank["disk_bytes_read"] == sum(n * layers[i] for i, n in rank["disk_reads"].items()) > 0


def test_the_expert_pool_refuses_quantized_experts_in_one_line(dirs):
    from energon_infer.loading.safetensors_files import TensorFiles
    from energon_infer.worker.expert_pool import ExpertPool
    from tightfit.planner.experts import ExpertPlan

    runner = ModelRunner.from_pretrained(dirs["mixtral"], quantization="int8", **OPTS)
    n = runner.config.n_experts
    plan = ExpertPlan(placement=(("device",) * (n - 1) + ("disk",),) * 3, slots=(1, 1, 1), slot_bytes=(0, 0, 0),
                      experts_per_token=2, unified=True, budget_bytes=0, host_budget_bytes=None, dense_bytes=0,
                      device_bytes=0, host_bytes=0, served=(1.0, 0.0, 0.0), batches=(), tokens_per_s=(),
                      disk_bytes_per_token=(), host_bytes_per_token=())
    files = TensorFiles(dirs["mixtral"])
    try:
        with pytest.raises(ValueError, match=r"experts are quantized, and the expert pool reads experts unquantized "
                                             r".* streams whole quantized layers"):
            ExpertPool(runner.stage, runner.config, runner.grid, plan, files)
    finally:
        files.close()


def _tp2_quantized(rank: int, world: int, dirs: dict, method: str, group: int | None) -> dict:
    out = {}
    for name, path in dirs.items():
        runner = ModelRunner.from_pretrained(path, tp=2, quantization=method, group_size=group, **OPTS)
        expert = runner.stage.layers["0"].moe.experts
        out[name] = ([g.token_ids for g in runner.generate(PROMPTS, GREEDY)], sorted(expert, key=int),
                     tuple(expert[next(iter(expert))].quant_weight("gate_up").shape))
    return out


@RunIf(min_world=2)
def test_quantized_experts_at_tp2_give_the_tokens_of_tp1(tmp_path):
    """int4 at tp=2 (hidden 64, so groups of 32 tile each rank's attention-out inputs): 4 experts split whole over
    the ranks (each rank quantizes its own experts), 3 sliced (a group never straddles two ranks): either way the
    values tp=1 holds, so tp=1's greedy tokens."""
    from tests.helpers.multiprocess import run_distributed

    dirs = {name: str(save_tiny(name, tmp_path / name, hidden_size=64)) for name in ("mixtral", "mixtral-sliced")}
    out = run_distributed(_tp2_quantized, 2, args=(dirs, "int4", 32), timeout=900)
    for name, path in dirs.items():
        one = ModelRunner.from_pretrained(path, quantization="int4", group_size=32, **OPTS)
        want = [g.token_ids for g in one.generate(PROMPTS, GREEDY)]
        assert out[0][name][0] == out[1][name][0] == want, name
    assert [out[r]["mixtral"][1:] for r in (0, 1)] == [(["0", "1"], (128, 64)), (["2", "3"], (128, 64))]
    assert out[0]["mixtral-sliced"][1:] == out[1]["mixtral-sliced"][1:] == (["0", "1", "2"], (64, 64))
