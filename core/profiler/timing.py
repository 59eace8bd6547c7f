"""``time_blocks``: measured forward, backward and recompute seconds of each block, on the real device.

FLOPs divided by one square-matmul rate ignore every non-matmul op (layer norms, GELU, softmax,
attention's reshapes, the loss) and the shape-dependence of matmul speed, so on CPU ranks the
FLOPs model predicts steps far shorter than they take (benchmarks/results/REPORT.md#cost_model). Timing the blocks themselves removes
both errors, and stays affordable for models that do not fit the machine:

* the model is traced on the meta device once, recording the shape and dtype of every block's
  inputs (no memory);
* each *distinct* block (same class, same parameter shapes, same input shapes: the 48 layers of
  GPT-2 XL are one) is materialised alone on the device, fed random tensors of those shapes, and
  timed: forward (with autograd recording, as in training), then backward from a random output
  gradient, ``warmup`` untimed rounds then the median of ``repeats``; the re-run forward of a
  checkpointed block costs its forward;
* the loss (``loss_fn`` on the last block's output) is timed with the last block: it is part of the
  step and not of any block;
* results are cached under :func:`~tightfit.profiler.device.cache_dir` keyed on the block shapes,
  the device, the thread count and torch's version, like the device profile.

Planners use the seconds in place of FLOPs / matmul rate whenever a profile carries them
(:attr:`ModelProfile.timed`), and say which model they used.

Example:
    >>> import torch
    >>> from tightfit.models import GPTConfig, build_gpt
    >>> from tightfit.profiler import profile_model
    >>> cfg = GPTConfig(vocab_size=64, n_positions=16, hidden=32, layers=2, heads=2)
    >>> ids = torch.zeros(2, 16, dtype=torch.long)
    >>> prof = time_blocks(build_gpt(cfg, device="meta"), ids, profile_model(build_gpt(cfg, device="meta"), ids),
    ...                    repeats=1, warmup=0, cache=False)
    >>> prof.timed
    True
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from tightfit.console import reporter
from tightfit.profiler.types import ModelProfile

_log = logging.getLogger(__name__)

__all__ = ["TIMING_SOURCE", "time_blocks", "block_inputs", "clock_of"]

TIMING_SOURCE = "measured block timings"


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype).removeprefix("torch."))
    if _holds_tensors(x):
        # An object carrying tensors of the meta forward (Hugging Face passes its KV cache, a ``DynamicCache``,
        # to every decoder layer even in training): replaying it would mix meta and real tensors, and its repr
        # (an address) would change the cache key every run. A training step discards such state; so do we.
        return None
    return x


def _holds_tensors(x: Any, depth: int = 4) -> bool:
    """Whether a non-tensor leaf holds tensors in its attributes (searched ``depth`` levels down: a
    ``DynamicCache`` holds a list of layers holding tensors)."""
    if isinstance(x, torch.Tensor):
        return True
    if depth == 0 or x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.device, type)):
        return False
    if isinstance(x, (list, tuple, set)):
        return any(_holds_tensors(v, depth - 1) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensors(v, depth - 1) for v in x.values())
    attrs = getattr(x, "__dict__", None)
    return isinstance(attrs, dict) and any(_holds_tensors(v, depth - 1) for v in attrs.values())


def block_inputs(model: nn.Module, example_inputs: Any) -> dict[str, tuple[tuple, dict]]:
    """The (args, kwargs) each block's forward receives, as ``("tensor", shape, dtype)`` specs, from one meta forward.

    ``model`` may be on any device; a deep copy is moved to meta, so nothing is allocated.
    """
    real = any(p.device.type != "meta" for p in model.parameters())
    try:
        return _block_inputs_on(copy.deepcopy(model).to("meta") if real else model, example_inputs, "meta")
    except Exception as exc:
        from tightfit.profiler.model import is_meta_failure

        if not real or not is_meta_failure(exc):
            raise
    # A step that cannot run on meta (``loss.item()``, a value-dependent op): a copy on the CPU records the
    # shapes instead, as profile_model's fallback does (the copy keeps the user's module untouched).
    return _block_inputs_on(copy.deepcopy(model).to("cpu"), example_inputs, "cpu")


def _block_inputs_on(meta: nn.Module, example_inputs: Any, device: str) -> dict[str, tuple[tuple, dict]]:
    from tightfit.profiler.blocks import find_blocks
    from tightfit.profiler.model import split_inputs

    specs: dict[str, tuple[tuple, dict]] = {}
    hooks = []
    for b in find_blocks(meta):
        if b.module is None:
            continue

        def hook(_m: nn.Module, args: tuple, kwargs: dict, name: str = b.name) -> None:
            if name not in specs:  # first call: a block reused later (tied) is timed at its first use
                specs[name] = (tree_map(_spec, args), tree_map(_spec, kwargs))
        hooks.append(b.module.register_forward_pre_hook(hook, with_kwargs=True))
    args, kwargs = split_inputs(example_inputs)
    to_meta = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    try:
        with torch.no_grad():
            out = meta(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    finally:
        for h in hooks:
            h.remove()
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    # Objects that filled up with tensors during the forward (a KV cache that was empty at the first layer's
    # hook) are state of the meta run: dropped, as _spec drops those that held tensors already.
    is_spec = lambda x: isinstance(x, tuple) and len(x) == 3 and x[0] == "tensor"  # noqa: E731
    specs = {name: tree_map(lambda x: None if not is_spec(x) and _holds_tensors(x) else x, spec, is_leaf=is_spec)
             for name, spec in specs.items()}
    specs["__output__"] = ((tuple(_spec(x) for x in leaves[:1]),), {})
    return specs


def _materialise(spec: Any, device: torch.device, dtype: torch.dtype | None, grad: bool) -> Any:
    def make(x: Any) -> Any:
        if not (isinstance(x, tuple) and len(x) == 3 and x[0] == "tensor"):
            return x
        _, shape, name = x
        dt = getattr(torch, name)
        if dt.is_floating_point:
            t = torch.randn(shape, device=device, dtype=dtype or dt)
            return t.requires_grad_(grad)
        if dt == torch.bool:
            return torch.ones(shape, device=device, dtype=dt)
        return torch.zeros(shape, device=device, dtype=dt)  # indices: 0 is valid for every embedding

    return tree_map(make, spec, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3 and x[0] == "tensor")


def _init(module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    real = copy.deepcopy(module).to_empty(device=device)
    for m in real.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
    with torch.no_grad():
        for p in real.parameters():
            if not torch.isfinite(p).all():  # modules without reset_parameters: small normal weights
                p.normal_(0.0, 0.02)
    if dtype is not None:
        real = real.to(dtype)
    return real


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_of(name: str) -> Callable[[], float]:
    """``"wall"``: ``time.perf_counter``; ``"cpu"``: this process's CPU time (user + system, every thread).

    CPU time is what a step costs on cores of its own: on a host shared with other jobs the wall time
    of one step can vary several-fold between repeats while its CPU time varies by a few percent. Only for CPU devices; a GPU's work is not the host's CPU time.
    """
    if name == "wall":
        return time.perf_counter
    if name == "cpu":
        return time.process_time
    raise ValueError(f"clock={name!r}: use 'wall' (elapsed time) or 'cpu' (process CPU time, CPU devices only)")


_EVICT: list[torch.Tensor] = []  # a buffer larger than a CPU's last-level cache, allocated on first use


def _evict_caches(device: torch.device) -> None:
    """Touch 64 MiB so the next timed phase starts with cold CPU caches, as it does inside a step.

    Timed alone, a block's weights and saved activations stay cached from one repeat to the next; inside
    a training step every other block's traffic evicts them, so warm timings of a small model undershoot its
    steps (a larger model's blocks do not fit the caches anyway). A GPU's caches are small next to its bandwidth."""
    if device.type != "cpu":
        return
    if not _EVICT:
        _EVICT.append(torch.zeros(2**24))
    _EVICT[0].add_(1.0)


def _time_one(module: nn.Module, spec: tuple[tuple, dict], device: torch.device, dtype: torch.dtype | None,
              warmup: int, repeats: int, loss_fn: Callable[[Any], torch.Tensor] | None,
              now: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(forward s, backward s): medians over ``repeats`` after ``warmup`` rounds."""
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        args, kwargs = _materialise(spec, device, dtype, grad=True)
        module.zero_grad(set_to_none=True)  # a real step's backward allocates fresh gradients too
        _evict_caches(device)
        _sync(device)
        t0 = now()
        out = module(*args, **kwargs)
        if loss_fn is not None:
            out = loss_fn(out)
        _sync(device)
        t1 = now()
        leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        if leaves:
            grads = [torch.ones_like(x) if x.dim() == 0 else torch.randn_like(x) for x in leaves]
            _evict_caches(device)
            _sync(device)
            t1b = now()
            torch.autograd.backward(leaves, grads)
            _sync(device)
            t2 = now() - t1b
        else:
            t2 = 0.0
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2)
        del out, leaves
    return statistics.median(fwd), statistics.median(bwd)


