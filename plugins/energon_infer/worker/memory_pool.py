"""Peer memory pooling: some layers' weights live outside the computing device and are prefetched ahead.

EnergonAI keeps the weights of some layers in a pool on a peer device (another GPU's memory, or
host memory) and copies each one into a small set of device buffers ("slots") a few layers before
it runs, on a side stream, so a stage whose weights do not fit on its device still runs at the
cost of the copies that compute does not hide.

Here a :class:`LayerPool` does that for one :class:`~energon_infer.worker.model.DecoderStage`:

* each pooled block's parameters are packed into one flat tensor in the pool (pinned host memory,
  a peer GPU, or on a CPU-only machine a separate host allocation) and removed from the device;
* ``lookahead + 1`` slots of the largest pooled block's size are allocated on the device;
* a forward pre-hook on every block binds the block's slot (waiting for its copy) and starts the
  copies of the next pooled blocks in execution order (cyclic: after the last layer the first
  pooled layers of the next step are fetched); a forward hook hands the slot back.

Copies run on a side CUDA stream (events order them against compute) or, on the CPU, on one
background thread (PyTorch releases the GIL in ``copy_``, so the copy overlaps the matmuls).

:func:`tightfit.planner.pool.plan_pool` (core; re-exported here) sizes the pool from the per-layer
parameter bytes of the stage (its profile, measured on the meta device by :func:`stage_layer_bytes`)
and a device budget; this module applies its plan.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from energon_infer.parallel import move_unpacked
from tightfit.planner.pool import PoolInfeasibleError, PoolPlan, plan_pool
from tightfit.storage import IOEngine

__all__ = ["MemoryPoolConfig", "PoolPlan", "PoolInfeasibleError", "LayerPool", "plan_pool", "stage_layer_bytes",
           "apply_memory_pool"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPoolConfig:
    """Which layers to pool, where they live, and how far ahead to fetch them.

    Two ways to size the pool. ``device_budget`` (or ``fraction``) pools layers into host memory or a peer GPU
    (EnergonAI's peer pool). ``memory_budget`` plans the three tiers (device, host, disk) with
    :func:`tightfit.planner.pool.plan_pool`: layers that fit no memory budget stay in the model directory's own
    safetensors files and are read from there into the prefetch slots on every pass (the disk tier: no
    conversion, no second copy on disk), so a model larger than memory is served.

    Args:
        fraction: share of each stage's layers to pool (0..1), spread evenly; ignored when a budget is given.
        device_budget: bytes (or ``"2GiB"``) the stage's weights may take on the device; the plan pools
            the fewest layers that fit (into ``pool_device``; no disk tier).
        memory_budget: bytes (or ``"2GiB"``) this rank's weights may take in memory, planned over device, host
            and disk: on a CPU-only machine (device and host are one memory) everything the stage's weights
            hold (embedding, head, kept layers, prefetch slots); on a GPU the device's share. KV cache and
            activations come on top.
        host_budget: with ``memory_budget`` on a GPU: host bytes for host-resident pooled layers and the disk
            reads' staging slots (``None``: what is free, ``MemAvailable``). Ignored on a CPU-only machine.
        disk: the disk the checkpoint is read from: ``None`` measures the model directory with
            :func:`tightfit.profiler.disk.profile_disk` (quick, cached per filesystem), a preset name
            (:func:`tightfit.profiler.disk_presets.disk_preset`, e.g. ``"nvme-gen4"``) or a
            :class:`~tightfit.profiler.types.DiskProfile`.
        lookahead: pooled layers fetched ahead of the one running (slots = lookahead + 1); with ``memory_budget``
            on a CPU the most: the engine's serving plan may fetch fewer where memory is short.
        pool_device: where pooled weights live: ``"cpu"`` (host memory, pinned when the compute
            device is a GPU) or a peer GPU (``"cuda:1"``).
        cpu_prefetch: on a CPU-only machine, ``"thread"`` copies on a background thread (overlaps when
            a core is free) or ``"inline"`` copies in order on the compute thread (no hand-off cost;
            better when the cores are all busy). GPUs always use a side stream.
        io_threads: disk reads in flight at once (each fills one slot; capped at the slot count).
        drop_page_cache: after each disk read, tell the kernel the pages will not be needed again
            (``POSIX_FADV_DONTNEED``): a streamed layer is read again next pass anyway, and under a memory
            limit (a cgroup) the page cache counts against it. Only for buffered reads (see ``direct_io``).
        quantized_dir: with a quantized model and a disk tier: where the quantized layers (or an expert plan's disk
            experts) are written once and streamed from (:mod:`energon_infer.worker.quantized_pool`); ``None``:
            beside the model
            (``.tightfit-quantized``), or the cache directory where the model's directory is read-only.
        direct_io: read disk layers with ``O_DIRECT`` (page cache bypassed: no readahead past each tensor, no
            cached pages counted against a memory limit) where the filesystem allows it; ``False``, or a
            filesystem that refuses it (tmpfs): buffered reads with readahead off.
        plans: each stage's pool plan, made by the engine's serving plan
            (:mod:`energon_infer.engine.memory_plan`) as a JSON list; the workers apply it instead of planning
            (``None``: they plan from ``memory_budget``).
        disk_vocab: with ``memory_budget`` on a CPU: the stage's vocabulary tables left in the checkpoint and read
            per step (``"embed"``: the rows a step looks up; ``"lm_head"``: the head in chunks), see
            :mod:`energon_infer.worker.disk_vocab`; the serving plan chooses them where memory is short.
        experts: an MoE model's expert placement (:class:`~tightfit.planner.experts.ExpertPlan` JSON, made by the
            engine's serving plan, :mod:`energon_infer.engine.expert_plan`): its disk experts are read when routed
            (:mod:`energon_infer.worker.expert_pool`).
        expert_lookahead: with ``experts``: the next MoE layer's predicted experts read ahead per layer (``None``:
            one token's picks where the serving plan fits them, else none; 0: no lookahead).
    """

    fraction: float = 0.5
    device_budget: int | str | None = None
    memory_budget: int | str | None = None
    host_budget: int | str | None = None
    disk: Any = None
    lookahead: int = 2
    pool_device: str = "cpu"
    cpu_prefetch: str = "thread"
    io_threads: int = 2
    drop_page_cache: bool = True
    quantized_dir: str | None = None
    direct_io: bool = True
    plans: str | None = None
    disk_vocab: tuple[str, ...] = ()
    experts: str | None = None
    expert_lookahead: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "disk_vocab", tuple(self.disk_vocab))
        if set(self.disk_vocab) - {"embed", "lm_head"}:
            raise ValueError(f"disk_vocab={self.disk_vocab!r} may name only 'embed' and 'lm_head' (the tables read "
                             "from the checkpoint per step)")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction={self.fraction} must be in [0, 1] (0 pools nothing, 1 pools every layer)")
        if self.lookahead < 0:
            raise ValueError(f"lookahead={self.lookahead} must be >= 0")
        if self.expert_lookahead is not None and (isinstance(self.expert_lookahead, bool)
                                                  or not isinstance(self.expert_lookahead, int)
                                                  or self.expert_lookahead < 0):
            raise ValueError(f"expert_lookahead={self.expert_lookahead!r} must be None or an int >= 0 (experts read "
                             "ahead per MoE layer); give 0 to turn the lookahead off")
        if self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads} must be >= 1")
        if self.cpu_prefetch not in ("thread", "inline"):
            raise ValueError(f"cpu_prefetch={self.cpu_prefetch!r} must be 'thread' or 'inline'")
        if self.device_budget is not None and self.memory_budget is not None:
            raise ValueError("give device_budget (a host/peer pool) or memory_budget (device, host and disk tiers), "
                             "not both")
        for name in ("device_budget", "memory_budget", "host_budget"):
            value = getattr(self, name)
            if isinstance(value, str):
                from tightfit.units import parse_bytes

                object.__setattr__(self, name, parse_bytes(value))
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r} must be a byte count >= 0 or a size such as '2GiB'")
        if self.disk is not None and not isinstance(self.disk, str) and not hasattr(self.disk, "read_fit"):
            raise ValueError(f"disk={self.disk!r} must be None (measure the model directory), a preset name such as "
                             "'nvme-gen4', or a DiskProfile")

    @property
    def tiered(self) -> bool:
        """Whether the pool is planned over device, host and disk (``memory_budget`` given)."""
        return self.memory_budget is not None


def stage_layer_bytes(stage: nn.Module) -> tuple[list[int], int]:
    """``(bytes of each layer, bytes of everything else)`` of a stage's parameters (works on meta tensors)."""
    blocks = stage.layers
    assert isinstance(blocks, nn.ModuleDict), "a DecoderStage keeps its blocks in a ModuleDict"
    layers = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks.values()]
    total = sum(p.numel() * p.element_size() for p in stage.parameters())
    return layers, total - sum(layers)


