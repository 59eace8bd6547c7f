"""Quantized layers in the memory pool: held quantized on the host, streamed quantized from a store on disk.

Tiny budgets force layers off the device; each test checks which layers moved and how many bytes (the quantized
bytes the pool packs, 2-4x fewer than fp32's), and that logits and greedy tokens equal the same quantized model
all in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.loading.config import load_config
from energon_infer.loading.quantization import QuantSpec, meta_quantize
from energon_infer.worker.disk_pool import _meta_stage, install_tiered_pool, plan_tiers, pool_snapshot
from energon_infer.worker.memory_pool import MemoryPoolConfig, stage_layer_bytes
from energon_infer.worker.quantized_pool import (
    apply_quantized_pool,
    packed_layer_bytes,
    quantized_store_dir,
    store_buffer_bytes,
)
from tests.energon_infer.tiny import PROMPTS, save_tiny
from tests.helpers.runif import RunIf
from tightfit.planner.pool import PoolInfeasibleError, plan_pool
from tightfit.profiler.types import DiskProfile

pytest.importorskip("torchao", reason="quantization needs torchao (scripts/setup.sh installs it)")

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SPECS = [("int8", None), ("int4", 32)]
WIDE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4)  # int4 groups of 32 tile every width
# Groups of 128 (int4) and widths of 128 (int8): where an int8-activation kernel reads their tiles (int4: AVX2 or
# AVX-512 VNNI; int8: AVX-512 VNNI) the projections are held (and stored) in tile_int4 / tile_int8's order.
WIDE128 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4)
# Packed bytes per layer / fp32 bytes per layer at most (int8: 1 byte + a row scale per 4; int4: 0.75 per 4).
RATIO = {"int8": 0.3, "int4": 0.2}


def _opts(method: str, group: int | None) -> dict:
    return dict(progress=False, block_size=4, packed_weights=False, quantization=method, group_size=group)


def _disk(path) -> DiskProfile:
    return DiskProfile(path=str(path), free_bytes=10**12, read_fit=(1e-4, 2e9))


def _fp32_layers(path) -> list[int]:
    return stage_layer_bytes(_meta_stage(load_config(path), 1, 1, 0, torch.float32))[0]


def _same_as_in_memory(runner: ModelRunner, ref: ModelRunner) -> None:
    items = list(enumerate(PROMPTS))
    assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    for r in (runner, ref):  # the next comparison starts these sequences afresh
        for seq_id, _ in items:
            r.free(seq_id)
    assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(save_tiny("llama", tmp_path_factory.mktemp("qpool") / "m", **WIDE))


@pytest.mark.parametrize("method,group", SPECS)
def test_host_pool_holds_and_moves_quantized_layers_and_equals_the_in_memory_model(llama, method, group):
    ref = ModelRunner.from_pretrained(llama, **_opts(method, group))
    runner = ModelRunner.from_pretrained(llama, **_opts(method, group))
    layers, resident = packed_layer_bytes(runner.stage)
    held = runner.layer_bytes()  # the quantized tensors' bytes; packing pads each to 64 bytes
    assert all(0 <= p - h < 64 * 16 for p, h in zip(layers, held))
    fp32 = _fp32_layers(llama)
    assert all(p <= RATIO[method] * f for p, f in zip(layers, fp32))
    # Three layers' bytes beside the resident ones: pooling 3 of 4 leaves one kept layer and two slots.
    budget = resident + 3 * max(layers)
    pool, plan = apply_quantized_pool(runner, MemoryPoolConfig(device_budget=budget, lookahead=1))
    assert plan.pooled == (0, 1, 2) and plan.device_bytes <= budget
    assert plan.pool_bytes == pool.pool_bytes == sum(layers[:3])
    assert pool.slot_bytes == 2 * max(layers)
    with pytest.raises(PoolInfeasibleError):  # counted in fp32 the same budget holds not even the slots
        plan_pool(fp32, resident_bytes=resident, budget_bytes=budget, lookahead=1)
    for i in plan.pooled:  # held in the pool only: the block's own tensors are meta placeholders
        assert runner.stage.layers[str(i)].qkv.qweight.device.type == "meta"
    _same_as_in_memory(runner, ref)
    assert pool.copies >= 3
    pool.close()


def _tiered(path, method, group, memory_budget, device="cpu", **kw):
    config = MemoryPoolConfig(memory_budget=memory_budget, disk=_disk(path), lookahead=1, **kw)
    spec = QuantSpec(method=method, group_size=group)
    plan = plan_tiers(path, load_config(path), tp=1, pp=1, dtype="float32", device_type=device, config=config,
                      quant=spec)[0]
    runner = ModelRunner.from_pretrained(path, offload=plan.disk_layers, **_opts(method, group))
    return runner, install_tiered_pool(runner, plan, config, path), plan


def _unified_budget(path, method, group, keep: int) -> tuple[int, list[int]]:
    stage = ModelRunner.from_pretrained(path, **_opts(method, group)).stage
    layers, resident = packed_layer_bytes(stage)
    return resident + store_buffer_bytes(layers, 2) + (keep + 2) * max(layers), layers


@pytest.mark.parametrize("method,group,dims", [(m, g, WIDE) for m, g in SPECS] + [("int4", 128, WIDE128),
                                                                                  ("int8", None, WIDE128)])
def test_disk_tier_streams_the_quantized_store_and_equals_the_in_memory_model(tmp_path, method, group, dims):
    path = save_tiny("llama", tmp_path / "m", shard="40KB", **dims)
    ref = ModelRunner.from_pretrained(path, **_opts(method, group))
    budget, layers = _unified_budget(path, method, group, keep=1)
    runner, pool, plan = _tiered(path, method, group, budget)
    assert plan.disk_layers == (0, 1, 2) and plan.device_bytes + plan.host_bytes <= budget
    for i in plan.disk_layers:  # never loaded, never held: read from the store into a slot each pass
        assert runner.stage.layers[str(i)].qkv.qweight.device.type == "meta"
    # The bytes per pass are the quantized layers', 2-4x (here 3.4x and more) fewer than fp32's.
    fp32 = _fp32_layers(path)
    assert plan.disk_bytes == sum(layers[i] for i in plan.disk_layers)
    assert plan.disk_bytes <= RATIO[method] * sum(fp32[i] for i in plan.disk_layers)
    _same_as_in_memory(runner, ref)
    snap = pool_snapshot(pool, plan)
    assert snap["disk_layers"] == [0, 1, 2] and snap["disk_layers_written"] == 3
    assert snap["disk_layer_bytes"] == {i: layers[i] for i in plan.disk_layers}
    assert snap["disk_bytes_read"] == sum(n * layers[i] for i, n in snap["disk_reads"].items())
    passes = 2 + GREEDY.max_tokens  # two forwards, then a prefill and 4 decode steps
    assert all(passes <= snap["disk_reads"][i] + 1 <= passes + 2 for i in plan.disk_layers)
    store = snap["disk_store"]
    assert store.startswith(str(path / ".tightfit-quantized" / f"{method}{f'-g{group}' if group else ''}-float32"))
    pool.close()
    # The next load reuses the store: nothing is quantized or written again, the same logits.
    runner, pool, plan = _tiered(path, method, group, budget)
    assert pool_snapshot(pool, plan)["disk_layers_written"] == 0
    _same_as_in_memory(runner, ref)
    pool.close()
    # A checkpoint file that changed (its modification time) makes the next load rewrite the store.
    shard = sorted(path.glob("*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    runner, pool, plan = _tiered(path, method, group, budget)
    assert pool_snapshot(pool, plan)["disk_layers_written"] == 3
    _same_as_in_memory(runner, ref)
    pool.close()


def test_disk_tier_at_the_defaults_equals_the_in_memory_model(tmp_path):
    """At the defaults (packed_weights on, weights wide enough for the real size rule to pack them) a quantized
    model holds no packed copy (its head is quantized too), and the quantized layers streamed from the store give
    the in-memory model's logits bit for bit."""
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "m", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512,
                              vocab=600, max_positions=64)
    opts = dict(progress=False, block_size=4, quantization="int8")  # packed_weights left at its default
    ref = ModelRunner.from_pretrained(path, **opts)
    layers, resident = packed_layer_bytes(ref.stage)
    budget = resident + store_buffer_bytes(layers, 2) + 3 * max(layers)  # one layer kept, two slots
    config = MemoryPoolConfig(memory_budget=budget, disk=_disk(path), lookahead=1)
    plan = plan_tiers(path, load_config(path), tp=1, pp=1, dtype="float32", device_type="cpu", config=config,
                      quant=QuantSpec(method="int8"))[0]
    runner = ModelRunner.from_pretrained(path, offload=plan.disk_layers, **opts)
    pool = install_tiered_pool(runner, plan, config, path)
    assert plan.disk_layers == (0, 1, 2)
    for r in (ref, runner):
        assert r.runtime.packed_weights and r.stage.lm_head.quant == "int8"
        assert all(getattr(m, "packed", None) is None for m in r.stage.modules())
    _same_as_in_memory(runner, ref)
    pool.close()


