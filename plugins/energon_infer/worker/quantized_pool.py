"""Quantized layers in the memory pool: held quantized on the host, or streamed quantized from a store on disk.

A quantized block (:mod:`energon_infer.loading.quantization`) holds tensors of several dtypes: int8 or packed
int4 weights, fp32 scales and zero points, the norms' and biases' weights. Here such a block is one run of
bytes (:class:`ByteSlotLayer`): every tensor at a 64-byte aligned offset, so a slot of bytes gives each one a
view of its dtype. The pool then moves the quantized bytes, 2-4x fewer than the full-precision layer's, and the
planner (:func:`tightfit.planner.pool.plan_pool`) counts exactly those bytes (:func:`packed_layer_bytes`), so
more layers fit a budget:

* host tier (:class:`QuantHostLayer`): the block's bytes packed in host (or peer) memory, copied into a slot
  before the block runs (:func:`apply_quantized_pool` for a ``device_budget`` / ``fraction`` pool; the host
  layers of a tiered plan on a GPU);
* disk tier (:class:`StoredLayer`): a quantized layer cannot be read from the fp32 checkpoint without reading
  its full-precision bytes, so the disk layers are quantized once at load and written, one run of bytes per
  layer, to a :class:`~tightfit.storage.TensorStore` (:func:`open_quantized_store`); each pass reads a layer's
  bytes straight into a 4 KiB-aligned slot (O_DIRECT where the filesystem takes it, checksummed). The store
  records what it was made from (the checkpoint's files with their sizes and modification times, the method,
  group size, dtype and this rank's place in the grid): the next load with the same reuses it, any change
  rewrites it.

Every quantized value is :func:`~energon_infer.loading.quantization.quantize_weight`'s of the same slice the
in-memory quantized model holds, so a pooled or streamed model gives exactly its logits.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from energon_infer.loading.quantization import QuantSpec, quantize_weight
from energon_infer.loading.weights import CheckpointReader, Part, build_param, hf_parts
from energon_infer.parallel import quant_tiling, tile_weight
from energon_infer.worker.memory_pool import LayerPool, MemoryPoolConfig, SlotLayer
from tightfit.memory_limit import release_freed_heap
from tightfit.planner.pool import PoolPlan, plan_pool
from tightfit.storage import ALIGN, IOCounters, StagingBuffers, TensorStore, aligned_empty

__all__ = ["ByteSlotLayer", "QuantHostLayer", "StoredLayer", "packed_block_bytes", "packed_layer_bytes",
           "apply_quantized_pool", "quantized_store_dir", "open_quantized_store", "write_missing_layers",
           "install_quantized_pool", "store_buffer_bytes", "STORE_FORMAT"]

TENSOR_ALIGN = 64  # bytes: every tensor of a packed block starts here, so a byte slot views as any dtype
STORE_FORMAT = 3  # the layout of a stored layer; a store written with another is rewritten (2: int4 tiles, 3: int8)
_COMPONENTS = {"qweight": "qweight", "qscale": "scale", "qzero": "zero"}  # parameter -> quantize_weight key


def _component(pname: str) -> tuple[str, str] | None:
    """``(the weight's parameter name, quantize_weight's key)`` of a quantized weight's component parameter: a
    projection's ``qscale`` -> ``("weight", "scale")``, an expert's ``down_qzero`` -> ``("down", "zero")``
    (:class:`energon_infer.worker.moe.Expert`); ``None`` for any other parameter."""
    for comp, key in _COMPONENTS.items():
        if pname == comp:
            return "weight", key
        if pname.endswith("_" + comp):
            return pname[: -len(comp) - 1], key
    return None


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _block_params(block: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [(m, name, p) for m in block.modules() for name, p in m._parameters.items() if p is not None]


def _transposed(p: torch.Tensor) -> bool:
    return p.dim() == 2 and not p.is_contiguous() and p.t().is_contiguous()


def packed_block_bytes(block: nn.Module) -> int:
    """Bytes of ``block`` (a layer or one expert) packed as a pool slot holds it (works on meta tensors)."""
    offset = 0
    for _, _, p in _block_params(block):
        offset = _round_up(offset, TENSOR_ALIGN) + p.numel() * p.element_size()
    return _round_up(offset, TENSOR_ALIGN)


def packed_layer_bytes(stage: nn.Module) -> tuple[list[int], int]:
    """``(bytes of each layer packed as a pool holds it, bytes of everything else)`` (works on meta tensors)."""
    blocks = stage.layers
    assert isinstance(blocks, nn.ModuleDict), "a DecoderStage keeps its blocks in a ModuleDict"
    layers = [packed_block_bytes(b) for b in blocks.values()]
    rest = sum(p.numel() * p.element_size() for n, p in stage.named_parameters() if not n.startswith("layers."))
    return layers, rest


class ByteSlotLayer(SlotLayer):
    """A pooled block packed as bytes: its parameters may have several dtypes (a quantized block's do).

    ``entries`` hold byte offsets (64-byte aligned) and the slot is ``uint8``; :meth:`slot_views` views each
    parameter's bytes as its dtype. The base class's single-dtype packing does not apply, so it is not called.
    """

    def __init__(self, block: nn.Module):  # not SlotLayer.__init__: its layout takes one dtype
        self.block = block
        params = _block_params(block)
        self.entries: list[tuple[nn.Module, str, int, torch.Size, bool]] = []
        self.dtypes: list[torch.dtype] = []
        offset = 0
        for module, name, p in params:
            offset = _round_up(offset, TENSOR_ALIGN)
            self.entries.append((module, name, offset, p.shape, _transposed(p)))
            self.dtypes.append(p.dtype)
            offset += p.numel() * p.element_size()
        self.dtype = torch.uint8
        self.numel = _round_up(offset, TENSOR_ALIGN)
        self.params = [p for _, _, p in params]
        self.views: dict[int, list[nn.Parameter]] = {}
        self.placeholders: list[nn.Parameter] = []

    def _typed(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Entry ``k``'s view of ``flat`` (a buffer of this layer's bytes), with its dtype, shape and layout."""
        _, _, off, shape, transposed = self.entries[k]
        dtype = self.dtypes[k]
        t = flat[off: off + shape.numel() * dtype.itemsize].view(dtype)
        return t.view(shape[1], shape[0]).t() if transposed else t.view(shape)

    def write_into(self, flat: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Pack ``values`` (one per entry, in order) into ``flat``; the padding between them is zeroed."""
        flat.zero_()
        for k, v in enumerate(values):
            self._typed(flat, k).copy_(v.detach())

    def slot_views(self, slot_id: int, slot: torch.Tensor) -> list[nn.Parameter]:
        views = self.views.get(slot_id)
        if views is None:
            with torch.inference_mode(False):
                views = [nn.Parameter(self._typed(slot, k), requires_grad=False) for k in range(len(self.entries))]
            self.views[slot_id] = views
        return views


class QuantHostLayer(ByteSlotLayer):
    """A pooled block's bytes in host (or peer) memory, copied into a slot before it runs."""

    streamed = False

    def __init__(self, block: nn.Module, pool_device: torch.device, pin: bool):
        super().__init__(block)
        self.flat = torch.empty(self.numel, dtype=torch.uint8, device=pool_device, pin_memory=pin)
        self.write_into(self.flat, self.params)
        self.held_bytes = self.numel
        self.params = []
        self._to_meta()

    def fill(self, dst: torch.Tensor) -> None:
        dst.copy_(self.flat, non_blocking=dst.device.type == "cuda")


class StoredLayer(ByteSlotLayer):
    """A block whose quantized bytes live in a :class:`TensorStore` (``layer.<index>.<layout>``), read each pass.

    Args:
        block: the block, its (quantized) parameters on the meta device.
        index: its layer number in the model.
        store: the quantized store (:func:`open_quantized_store`).
        staging: the per-thread host buffers (pinned) for GPU slots.
        expert: where ``block`` is one expert of layer ``index``'s MoE (:mod:`energon_infer.worker.expert_pool`), its
            number: stored as ``expert.<index>.<expert>.<layout>``, its runtime name ``layers.<index>.moe.experts.<e>``.
    """

    def __init__(self, block: nn.Module, index: int, store: TensorStore, staging: StagingBuffers, *,
                 expert: int | None = None):
        super().__init__(block)
        self.placeholders = list(self.params)  # already meta
        self.params = []
        self.index, self.store, self.staging = index, store, staging
        # The runtime's name of ``block`` (its parameters' names start with it) and the store's name of its bytes.
        self.prefix = f"layers.{index}." if expert is None else f"layers.{index}.moe.experts.{expert}."
        self.stem = f"layer.{index}" if expert is None else f"expert.{index}.{expert}"
        layout = [(name, str(dtype), tuple(shape), off, t) for (_, name, off, shape, t), dtype in
                  zip(self.entries, self.dtypes)]
        # The layout in the name: a store written by another layout of the block is never read as this one.
        self.name = f"{self.stem}.{hashlib.sha256(repr(layout).encode()).hexdigest()[:12]}"
        self.written = False  # whether this load quantized and wrote it (False: reused from the store)
        self.io = IOCounters()

    def fill(self, dst: torch.Tensor) -> None:
        with self.io.reading() as tally:
            if dst.device.type == "cpu":
                self.store.read_into(self.name, dst).result()
            else:  # the store moves host memory: read into this thread's staging buffer, then copy on the stream
                buf = self.staging.get()[: self.numel]
                self.store.read_into(self.name, buf).result()
                dst.copy_(buf, non_blocking=True)
            tally.bytes += self.numel

    def close(self) -> None:
        self.store.close()  # idempotent: every stored layer of a pool shares the store


def _align_slots(pool: LayerPool) -> None:
    """Give the pool 4 KiB-aligned CPU slots (before its first copy): an O_DIRECT read lands in one directly."""
    if pool.slots and pool.slots[0].device.type == "cpu":
        pool.slots = [aligned_empty(s.numel(), s.dtype) for s in pool.slots]


def apply_quantized_pool(runner: Any, config: MemoryPoolConfig) -> tuple[LayerPool, PoolPlan]:
    """:func:`~energon_infer.worker.memory_pool.apply_memory_pool` for a quantized runner: the plan counts each
    layer's quantized bytes, and pooled layers are held and moved quantized (:class:`QuantHostLayer`)."""
    layers, resident = packed_layer_bytes(runner.stage)
    budget = config.device_budget
    plan = plan_pool(layers, resident_bytes=resident, budget_bytes=budget if isinstance(budget, int) else None,
                     fraction=config.fraction, lookahead=config.lookahead)
    blocks = list(runner.stage.layers.values())
    pool_device = torch.device(config.pool_device)
    pin = runner.device.type == "cuda" and pool_device.type == "cpu"
    held: dict[int, SlotLayer] = {i: QuantHostLayer(blocks[i], pool_device, pin) for i in plan.pooled}
    pool = LayerPool(runner.stage, plan.pooled, lookahead=config.lookahead, pool_device=config.pool_device,
                     cpu_prefetch=config.cpu_prefetch, layers=held, device=runner.device)
    if plan.pooled:  # a CUDA graph replays the weights' old addresses; pooled layers move every step
        runner.decode_graphs = None
    return pool, plan


# ---------------------------------------------------------------------------- the quantized store


def quantized_store_dir(model_path: str | Path, given: str | os.PathLike[str] | None, spec: QuantSpec, dtype: str,
                        tp: int, pp: int) -> Path:
    """The directory of the quantized stores of this layout (one ``rank<r>`` store per rank inside), created.

    ``given``: the user's directory; ``None``: ``.tightfit-quantized`` beside the model where its directory is
    writable, else ``$TIGHTFIT_CACHE_DIR/quantized/<hash of the model's path>`` (``~/.cache/tightfit``).
    """
    model = Path(model_path).resolve()
    if given is not None:
        base = Path(given).expanduser()
    elif os.access(model, os.W_OK):
        base = model / ".tightfit-quantized"
    else:
        from tightfit.profiler.device import cache_dir

        base = cache_dir() / "quantized" / hashlib.sha256(str(model).encode()).hexdigest()[:16]
    group = f"-g{spec.group_size}" if spec.group_size else ""
    sub = base / f"{spec.method}{group}-{dtype}-tp{tp}-pp{pp}"
    try:
        sub.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"quantized_dir={str(base)!r}: cannot create {sub} ({exc.strerror}); the disk tier of a "
                      "quantized model writes its quantized layers there: give MemoryPoolConfig(quantized_dir=...) "
                      "a writable directory") from None
    return sub


def store_buffer_bytes(layer_bytes: Sequence[int], io_threads: int) -> int:
    """Host bytes a quantized store's reads may add: each I/O thread's aligned bounce buffer of one extent."""
    return io_threads * _extent_bytes(max(layer_bytes, default=0))


def _extent_bytes(largest: int) -> int:
    return max(ALIGN, min(4 * 2**20, _round_up(largest, ALIGN)))  # a small layer: one extent, one request


def _manifest(model_path: str | Path, spec: QuantSpec, dtype: str, grid: Any) -> dict[str, Any]:
    from energon_infer.loading.safetensors_files import TensorFiles

    files = TensorFiles(model_path)
    try:
        stamps = {f.name: list(st) for f, st in sorted(files.stamps.items())}  # (size, mtime_ns) of every file
    finally:
        files.close()
    return {"format": STORE_FORMAT, "method": spec.method, "group_size": spec.group_size, "dtype": dtype,
            "tiles": quant_tiling(spec.method, getattr(torch, dtype, None), "meta"),
            "tp": grid.tp, "pp": grid.pp, "tp_rank": grid.tp_rank, "stage": grid.stage, "files": stamps}


def _read_manifest(store: TensorStore) -> dict[str, Any] | None:
    if "manifest" not in store:
        return None
    try:
        return json.loads(bytes(store.get("manifest").numpy()).decode())
    except (ValueError, UnicodeDecodeError):
        return None


def open_quantized_store(model_path: str | Path, runner: Any, config: MemoryPoolConfig, largest: int) -> TensorStore:
    """This rank's quantized store (:func:`quantized_store_dir`), emptied if it was made from other checkpoint
    files or with another method, group size, dtype or grid; ``largest``: the largest layer it will hold."""
    spec, grid = runner.quant, runner.grid
    root = quantized_store_dir(model_path, config.quantized_dir, spec, runner.runtime.dtype, grid.tp, grid.pp)
    store = TensorStore.for_rank(root, grid.rank, workers=config.io_threads, extent_bytes=_extent_bytes(largest))
    if _read_manifest(store) != _manifest(model_path, spec, runner.runtime.dtype, grid):
        for name in store.names():
            store.delete(name)
        store.sync()
    return store


def write_missing_layers(store: TensorStore, model_path: str | Path, runner: Any,
                         layers: Sequence[StoredLayer]) -> int:
    """Quantize and write each of ``layers`` the store lacks (one layer's full-precision tensors in memory at a
    time), then record what the store was made from. Returns the number of layers written (0: all reused)."""
    todo = [layer for layer in layers if layer.name not in store]
    if todo:
        reader = CheckpointReader(model_path)
        try:
            for layer in todo:
                for old in [n for n in store.names() if n.startswith(f"{layer.stem}.")]:
                    store.delete(old)  # the same layer (or expert) in an older layout
                buf = aligned_empty(layer.numel)
                _write_layer(runner, reader, layer, buf)
                store.put(layer.name, buf)
                layer.written = True
        finally:
            reader.close()
        release_freed_heap()  # quantizing leaves freed temporaries in the heap; the pool and page cache want it
    if todo or "manifest" not in store:  # the manifest last: a store cut short lacks layers, never holds wrong ones
        store.sync()
        want = _manifest(model_path, runner.quant, runner.runtime.dtype, runner.grid)
        store.put("manifest", torch.frombuffer(bytearray(json.dumps(want, sort_keys=True).encode()),
                                               dtype=torch.uint8))
        store.sync()
    return len(todo)


def _write_layer(runner: Any, reader: CheckpointReader, layer: StoredLayer, flat: torch.Tensor) -> None:
    """Pack this rank's values of every parameter of ``layer`` (a block or one expert) into ``flat`` (its layout),
    quantized where it is. A quantized projection is built and quantized part by part (qkv, gate and up are fused), each
    part's rows going straight into their place in ``flat``: the quantization is per row (int8) or per row and
    group of inputs (int4), so the values are those of the fused weight, and only one part's full-precision rows
    and its quantized copy are in memory besides ``flat``, which keeps the peak below quantizing the fused weight
    whole."""
    cfg, grid, spec = runner.config, runner.grid, runner.quant
    keys = set(reader.keys())
    names = {id(m): n for n, m in layer.block.named_modules()}
    nonfinite = runner.runtime.nonfinite_weights

    def fetch(part: Part, want: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...], bool]:
        t = part.take(reader.get(part.source))
        return t, tuple(t.shape), False

    def quantize_into(name: str, shape: tuple[int, ...], views: dict[str, torch.Tensor]) -> None:
        parts = hf_parts(cfg, name, keys)
        if len(parts) == 1:
            pieces = [(build_param(cfg, grid, name, shape, parts, fetch, nonfinite=nonfinite), 0)]
            rows = [shape[0]]
        else:
            rows = [shape[0] // len(parts)] * len(parts)
            if name.endswith("qkv.weight"):
                rows = [cfg.n_heads * cfg.head_dim // grid.tp] + [cfg.n_kv_heads * cfg.head_dim // grid.tp] * 2
        start = 0
        for i, r in enumerate(rows):
            w = pieces[0][0] if len(parts) == 1 else build_param(
                cfg, grid, f"{name} (part {i})", (r, *shape[1:]), [parts[i]], fetch, nonfinite=nonfinite)
            for key, q in quantize_weight(w, spec).items():
                views[key][start: start + r].copy_(q)
            del w
            start += r

    flat.zero_()
    done: set[str] = set()
    for k, (module, pname, _, shape, _) in enumerate(layer.entries):
        prefix = layer.prefix + (f"{names[id(module)]}." if names[id(module)] else "")
        if (part := _component(pname)) is not None:  # a quantized weight: every component of it at once
            weight, _ = part
            if prefix + weight in done:
                continue
            done.add(prefix + weight)
            views = {key: layer._typed(flat, e) for e in range(len(layer.entries)) if layer.entries[e][0] is module
                     and (c := _component(layer.entries[e][1])) is not None and c[0] == weight for key in (c[1],)}
            qname = "qweight" if weight == "weight" else f"{weight}_qweight"
            rows, cols = module._parameters[qname].shape  # type: ignore[union-attr]
            n, kk = int(rows), int(cols) * (2 if spec.method == "int4" else 1)  # int4: two inputs a byte
            quantize_into(prefix + weight, (n, kk), views)
            if getattr(module, "tiled", False):  # the byte order the layer runs from (parallel.quant_tiling)
                views["qweight"].copy_(tile_weight(spec.method, views["qweight"]))
        else:
            value = build_param(cfg, grid, prefix + pname, tuple(shape), hf_parts(cfg, prefix + pname, keys), fetch,
                                nonfinite=nonfinite)
            layer._typed(flat, k).copy_(value.to(layer.dtypes[k]).detach())


def install_quantized_pool(runner: Any, plan: PoolPlan, config: MemoryPoolConfig, path: str | Path) -> LayerPool:
    """The tiered pool of ``plan`` for a quantized runner loaded with ``offload=plan.disk_layers``: disk layers
    streamed from the quantized store (written now where missing), host layers held quantized."""
    blocks = list(runner.stage.layers.values())
    keys = list(runner.stage.layers)
    largest = max((packed_block_bytes(blocks[i]) for i in plan.disk_layers), default=0)
    layers: dict[int, SlotLayer] = {}
    if plan.disk_layers:
        store = open_quantized_store(path, runner, config, largest)
        staging = StagingBuffers(largest)  # pinned where CUDA is present
        stored = {i: StoredLayer(blocks[i], int(keys[i]), store, staging) for i in plan.disk_layers}
        write_missing_layers(store, path, runner, list(stored.values()))
        layers.update(stored)
    pool_device = torch.device(config.pool_device)
    pin = runner.device.type == "cuda" and pool_device.type == "cpu"
    layers.update({i: QuantHostLayer(blocks[i], pool_device, pin) for i in plan.pooled if i not in layers})
    pool = LayerPool(runner.stage, plan.pooled, lookahead=plan.lookahead, pool_device=config.pool_device,
                     cpu_prefetch=config.cpu_prefetch, layers=layers, io_threads=config.io_threads,
                     device=runner.device)
    _align_slots(pool)
    if plan.pooled:  # a CUDA graph replays the weights' old addresses; pooled layers move every step
        runner.decode_graphs = None
    return pool
