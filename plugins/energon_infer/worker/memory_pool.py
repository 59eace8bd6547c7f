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
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from energon_infer.parallel import drop_packed
from tightfit.planner.pool import PoolInfeasibleError, PoolPlan, plan_pool

__all__ = ["MemoryPoolConfig", "PoolPlan", "PoolInfeasibleError", "LayerPool", "plan_pool", "stage_layer_bytes",
           "apply_memory_pool"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPoolConfig:
    """Which layers to pool and how far ahead to fetch them.

    Args:
        fraction: share of each stage's layers to pool (0..1), spread evenly; ignored when
            ``device_budget`` is given.
        device_budget: bytes (or ``"2GiB"``) the stage's weights may take on the device; the plan pools
            the fewest layers that fit.
        lookahead: pooled layers fetched ahead of the one running (slots = lookahead + 1).
        pool_device: where pooled weights live: ``"cpu"`` (host memory, pinned when the compute
            device is a GPU) or a peer GPU (``"cuda:1"``).
        cpu_prefetch: on a CPU-only machine, ``"thread"`` copies on a background thread (overlaps when
            a core is free) or ``"inline"`` copies in order on the compute thread (no hand-off cost;
            better when the cores are all busy). GPUs always use a side stream.
    """

    fraction: float = 0.5
    device_budget: int | str | None = None
    lookahead: int = 2
    pool_device: str = "cpu"
    cpu_prefetch: str = "thread"

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction={self.fraction} must be in [0, 1] (0 pools nothing, 1 pools every layer)")
        if self.lookahead < 0:
            raise ValueError(f"lookahead={self.lookahead} must be >= 0")
        if self.cpu_prefetch not in ("thread", "inline"):
            raise ValueError(f"cpu_prefetch={self.cpu_prefetch!r} must be 'thread' or 'inline'")
        if isinstance(self.device_budget, str):
            from tightfit.units import parse_bytes

            object.__setattr__(self, "device_budget", parse_bytes(self.device_budget))


def stage_layer_bytes(stage: nn.Module) -> tuple[list[int], int]:
    """``(bytes of each layer, bytes of everything else)`` of a stage's parameters (works on meta tensors)."""
    blocks = stage.layers
    assert isinstance(blocks, nn.ModuleDict), "a DecoderStage keeps its blocks in a ModuleDict"
    layers = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks.values()]
    total = sum(p.numel() * p.element_size() for p in stage.parameters())
    return layers, total - sum(layers)


def _view(flat: torch.Tensor, shape: torch.Size, transposed: bool) -> torch.Tensor:
    return flat.view(shape[1], shape[0]).t() if transposed else flat.view(shape)


class _Packed:
    """One pooled block: its parameters packed into one flat pool tensor, and where each one sits in it."""

    def __init__(self, block: nn.Module, pool_device: torch.device, pin: bool):
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
        flat = torch.empty(self.numel, dtype=self.dtype, device=pool_device, pin_memory=pin)
        offset = 0
        for module, name, p in params:
            transposed = p.dim() == 2 and not p.is_contiguous() and p.t().is_contiguous()
            flat[offset: offset + p.numel()].copy_((p.detach().t() if transposed else p.detach()).reshape(-1))
            self.entries.append((module, name, offset, p.shape, transposed))
            # The device copy goes away; a meta placeholder makes any use outside the hooks fail loudly.
            module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                    requires_grad=False)
            offset += p.numel()
        self.flat = flat
        drop_packed(block)  # oneDNN copies of the weights would keep them resident (and go stale)
        self.placeholders = [m._parameters[n] for m, n, _, _, _ in self.entries]
        self.views: dict[int, list[nn.Parameter]] = {}

    def bind(self, slot_id: int, slot: torch.Tensor) -> None:
        views = self.views.get(slot_id)
        if views is None:  # built once per slot, outside any inference-mode region's lifetime concerns
            with torch.inference_mode(False):
                views = [nn.Parameter(_view(slot[off: off + shape.numel()], shape, transposed), requires_grad=False)
                         for _, _, off, shape, transposed in self.entries]
            self.views[slot_id] = views
        for (module, name, _, _, _), view in zip(self.entries, views):
            module._parameters[name] = view

    def unbind(self) -> None:
        for (module, name, _, _, _), ph in zip(self.entries, self.placeholders):
            module._parameters[name] = ph


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
                 cpu_prefetch: str = "thread"):
        layers = stage.layers
        assert isinstance(layers, nn.ModuleDict), "a DecoderStage keeps its blocks in a ModuleDict"
        blocks = list(layers.values())
        bad = [i for i in pooled if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"pooled layer positions {bad} are outside this stage's {len(blocks)} layers")
        self.device = next(stage.parameters()).device
        self.pool_device = torch.device(pool_device)
        self.cuda = self.device.type == "cuda"
        pin = self.cuda and self.pool_device.type == "cpu"
        self.order = sorted(set(pooled))
        self.packed = [_Packed(blocks[i], self.pool_device, pin) for i in self.order]
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
        self._executor = None
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)
        elif cpu_prefetch == "thread":
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="energon-prefetch")
        self.copies = 0
        self.waits = 0  # times a block had to wait for its copy (it was not prefetched in time or at all)
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
        return sum(p.flat.numel() * p.flat.element_size() for p in self.packed)

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)

    # ------------------------------------------------------------------ copies

    def _copy(self, k: int, slot: int) -> Any:
        src, dst = self.packed[k].flat, self.slots[slot][: self.packed[k].numel]
        self.copies += 1
        if self.cuda:
            with torch.cuda.stream(self._stream):
                event = self._slot_free_event.pop(slot, None)
                if event is not None:
                    self._stream.wait_event(event)  # the block that used this slot last has finished with it
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return event
        if self._executor is None:  # inline: in execution order, on this thread
            done: Future[torch.Tensor] = Future()
            done.set_result(dst.copy_(src))
            return done
        return self._executor.submit(dst.copy_, src)

    def _fill(self) -> None:
        """Start copies of the next pooled blocks (in execution order) while slots are free."""
        while self._free_slots and len(self._loaded) + len(self._bound) <= self.lookahead:
            slot = self._free_slots.popleft()
            k = self._next_fetch
            self._next_fetch = (k + 1) % len(self.packed)
            self._loaded.append((k, slot, self._copy(k, slot)))

    def _wait(self, handle: Any) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(handle)
        else:
            assert isinstance(handle, Future)
            if not handle.done():
                self.waits += 1
            handle.result()

    def _resync(self, k: int) -> None:
        """Execution left the expected order (an aborted step): drop prefetches, restart the cycle at ``k``."""
        while self._loaded:
            _, slot, handle = self._loaded.popleft()
            self._wait(handle)
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
            self._wait(handle)
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
        for h in self._handles:
            h.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)


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
