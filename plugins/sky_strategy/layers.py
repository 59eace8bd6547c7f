"""The LightningModule convention for pipelines, stage modules and per-layer measurement.

A LightningModule trained with ``strategy="sky"`` declares its layer sequence:

    class Net(L.LightningModule):
        pipeline_layers = ("embed", "blocks", "head")   # submodule names, in forward order
        def forward(self, x):            # must equal applying the layers in that order
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)
        def loss_fn(self, output, target):   # the per-microbatch loss (mean-reduced)
            return F.cross_entropy(output, target)

A name that is a ``ModuleList``/``Sequential``/``ModuleDict`` expands to its children, so
``"blocks"`` becomes ``blocks.0 ... blocks.N-1``: each is one layer the planner can place. Every
trainable parameter must belong to exactly one layer (parameters tied across layers cannot be split
over ranks). A layer takes the previous layer's output (a tensor or a tuple of tensors) and returns
the next. The batch is split into ``(inputs, target)`` by ``pipeline_batch(batch)`` when the module
defines it, else a ``(inputs, target)`` pair is expected.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

__all__ = ["ConventionError", "Layer", "resolve_layers", "split_batch", "call_layer", "StageModule", "TimedStage",
           "HostTimer", "EventTimer", "stage_timer", "LayerMeasurement", "measure_layers"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class ConventionError(TypeError):
    """The LightningModule does not follow the pipeline convention (see the module docstring)."""


@dataclass(frozen=True)
class Layer:
    """One placeable layer: its fully-qualified name in the LightningModule and the module."""

    name: str
    module: nn.Module

    def parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for n, p in self.module.named_parameters():
            yield f"{self.name}.{n}", p

    def buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, b in self.module.named_buffers():
            yield f"{self.name}.{n}", b


def resolve_layers(module: nn.Module) -> list[Layer]:
    """The declared layer sequence, checked to cover every trainable parameter exactly once."""
    names = getattr(module, "pipeline_layers", None)
    if callable(names):
        names = names()
    if not names or isinstance(names, str):
        raise ConventionError(
            f"{type(module).__name__} declares no pipeline layers: set `pipeline_layers = (\"embed\", \"blocks\", "
            "\"head\")` (submodule names in forward order; a ModuleList expands to its children)")
    layers: list[Layer] = []
    for name in names:
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            raise ConventionError(f"pipeline_layers names {name!r}, which is not a submodule of "
                                  f"{type(module).__name__}") from None
        if isinstance(sub, _CONTAINERS):
            layers += [Layer(f"{name}.{child}", m) for child, m in sub.named_children()]
        else:
            layers.append(Layer(name, sub))
    owner: dict[int, str] = {}
    for layer in layers:
        for fqn, p in layer.parameters():
            if id(p) in owner:
                raise ConventionError(f"parameter {fqn} is shared with {owner[id(p)]}; tied parameters cannot be split "
                                      "across pipeline stages: untie them or keep both uses inside one layer")
            owner[id(p)] = fqn
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        raise ConventionError(f"parameter(s) {missing[:3]} belong to no pipeline layer; add their module to "
                              "pipeline_layers (every trainable parameter must live in exactly one layer)")
    if not hasattr(module, "loss_fn"):
        raise ConventionError(f"{type(module).__name__} has no `loss_fn(output, target)`: SkyStrategy computes the loss "
                              "per microbatch on the last stage with it")
    return layers


def split_batch(module: nn.Module, batch) -> tuple[object, torch.Tensor]:
    """``(inputs, target)`` of a batch: ``module.pipeline_batch(batch)`` or a 2-element tuple/list."""
    hook = getattr(module, "pipeline_batch", None)
    if hook is not None:
        return hook(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConventionError(f"cannot split a batch of type {type(batch).__name__} into (inputs, target): return "
                          "(inputs, target) from the dataloader or define `pipeline_batch(self, batch)`")


def call_layer(layer: nn.Module, x):
    """Apply one pipeline layer to the previous layer's output (a tuple is unpacked into arguments)."""
    return layer(*x) if isinstance(x, tuple) else layer(x)