def _view(flat: torch.Tensor, shape: torch.Size, transposed: bool) -> torch.Tensor:
    return flat.view(shape[1], shape[0]).t() if transposed else flat.view(shape)


class SlotLayer(ABC):
    """A pooled block whose parameters are bound to views of a slot while it runs (and to meta placeholders
    otherwise). Subclasses say where the bytes come from: :meth:`fill` writes the block's packed parameters
    into a slot (``numel`` elements of ``dtype``, in the order of ``entries``)."""

    # Whether :meth:`fill` reads from storage (on an I/O thread, even on a GPU) rather than copying memory the
    # pool holds (``held_bytes`` of it).
    streamed = True
    held_bytes = 0

    def __init__(self, block: nn.Module):
        self.block = block
        # (module, name, offset, shape, stored transposed): input-major linear weights
        # (parallel.linear_weight) keep that layout in the pool and in every slot.
        self.entries: list[tuple[nn.Module, str, int, torch.Size, bool]] = []
        params = [(m, name, p) for m in block.modules() for name, p in m._parameters.items() if p is not None]
        dtypes = {p.dtype for _, _, p in params}
        if len(dtypes) != 1:
            raise ValueError(f"a pooled layer must have one parameter dtype, found {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.numel = sum(p.numel() for _, _, p in params)
        offset = 0
        for module, name, p in params:
            transposed = p.dim() == 2 and not p.is_contiguous() and p.t().is_contiguous()
            self.entries.append((module, name, offset, p.shape, transposed))
            offset += p.numel()
        self.params = [p for _, _, p in params]
        self.views: dict[int, list[nn.Parameter]] = {}
        self.placeholders: list[nn.Parameter] = []

    @abstractmethod
    def fill(self, dst: torch.Tensor) -> None:
        """Write this block's packed parameters into ``dst`` (a slot's first ``numel`` elements)."""

    def close(self) -> None:
        """Release what the layer keeps open (a store); the pool calls it once it stops."""
        return None  # a layer held in memory keeps nothing open

    def _to_meta(self) -> None:
        """Swap the parameters for meta placeholders: any use outside the pool's hooks fails loudly."""
        for module, name, _, shape, _ in self.entries:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                                    requires_grad=False)
        # oneDNN copies of the weights would keep them resident (and go stale): the weights the block packed run the
        # packed product on the slot's plain weight instead, so its products are the all-in-memory engine's
        move_unpacked(self.block)
        self.placeholders = [m._parameters[n] for m, n, _, _, _ in self.entries]  # type: ignore[misc]

    def slot_views(self, slot_id: int, slot: torch.Tensor) -> list[nn.Parameter]:
        views = self.views.get(slot_id)
        if views is None:  # built once per slot, outside any inference-mode region's lifetime concerns
            with torch.inference_mode(False):
                views = [nn.Parameter(_view(slot[off: off + shape.numel()], shape, transposed), requires_grad=False)
                         for _, _, off, shape, transposed in self.entries]
            self.views[slot_id] = views
        return views

    def bind(self, slot_id: int, slot: torch.Tensor) -> None:
        for (module, name, _, _, _), view in zip(self.entries, self.slot_views(slot_id, slot)):
            module._parameters[name] = view

    def unbind(self) -> None:
        for (module, name, _, _, _), ph in zip(self.entries, self.placeholders):
            module._parameters[name] = ph


