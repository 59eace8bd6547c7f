"""Decide once on rank 0, share the decision as JSON text with every rank.

Every strategy makes its plan the same way: one rank (rank 0) runs the planner, every other rank
receives the *same* plan. :func:`decide_on_rank0` does that with a byte tensor broadcast (no
``pickle``: a plan is a frozen dataclass with ``to_json`` / ``from_json``), and re-raises an error
rank 0 met on every rank, with its type and numbers when it is one of the planner errors, so no rank
hangs waiting for a plan that will never come.

Core never starts processes; this module only uses a process group the caller already has, and
imports ``torch.distributed`` lazily so planners stay free of it.

Example (one process, no process group: the decision is simply returned):
    >>> decide_on_rank0(lambda: {"units": 3}, encode=json.dumps, decode=json.loads)
    {'units': 3}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tightfit.planner.errors import PlanError, PlanInfeasibleError, PlanMismatchError

__all__ = ["decide_on_rank0", "broadcast_text", "slowest"]

T = TypeVar("T")


def _group_device(group: Any) -> torch.device:
    """NCCL moves only CUDA tensors; every other backend takes CPU tensors."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def slowest(seconds: float, *, group: Any = None) -> float:
    """The largest of every rank's ``seconds``: the slowest rank paces a synchronous step, so timings are
    agreed on as the maximum (on the group's device: NCCL moves only CUDA tensors)."""
    import torch.distributed as dist

    t = torch.tensor([float(seconds)], dtype=torch.float64, device=_group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def broadcast_text(text: str | None, *, src: int = 0, group: Any = None) -> str:
    """Send ``text`` from global rank ``src`` to every rank of ``group`` (UTF-8 bytes in a tensor).

    Ranks other than ``src`` pass ``None`` (their argument is ignored). Without an initialised
    process group, or in a world of one, ``text`` is returned as it is.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if text is None:
            raise ValueError("broadcast_text: the source rank must pass the text (got None in a world of one)")
        return text
    device = _group_device(group)
    is_src = dist.get_rank() == src
    data = (text or "").encode("utf-8") if is_src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if is_src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if n else torch.empty(0, dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().tolist()).decode("utf-8") if n else ""


def _error_record(exc: BaseException) -> dict[str, Any]:
    rec: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc), "class": _qualified(type(exc))}
    if isinstance(exc, PlanInfeasibleError):
        rec["attrs"] = {"needed_bytes": exc.needed_bytes, "budget_bytes": exc.budget_bytes,
                        "suggestions": list(exc.suggestions), "tier": exc.tier}
    elif isinstance(exc, PlanMismatchError):
        rec["attrs"] = {"field": exc.field, "expected": _jsonable(exc.expected), "actual": _jsonable(exc.actual)}
    return rec


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _qualified(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _same_class(base: type, qualified: str | None) -> type:
    """``base``, or its subclass this process has defined whose qualified name is ``qualified``.

    Every rank runs the same code, so the plugin whose subclass rank 0 raised (a ``MemoryLimitError``) has defined
    it here too; core never imports a plugin to find it (the one-way rule), it looks among the classes defined.
    """
    stack = [base]
    while qualified and stack:
        kind = stack.pop()
        if _qualified(kind) == qualified:
            return kind
        stack.extend(kind.__subclasses__())
    return base


def _raise_record(rec: dict[str, Any]) -> None:
    name, message, attrs, qualified = rec["error"], rec["message"], rec.get("attrs"), rec.get("class")
    if attrs is not None and "needed_bytes" in attrs:  # a PlanInfeasibleError, or a plugin's subclass of it
        raise _same_class(PlanInfeasibleError, qualified)(
            message, needed_bytes=attrs.get("needed_bytes", 0), budget_bytes=attrs.get("budget_bytes", 0),
            suggestions=tuple(attrs.get("suggestions", ())), tier=attrs.get("tier", "device"))
    if attrs is not None and "field" in attrs:  # a PlanMismatchError, or a subclass
        raise _same_class(PlanMismatchError, qualified)(
            message, field=attrs.get("field", ""), expected=attrs.get("expected"), actual=attrs.get("actual"))
    if name == "PlanError":
        raise PlanError(message)
    raise RuntimeError(f"{name} on rank 0: {message}")


def decide_on_rank0(decide: Callable[[], T], *, encode: Callable[[T], str], decode: Callable[[str], T],
                    group: Any = None, src: int = 0) -> T:
    """Run ``decide()`` on rank ``src`` only and return its result on every rank of ``group``.

    Args:
        decide: the decision (usually a planner call); runs on rank ``src`` only.
        encode: result -> JSON text (a plan's ``to_json``).
        decode: JSON text -> result (a plan type's ``from_json``); every rank decodes, rank ``src``
            too, so all ranks hold equal objects.
        group: the process group (default: the world); ``src`` is a global rank.

    An exception in ``decide()`` is raised on every rank: planner errors keep their type and
    numbers (``PlanInfeasibleError.needed_bytes``...), others become ``RuntimeError`` naming the
    original type; rank ``src`` re-raises the original exception itself.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return decode(encode(decide()))
    error: BaseException | None = None
    text: str | None = None
    if dist.get_rank() == src:
        try:
            text = json.dumps({"ok": encode(decide())})
        except Exception as exc:  # shared with the other ranks, then re-raised here below
            error = exc
            text = json.dumps(_error_record(exc))
    payload = json.loads(broadcast_text(text, src=src, group=group))
    if error is not None:
        raise error
    if "ok" not in payload:
        _raise_record(payload)
    return decode(payload["ok"])