class StageModule(nn.Module):
    """Runs a contiguous run of layers; the layers stay registered in the LightningModule too, so
    gradients land on the original parameters and checkpoints keep the original names."""

    def __init__(self, layers: list[nn.Module], context: Callable[[], AbstractContextManager] | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._context = context or nullcontext

    def forward(self, *args):
        x = args if len(args) > 1 else args[0]
        with self._context():
            for layer in self.layers:
                x = call_layer(layer, x)
        return x


class _Elapsed:
    """A finished host-clock interval, with the CPU time this thread spent in it."""

    __slots__ = ("_s", "_cpu")

    def __init__(self, seconds: float, cpu: float | None = None) -> None:
        self._s, self._cpu = seconds, cpu

    def seconds(self) -> float:
        return self._s

    def work_seconds(self) -> float:
        """The compute itself: this thread's CPU time when torch computes on it alone (one intra-op
        thread), else the elapsed time. On a host shared with other jobs the elapsed time also holds
        their preemptions, which a slowed rank's sleep would multiply by its slowdown."""
        return self._cpu if self._cpu is not None else self._s


class HostTimer:
    """Times a stage's compute with the host clock: right where work is synchronous (CPU devices)."""

    def start(self) -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def stop(self, token) -> _Elapsed:
        wall, cpu = token if isinstance(token, tuple) else (token, None)
        single = cpu is not None and torch.get_num_threads() == 1
        return _Elapsed(time.perf_counter() - wall, time.thread_time() - cpu if single else None)


class _EventInterval:
    __slots__ = ("_start", "_end")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._start, self._end = start, end

    def seconds(self) -> float:
        self._end.synchronize()  # waits for this stream's work up to the event, not for the device
        return self._start.elapsed_time(self._end) / 1e3


class EventTimer:
    """Times a stage's compute with CUDA events on the stream it runs on.

    The start event is recorded when the chunk is issued, after the schedule made the stream wait for
    the chunk's incoming activations (NCCL ``work.wait()`` is a wait *on the stream*), so a pending
    receive is not counted as compute; nothing blocks the host until the time is read.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, token: torch.cuda.Event) -> _EventInterval:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        return _EventInterval(token, end)


def stage_timer(device: torch.device) -> HostTimer | EventTimer:
    """CUDA events on a GPU, the host clock elsewhere."""
    return EventTimer(device) if device.type == "cuda" else HostTimer()


class TimedStage(PipelineStage):
    """A :class:`PipelineStage` that times its compute per microbatch and, when this rank plays a slower
    device (``slowdown() > 1``), sleeps ``(slowdown - 1) x`` the compute it just did: the rank is busy
    exactly as long as the slower device would be, without using the CPU that other ranks share
    (on a CPU computing on one thread, "the compute" is the thread's CPU time, see ``work_seconds``).

    On a GPU the time comes from CUDA events (:class:`EventTimer`): with no slowdown nothing waits
    per chunk (the intervals are read when ``busy_s`` is, once per step), and with one only this
    chunk's own stream work is waited for, never the whole device (a device-wide synchronise after
    every chunk would serialise the pipeline and count pending NCCL waits as compute, which the
    injected slowdown would then multiply).
    """

    def __init__(self, *args, slowdown: Callable[[], float], timer: HostTimer | EventTimer | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._slowdown = slowdown
        self._timer = timer if timer is not None else stage_timer(self.device)
        self._busy = 0.0
        self._open: list = []  # intervals not yet read (GPU: their events may still be pending)
        self.chunks_run = 0

    @property
    def busy_s(self) -> float:
        """Compute (+ injected delay) seconds since the last reset; reading it waits for pending chunks."""
        if self._open:
            self._busy += sum(i.seconds() for i in self._open)
            self._open.clear()
        return self._busy

    @busy_s.setter
    def busy_s(self, value: float) -> None:
        self._open.clear()
        self._busy = value

    def _timed(self, fn, *args, **kwargs):
        token = self._timer.start()
        out = fn(*args, **kwargs)
        interval = self._timer.stop(token)
        factor = self._slowdown() - 1.0
        if factor > 0:
            elapsed = interval.seconds()
            work = interval.work_seconds() if hasattr(interval, "work_seconds") else elapsed
            time.sleep(factor * work)
            self._busy += elapsed + factor * work
        else:
            self._open.append(interval)
        return out

    def forward_one_chunk(self, *args, **kwargs):
        self.chunks_run += 1
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)


@dataclass(frozen=True)
class LayerMeasurement:
    """One rank's measurement of one layer on one microbatch.

    Args:
        seconds: median forward+backward time (already divided by an injected speed factor).
        param_bytes: bytes of its parameters; activation_bytes: bytes autograd saved in its forward
            (parameters excluded); output_bytes: bytes of its output.
        kind: the layer's type, parameter shapes and input shapes: layers of one kind do the same work.
        samples: every timed repeat (seconds, divided by the speed factor like ``seconds``).
    """

    seconds: float
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    kind: str = ""
    samples: tuple[float, ...] = ()


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(t) for t in x)
    return 0


def _shapes(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype))
    if isinstance(x, (tuple, list)):
        return tuple(_shapes(t) for t in x)
    return type(x).__name__


def _detach(x):
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point())
    return tuple(_detach(t) for t in x)


def _grad_like(y):
    if isinstance(y, torch.Tensor):
        return [y], [torch.ones_like(y)]
    outs, grads = [], []
    for t in y:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            outs.append(t)
            grads.append(torch.ones_like(t))
    return outs, grads


def _fwd_bwd(mod: nn.Module, xin, sync: Callable[[], None], clock: Callable[[], float], pack=None):
    """(seconds, output) of one forward+backward of ``mod`` on ``xin``; ``pack`` records saved tensors."""
    start = clock()
    if pack is not None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = call_layer(mod, xin)
    else:
        y = call_layer(mod, xin)
    outs, grads = _grad_like(y)
    if outs:
        torch.autograd.backward(outs, grads)
    sync()
    return clock() - start, y


def measure_layers(layers: list[Layer], sample, *, device: torch.device, repeats: int = 3,
                   speed_factor: float = 1.0, sync: Callable[[], None] = lambda: None,
                   progress: Callable[[str], None] | None = None, offload: bool = False,
                   clock: Callable[[], float] = time.perf_counter) -> list[LayerMeasurement]:
    """Time each layer's forward+backward on ``sample`` (one microbatch), layer after layer.

    Each layer is measured alone on the previous layer's real output, so a rank only ever needs
    one layer's weights on its device at a time. The median of ``repeats`` runs after one warm-up is
    reported, divided by ``speed_factor`` (a rank playing a device 3x slower reports 3x the time).
    With ``offload`` each layer is moved to ``device`` only while it is measured (the model waits in
    host memory until it is partitioned), its repeats back to back. Without it the repeats go round
    the layers in model order (layer 0..N-1, then again): in a pipeline a layer runs after its
    stage's other layers and microbatches, not right after itself, and a layer timed back to back
    finds its weights and gradients still in cache (back-to-back timings of a small model come out well
    below the same layers inside the running pipeline).
    ``clock``: ``time.perf_counter`` (elapsed) or a CPU clock (:func:`tightfit.profiler.timing.clock_of`,
    CPU devices on a shared host).
    """
    out: list[LayerMeasurement] = []
    inputs: list = []
    times: list[list[float]] = []
    x = sample
    for n, layer in enumerate(layers):
        mod = layer.module
        if offload:
            mod.to(device)
        params = {p.data_ptr() for p in mod.parameters()}
        param_bytes = sum(p.numel() * p.element_size() for p in mod.parameters())
        saved: dict[int, int] = {}

        def pack(t, saved=saved, params=params):
            if t.data_ptr() not in params:
                saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel() * t.element_size())
            return t

        inputs.append(x)
        _, y = _fwd_bwd(mod, _detach(x) if n > 0 else x, sync, clock, pack)  # warm-up, records activations
        mine = [_fwd_bwd(mod, _detach(x) if n > 0 else x, sync, clock)[0] for _ in range(repeats)] if offload else []
        times.append(mine)
        if offload:
            mod.zero_grad(set_to_none=True)
            mod.to("cpu")
        kind = repr((type(mod).__qualname__, [(n_, tuple(p.shape), str(p.dtype)) for n_, p in mod.named_parameters()],
                     _shapes(x)))
        out.append(LayerMeasurement(seconds=0.0, param_bytes=param_bytes, activation_bytes=sum(saved.values()),
                                    output_bytes=_nbytes(y), kind=kind))
        x = y.detach() if isinstance(y, torch.Tensor) else tuple(t.detach() for t in y)
        if progress is not None and (n + 1) % max(1, len(layers) // 4) == 0:
            progress(f"profiled {n + 1}/{len(layers)} layers")
    if not offload:
        for _ in range(repeats):
            for n, layer in enumerate(layers):
                times[n].append(_fwd_bwd(layer.module, _detach(inputs[n]) if n > 0 else inputs[n], sync, clock)[0])
        for layer in layers:
            layer.module.zero_grad(set_to_none=True)
    return [dataclasses.replace(m, seconds=statistics.median(t) / speed_factor,
                                samples=tuple(v / speed_factor for v in t)) for m, t in zip(out, times)]