class _Packed(SlotLayer):
    """One pooled block: its parameters packed into one flat pool tensor (host memory or a peer GPU)."""

    streamed = False

    def __init__(self, block: nn.Module, pool_device: torch.device, pin: bool):
        super().__init__(block)
        flat = torch.empty(self.numel, dtype=self.dtype, device=pool_device, pin_memory=pin)
        for (_, _, offset, _, transposed), p in zip(self.entries, self.params):
            flat[offset: offset + p.numel()].copy_((p.detach().t() if transposed else p.detach()).reshape(-1))
        self.flat = flat
        self.held_bytes = flat.numel() * flat.element_size()
        self.params = []
        self._to_meta()

    def fill(self, dst: torch.Tensor) -> None:
        dst.copy_(self.flat, non_blocking=dst.device.type == "cuda")


class LayerPool:
    """Pool some blocks of a stage and prefetch them ahead of use (see the module docstring).

    Args:
        stage: a loaded :class:`~energon_infer.worker.model.DecoderStage` (its weights are moved into the pool).
        pooled: positions (within ``stage.layers``) of the blocks to pool.
        lookahead: pooled blocks fetched ahead of the running one.
        pool_device: where the pool lives (``"cpu"`` or a peer ``"cuda:N"``).
        cpu_prefetch: ``"thread"`` or ``"inline"`` (CPU compute device only; see :class:`MemoryPoolConfig`).
    """

    def __init__(self, stage: nn.Module, pooled: Sequence[int], *, lookahead: int = 2, pool_device: str = "cpu",
                 cpu_prefetch: str = "thread", layers: Mapping[int, SlotLayer] | None = None, io_threads: int = 1,
                 device: torch.device | None = None):
        blocks_dict = stage.layers
        assert isinstance(blocks_dict, nn.ModuleDict), "a DecoderStage keeps its blocks in a ModuleDict"
        blocks = list(blocks_dict.values())
        bad = [i for i in pooled if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"pooled layer positions {bad} are outside this stage's {len(blocks)} layers")
        given = dict(layers or {})
        if set(given) - set(pooled):
            raise ValueError(f"layers given for positions {sorted(set(given) - set(pooled))} that are not pooled")
        self.device = device or next(p.device for p in stage.parameters() if p.device.type != "meta")
        self.pool_device = torch.device(pool_device)
        self.cuda = self.device.type == "cuda"
        pin = self.cuda and self.pool_device.type == "cpu"
        self.order = sorted(set(pooled))
        self.packed = [given[i] if i in given else _Packed(blocks[i], self.pool_device, pin) for i in self.order]
        n_slots = min(lookahead + 1, len(self.packed))
        self.lookahead = n_slots - 1
        width = max((p.numel for p in self.packed), default=0)
        dtype = self.packed[0].dtype if self.packed else torch.float32
        self.slots = [torch.empty(width, dtype=dtype, device=self.device) for _ in range(n_slots)]
        self._free_slots: deque[int] = deque(range(n_slots))
        self._loaded: deque[tuple[int, int, Any]] = deque()  # (pooled index, slot, ready handle) in fetch order
        self._next_fetch = 0
        self._bound: dict[int, int] = {}  # pooled index -> slot while its block runs
        self._slot_free_event: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._executor: IOEngine | None = None
        # Layers whose fill is not a plain device copy (disk reads) run on threads even on a GPU.
        self._threaded = {k for k, p in enumerate(self.packed) if p.streamed}
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)
        if (not self.cuda and cpu_prefetch == "thread") or self._threaded:
            workers = max(1, min(io_threads if self._threaded else 1, n_slots))
            # The store's I/O engine runs the fills (at most one per slot in flight), with one intra-op thread
            # each: a copy on a thread of its own would otherwise start a second OpenMP team as wide as the
            # compute's, and the teams' spinning barriers fight over the cores (a tiny F.linear then takes
            # milliseconds while copies run).
            self._executor = IOEngine(workers=workers, max_inflight=max(1, n_slots), name="energon-prefetch",
                                      initializer=lambda: torch.set_num_threads(1))
        self.copies = 0
        self.waits = 0  # times a block had to wait for its copy (it was not prefetched in time or at all)
        self.wait_s = 0.0  # compute thread's time spent waiting for copies
        self.experts: Any = None  # an MoE model's ExpertPool (worker.expert_pool), where experts are placed singly
        position = {i: k for k, i in enumerate(self.order)}
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(
                lambda _m, _a, k=position.get(i): self._before(k)))
            if i in position:
                self._handles.append(block.register_forward_hook(lambda _m, _a, _o, k=position[i]: self._after(k)))

    # ------------------------------------------------------------------ accounting

    @property
    def pool_bytes(self) -> int:
        """Bytes held in the pool (host or peer memory); disk layers hold none."""
        return sum(p.held_bytes for p in self.packed)

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)

    # ------------------------------------------------------------------ copies

    def _copy(self, k: int, slot: int) -> Any:
        layer, dst = self.packed[k], self.slots[slot][: self.packed[k].numel]
        self.copies += 1
        if k in self._threaded:  # a disk read: on a thread (the wait for the slot's last user too)
            assert self._executor is not None
            return self._executor.submit(self._fill_threaded, layer, dst, self._slot_free_event.pop(slot, None))
        if self.cuda:
            with torch.cuda.stream(self._stream):
                event = self._slot_free_event.pop(slot, None)
                if event is not None:
                    self._stream.wait_event(event)  # the block that used this slot last has finished with it
                layer.fill(dst)
                event = torch.cuda.Event()
                event.record(self._stream)
            return event
        if self._executor is None:  # inline: in execution order, on this thread
            done: Future[None] = Future()
            layer.fill(dst)
            done.set_result(None)
            return done
        return self._executor.submit(layer.fill, dst)

    def _fill_threaded(self, layer: SlotLayer, dst: torch.Tensor, slot_free: Any) -> None:
        if slot_free is not None:
            slot_free.synchronize()
        if self.cuda:
            with torch.cuda.stream(self._stream):
                layer.fill(dst)
            self._stream.synchronize()  # the staging buffer is reused by the next read
        else:
            layer.fill(dst)

    def _fill(self) -> None:
        """Start copies of the next pooled blocks (in execution order) while slots are free."""
        while self._free_slots and len(self._loaded) + len(self._bound) <= self.lookahead:
            slot = self._free_slots.popleft()
            k = self._next_fetch
            self._next_fetch = (k + 1) % len(self.packed)
            self._loaded.append((k, slot, self._copy(k, slot)))

    def _wait(self, handle: Any) -> None:
        if isinstance(handle, Future):
            if not handle.done():
                self.waits += 1
                start = time.perf_counter()
                handle.result()
                self.wait_s += time.perf_counter() - start
            handle.result()  # raises what the copy raised (a disk read's CheckpointChangedError)
        else:
            torch.cuda.current_stream(self.device).wait_event(handle)

    def _resync(self, k: int) -> None:
        """Execution left the expected order (an aborted step): drop prefetches, restart the cycle at ``k``."""
        while self._loaded:
            _, slot, handle = self._loaded.popleft()
            try:
                self._wait(handle)
            except Exception:  # noqa: BLE001 - a dropped prefetch's failure: the layer is read again when due
                pass
            self._free_slots.append(slot)
        self._next_fetch = k

    def _release_stale(self) -> None:
        """A block is starting, so no block runs: a slot still bound belongs to a step that died mid-layer."""
        for k, slot in list(self._bound.items()):
            self.packed[k].unbind()
            self._free_slots.append(slot)
        self._bound.clear()

    def _before(self, k: int | None) -> None:
        with self._lock:
            if not self.packed:
                return
            if self._bound:
                self._release_stale()
            self._fill()
            if k is None:
                return
            if not self._loaded or self._loaded[0][0] != k:
                self._resync(k)
                self._fill()
            _, slot, handle = self._loaded.popleft()
            try:
                self._wait(handle)
            except BaseException:
                self._free_slots.append(slot)
                raise
            self.packed[k].bind(slot, self.slots[slot])
            self._bound[k] = slot
            self._fill()

    def _after(self, k: int) -> None:
        with self._lock:
            slot = self._bound.pop(k)
            self.packed[k].unbind()
            if self.cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._slot_free_event[slot] = event
            self._free_slots.append(slot)
            self._fill()

    def close(self) -> None:
        if self.experts is not None:
            self.experts.close()
        for h in self._handles:
            h.remove()
        if self._executor is not None:
            self._executor.close()
        for layer in self.packed:
            layer.close()


def apply_memory_pool(runner: Any, config: MemoryPoolConfig) -> tuple[LayerPool, PoolPlan]:
    """Plan and install a :class:`LayerPool` on a loaded :class:`~energon_infer.worker.runtime.ModelRunner`'s stage."""
    layers, resident = stage_layer_bytes(runner.stage)
    budget = config.device_budget
    plan = plan_pool(layers, resident_bytes=resident, budget_bytes=budget if isinstance(budget, int) else None,
                     fraction=config.fraction, lookahead=config.lookahead)
    pool = LayerPool(runner.stage, plan.pooled, lookahead=config.lookahead, pool_device=config.pool_device,
                     cpu_prefetch=config.cpu_prefetch)
    if plan.pooled:  # a CUDA graph replays the weights' old addresses; pooled layers move every step
        runner.decode_graphs = None
    return pool, plan