def test_the_store_records_what_it_was_made_from_in_the_directory_given(tmp_path, llama):
    spec = QuantSpec(method="int4", group_size=32)
    budget, _ = _unified_budget(llama, "int4", 32, keep=1)
    given = tmp_path / "qstore"
    runner, pool, plan = _tiered(llama, "int4", 32, budget, quantized_dir=str(given))
    assert plan.disk_layers == (0, 1, 2)
    root = quantized_store_dir(llama, str(given), spec, "float32", 1, 1)
    assert pool_snapshot(pool, plan)["disk_store"] == str(root / "rank0")
    manifest = json.loads(bytes(pool.packed[0].store.get("manifest").numpy()).decode())
    assert manifest["method"] == "int4" and manifest["group_size"] == 32 and manifest["tp"] == 1
    assert set(manifest["files"]) == {p.name for p in Path(llama).glob("*.safetensors")}
    pool.close()
    # Another group size or method: another store, never the same bytes read as another format.
    assert quantized_store_dir(llama, str(given), QuantSpec(method="int4", group_size=64), "float32", 1, 1) != root
    assert quantized_store_dir(llama, str(given), QuantSpec(method="int8"), "float32", 1, 1) != root


def test_a_gpu_plan_keeps_quantized_layers_on_the_host_and_the_rest_on_disk(tmp_path, llama):
    """A plan for a GPU (device and host apart) with a host budget for one layer: that layer is held quantized in
    host memory and the others stream from the store; applied here on the CPU, against the in-memory model."""
    ref = ModelRunner.from_pretrained(llama, **_opts("int4", 32))
    layers, resident = packed_layer_bytes(ref.stage)
    host = store_buffer_bytes(layers, 2) + 3 * max(layers)  # one host layer + the two staging slots
    runner, pool, plan = _tiered(llama, "int4", 32, resident + 2 * max(layers), host_budget=host,
                                 quantized_dir=str(tmp_path / "q"), device="cuda")
    assert plan.pooled == (0, 1, 2, 3) and sorted(plan.tiers) == ["disk", "disk", "disk", "host"]
    host_layer = plan.pooled[plan.tiers.index("host")]
    assert pool.pool_bytes == layers[host_layer]  # held on the host quantized: its packed bytes
    _same_as_in_memory(runner, ref)
    assert set(pool_snapshot(pool, plan)["disk_layers"]) == set(plan.disk_layers)
    pool.close()


