"""``profile_model``: trace one training (or forward) step on the meta device and return a :class:`ModelProfile`.

The model runs under ``FakeTensorMode``: tensors carry shapes, dtypes and a device but their storage
is on the meta device, so nothing is allocated and a 20B-parameter GPT-2 profiles on a laptop. The
fake device is the model's device (``"cpu"`` for a model built on meta), so PyTorch picks the same
kernels as a real step there (e.g. the fused CPU attention) and the trace saves what they save.
A :class:`~tightfit.profiler.trace.StepTracer` records allocations, frees, FLOPs and block
boundaries; :mod:`tightfit.profiler.blocks` decides the blocks.

Example:
    >>> import torch
    >>> from tightfit.models import build_gpt
    >>> from tightfit.profiler import profile_model
    >>> model = build_gpt("gpt2-xl", device="meta")
    >>> prof = profile_model(model, torch.zeros(1, 1024, dtype=torch.long))   # doctest: +SKIP
    >>> prof.param_numel, len(prof.blocks)                                       # doctest: +SKIP
    (1557611200, 53)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from tightfit.console import reporter
from tightfit.profiler.blocks import BlockSpec, find_blocks
from tightfit.profiler.memory import estimate_peak
from tightfit.profiler.trace import StepTracer, levels
from tightfit.profiler.types import BlockProfile, MemoryEvent, ModelProfile, ParamInfo

_log = logging.getLogger(__name__)

__all__ = ["profile_model", "MetaProfilingError", "default_loss", "split_inputs", "is_meta_failure"]


class MetaProfilingError(RuntimeError):
    """The model cannot run on the meta device (data-dependent shapes or an op without a meta kernel)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_loss(output: Any) -> torch.Tensor:
    """What ``profile_model`` backpropagates when no ``loss_fn`` is given.

    ``output.loss`` when present (Hugging Face outputs given labels), a scalar tensor as is, otherwise
    the sum of the first floating-point tensor (``logits.sum()``: one reduction, its gradient is a
    broadcast of ones, close to what a real loss costs in memory).
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    logits = getattr(output, "logits", None)
    candidates = [logits] if isinstance(logits, torch.Tensor) else []
    candidates += [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    for t in candidates:
        if t.is_floating_point() and t.requires_grad:
            return t.sum()
    raise ValueError(
        f"cannot find a differentiable output to backpropagate in a {type(output).__name__}; "
        "pass loss_fn=lambda out: ... returning a scalar, or step='forward'"
    )


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a forward call from example inputs: a dict is keyword arguments, a tuple
    positional ones, anything else the single positional argument."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _describe_inputs(args: tuple, kwargs: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, a in enumerate(args):
        for j, t in enumerate(t for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)):
            out[f"arg{i}" + (f".{j}" if j else "")] = list(t.shape)
    for k, v in kwargs.items():
        for j, t in enumerate(t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)):
            out[k + (f".{j}" if j else "")] = list(t.shape)
    if not out:  # e.g. a TorchRec KeyedJaggedTensor, which pytree does not open
        for i, a in enumerate(args):
            values = getattr(a, "values", None)
            if callable(values):
                out[f"arg{i}.values"] = list(values().shape)
    return out


def _fake_copy(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake tensors (call under FakeTensorMode)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            dt = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=dt, device=device),
                                       requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device)
    return copy.deepcopy(model, memo)


def _to_device(x: Any, device: torch.device, fake: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if fake is not None:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device) if x.is_meta else \
                fake.from_tensor(x.to(device) if x.device != device else x)
        return x.to(device)
    to = getattr(x, "to", None)
    if callable(to) and fake is None:  # KeyedJaggedTensor and friends
        return to(device)
    return x


def _assign(specs: list[BlockSpec], tracer: StepTracer, canonical: dict[int, str]
            ) -> tuple[list[int], dict[int, int]]:
    """Block order by first use, and the owning block of every parameter (its first user wins)."""
    candidates: dict[int, set[int]] = {}
    for i, spec in enumerate(specs):
        for _, p in spec.params:
            candidates.setdefault(id(p), set()).add(i)
    first_use: dict[int, int] = dict(tracer.first_call)
    owner: dict[int, int] = {}
    for pid, blocks in candidates.items():
        name = canonical[pid]
        user = tracer.param_first_block.get(name)
        if user not in blocks:
            user = min(blocks, key=lambda i: (first_use.get(i, sys.maxsize), i))
        owner[pid] = user
        if specs[user].module is None and name in tracer.param_first_t:  # parameter-only block: first use
            first_use[user] = min(first_use.get(user, sys.maxsize), tracer.param_first_t[name])
    owning = set(owner.values())
    for i in owning:
        first_use.setdefault(i, sys.maxsize)
    order = sorted(first_use, key=lambda i: (first_use[i], i))
    return order, owner


def _name_of(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    for attr in ("name", "model_type"):
        value = getattr(config, attr, None)
        if isinstance(value, str) and value and value != "custom":
            return value
    return type(model).__name__


def _trace(model: nn.Module, args: tuple, kwargs: dict, *, step: str, loss_fn: Callable[[Any], torch.Tensor] | None,
           checkpointing: Iterable[str] | str | None, name: str | None, target: torch.device, meta: bool,
           say: Callable[[str], None], started: float) -> ModelProfile:
    specs = find_blocks(model)
    named = list(model.named_parameters())
    canonical = {id(p): n for n, p in named}
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n != canonical[id(p)]:
            aliases.setdefault(id(p), []).append(n)
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    tracer = StepTracer([(i, s.module) for i, s in enumerate(specs) if s.module is not None], named,
                        [*model.parameters(), *model.buffers(), *inputs])
    model.train(step == "train")
    say(f"{len(named)} parameter tensors, {len(specs)} candidate blocks; running one {step} step")
    try:
        with (torch.enable_grad() if step == "train" else torch.no_grad()), tracer:
            out = model(*args, **kwargs)
            if step == "train":
                loss = (loss_fn or default_loss)(out)
                # The output dies before backward, as in a training_step that returns only the loss.
                del out
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                                     f"{tuple(getattr(loss, 'shape', ()))}")
                say(f"forward done ({tracer.t} ops); backward")
                tracer.begin_backward(loss)
                loss.backward()
                del loss
            else:
                del out
            tracer.finish([p.grad for p in model.parameters() if p.grad is not None])
    finally:
        tracer.finish([])  # idempotent: removes the hooks if the step failed
    order, owner = _assign(specs, tracer, canonical)
    lv = levels(tracer.allocs, tracer.t)
    act = lv.activation
    fwd_end = tracer.fwd_end
    alive_at_end = {a.key: a for a in tracer.allocs if a.start < fwd_end and (a.end is None or a.end > fwd_end)}

    def seg_peak(start: int, end: int) -> int:
        return max(act[start:max(end, start + 1)], default=0)

    fwd_above: dict[int, int] = {}
    bwd_peak: dict[int, int] = {}
    # The loss's backward (ops after the last block, folded into it) is priced apart from the block's own: it runs
    # before any node of the block, so before a sharded runtime gathers the block's parameters for its backward.
    loss_ops = set(tracer.loss_ops)
    loss_peak: dict[int, int] = {}
    for t in loss_ops:
        block = tracer.loss_block
        if block is not None and 0 <= t < len(act):
            loss_peak[block] = max(loss_peak.get(block, 0), act[t])
    timeline: list[MemoryEvent] = []
    for seg in tracer.segments:
        peak = seg_peak(seg.start, seg.end)
        if seg.phase == "forward":
            before = act[seg.start - 1] if seg.start > 0 else 0
            fwd_above[seg.block] = max(fwd_above.get(seg.block, 0), peak - before)
        else:
            own = [act[t] for t in range(seg.start, max(seg.end, seg.start + 1)) if t not in loss_ops and t < len(act)]
            if own or seg.block not in loss_peak:
                bwd_peak[seg.block] = max(bwd_peak.get(seg.block, 0), max(own, default=0))
        label = specs[seg.block].name
        if timeline and timeline[-1].phase == seg.phase and timeline[-1].block == label:
            timeline[-1] = MemoryEvent(phase=seg.phase, block=label, bytes=max(timeline[-1].bytes, peak))
        else:
            timeline.append(MemoryEvent(phase=seg.phase, block=label, bytes=peak))

    by_id = {id(p): p for _, p in named}
    use_rank = {n: r for r, n in enumerate(tracer.forward_order)}
    ordered_params = sorted(by_id, key=lambda pid: (use_rank.get(canonical[pid], len(use_rank)), list(by_id).index(pid)))
    params = tuple(
        ParamInfo(name=canonical[pid], shape=tuple(by_id[pid].shape), dtype=_dtype_name(by_id[pid].dtype),
                  numel=by_id[pid].numel(), bytes=by_id[pid].numel() * by_id[pid].element_size(),
                  block=specs[owner[pid]].name, aliases=tuple(aliases.get(pid, ())),
                  requires_grad=by_id[pid].requires_grad)
        for pid in ordered_params
    )
    blocks = []
    prefix = 0
    for index, i in enumerate(order):
        spec = specs[i]
        mine = [p for p in params if p.block == spec.name]
        saved = sum(a.nbytes for a in alive_at_end.values() if a.phase == "forward" and a.block == i)
        out_keys = {k for k, _ in tracer.outputs.get(i, [])}
        ckpt = sum(alive_at_end[k].nbytes for k in out_keys if k in alive_at_end and alive_at_end[k].block == i)
        transient = max(0, bwd_peak.get(i, 0) - prefix - saved) if i in bwd_peak else 0
        loss_transient = max(0, loss_peak[i] - prefix - saved) if i in loss_peak else 0
        blocks.append(BlockProfile(
            name=spec.name, type=spec.type, index=index, params=tuple(p.name for p in mine),
            param_numel=sum(p.numel for p in mine), param_bytes=sum(p.bytes for p in mine),
            fwd_flops=float(tracer.fwd_flops.get(i, 0)), bwd_flops=float(tracer.bwd_flops.get(i, 0)),
            saved_bytes=saved, checkpoint_bytes=min(ckpt, saved), transient_bytes=transient,
            output_bytes=sum(n for _, n in tracer.outputs.get(i, [])), checkpointable=spec.module is not None,
            fwd_transient_bytes=max(0, fwd_above.get(i, 0) - saved), loss_transient_bytes=loss_transient,
        ))
        prefix += saved
    param_bytes = sum(p.bytes for p in params)
    totals = [a + g for a, g in zip(act, lv.grads)]
    notes = [f"traced on the meta device as {target.type}" if meta else f"traced on a real {target} device"]
    dtypes = sorted({p.dtype for p in params})
    profile = ModelProfile(
        model=name or _name_of(model), step=step,  # type: ignore[arg-type]
        inputs=_describe_inputs(args, kwargs), params=params, blocks=tuple(blocks),
        forward_order=tuple(tracer.forward_order), backward_order=tuple(tracer.backward_order),
        timeline=tuple(timeline), activation_peak_bytes=max(act, default=0),
        peak_bytes=param_bytes + max(totals, default=0),
        fwd_flops=float(sum(tracer.fwd_flops.values())), bwd_flops=float(sum(tracer.bwd_flops.values())),
        param_dtype=dtypes[0] if len(dtypes) == 1 else "+".join(dtypes), notes=tuple(notes), device=target.type,
    )
    if checkpointing is not None:
        est = estimate_peak(profile, checkpointing)
        profile = dataclasses.replace(profile, checkpointed=est.checkpointed,
                                      checkpointed_activation_peak_bytes=est.activation_bytes,
                                      checkpointed_peak_bytes=est.total_bytes)
    say(f"done in {time.perf_counter() - started:.1f} s: {len(blocks)} blocks, {tracer.t} ops")
    return profile


def profile_model(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    example_inputs: Any,
    *,
    step: Literal["train", "forward"] = "train",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    checkpointing: Iterable[str] | str | None = None,
    device: str | torch.device = "meta",
    param_dtype: torch.dtype | None = None,
    name: str | None = None,
    progress: bool = False,
    fallback: str | torch.device | None = None,
) -> ModelProfile:
    """Profile one step of a model without allocating it.

    Args:
        model_or_factory: a module (any device, meta included; it is not modified) or a function
            building one (called under the fake mode, so even its construction allocates nothing).
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments,
            shaped like a real batch (values are not used on meta).
        step: ``"train"`` (forward + backward) or ``"forward"`` (under ``torch.no_grad``).
        loss_fn: ``loss_fn(output) -> scalar``; default :func:`default_loss`.
        checkpointing: blocks (names, or ``"all"``) whose checkpointed peak to record in the profile.
        device: ``"meta"`` (default: nothing allocated) or a real device for models that cannot run on
            meta (data-dependent shapes); then the model is copied there, so use a small batch.
        param_dtype: profile with floating-point parameters cast to this dtype.
        name: the model's name in the profile (default: ``config.name``/``model_type``, or the class name).
        progress: log what it is doing at INFO (on stderr unless logging is configured: :func:`tightfit.console.reporter`).
        fallback: a real device (``"cpu"``) to profile on when the model cannot run on meta, instead
            of raising; the profile's notes say so. The model is copied there: keep the batch small.

    Raises:
        MetaProfilingError: the model cannot run on meta; the message names the op and the fallback.
    """
    if step not in ("train", "forward"):
        raise ValueError(f"step={step!r} must be 'train' or 'forward'")
    started = time.perf_counter()
    say = reporter(_log, "profile_model", enabled=progress)
    meta = torch.device(device).type == "meta"
    fake_mode = None
    if meta:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs = split_inputs(example_inputs)
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            if isinstance(model_or_factory, nn.Module):
                src = model_or_factory
                first = next(iter(src.parameters()), None)
                target = torch.device("cpu") if first is None or first.is_meta else first.device
                if meta:
                    model = _fake_copy(src, target, param_dtype)
                else:
                    target = torch.device(device)
                    model = copy.deepcopy(src).to(target)
                    if param_dtype is not None:
                        model = model.to(param_dtype)
            else:
                target = torch.device("cpu") if meta else torch.device(device)
                with torch.device(target):
                    model = model_or_factory()
                if param_dtype is not None:  # Module.to() cannot swap fake parameters: rebuild them
                    model = _fake_copy(model, target, param_dtype) if meta else model.to(param_dtype)
            say(f"traced copy of {type(model).__name__} on {'meta (as ' + str(target) + ')' if meta else target}")
            args = tree_map(lambda x: _to_device(x, target, fake_mode), args)
            kwargs = tree_map(lambda x: _to_device(x, target, fake_mode), kwargs)
            return _trace(model, args, kwargs, step=step, loss_fn=loss_fn, checkpointing=checkpointing,
                          name=name, target=target, meta=meta, say=say, started=started)
    except MetaProfilingError:
        raise
    except Exception as exc:
        if not meta or not is_meta_failure(exc):
            raise
        what = type(model_or_factory).__name__ if isinstance(model_or_factory, nn.Module) else "this model"
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        if fallback is not None:
            say(f"cannot run on meta ({type(exc).__name__}: {first_line}); profiling on {fallback} instead")
            prof = profile_model(model_or_factory, example_inputs, step=step, loss_fn=loss_fn, checkpointing=checkpointing,
                                 device=fallback, param_dtype=param_dtype, name=name, progress=progress)
            why = f"meta device unsupported ({type(exc).__name__}: {first_line}); fell back to {fallback}"
            return dataclasses.replace(prof, notes=(why, *prof.notes))
        raise MetaProfilingError(
            f"{what} cannot be profiled on the meta device: {type(exc).__name__}: {first_line} (an op whose output "
            "shape depends on tensor values, or one without a meta kernel). Profile it on a real device with a "
            "small batch instead: profile_model(model, small_inputs, device='cpu')"
        ) from exc


def is_meta_failure(exc: Exception) -> bool:
    """Whether ``exc`` says the step cannot run on the meta device (fake tensors): an unsupported operator,
    a data-dependent value or output shape (``loss.item()``), a missing meta kernel. The profilers then run
    the step on a real device instead; any other exception is the model's own and is raised."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    known = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
             NotImplementedError)
    if isinstance(exc, known):
        return True
    text = f"{type(exc).__name__} {exc}"
    return any(s in text for s in ("meta", "Meta", "data-dependent", "DataDependent", "GuardOnDataDependent",
                                   "item()", "fake tensor", "FakeTensor"))
