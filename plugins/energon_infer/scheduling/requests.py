"""What the scheduler keeps of each request (:class:`Request`) and of each step it plans (:class:`StepPlan`).

Both are the scheduler's (:mod:`energon_infer.scheduling.scheduler`, which re-exports them); the frontend reads a
request and never writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from energon_infer.protocol import Step
from energon_infer.sampling import SamplingParams
from energon_infer.scheduling.detokenizer import IncrementalDetokenizer

__all__ = ["Encoded", "Request", "StepPlan"]


class Encoded(list[int]):
    """A prompt's token ids as ``Engine.encode`` returned them: tokenized (or checked) once, so the engine takes them
    as they are (the server encodes a prompt before it submits it)."""

    __slots__ = ()


@dataclass(eq=False, slots=True)
class Request:
    """What batching needs of one request as it moves from waiting to running to finished; written here only.

    The caller's side of a request (its future, listener, streamed text and timings) is the frontend's
    (:class:`energon_infer.engine.delivery.Output`), which reads this one and never writes it.

    Args:
        request_id: the caller's id (unique among live requests).
        prompt: prompt token ids.
        params: how it samples and stops.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seq_id: int = 0
    queue_order: int = 0  # its place in the order requests were queued (a held one rejoins the queue there)
    reserve: int = 0
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # tokens of prompt + generated whose keys/values the workers hold (or will, in flight)
    preemptions: int = 0
    pending: int = 0  # tokens being sampled by steps in flight
    fed_unknown: int = 0  # of those, fed already as a placeholder input
    last_sampled: int = 0  # the step that samples its latest token
    group: int = -1
    state: str = "new"  # new -> waiting -> running -> finished
    in_flight: int = 0  # steps in flight that hold it
    aborted: bool = False
    finish_reason: str | None = None
    text: str | None = None  # the final text (cut at a stop string)
    detok: IncrementalDetokenizer | None = None  # its text, decoded once per token (with a tokenizer): the stop rule
    logprobs: list[Any] = field(default_factory=list)  # per generated token, when params.logprobs is set
    error: str | None = None  # why it failed alone in a worker (finish_reason "error")
    swapped: list[int] = field(default_factory=list)  # host blocks holding its keys/values while preempted
    swap_counts: tuple[int, ...] = ()  # of those, how many each KV group's (energon_infer.scheduling.kv_groups)
    rope_long: bool = False  # (re)started past SchedulerConfig.rope_switch: its keys are long-factor ones
    proposed: int = 0  # speculation: tokens proposed for it, and of those, accepted (scheduling.speculation)
    accepted: int = 0
    spec_histogram: list[int] = field(default_factory=list)  # its verifying steps by proposals accepted (0, 1, ...)


@dataclass(slots=True)
class StepPlan:
    """One planned step: the :class:`~energon_infer.protocol.Step` the workers run (sent as it is) and what the
    scheduler needs back when its tokens arrive. The step's fields read through (``plan.items`` is
    ``plan.step.items``): frees first, then the packed items (``(seq_id, new_tokens)``).

    Args:
        step: the workers' command (frees, items, block decisions, feedback flags).
        requests: the request of each item.
        samples: per item: does its sampled token count (the last chunk of a prompt, or a decode).
        started: when it was planned (the watchdog's clock).
    """

    step: Step
    requests: list[Request] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    started: float = 0.0

    def __getattr__(self, name: str) -> Any:  # only for names StepPlan lacks: the step's fields read through
        if name == "step":  # not set yet (being copied): no recursion
            raise AttributeError(name)
        return getattr(self.step, name)

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for _, t in self.step.items)
