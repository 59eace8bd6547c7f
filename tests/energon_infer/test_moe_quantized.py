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


def test_the_engine_places_quantized_experts_one_by_one_beyond_its_budget(tmp_path):
    """The served path: the caller's process plans a quantized qwen3_moe model under a budget that holds none of
    its layers whole; the expert plan keeps the dense parts and the experts that fit (priced at their packed int8
    bytes) and the spawned worker reads the rest from the quantized store when routed: the in-memory quantized model's
    tokens, each read one expert's quantized bytes."""
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from energon_infer.worker.quantized_pool import packed_block_bytes
    from tests.energon_infer.test_quantized_pool import _disk, _opts, _unified_budget

    path = save_tiny("qwen3_moe", tmp_path / "m", **FAMILIES["qwen3_moe"])
    ref = ModelRunner.from_pretrained(path, **_opts("int8", None))
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    size = packed_block_bytes(ref.stage.layers["0"].moe.experts["0"])
    budget, layers = _unified_budget(path, "int8", None, keep=0)
    pool = MemoryPoolConfig(memory_budget=budget, disk=_disk(path), lookahead=1, quantized_dir=str(tmp_path / "q"))
    with Engine.from_pretrained(path, memory_pool=pool, quantization="int8", progress=False, threads_per_worker=1,
                                block_size=4, packed_weights=False, kv_cache_tokens=512) as engine:
        lines = dict(engine.memory_plan.lines[0])
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        rank = engine.memory_report()["ranks"][0]
    assert got == want
    kept = next(w for w in lines if w.endswith("experts kept in memory"))
    n_kept, n_all = int(kept.split()[0]), int(kept.split()[2])
    assert 0 < n_kept < n_all and lines[kept] == n_kept * size  # priced at the packed quantized bytes
    assert rank["weights"] == "int8" and rank["experts_on_disk"] == n_all - n_kept and rank["expert_reads"] > 0
    assert not rank.get("disk_layer_bytes")  # no whole layer streams
    misread = rank["expert_prefetches"] - rank["expert_prefetches_used"]  # read ahead, then not routed
    assert rank["expert_bytes_read"] == (rank["expert_reads"] + misread) * size


def _quantized_pool(path: str, method: str, group: int | None, store_dir, lookahead: int | None = 0):
    """``(in-memory quantized model, the same with the odd experts of every MoE layer read from the quantized store
    when routed, its pool)``: one cache slot per layer."""
    from energon_infer.worker.expert_pool import expert_names, install_expert_pool, moe_layers
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from tests.energon_infer.test_expert_pool import _plan

    opts = dict(OPTS, quantization=method, group_size=group, packed_weights=False)
    ref = ModelRunner.from_pretrained(path, **opts)
    n_moe, n = len(moe_layers(ref.stage)), ref.config.n_experts
    plan = _plan([["disk" if e % 2 else "device" for e in range(n)] for _ in range(n_moe)], [1] * n_moe,
                 ref.config.experts_per_token)
    runner = ModelRunner.from_pretrained(path, offload=expert_names(ref.stage, plan), **opts)
    pool = install_expert_pool(runner, plan, MemoryPoolConfig(quantized_dir=str(store_dir), expert_lookahead=lookahead),
                               path)
    return ref, runner, pool


