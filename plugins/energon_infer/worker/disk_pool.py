"""The memory pool's disk tier: layers streamed from the checkpoint's own safetensors files on every pass.

With ``MemoryPoolConfig(memory_budget=...)`` the pool is planned over three tiers by
:func:`tightfit.planner.pool.plan_pool` (core): from each stage's per-layer bytes (measured on a meta copy
of the stage), the bytes that always stay (embedding, head, norms, the read buffers), the budgets and the
measured disk (:func:`tightfit.profiler.disk.profile_disk` of the model directory, cached per
filesystem). The plan is made once, on rank 0 (:func:`tightfit.distributed.decide_on_rank0`), for every
stage; each rank applies its stage's:

* layers the plan places on disk are never loaded: the runner builds them on the meta device
  (``ModelRunner(offload=...)``), and a :class:`DiskLayer` reads their bytes from the model directory
  (:class:`~energon_infer.loading.safetensors_files.TensorFiles`: by byte range through the store's
  :class:`~tightfit.storage.ExternalFile`, no conversion, no second copy on disk) straight into a prefetch slot
  of the :class:`~energon_infer.worker.memory_pool.LayerPool`, ``lookahead`` layers ahead, on ``io_threads``
  threads of the store's :class:`~tightfit.storage.IOEngine`, so the reads overlap the compute of the layers
  before; a tensor-parallel rank reads only its own rows of each column-parallel weight;
* host-tier layers (on a GPU) are a fixed set the planner chose, packed in host memory as the peer pool
  does (a cyclic pass over the layers defeats an LRU cache: nothing is evicted at run time);
* every read batch checks the files' size and modification time first and last
  (:meth:`TensorFiles.check`): a checkpoint that changes under a running server stops it with
  :class:`~energon_infer.loading.safetensors_files.CheckpointChangedError` naming the file.

One pass of disk reads serves the whole running batch, so tokens/s grows with the batch until compute
binds: the plan's I/O roofline is ``batch / io_seconds`` (:meth:`PoolPlan.io_roofline`), and
:func:`pool_snapshot` reports the bytes actually read for the engine's metrics.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from energon_infer.loading.config import ModelConfig
from energon_infer.loading.quantization import QuantSpec, meta_quantize, quantize_head
from energon_infer.loading.safetensors_files import TensorFiles
from energon_infer.loading.weights import Part, available_bytes, build_param, hf_parts, source_order
from energon_infer.parallel import Grid, move_unpacked, split_layers
from energon_infer.worker.memory_pool import LayerPool, MemoryPoolConfig, SlotLayer, _view, stage_layer_bytes
from energon_infer.worker.model import DecoderStage
from energon_infer.worker.quantized_pool import (
    StoredLayer,
    install_quantized_pool,
    packed_layer_bytes,
    quantized_store_dir,
    store_buffer_bytes,
)
from energon_infer.worker.runtime_config import DTYPES
from tightfit.planner.pool import PoolPlan, plan_pool
from tightfit.profiler.types import DiskProfile
from tightfit.storage import IOCounters, StagingBuffers, Tally, direct_buffer_bytes

__all__ = ["DiskLayer", "plan_tiers", "stage_weights", "resolve_disk", "install_tiered_pool", "pool_snapshot", "read_buffer_bytes"]


class DiskLayer(SlotLayer):
    """A block whose parameters stay in the checkpoint files and are read into a slot each time it runs.

    Args:
        block: the block, its parameters on the meta device (never loaded).
        index: its layer number in the model (``layers.<index>.`` in the runtime's names).
        files: the checkpoint's tensors by byte range.
        cfg: the model; grid: this rank's place (which rows a column-parallel weight reads).
        scratch: the per-thread read buffers (the checkpoint's tensors pass through them).
        nonfinite: the first read checks the values as loading does (``"warn"``, ``"error"``, ``"ignore"``).
        prefix: the runtime's name of ``block`` with a trailing dot (default ``layers.<index>.``; an expert of an MoE
            layer is ``layers.<index>.moe.experts.<e>.``, :mod:`energon_infer.worker.expert_pool`).
    """

    def __init__(self, block: nn.Module, index: int, files: TensorFiles, cfg: ModelConfig, grid: Grid,
                 scratch: StagingBuffers, *, nonfinite: str = "warn", prefix: str | None = None):
        super().__init__(block)
        names = {id(p): n for n, p in block.named_parameters()}
        keys = set(files.keys())
        pre = f"layers.{index}." if prefix is None else prefix
        self.recipe = [(f"{pre}{names[id(p)]}", hf_parts(cfg, f"{pre}{names[id(p)]}", keys)) for p in self.params]
        missing = sorted({part.source for _, parts in self.recipe for part in parts if part.source not in keys})
        if missing:
            from energon_infer.loading.weights import WeightError

            raise WeightError(f"the checkpoint in {files.path} lacks {missing[:5]}, which layer {index} of this "
                              f"{cfg.model_type} config needs; check that config.json belongs to these weights")
        self.placeholders = list(self.params)  # already meta
        self.params = []
        self.index, self.files, self.cfg, self.grid, self.scratch = index, files, cfg, grid, scratch
        self.used = {files.extents[part.source].file for _, parts in self.recipe for part in parts}
        self.nonfinite = nonfinite
        self._last: tuple[tuple[str, Any], torch.Tensor] | None = None  # (source, rows) in the read buffer
        # Parameters filled grouped by the checkpoint tensor they come from: a fused tensor many parameters are
        # sliced from (gpt-oss's experts) is read once a fill, not once per parameter.
        self._order = source_order([parts for _, parts in self.recipe])
        self.io = IOCounters()  # one read per completed fill
        self._tally = Tally()  # bytes of the fill in progress

    def _fetch(self, part: Part, want: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...], bool]:
        ext, grid = self.files.extents[part.source], self.grid
        buf = self.scratch.get()
        if (part.split == "col" and part.transform is None and grid.tp > 1 and ext.shape
                and ext.shape[0] % grid.tp == 0):
            rows = ext.shape[0] // grid.tp  # this rank's rows only: a contiguous byte range
            t = self.files.read(part.source, (grid.tp_rank * rows, (grid.tp_rank + 1) * rows), out=buf)
            self._tally.bytes += t.numel() * t.element_size()
            self._last = None
            return t, ext.shape, True
        key = (part.source, part.rows)
        if self._last is not None and self._last[0] == key:
            t = self._last[1]  # GPT-2's fused c_attn feeds q, k and v: read once (still in the buffer)
        else:  # the whole tensor, or only the rows the part takes (a fused tensor's expert)
            t = self.files.read(part.source, part.rows, out=buf)
            self._tally.bytes += t.numel() * t.element_size()
            self._last = (key, t)
        if part.transform is not None:
            t = part.transform(t)
        return t, tuple(t.shape), False

    def fill(self, dst: torch.Tensor) -> None:
        nonfinite = self.nonfinite if self.io.totals.reads == 0 else "ignore"  # checked once, as loading does
        with self.io.reading() as self._tally:
            self.files.check(self.used)
            self._last = None
            for i in self._order:
                (_, _, off, shape, transposed), (name, parts) = self.entries[i], self.recipe[i]
                view = _view(dst[off: off + shape.numel()], shape, transposed)
                build_param(self.cfg, self.grid, name, tuple(shape), parts, self._fetch, nonfinite=nonfinite, out=view)
            self.files.check(self.used)  # changed while we read: these bytes may mix two versions


def resolve_disk(disk: Any, path: str | Path) -> DiskProfile:
    """The disk profile a plan uses: ``disk`` itself, a preset by name, or the model directory measured."""
    if isinstance(disk, DiskProfile):
        return disk
    usage = shutil.disk_usage(path)
    if isinstance(disk, str):
        from tightfit.profiler.disk_presets import disk_preset

        return disk_preset(disk, path=str(path), free_bytes=usage.free, total_bytes=usage.total)
    from tightfit.profiler.disk import profile_disk

    return profile_disk(path, quick=True, progress=False)


def _meta_stage(cfg: ModelConfig, tp: int, pp: int, stage: int, dtype: torch.dtype) -> DecoderStage:
    grid = Grid(tp=tp, pp=pp, stage=stage)
    return DecoderStage(cfg, grid, split_layers(cfg.n_layers, pp)[stage], dtype=dtype, device="meta")


def read_buffer_bytes(stage: nn.Module, cfg: ModelConfig, files: TensorFiles) -> int:
    """One I/O thread's read buffer: the largest checkpoint tensor a block of ``stage`` reads, with the slack a
    direct (``O_DIRECT``) read of it needs (:func:`~tightfit.storage.direct_buffer_bytes`)."""
    keys, largest = set(files.keys()), 0
    for name, _ in stage.named_parameters():
        if name.startswith("layers."):
            for part in hf_parts(cfg, name, keys):
                if part.source in files.extents:
                    ext = files.extents[part.source]
                    largest = max(largest, ext.nbytes if part.rows is None else
                                  (part.rows[1] - part.rows[0]) * ext.row_bytes)
    return direct_buffer_bytes(largest) if largest else 0


def stage_weights(path: str | Path, cfg: ModelConfig, *, tp: int, pp: int, dtype: str, io_threads: int,
                  quant: QuantSpec | None = None) -> list[tuple[DecoderStage, list[int], int, int]]:
    """Per stage ``(its meta copy, bytes of each layer as a pool holds it, bytes of everything else, the read
    buffers of io_threads)``: quantized bytes where ``quant`` (pure but for reading the checkpoint's headers)."""
    files = TensorFiles(path)
    try:
        out = []
        for s in range(pp):
            stage = _meta_stage(cfg, tp, pp, s, DTYPES[dtype])
            if quant is None:
                layers, resident = stage_layer_bytes(stage)
                buffers = read_buffer_bytes(stage, cfg, files) * io_threads
            else:
                meta_quantize(stage.layers.values(), quant)
                quantize_head(stage, quant)  # as load_quantized holds it
                layers, resident = packed_layer_bytes(stage)
                buffers = store_buffer_bytes(layers, io_threads)
            out.append((stage, layers, resident, buffers))
        return out
    finally:
        files.close()


def plan_tiers(path: str | Path, cfg: ModelConfig, *, tp: int, pp: int, dtype: str, device_type: str,
               config: MemoryPoolConfig, quant: QuantSpec | None = None) -> list[PoolPlan]:
    """Every stage's pool plan over device, host and disk (pure but for reading headers and the disk profile).

    On a CPU-only machine host and device are one memory (``unified``): ``memory_budget`` covers the
    stage's resident weights, kept layers, prefetch slots and read buffers, and only the disk tier saves
    memory. On a GPU ``memory_budget`` is the device's and ``host_budget`` (default: the host's free memory
    split among the ranks) the host's. With ``quant`` every layer counts its quantized bytes as the pool packs
    them, and the disk is the quantized store's (:mod:`energon_infer.worker.quantized_pool`). Plans the engine's
    serving plan made (``config.plans``) are returned as they are.
    """
    assert config.memory_budget is not None, "plan_tiers needs MemoryPoolConfig(memory_budget=...)"
    if config.plans is not None:  # the engine's serving plan chose them (energon_infer.engine.memory_plan)
        plans = decode_plans(config.plans)
        if len(plans) != pp:
            raise ValueError(f"MemoryPoolConfig.plans has {len(plans)} stage plans for pp={pp}; leave plans=None "
                             "to plan here")
        return plans
    if dtype == "auto":  # the runtime's default: the checkpoint's dtype where the device computes in it
        from energon_infer.loading.hf_files import auto_dtype

        dtype = auto_dtype(path, "cuda" if device_type == "cuda" else "cpu")[0]
    where = path if quant is None else quantized_store_dir(path, config.quantized_dir, quant, dtype, tp, pp)
    disk = resolve_disk(config.disk, where)
    unified = device_type != "cuda"
    plans = []
    for _, layers, resident, buffers in stage_weights(path, cfg, tp=tp, pp=pp, dtype=dtype,
                                                      io_threads=config.io_threads, quant=quant):
        host = config.host_budget
        if not unified and host is None:
            free = available_bytes(torch.device("cpu"))
            host = None if free is None else free // (tp * pp)
        if not unified and host is not None:
            host = max(0, int(host) - buffers)
        plans.append(plan_pool(layers, resident_bytes=resident + (buffers if unified else 0),
                               budget_bytes=int(config.memory_budget), lookahead=config.lookahead,
                               host_budget_bytes=None if unified else host, disk=disk, unified=unified,
                               sharers=tp * pp))
    return plans


def encode_plans(plans: list[PoolPlan]) -> str:
    return json.dumps([p.to_json() for p in plans])


def decode_plans(text: str) -> list[PoolPlan]:
    return [PoolPlan.from_json(t) for t in json.loads(text)]


def _packs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether loading packs a (finite, large enough) projection weight of ``dtype`` on ``device``: the conditions of
    :func:`tightfit.kernels.packed_linear.pack_linear_weight` that do not depend on the values."""
    from tightfit.kernels.packed_linear import PACKABLE_DTYPES, packing_available

    return device.type == "cpu" and dtype in PACKABLE_DTYPES and packing_available()


def install_tiered_pool(runner: Any, plan: PoolPlan, config: MemoryPoolConfig, path: str | Path) -> LayerPool:
    """Install the pool of ``plan`` on a runner loaded with ``offload=plan.disk_layers`` (those blocks on meta)."""
    if runner.quant is not None:  # quantized layers: from the quantized store, held quantized
        if config.disk_vocab:
            raise ValueError(f"MemoryPoolConfig(disk_vocab={config.disk_vocab!r}) reads the tables as the checkpoint "
                             "stores them, not quantized; leave disk_vocab empty with quantization")
        return install_quantized_pool(runner, plan, config, path)
    stage, cfg, grid = runner.stage, runner.config, runner.grid
    files = TensorFiles(path, drop_page_cache=config.drop_page_cache, direct=config.direct_io)
    if config.disk_vocab:
        from energon_infer.worker.disk_vocab import install_disk_vocab

        install_disk_vocab(stage, cfg, grid, files, config.disk_vocab, runner.dtype)
    # Not pinned: the tensors are copied into the slot from here synchronously, as build_param assembles them.
    scratch = StagingBuffers(read_buffer_bytes(stage, cfg, files), pin=False)
    blocks = list(stage.layers.items())
    disk = {i: DiskLayer(blocks[i][1], int(blocks[i][0]), files, cfg, grid, scratch,
                         nonfinite=runner.runtime.nonfinite_weights) for i in plan.disk_layers}
    # Never loaded, so never packed: the weights the all-in-memory engine packs run the packed product on the
    # slot's plain weight, so the disk layers' products are its products.
    packs = runner.runtime.packed_weights and _packs_on(runner.device, runner.dtype)
    for i in plan.disk_layers:
        move_unpacked(blocks[i][1], packs)
    pool = LayerPool(stage, plan.pooled, lookahead=plan.lookahead, pool_device=config.pool_device,
                     cpu_prefetch=config.cpu_prefetch, layers=disk, io_threads=config.io_threads, device=runner.device)
    if plan.pooled:  # a CUDA graph replays the weights' old addresses; pooled layers move every step
        runner.decode_graphs = None
    return pool


def pool_snapshot(pool: LayerPool | None, plan: PoolPlan | None) -> dict[str, Any]:
    """What a rank's pool did since it started: disk reads by layer (model layer numbers), bytes, seconds."""
    if pool is None or plan is None:
        return {}
    disk: list[Any] = [layer for layer in pool.packed if isinstance(layer, (DiskLayer, StoredLayer))]
    io = {d.index: d.io.totals for d in disk}
    stored = [d for d in disk if isinstance(d, StoredLayer)]
    store = {"disk_store": str(stored[0].store.path), "disk_layers_written": sum(d.written for d in stored),
             "disk_layer_bytes": {d.index: d.numel for d in stored}} if stored else {}
    experts = pool.experts.snapshot() if pool.experts is not None else {}
    return {**store, **experts, "disk_layers": list(io), "disk_reads": {i: t.reads for i, t in io.items()},
            "disk_bytes_read": sum(t.bytes_read for t in io.values()) + experts.get("expert_bytes_read", 0),
            "disk_read_s": sum(t.read_s for t in io.values()),
            "pool_wait_s": pool.wait_s, "pool_waits": pool.waits, "pool_copies": pool.copies,
            "disk_bytes_per_pass": plan.disk_bytes, "io_seconds_per_pass": plan.io_seconds}