def test_engine_from_the_serve_flags_serves_quantized_beyond_its_budget(tmp_path):
    """`tightfit serve DIR --quantization int4 --group-size 32 --memory-budget N`: the engine those flags build
    streams quantized layers and its memory report says what each layer holds and what was read."""
    from energon_infer.engine.engine import Engine
    from energon_infer.serving.serve import _memory_pool, build_parser

    path = save_tiny("llama", tmp_path / "m", shard=None, **WIDE)
    ref = ModelRunner.from_pretrained(path, **_opts("int4", 32))
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    budget, layers = _unified_budget(path, "int4", 32, keep=0)
    args = build_parser().parse_args([str(path), "--quantization", "int4", "--group-size", "32", "--memory-budget",
                                      str(budget), "--lookahead", "1", "--quantized-dir", str(tmp_path / "q")])
    pool = _memory_pool(args.memory_pool, args.memory_budget, args.host_budget, args.lookahead,
                        quantized_dir=args.quantized_dir)
    pool = MemoryPoolConfig(**{**{f: getattr(pool, f) for f in pool.__slots__}, "disk": _disk(path)})
    with Engine.from_pretrained(path, memory_pool=pool, quantization=args.quantization, group_size=args.group_size,
                                progress=False, threads_per_worker=1, block_size=4, packed_weights=False,
                                kv_cache_tokens=512) as engine:
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        rank = engine.memory_report()["ranks"][0]
    assert got == want
    assert rank["weights"] == "int4 (group 32)"
    assert rank["tiers"] == {i: "disk" for i in range(len(layers))}
    assert rank["layer_bytes"] == dict(enumerate(ref.layer_bytes()))  # what each layer holds: its quantized bytes
    assert rank["disk_layer_bytes"] == dict(enumerate(layers))  # and as the store holds and streams it
    assert rank["disk_bytes_read"] == sum(n * layers[i] for i, n in rank["disk_reads"].items()) > 0
    assert rank["disk_store"].startswith(str(tmp_path / "q"))


