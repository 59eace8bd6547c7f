"""A step's token budget from measured step costs: how much prefill joins the running decodes (``token_budget``).

A step's time on the worker is close to ``fixed + per_token x tokens`` (the weights are read once per step; each
token adds its share of the matmuls and attention). :func:`fit_costs` fits the two from the steps the workers ran;
:func:`choose_budget` then spends the time a decode step may take, its TPOT target, on prefill:

* every running decode is in the step (decode is never starved: the budget is at least its tokens);
* the prefill allowance is what the target leaves once the decodes are paid, at the measured cost per token, and
  at least ``min_prefill`` tokens (the head of the queue's prompt, or a chunk of it, so prefill is never starved);
* the TPOT target is ``tpot_target_s`` where the user set one, else the decode-only step's own cost times
  ``1 + SLACK``: prefill may stretch a decode step by ``SLACK`` of itself. With no decode running, the whole
  ``max_batch_tokens`` goes to prefill (nobody's TPOT to protect).

Pure: numbers in, numbers out (:class:`TokenBudget` keeps the last steps' samples for the scheduler).

Example:
    >>> costs = StepCosts(fixed_s=0.02, per_token_s=0.001)
    >>> choose_budget(costs, decode_tokens=8, max_batch_tokens=4096, min_prefill=16).prefill_tokens
    28
    >>> choose_budget(costs, decode_tokens=0, max_batch_tokens=4096, min_prefill=16).prefill_tokens
    4096
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SLACK", "StepCosts", "Budget", "fit_costs", "choose_budget", "TokenBudget"]

#: How much of a decode step's own time prefill may add to it when the user set no TPOT target.
SLACK = 1.0


@dataclass(frozen=True, slots=True)
class StepCosts:
    """A step's measured seconds: ``fixed_s + per_token_s x tokens``."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True, slots=True)
class Budget:
    """One step's budget: ``tokens`` in all, of which ``prefill_tokens`` may be prompts; ``target_s``: the step time
    it aims at (``inf``: no decode to protect), ``why``: one line."""

    tokens: int
    prefill_tokens: int
    target_s: float
    why: str


def fit_costs(samples: Sequence[tuple[int, float]]) -> StepCosts | None:
    """Least squares of ``seconds = fixed + per_token x tokens`` over ``(tokens, seconds)`` samples, both at least 0;
    ``None`` without two different token counts (nothing to fit a slope to)."""
    if len({n for n, _ in samples}) < 2:
        return None
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(s for _, s in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    slope = max(0.0, sum((t - mx) * (s - my) for t, s in samples) / var)
    return StepCosts(fixed_s=max(0.0, my - slope * mx), per_token_s=slope)


def choose_budget(costs: StepCosts | None, *, decode_tokens: int, max_batch_tokens: int, min_prefill: int,
                  tpot_target_s: float = 0.0) -> Budget:
    """The next step's budget (see the module docstring). ``costs`` ``None`` (not measured yet): ``max_batch_tokens``."""
    if decode_tokens < 0 or max_batch_tokens < 1 or min_prefill < 0 or tpot_target_s < 0:
        raise ValueError(f"decode_tokens={decode_tokens}, min_prefill={min_prefill} and tpot_target_s={tpot_target_s} "
                         f"must be >= 0 and max_batch_tokens={max_batch_tokens} >= 1")
    room = max(0, max_batch_tokens - decode_tokens)
    if costs is None or decode_tokens == 0:
        why = "no step costs measured yet" if costs is None else "no decode running"
        return Budget(decode_tokens + room, room, math.inf, f"{why}: max_batch_tokens={max_batch_tokens}")
    decode_s = costs.seconds(decode_tokens)
    target = tpot_target_s or decode_s * (1 + SLACK)
    spare = target - decode_s
    ratio = max(0.0, spare) / costs.per_token_s if costs.per_token_s > 0 else math.inf
    fits = room if ratio >= room else int(ratio + 1e-9)  # 27.999... tokens of a fitted line are 28
    prefill = min(room, max(min_prefill, fits))
    why = (f"{decode_tokens} decode(s) cost {decode_s * 1e3:.2f} ms of a {target * 1e3:.2f} ms target "
           f"({'tpot_target_s' if tpot_target_s else f'1 + SLACK={1 + SLACK:g} x the decode step'}): "
           f"{prefill} prefill tokens at {costs.per_token_s * 1e6:.1f} us each")
    return Budget(decode_tokens + prefill, prefill, target, why)


class TokenBudget:
    """The scheduler's budget per step: ``max_batch_tokens`` (``mode="fixed"``), or chosen from the last
    ``window`` steps' measured costs (``mode="measured"``, :func:`choose_budget`). :meth:`observe` takes each step's
    tokens and worker seconds; :attr:`last` is the latest choice (``explain()``, ``/metrics``)."""

    def __init__(self, mode: str, max_batch_tokens: int, *, tpot_target_s: float = 0.0, window: int = 64):
        self.mode, self.max_batch_tokens, self.tpot_target_s = mode, max_batch_tokens, tpot_target_s
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.costs: StepCosts | None = None
        self.last = Budget(max_batch_tokens, max_batch_tokens, math.inf, f"fixed: max_batch_tokens={max_batch_tokens}")

    def observe(self, tokens: int, seconds: float) -> None:
        """One step the workers ran: its tokens and its seconds on the worker."""
        self.samples.append((tokens, seconds))
        if self.mode == "measured":  # fitted only where used (a few microseconds a step)
            self.costs = fit_costs(self.samples)

    def choose(self, decode_tokens: int, min_prefill: int) -> int:
        """The next step's tokens in all (``decode_tokens`` of the running requests first)."""
        if self.mode == "measured":
            self.last = choose_budget(self.costs, decode_tokens=decode_tokens, max_batch_tokens=self.max_batch_tokens,
                                      min_prefill=min_prefill, tpot_target_s=self.tpot_target_s)
        return self.last.tokens