@pytest.mark.parametrize("method,group", SPECS, ids=["int8", "int4-g32"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_quantized_disk_experts_are_read_from_the_store_and_give_the_in_memory_models_logits(dirs, tmp_path, name,
                                                                                          method, group):
    """Quantized experts placed one by one: the disk experts are never quantized into memory at load, each is written
    once to the quantized store as its packed quantized bytes (weights, scales, zero points, biases) and read from
    there when routed, through the same grouped quantized kernel: the in-memory quantized model's logits and greedy
    tokens bit for bit, and every read exactly one expert's quantized bytes (int8 under 1/3, int4 under 1/4 of the
    fp32 expert's). gpt-oss's experts are sliced from one fused tensor: stored quantized, each is read on its own."""
    from energon_infer.worker.expert_pool import moe_layers

    ref, runner, pool = _quantized_pool(dirs[name], method, group, tmp_path / "q")
    try:
        routed = []
        for _, moe in moe_layers(ref.stage):
            moe.register_forward_hook(lambda m, args, out: routed.append(set(m.route(args[0])[1].reshape(-1).tolist())))
        for _, moe in moe_layers(runner.stage):
            for e, expert in moe.experts.items():  # the odd ones never loaded: the shared zero expert stands in
                zeros = expert.gate_up_qweight.untyped_storage().data_ptr() == pool._zeros.data_ptr()
                assert zeros == (int(e) % 2 == 1)
        stored = sorted(n.rsplit(".", 1)[0] for n in pool.store.names() if n.startswith("expert."))
        assert stored == sorted(f"expert.{i}.{e}" for i, _ in moe_layers(runner.stage)
                                for e in range(1, runner.config.n_experts, 2))
        expert = ref.stage.layers["0"].moe.experts["1"]  # its quantized tensors as the in-memory model holds them
        size = sum(-(-p.numel() * p.element_size() // 64) * 64 for p in expert.parameters())
        fp32 = 4 * sum(p.numel() for p in ModelRunner.from_pretrained(dirs[name], **OPTS).stage.layers["0"].moe
                       .experts["1"].parameters())
        assert size <= {"int8": 1 / 3, "int4": 1 / 4}[method] * fp32
        items = list(enumerate(PROMPTS))
        assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
        snap = pool.snapshot()
        disk_used = sum(len([e for e in layer if e % 2]) for layer in routed)
        assert snap["expert_reads"] == disk_used > 0 and snap["expert_cache_hits"] == 0
        assert snap["expert_bytes_read"] == disk_used * size
        for seq_id, _ in items:
            runner.free(seq_id)
            ref.free(seq_id)
        assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == \
            [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
        snap = pool.snapshot()
        assert snap["expert_uses"] == snap["expert_uses_in_memory"] + snap["expert_cache_hits"] + snap["expert_reads"]
        assert snap["expert_bytes_read"] == snap["expert_reads"] * size  # no lookahead: every read a routed use
    finally:
        pool.close()


def test_quantized_experts_are_read_ahead_and_the_store_is_reused(dirs, tmp_path):
    """With lookahead the next layer's predicted quantized experts are read ahead from the store (the same tokens,
    the bytes of every read issued, used or not); a second pool over the same store writes nothing again."""
    from energon_infer.worker.quantized_pool import packed_block_bytes

    ref, runner, pool = _quantized_pool(dirs["mixtral"], "int4", 32, tmp_path / "q", lookahead=None)
    try:
        assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == \
            [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
        snap = pool.snapshot()
        size = packed_block_bytes(ref.stage.layers["0"].moe.experts["1"])
        assert snap["expert_prefetches_used"] > 0
        assert any(ev[0] == "read" and ev[3] == "ahead" for ev in pool.events)
        misread = snap["expert_prefetches"] - snap["expert_prefetches_used"]
        assert snap["expert_bytes_read"] == (snap["expert_reads"] + misread) * size
        written = set(pool.store.names())
    finally:
        pool.close()
    # The store made from the same checkpoint with the same method is reused: nothing is quantized or written again.
    from energon_infer.worker.expert_pool import stored_experts
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from energon_infer.worker.quantized_pool import open_quantized_store, write_missing_layers

    store = open_quantized_store(dirs["mixtral"], runner, MemoryPoolConfig(quantized_dir=str(tmp_path / "q")), size)
    try:
        assert set(store.names()) == written
        units = [u for layer in stored_experts(runner.stage, pool.plan, store) for u in layer.values()]
        assert len(units) == len([n for n in written if n.startswith("expert.")]) > 0
        assert write_missing_layers(store, dirs["mixtral"], runner, units) == 0
    finally:
        store.close()


def test_the_expert_pool_refuses_quantized_experts_without_their_store_in_one_line(dirs, tmp_path):
    from energon_infer.loading.safetensors_files import TensorFiles
    from energon_infer.worker.expert_pool import ExpertPool
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from energon_infer.worker.quantized_pool import open_quantized_store
    from tightfit.planner.experts import ExpertPlan

    runner = ModelRunner.from_pretrained(dirs["mixtral"], quantization="int8", **OPTS)
    n = runner.config.n_experts
    plan = ExpertPlan(placement=(("device",) * (n - 1) + ("disk",),) * 3, slots=(1, 1, 1), slot_bytes=(0, 0, 0),
                      experts_per_token=2, unified=True, budget_bytes=0, host_budget_bytes=None, dense_bytes=0,
                      device_bytes=0, host_bytes=0, served=(1.0, 0.0, 0.0), batches=(), tokens_per_s=(),
                      disk_bytes_per_token=(), host_bytes_per_token=())
    files = TensorFiles(dirs["mixtral"])
    try:
        with pytest.raises(ValueError, match=r"^ExpertPool: this stage's experts are quantized and store=None; "
                                             r"[^\n]* give store=[^\n]*install_expert_pool$"):
            ExpertPool(runner.stage, runner.config, runner.grid, plan, files)
    finally:
        files.close()
    store = open_quantized_store(dirs["mixtral"], runner, MemoryPoolConfig(quantized_dir=str(tmp_path / "q")), 4096)
    with pytest.raises(ValueError, match=r"^ExpertPool: the quantized store \S+ lacks 3 of the plan's disk experts "
                                         r"\(\['expert\.0\.3\.[^\n]*write them first[^\n]*$"):
        ExpertPool(runner.stage, runner.config, runner.grid, plan, None, store=store)
    store.close()


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