def test_engine_pools_a_quantized_model_in_host_memory(llama):
    from energon_infer.engine.engine import Engine

    ref = ModelRunner.from_pretrained(llama, **_opts("int8", None))
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    with Engine.from_pretrained(llama, memory_pool=0.5, quantization="int8", progress=False, threads_per_worker=1,
                                block_size=4, packed_weights=False, kv_cache_tokens=512) as engine:
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        pool = engine.worker_info[0]["pool"]
    assert got == want
    layers, _ = packed_layer_bytes(ref.stage)
    assert pool["pooled"] == [0, 2] and pool["pool_bytes"] == layers[0] + layers[2]


def _tp2_quantized(rank: int, world: int, path: str, budget: int, store: str) -> dict:
    from energon_infer.worker.runtime import RuntimeConfig
    from energon_infer.worker.workers import ModelSource, load_worker

    pool = MemoryPoolConfig(memory_budget=budget, disk=_disk(path), lookahead=1, quantized_dir=store)
    runtime = RuntimeConfig(tp=2, **_opts("int4", 32))
    runner, timer, info = load_worker(ModelSource("pretrained", path), runtime, pool, rank)
    return {"gen": [g.token_ids for g in runner.generate(PROMPTS, GREEDY)], "stats": timer.snapshot(),
            "layer_bytes": list(info.layer_bytes)}


@RunIf(min_world=2)
def test_tp2_ranks_stream_their_own_quantized_slices(tmp_path, llama):
    """Each rank quantizes and stores only its slice (int4 groups never straddle ranks, so tp=2 holds exactly the
    values tp=1 holds): the greedy tokens of the in-memory quantized model, half the bytes per rank."""
    from tests.helpers.multiprocess import run_distributed

    ref = ModelRunner.from_pretrained(llama, **_opts("int4", 32))
    want = [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    full, _ = packed_layer_bytes(ref.stage)
    half = _meta_stage(load_config(llama), 2, 1, 0, torch.float32)  # one rank's stage, quantized on meta
    meta_quantize(half.layers.values(), QuantSpec(method="int4", group_size=32))
    layers, resident = packed_layer_bytes(half)
    budget = resident + store_buffer_bytes(layers, 2) + 3 * max(layers)  # one layer kept, two slots
    out = run_distributed(_tp2_quantized, 2, args=(llama, budget, str(tmp_path / "q")))
    for rank, r in enumerate(out):
        st = r["stats"]
        assert r["gen"] == want
        assert st["disk_layers"] and st["disk_store"].endswith(f"int4-g32-float32-tp2-pp1/rank{rank}")
        assert st["disk_layers_written"] == len(st["disk_layers"])
        assert st["disk_layers"] == [0, 1, 2] and st["disk_layer_bytes"] == {i: layers[i] for i in range(3)}
        assert all(b < 0.75 * full[i] for i, b in st["disk_layer_bytes"].items())  # this rank's slice only


def test_docs_quantized_weights_beyond_memory_snippet_runs(tmp_path):
    """docs/energon-memory.md's "Quantized weights beyond memory" block, as a script (its engine spawns a worker)."""
    from tests.helpers.docs import python_block, run_script

    out = run_script(python_block("docs/energon-memory.md", "Quantized weights beyond memory"), tmp_path)
    assert "int4 (group 64)" in out.stdout and "'disk'" in out.stdout and ".tightfit-quantized" in out.stdout
    assert (tmp_path / "model-q" / ".tightfit-quantized").is_dir()
