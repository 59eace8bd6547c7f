"""The memory pool's disk tier: layers read from the checkpoint's own safetensors files, exactly, and only those.

Tiny budgets force layers onto disk; each test checks which layers were read and how many bytes, and that
logits and greedy tokens equal the all-in-RAM runtime (GPT-2, OPT and LLaMA/GQA checkpoints, sharded and
not, at tp=1, and an engine at tp=2 over gloo).
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.loading.config import load_config
from energon_infer.loading.safetensors_files import CheckpointChangedError, TensorFiles, read_header
from energon_infer.loading.weights import WeightError
from energon_infer.worker.disk_pool import install_tiered_pool, plan_tiers, pool_snapshot
from energon_infer.worker.memory_pool import MemoryPoolConfig, apply_memory_pool, stage_layer_bytes
from tests.energon_infer.tiny import PROMPTS, save_tiny
from tests.helpers.runif import RunIf
from tightfit.kernels.packed_linear import packed_linear, packing_available
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.planner.tiers import disk_seconds
from tightfit.profiler.types import DiskProfile

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
OPTS = dict(progress=False, block_size=4, packed_weights=False)  # F.linear everywhere: bitwise comparisons


def _disk(path) -> DiskProfile:
    return DiskProfile(path=str(path), free_bytes=10**12, read_fit=(1e-4, 2e9))


def _budget(path, keep: int, *, lookahead: int = 1, threads: int = 2, tp: int = 1, pp: int = 1
            ) -> tuple[int, list[int], int]:
    """A unified (CPU) budget that holds the resident weights, ``keep`` layers, the slots and the read buffers
    (of the largest stage at ``pp`` > 1); with it that stage's layers and resident bytes."""
    from energon_infer.loading.safetensors_files import TensorFiles
    from energon_infer.worker.disk_pool import _meta_stage, read_buffer_bytes

    cfg = load_config(path)
    files = TensorFiles(path)
    best = (0, [], 0)
    for s in range(pp):
        stage = _meta_stage(cfg, tp, pp, s, torch.float32)
        layers, resident = stage_layer_bytes(stage)
        buffers = read_buffer_bytes(stage, cfg, files) * threads
        best = max(best, (resident + buffers + (keep + lookahead + 1) * max(layers), layers, resident))
    files.close()
    return best


