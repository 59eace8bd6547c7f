"""Trace one step at the dispatcher: what each op allocates and frees, its FLOPs, and which block ran it.

:class:`StepTracer` is a ``TorchDispatchMode``. It sees every ATen op of the forward and of the
backward (the autograd engine runs on the calling thread for CPU and meta tensors) and keeps an
allocator's view of memory: an output whose storage is new (not an input's, not a parameter's) is
an allocation of ``storage.nbytes()``; a storage is freed when its last reference dies, which
``StorageWeakRef`` reports. Frees are swept before each op, so the level recorded after an op is
what a real allocator holds at that op's peak (inputs and outputs both alive). Internal kernel
workspace that never surfaces as an op output is not seen; on the CPU kernels PyTorch uses for
GPT-2 that is none (tests/core/test_profiler_model.py compares with ``torch.profiler``).

Block attribution: forward ops belong to the block whose forward is running (module hooks);
backward ops belong to the block whose forward created the autograd node being executed (the
graph is walked at each block's exit, see :meth:`StepTracer.label_graph`). A dispatch mode runs
below autograd, so its outputs carry no ``grad_fn`` yet: hence the walk from the block outputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["Allocation", "StepTracer", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage while it lives (shared by views)."""
    return t.untyped_storage()._cdata


@dataclass
class Allocation:
    key: int
    nbytes: int
    start: int  # op index it was allocated at
    phase: str
    block: int | None
    end: int | None = None  # op index at which it was found freed
    is_grad: bool = False


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    # Q K^T and P V: 2 * B * H * Tq * Tk * (Dqk + Dv).
    *batch, tq, d = q.shape
    tk, dv = k.shape[-2], v.shape[-1]
    b = 1
    for s in batch:
        b *= s
    return 2 * b * tq * tk * (d + dv)


# CPU fused attention is missing from torch.utils.flop_counter's registry; same formula as its
# CUDA flash entry (backward: four matmuls of the forward's shape, 2x the forward).
_EXTRA_FLOPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu": lambda a, k: _attention_flops(a[0], a[1], a[2]),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": lambda a, k: 2 * _attention_flops(a[1], a[2], a[3]),
}


def _op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    packet = func._overloadpacket
    fn = flop_registry.get(packet)
    if fn is not None:
        return int(fn(*args, **kwargs, out_val=out))
    extra = _EXTRA_FLOPS.get(str(packet))
    return int(extra(args, kwargs)) if extra is not None else 0


# With a Python dispatch mode active, autograd's backward formulas switch to out-of-place variants
# ("composite compliance": index backward does new_zeros(...).index_put(...) instead of index_put_),
# so the trace would hold the zeros and the result at once where a real step reuses one buffer.
# When such an op's destination was allocated by the op just before it and dies right after, the
# tracer books it as freed at that op: the in-place accounting of the real step.
_INPLACE_TWINS = {
    "aten.index_put.default", "aten.index_add.default", "aten.index_copy.default", "aten.scatter.src",
    "aten.scatter.value", "aten.scatter_add.default", "aten.scatter_reduce.two", "aten.masked_scatter.default",
    "aten.index_fill.int_Scalar", "aten.masked_fill.Scalar", "aten.slice_scatter.default",
    "aten.select_scatter.default", "aten.as_strided_scatter.default", "aten.diagonal_scatter.default",
}


@dataclass
class _Segment:
    phase: str
    block: int
    start: int
    end: int = -1
    start_level: int = 0


