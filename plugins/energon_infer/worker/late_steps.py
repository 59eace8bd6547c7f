"""A single worker runs a late step together with the step planned ahead of it, when that one has not started.

With steps planned ahead (``depth > 1``) the worker's queue already holds the group's next step while the current
one runs, so a request that arrives then would wait for that step to run before its prompt could. The scheduler
admits it at once in a *late* step instead (``Step.late``: admissions only, see
:meth:`~energon_infer.scheduling.scheduler.Scheduler.schedule_late`). Before a worker starts a step it takes the
late steps queued right behind it (:func:`take_late`) and runs them all as one (:func:`merge`): the new prompts
ride on the step that was about to run anyway. Each part still gets its own reply (:func:`split`), so the
controller sees the steps it planned. A late step that comes too late (its step already started) runs alone,
right after it; :class:`~energon_infer.worker.token_feedback.TokenFeedback` then keeps both steps' tokens for the
group's next step.

Only one rank may decide this (ranks that merge differently would run different collectives), so the engine
plans late steps at ``tp = pp = 1`` only.
"""

from __future__ import annotations

import dataclasses
import queue
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from energon_infer.protocol import Command, Step, Tokens

__all__ = ["take_late", "merge", "split", "poller"]


def poller(q: Any) -> Callable[[], Command | None]:
    """The ``poll`` :func:`take_late` asks: the next command on ``q`` (a ``queue.Queue`` or a multiprocessing
    queue) if one is there, else ``None`` at once."""
    def poll() -> Command | None:
        try:
            return q.get_nowait()
        except queue.Empty:
            return None
    return poll


def take_late(step: Step, poll: Callable[[], Command | None], held: deque[Command]) -> list[Step]:
    """The late steps of ``step``'s group queued right behind it: from ``held`` first, then ``poll()`` (the next
    command if one is queued, without waiting). The first other command stops the search and stays in ``held``."""
    late: list[Step] = []
    while True:
        nxt = held[0] if held else poll()
        if nxt is None:
            return late
        if not held:
            held.append(nxt)
        if not (isinstance(nxt, Step) and nxt.late and nxt.group == step.group):
            return late
        late.append(held.popleft())  # type: ignore[arg-type]


def merge(parts: Sequence[Step]) -> Step:
    """One step running every part's items in order (the first part's frees, swaps, copies and feedback flags:
    a late step has none of its own but ``send_back``, which the step planned ahead has too)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    items = [item for p in parts for item in p.items]
    joined: dict[str, Any] = {name: {k: v for p in parts for k, v in getattr(p, name).items()}
                              for name in ("new_params", "blocks", "starts", "history", "prefill_lengths")}
    return dataclasses.replace(first, items=items, **joined)


def split(parts: Sequence[Step], tokens: Sequence[int], logprobs: dict[int, Any], errors: dict[int, str],
          accepted: dict[int, Any] | None = None) -> list[Tokens]:
    """Each part's reply from the merged step's sampled tokens (in item order) and its by-sequence results."""
    out, at = [], 0
    for p in parts:
        ids = {seq for seq, _ in p.items}
        out.append(Tokens(p.step_id, list(tokens[at:at + len(p.items)]),
                          {s: v for s, v in logprobs.items() if s in ids}, {s: v for s, v in errors.items() if s in ids},
                          accepted={s: v for s, v in (accepted or {}).items() if s in ids}))
        at += len(p.items)
    return out