def _tiered(path, memory_budget, opts=OPTS, **kw):
    cfg = load_config(path)
    config = MemoryPoolConfig(memory_budget=memory_budget, disk=_disk(path), lookahead=1, **kw)
    plan = plan_tiers(path, cfg, tp=1, pp=1, dtype="float32", device_type="cpu", config=config)[0]
    runner = ModelRunner.from_pretrained(path, offload=plan.disk_layers, **opts)
    return runner, install_tiered_pool(runner, plan, config, path), plan


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_disk_layers_stream_from_the_checkpoint_and_equal_the_loaded_model(tmp_path, family):
    depth = {"gpt2": {"n_layer": 5}}.get(family, {"num_hidden_layers": 5})
    path = save_tiny(family, tmp_path / family, shard="40KB" if family == "llama" else None, **depth)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    budget, layers, _ = _budget(path, keep=1)
    runner, pool, plan = _tiered(path, budget)
    n = len(layers)
    assert plan.disk_layers and len(plan.disk_layers) == n - 1 and plan.tier_of(plan.disk_layers[0]) == "disk"
    for i in plan.disk_layers:  # never loaded: the block's parameters are placeholders on the meta device
        assert runner.stage.layers[str(i)].qkv.weight.device.type == "meta"
    items = list(enumerate(PROMPTS))
    assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    gen = [g.token_ids for g in runner.generate(PROMPTS, GREEDY)]
    assert gen == [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    snap = pool_snapshot(pool, plan)
    passes = 1 + GREEDY.max_tokens  # the forward, one prefill step and 4 decode steps (the last token is not fed)
    assert snap["disk_layers"] == list(plan.disk_layers)
    for i in plan.disk_layers:  # each disk layer once per pass, plus at most the prefetch for the next one
        assert passes <= snap["disk_reads"][i] + 1 <= passes + 1 + 1
    assert snap["disk_bytes_read"] == sum(snap["disk_reads"][i] * layers[i] for i in plan.disk_layers)
    assert plan.disk_bytes == sum(layers[i] for i in plan.disk_layers)
    pool.close()


@pytest.mark.skipif(not packing_available(), reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_pooled_layers_at_the_defaults_equal_the_loaded_model(tmp_path, tier, monkeypatch):
    """At the defaults the loaded model multiplies by oneDNN-packed copies of its projection weights; a layer that
    moves (host pool) or is read from disk keeps no copy but must run the same products on its plain weights, so
    its logits are bit-equal too. The weights are wide enough that the real size rule packs them (the tiny models'
    are not)."""
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "m", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512,
                              vocab=600, max_positions=256)
    opts = dict(progress=False, block_size=4)  # packed_weights left at its default
    ref = ModelRunner.from_pretrained(path, **opts)
    block = ref.stage.layers["0"]
    assert all(m.packed is not None for m in (block.qkv, block.o, block.up, block.down, ref.stage.lm_head))
    if tier == "host":
        runner = ModelRunner.from_pretrained(path, **opts)
        pool, plan = apply_memory_pool(runner, MemoryPoolConfig(fraction=0.5, lookahead=1))
    else:
        runner, pool, plan = _tiered(path, _budget(path, keep=1)[0], opts=opts)
        assert len(plan.disk_layers) == 3
    moved = [runner.stage.layers[str(i)] for i in plan.pooled]
    assert moved and all(m.plain_packed and m.packed is None for b in moved for m in (b.qkv, b.o, b.up, b.down))
    plain: list[int] = []

    def recording(x, weight, *args, **kwargs):  # which path ran: the packed product on a plain weight
        if not weight.is_mkldnn:
            plain.append(weight.numel())
        return packed_linear(x, weight, *args, **kwargs)

    monkeypatch.setattr("energon_infer.parallel.packed_linear", recording)
    # A 70-token prompt: the out projection (256 x 256) takes the packed product from SMALL_MIN_ROWS (64) rows.
    prompts = [*PROMPTS, list(range(100, 170))]
    items = list(enumerate(prompts))
    assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    # Each moved layer's four projections once (the step has 130 rows), the out projection (65536 elements) too.
    assert sorted(plain) == sorted([256 * 512, 256 * 256, 256 * 1024, 512 * 256] * len(moved))
    plain.clear()
    for rows in (1, 2, 5):  # decode-sized steps: one row runs F.linear on both sides, more the packed product
        step = [(100 + i, [7 + i]) for i in range(rows)]
        assert torch.equal(runner.forward(step), ref.forward(step))
    assert len(plain) == 2 * 3 * len(moved)  # the 2- and 5-row steps: all but the out projection
    gen = [g.token_ids for g in runner.generate(prompts, GREEDY)]
    assert gen == [g.token_ids for g in ref.generate(prompts, GREEDY)]
    pool.close()


def test_plan_prices_the_reads_with_the_given_disk_and_fits_the_budget(tmp_path):
    path = save_tiny("llama", tmp_path / "m", shard=None, num_hidden_layers=5)
    budget, layers, resident = _budget(path, keep=1)
    _, pool, plan = _tiered(path, budget)
    assert len(plan.disk_layers) == 4
    disk = _disk(path)
    assert plan.io_seconds == pytest.approx(sum(disk_seconds(disk, layers[i]) for i in plan.disk_layers))
    assert plan.device_bytes + plan.host_bytes <= budget
    assert plan.io_roofline(32) == pytest.approx(32 / plan.io_seconds)
    pool.close()
    with pytest.raises(PlanInfeasibleError, match="raise the budget") as err:
        _tiered(path, resident // 2)
    assert err.value.tier == "device" and err.value.budget_bytes == resident // 2


def test_a_checkpoint_changed_under_the_pool_is_refused_naming_the_file(tmp_path):
    path = save_tiny("llama", tmp_path / "m", shard=None)
    budget, _, _ = _budget(path, keep=0)
    runner, pool, plan = _tiered(path, budget)
    runner.forward([(0, PROMPTS[0])])
    file = path / "model.safetensors"
    st_ = file.stat()
    os.utime(file, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # same bytes, new mtime: refused all the same
    with pytest.raises(CheckpointChangedError, match=r"model\.safetensors changed .*mtime.*restart the engine"):
        runner.forward([(1, PROMPTS[1])])
    pool.close()


def _header_file(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(0, 5), max_size=3), dtype=st.sampled_from(["F32", "F16", "BF16", "I64"]),
       extra=st.integers(-3, 3), begin=st.integers(0, 8))
def test_headers_are_checked_against_the_file(tmp_path, shape, dtype, extra, begin):
    """A header whose offsets do not hold exactly the tensor's bytes inside the file raises WeightError naming
    it; a correct one reads back what was written."""
    size = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}[dtype]
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * size
    end = begin + nbytes + extra
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}}).encode()
    file = tmp_path / "x.safetensors"
    _header_file(file, header, bytes(range(256)) * (1 + (begin + nbytes) // 256))
    data_len = len(bytes(range(256)) * (1 + (begin + nbytes) // 256))
    if extra != 0 or end > data_len or end < begin:
        with pytest.raises(WeightError, match=r"x\.safetensors is not a valid safetensors file"):
            read_header(file)
        return
    ext = read_header(file)["t"]
    assert ext.shape == tuple(shape) and ext.nbytes == nbytes and ext.start == 8 + len(header) + begin


@pytest.mark.parametrize("blob", [b"", b"\x01\x02", struct.pack("<Q", 10**12) + b"{}", struct.pack("<Q", 4) + b"[1]x",
                                  struct.pack("<Q", 2) + b"{", struct.pack("<Q", 30) + b'{"t": {"dtype": "F32"}}      '])
def test_garbage_headers_raise_weight_error(tmp_path, blob):
    file = tmp_path / "model.safetensors"
    file.write_bytes(blob)
    with pytest.raises(WeightError, match="model.safetensors is not a valid safetensors file"):
        read_header(file)


def test_rows_of_a_tensor_are_read_by_byte_range(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(6, 5)
    save_file({"w": w, "b": torch.arange(3, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    files = TensorFiles(tmp_path)
    assert torch.equal(files.read("w", (2, 4)), w[2:4]) and torch.equal(files.read("w"), w)
    assert files.read("b").tolist() == [0, 1, 2]
    files.close()


def _direct_checkpoint(where) -> tuple[dict[str, torch.Tensor], object]:
    """Tensors whose byte ranges start and end off the 4 KiB blocks (and one spanning the file's last block)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 7), "w": torch.randn(300, 37), "z": torch.randn(1001)}
    where.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(where / "model.safetensors"))
    return tensors, where


def test_direct_reads_bypass_the_page_cache_and_equal_buffered_reads(tmp_path):
    from tightfit.storage import ALIGN as DIRECT_ALIGN
    from tightfit.storage import direct_buffer_bytes

    tensors, path = _direct_checkpoint(tmp_path / "m")
    files = TensorFiles(path, direct=True)
    if not files.direct:
        files.close()
        pytest.skip(f"{tmp_path} is on a filesystem without O_DIRECT")
    buf = torch.empty(direct_buffer_bytes(max(t.numel() * 4 for t in tensors.values())), dtype=torch.uint8)
    for start in (0, 1, 7):  # the caller's buffer at any address: the read aligns inside it
        for name, t in tensors.items():
            got = files.read(name, out=buf[start:])
            assert torch.equal(got, t) and got.data_ptr() - buf.data_ptr() >= start
            assert (got.data_ptr() - files.extents[name].start) % DIRECT_ALIGN == 0
        assert torch.equal(files.read("w", (123, 201), out=buf[start:]), tensors["w"][123:201])
    assert files.direct_reads == 12 and files.buffered_reads == 0
    small = torch.empty(4 * 37 * 4, dtype=torch.uint8)  # a buffer without the slack: read buffered
    assert torch.equal(files.read("w", (5, 9), out=small), tensors["w"][5:9]) and files.buffered_reads == 1
    files.close()


def test_direct_reads_fall_back_to_buffered_where_the_filesystem_refuses(tmp_path, monkeypatch):
    """No filesystem here refuses O_DIRECT (this kernel's tmpfs takes it too), so the refusal is the one
    os.open gives on such a filesystem (EINVAL); the reads must then be buffered and still exact."""
    import errno

    from tightfit.storage import direct_buffer_bytes

    tensors, path = _direct_checkpoint(tmp_path / "m")
    real_open = os.open

    def refusing_open(file, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(file))
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    files = TensorFiles(path, direct=True)
    assert not files.direct
    buf = torch.empty(direct_buffer_bytes(300 * 37 * 4), dtype=torch.uint8)
    assert all(torch.equal(files.read(n, out=buf), t) for n, t in tensors.items())
    assert files.direct_reads == 0 and files.buffered_reads == 3
    files.close()


def test_engine_serves_beyond_its_budget_and_reports_the_disk_tier(tmp_path):
    from energon_infer.engine.engine import Engine

    path = save_tiny("llama", tmp_path / "m", shard=None)
    budget, layers, resident = _budget(path, keep=0)
    # At the defaults (packed_weights on): test_pooled_layers_at_the_defaults_equal_the_loaded_model checks the
    # logits of weights wide enough to pack; this model's are not, so its workers run what the reference runs.
    ref = [g.token_ids for g in ModelRunner.from_pretrained(path, progress=False, block_size=4).generate(PROMPTS, GREEDY)]
    pool = MemoryPoolConfig(memory_budget=budget, disk=_disk(path), lookahead=1)
    with Engine.from_pretrained(path, memory_pool=pool, progress=False, threads_per_worker=1, block_size=4,
                                kv_cache_tokens=512) as engine:
        out = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        report = engine.memory_report()
        metrics = engine.render_metrics()
        file = path / "model.safetensors"
        file.write_bytes(file.read_bytes() + b"\0")  # the checkpoint grows under the server
        from energon_infer.engine.controller import WorkerFailedError

        with pytest.raises(WorkerFailedError, match=r"CheckpointChangedError: .*model\.safetensors changed"):
            engine.generate([PROMPTS[0]], GREEDY)
        assert engine.health()["status"] == "failed" and "model.safetensors" in engine.health()["last_error"]
    assert out == ref
    rank = report["ranks"][0]
    assert [rank["tiers"][i] for i in range(len(layers))] == ["disk"] * len(layers)
    assert rank["disk_layers"] == list(range(len(layers))) and rank["disk_bytes_read"] > 0
    assert rank["disk_bytes_read"] == sum(n * layers[i] for i, n in rank["disk_reads"].items())
    assert report["io_roofline_tokens_per_s"] == pytest.approx(report["mean_batch"] / rank["io_seconds"])
    assert report["tokens_per_s"] > 0 and "energon_pool_io_roofline_tokens_per_s" in metrics
    with pytest.raises(PlanInfeasibleError, match="device budget|needs at least") as err:
        Engine.from_pretrained(path, memory_pool=MemoryPoolConfig(memory_budget=resident // 4, disk=_disk(path)),
                               progress=False)
    assert err.value.tier == "device"


def _tp2_reads(rank: int, world: int, path: str, budget: int, tp: int = 2, pp: int = 1, disk_vocab=()) -> dict:
    from energon_infer.worker.runtime import RuntimeConfig
    from energon_infer.worker.workers import ModelSource, load_worker

    pool = MemoryPoolConfig(memory_budget=budget, disk=_disk(path), lookahead=1, disk_vocab=disk_vocab)
    runner, timer, info = load_worker(ModelSource("pretrained", path), RuntimeConfig(tp=tp, pp=pp, **OPTS), pool, rank)
    gen = [g.token_ids for g in runner.generate(PROMPTS, GREEDY)]
    return {"gen": gen, "stats": timer.snapshot(), "plan": info.pool.plan}


@RunIf(min_world=2)
def test_tp2_ranks_read_only_their_slices_and_equal_the_loaded_model(tmp_path):
    from tests.helpers.multiprocess import run_distributed

    path = save_tiny("llama", tmp_path / "m", shard="40KB")
    ref = [g.token_ids for g in ModelRunner.from_pretrained(path, **OPTS).generate(PROMPTS, GREEDY)]
    _, layers, _ = _budget(path, keep=0)
    budget, _, _ = _budget(path, keep=0, tp=2)
    out = run_distributed(_tp2_reads, 2, args=(str(path), budget))
    assert out[0]["gen"] == ref and out[1]["gen"] == ref
    assert out[0]["plan"] == out[1]["plan"]  # decided once, on rank 0
    full_layer = layers[0]
    for r in out:
        st_ = r["stats"]
        reads = sum(st_["disk_reads"].values())
        assert st_["disk_layers"] and reads > 0
        # Each rank reads its half of q/k/v, gate/up (column-parallel rows) and all of o/down: less than a layer.
        assert st_["disk_bytes_read"] < reads * full_layer


def test_docs_serving_beyond_memory_snippet_runs(tmp_path):
    """docs/energon-memory.md's "Serving a model larger than memory" block, as a script (its engine spawns a worker
    that imports it)."""
    from tests.helpers.docs import python_block, run_script

    out = run_script(python_block("docs/energon-memory.md", "Serving a model larger than memory"), tmp_path)
    assert "'disk'" in out.stdout and "I/O roofline" in out.stdout


@RunIf(min_world=2)
def test_pp2_stages_each_stream_their_own_layers_and_equal_the_loaded_model(tmp_path):
    from tests.helpers.multiprocess import run_distributed

    path = save_tiny("llama", tmp_path / "m", shard="40KB", num_hidden_layers=6)
    ref = [g.token_ids for g in ModelRunner.from_pretrained(path, **OPTS).generate(PROMPTS, GREEDY)]
    budget, _, _ = _budget(path, keep=0, pp=2)
    out = run_distributed(_tp2_reads, 2, args=(str(path), budget, 1, 2))
    assert out[0]["gen"] == ref and out[1]["gen"] == ref
    # Stage 0 holds layers 0-2, stage 1 layers 3-5: each reads only its own (model layer numbers).
    assert out[0]["stats"]["disk_layers"] == [0, 1, 2] and out[1]["stats"]["disk_layers"] == [3, 4, 5]


def test_serve_flags_build_the_tiered_pool():
    from energon_infer.serving.serve import _memory_pool, build_parser

    args = build_parser().parse_args(["dir", "--memory-budget", "2GiB", "--host-budget", "8GiB", "--lookahead", "3"])
    pool = _memory_pool(args.memory_pool, args.memory_budget, args.host_budget, args.lookahead)
    assert pool.tiered and pool.memory_budget == 2 * 2**30 and pool.host_budget == 8 * 2**30 and pool.lookahead == 3
    assert _memory_pool("0.5") == MemoryPoolConfig(fraction=0.5)
    with pytest.raises(ValueError, match="not both"):
        _memory_pool("0.5", "2GiB")
    with pytest.raises(ValueError, match="needs --memory-budget"):
        _memory_pool(None, None, "8GiB")
    with pytest.raises(ValueError, match="device_budget .* or memory_budget"):
        MemoryPoolConfig(device_budget="1GiB", memory_budget="1GiB")


@RunIf(min_world=2)
def test_pp2_engine_streaming_from_disk_runs_one_group_per_pass(tmp_path):
    """The plan's policy (streaming_groups): with disk layers one group of requests is in flight, so each pass of
    reads serves the whole running batch; outputs still equal the loaded model's."""
    from energon_infer.engine.engine import Engine

    path = save_tiny("llama", tmp_path / "m", shard=None, num_hidden_layers=6)
    ref = [g.token_ids for g in ModelRunner.from_pretrained(path, **OPTS).generate(PROMPTS, GREEDY)]
    budget, _, _ = _budget(path, keep=0, pp=2)
    pool = MemoryPoolConfig(memory_budget=budget, disk=_disk(path), lookahead=1)
    with Engine.from_pretrained(path, memory_pool=pool, pp=2, progress=False, threads_per_worker=1, block_size=4,
                                packed_weights=False, kv_cache_tokens=512) as engine:
        assert engine.groups == 1 and engine.scheduler.config.groups == 1
        out = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        report = engine.memory_report()
    assert out == ref
    assert [r["disk_layers"] for r in report["ranks"]] == [[0, 1, 2], [3, 4, 5]]
    with Engine.from_pretrained(path, pp=2, progress=False, threads_per_worker=1, block_size=4,
                                kv_cache_tokens=512) as engine:
        assert engine.groups == 2  # nothing streamed: one group per stage (the non-blocking pipeline)