def _agree(measured: dict[str, list[float]], keys: list[str]) -> dict[str, list[float]]:
    """With a process group every rank keeps the slowest rank's seconds: a synchronous step is paced by it,
    and every rank must price (and so plan) from the same numbers. Every rank calls this once."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 or not keys:
        return measured
    flat = torch.tensor([v for k in keys for v in measured[k]], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        flat = flat.cuda()
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    vals = flat.cpu().tolist()
    return {k: vals[2 * i:2 * i + 2] for i, k in enumerate(keys)}


def _cache_path(key: str) -> Any:
    from tightfit.profiler.device import cache_dir

    return cache_dir() / f"blocks-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def time_blocks(model: nn.Module, example_inputs: Any, profile: ModelProfile, *,
                device: str | torch.device | None = None, dtype: torch.dtype | None = None, repeats: int = 5,
                warmup: int = 2, loss_fn: Callable[[Any], torch.Tensor] | None = None, cache: bool = True,
                refresh: bool = False, progress: bool = False, clock: str = "wall", agree: bool = True) -> ModelProfile:
    """``profile`` with each block's measured ``fwd_s``, ``bwd_s`` and ``recompute_s`` filled in.

    Args:
        model: the model (meta is fine: only one block at a time is materialised on ``device``).
        example_inputs: the profiled micro-batch (a tensor, a tuple or a dict, as for ``profile_model``).
        profile: its :class:`ModelProfile` (from ``profile_model`` on the same inputs).
        device: where to time (default: CUDA if available, else CPU).
        dtype: run blocks and float inputs in this dtype (the compute dtype under ``*-true`` precisions;
            default: the model's own).
        repeats: timed rounds per distinct block (the median is kept).
        warmup: untimed rounds per distinct block before the timed ones.
        loss_fn: ``loss_fn(output) -> scalar`` timed with the last block (default: the profile's
            ``default_loss``; pass the training loss, e.g. cross-entropy, for its real cost).
        cache: read and write the on-disk cache.
        refresh: ignore what the cache holds (and overwrite it).
        progress: log each distinct block's time at INFO (on stderr unless logging is configured).
        clock: ``"wall"`` (elapsed) or ``"cpu"`` (process CPU time: immune to other jobs on a shared
            CPU host; use the same clock when measuring the steps it predicts), see :func:`clock_of`.
        agree: with a process group, keep the slowest rank's numbers (a collective: every rank calls);
            ``False`` times on the calling rank alone (a rank that plans for the others and shares the plan).

    With an initialised process group and ``agree=True`` every rank must call it (same model and inputs): each
    rank times its blocks, then all keep the slowest rank's numbers, so every rank plans the same way.
    """

    from tightfit.profiler.blocks import find_blocks
    from tightfit.profiler.model import default_loss

    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_blocks(repeats={repeats}, warmup={warmup}): need repeats >= 1 and warmup >= 0")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    now = clock_of(clock)
    if clock == "cpu" and dev.type != "cpu":
        raise ValueError(f"time_blocks(clock='cpu') on {dev}: a GPU's time is not host CPU time; use clock='wall'")
    specs = block_inputs(model, example_inputs)
    modules = {b.name: b.module for b in find_blocks(model) if b.module is not None}
    last = next((b.name for b in reversed(profile.blocks) if b.name in modules), None)
    out_spec = specs.pop("__output__")

    def key_of(name: str) -> str:
        m = modules[name]
        shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters()]
        return json.dumps([type(m).__name__, shapes, repr(specs.get(name)), name == last], default=str)

    env = f"{dev.type} | {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''} | threads " \
          f"{torch.get_num_threads()} | torch {torch.__version__} | clock {clock} | dtype {dtype} | loss {getattr(loss_fn, '__name__', loss_fn)}"
    keys = {name: key_of(name) for name in modules if name in specs}
    path = _cache_path(env + "\n" + "\n".join(sorted(set(keys.values()))) + f"\n{repeats}/{warmup} cold")
    measured: dict[str, list[float]] = {}
    if cache and not refresh and path.is_file():
        try:
            measured = json.loads(path.read_text())
        except (OSError, ValueError):
            measured = {}
    loss = loss_fn or default_loss
    say = reporter(_log, "time_blocks", enabled=progress)
    cached = len(measured)
    for name, k in keys.items():
        if k in measured:
            continue
        block = _init(modules[name], dev, dtype)
        f, b = _time_one(block, specs[name], dev, dtype, warmup, repeats, loss if name == last else None, now)
        measured[k] = [f, b]
        del block
        say(f"{name} ({type(modules[name]).__name__}): forward {f * 1e3:.2f} ms, backward {b * 1e3:.2f} ms")
    del out_spec
    if cache and len(measured) > cached:  # a run that found everything cached writes nothing
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measured))
    if agree:
        measured = _agree(measured, sorted(set(keys.values())))
    blocks = []
    for b in profile.blocks:
        if b.name in keys:
            f, bw = measured[keys[b.name]]
            b = dataclasses.replace(b, fwd_s=max(f, 1e-9), bwd_s=max(bw, 0.0), recompute_s=max(f, 1e-9))
        blocks.append(b)
    return dataclasses.replace(profile, blocks=tuple(blocks),
                               notes=(*profile.notes, f"{TIMING_SOURCE} on {dev.type} ({torch.get_num_threads()} "
                                                      f"threads, {clock} clock), median of {repeats}"))