class StepTracer(TorchDispatchMode):
    """Record allocations, FLOPs, parameter use and block boundaries of one step.

    Args:
        block_modules: ``(block index, module)`` for blocks that have a forward.
        params: ``(name, parameter, owning block candidates)``; the first block whose ops use a tied
            parameter becomes its owner.
        preexisting: tensors alive before the step (parameters, buffers, inputs): never counted.
    """

    def __init__(self, block_modules: Iterable[tuple[int, nn.Module]], params: Iterable[tuple[str, torch.Tensor]],
                 preexisting: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.t = 0
        self.phase = "forward"
        self.current: int | None = None
        self.stack: list[int] = []
        self.allocs: list[Allocation] = []
        self.live: dict[int, tuple[StorageWeakRef, Allocation]] = {}
        self.fwd_flops: dict[int | None, int] = {}
        self.bwd_flops: dict[int | None, int] = {}
        self.first_call: dict[int, int] = {}
        self.outputs: dict[int, list[tuple[int, int]]] = {}  # block -> [(storage key, tensor nbytes)]
        self.node_block: dict[int, int | None] = {}
        # The loss's own autograd nodes (ops after the last block, folded into it) and the backward op indices
        # that ran them: in backward they run before any node of the block, so before its parameters' hooks.
        self.loss_nodes: set[int] = set()
        self.loss_ops: list[int] = []
        self.loss_block: int | None = None
        self.segments: list[_Segment] = []
        self.level = 0
        self.fwd_end = -1
        self.param_key = {storage_key(p): name for name, p in params}
        self.param_by_id = {id(p): name for name, p in params}
        self.forward_order: list[str] = []
        self.param_first_block: dict[str, int | None] = {}
        self.param_first_t: dict[str, int] = {}
        self.backward_order: list[str] = []
        self._pre = {storage_key(t) for t in preexisting} | set(self.param_key)
        self._hooks = []
        self._finished = False
        self._reused: dict[int, int] = {}  # destination storage of an out-of-place twin -> its op index
        for index, module in block_modules:
            self._hooks.append(module.register_forward_pre_hook(self._make_pre(index)))
            self._hooks.append(module.register_forward_hook(self._make_post(index)))

    # ------------------------------------------------------------------ block boundaries
    def _make_pre(self, index: int):
        def pre(module: nn.Module, args: Any) -> None:
            self.stack.append(index)
            self.first_call.setdefault(index, self.t)
            self._enter(index)

        return pre

    def _make_post(self, index: int):
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == index:
                self.stack.pop()
            tensors = [o for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor)]
            self.outputs[index] = [(storage_key(o), o.nbytes) for o in tensors]
            self.label_graph(tensors, index)
            if self.stack:
                self._enter(self.stack[-1])

        return post

    def _enter(self, block: int | None) -> None:
        if block is None or block == self.current:
            return
        if self.current is None and self.phase == "forward":  # ops before the first block belong to it
            for a in self.allocs:
                if a.block is None:
                    a.block = block
            self.fwd_flops[block] = self.fwd_flops.get(block, 0) + self.fwd_flops.pop(None, 0)
            for name, owner in self.param_first_block.items():
                if owner is None:
                    self.param_first_block[name] = block
        self.current = block
        if self.segments:
            self.segments[-1].end = self.t
        self.segments.append(_Segment(self.phase, block, self.t, start_level=self.level))

    def label_graph(self, tensors: Iterable[torch.Tensor], block: int | None) -> None:
        """Give every autograd node reachable from ``tensors`` and not yet labelled to ``block``.

        Called at each block's forward exit, so a node belongs to the first block whose output
        depends on it: the block that created it (or, for ops between blocks, the next block).
        Nodes are keyed by sequence number; no reference to the graph is kept, so saved tensors
        die exactly when they would without the tracer.
        """
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if hasattr(node, "variable"):  # AccumulateGrad: owned through its parameter
                continue
            seq = node._sequence_nr()
            if seq in self.node_block:
                continue
            self.node_block[seq] = block
            stack.extend(n for n, _ in node.next_functions if n is not None)

    def begin_backward(self, loss: torch.Tensor | None = None) -> None:
        if loss is not None:  # the loss's own nodes run first in backward: the last block's
            before = set(self.node_block)
            self.label_graph([loss], self.current)
            self.loss_nodes = set(self.node_block) - before
            self.loss_block = self.current
        self._sweep()
        self.fwd_end = self.t
        self.phase = "backward"
        if self.segments:
            self.segments[-1].end = self.t
        self.current = None

    def finish(self, grads: Iterable[torch.Tensor]) -> None:
        """Sweep the last frees, mark parameter-gradient storages, remove the hooks (once)."""
        if self._finished:
            return
        self._finished = True
        self._sweep()
        self.t += 1
        if self.segments and self.segments[-1].end < 0:
            self.segments[-1].end = self.t
        if self.fwd_end < 0:
            self.fwd_end = self.t
        grad_keys = {storage_key(g) for g in grads}
        for key, (_, alloc) in self.live.items():
            if key in grad_keys:
                alloc.is_grad = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ dispatch
    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            _, alloc = self.live.pop(k)
            alloc.end = self._reused.get(k, self.t)
            self.level -= alloc.nbytes
        self._reused.clear()

    def _backward_block(self) -> int | None:
        node = torch._C._current_autograd_node()
        if node is None:
            return self.current
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a parameter's gradient lands
            name = self.param_by_id.get(id(variable))
            if name is not None:
                if name not in self.backward_order:
                    self.backward_order.append(name)
                return self.param_first_block.get(name, self.current)
            return self.current
        seq = node._sequence_nr()
        if seq in self.loss_nodes:
            self.loss_ops.append(self.t)
        return self.node_block.get(seq, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._sweep()
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        in_keys = {storage_key(t) for t in flat_in}
        if self.phase == "forward":
            for key in in_keys:
                name = self.param_key.get(key)
                if name is not None and name not in self.param_first_block:
                    self.forward_order.append(name)
                    self.param_first_block[name] = self.current
                    self.param_first_t[name] = self.t
            block = self.current
        else:
            block = self._backward_block()
            self._enter(block)
        if self.phase == "backward" and str(func) in _INPLACE_TWINS and args and isinstance(args[0], torch.Tensor):
            entry = self.live.get(storage_key(args[0]))
            if entry is not None and entry[1].start == self.t - 1:
                self._reused[entry[1].key] = self.t
        out = func(*args, **kwargs)
        flops = _op_flops(func, args, kwargs, out)
        if flops:
            table = self.fwd_flops if self.phase == "forward" else self.bwd_flops
            table[block] = table.get(block, 0) + flops
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in in_keys or key in self._pre or key in self.live:
                continue
            alloc = Allocation(key, storage.nbytes(), self.t, self.phase, block)
            self.allocs.append(alloc)
            self.live[key] = (StorageWeakRef(storage), alloc)
            self.level += alloc.nbytes
        self.t += 1
        return out


@dataclass
class Levels:
    """Memory levels after each op, from the allocation records."""

    activation: list[int] = field(default_factory=list)
    grads: list[int] = field(default_factory=list)


def levels(allocs: Iterable[Allocation], steps: int) -> Levels:
    """Activation bytes (parameter gradients excluded) and parameter-gradient bytes after each op."""
    act = [0] * (steps + 1)
    grad = [0] * (steps + 1)
    for a in allocs:
        series = grad if a.is_grad else act
        series[a.start] += a.nbytes
        if a.end is not None:
            series[a.end] -= a.nbytes
    out = Levels()
    run_a = run_g = 0
    for i in range(steps):
        run_a += act[i]
        run_g += grad[i]
        out.activation.append(run_a)
        out.grads.append(run_g)
    return out
