"""How many tokens each request proposes in a speculative step: a pure decision from measured costs.

A step's time is modelled as ``base_s + per_token_s * tokens`` (:class:`StepCost`): ``base_s`` is what a step
costs whatever it carries (the weights read once per step: from disk or host memory when they are streamed,
from device memory otherwise), ``per_token_s`` the compute of one more token. A request whose proposals are
accepted with probability ``alpha`` each (independently, as in Leviathan et al.'s analysis) emits
``1 + alpha + ... + alpha**k`` tokens on average when it proposes ``k``: its ``k``-th proposal adds
``alpha**k`` expected tokens for ``per_token_s`` more seconds.

:func:`plan_proposals` adds proposals one at a time, the one with the largest expected gain first, while the
step's tokens per second still rise: a gain ``g`` for a cost ``c`` is taken only while ``g / c > G / T`` (the
step's expected tokens over its time so far). A streamed (memory-bound) step has ``per_token_s`` small against
``base_s``, so proposals are nearly free and many are taken; a compute-bound batch takes few or none; a request
whose acceptance falls to 0 proposes nothing. :class:`CostFit` measures the two coefficients online from the
steps' sizes and times.

**Steps planned ahead** (``ahead=True``: two steps in flight) price what a verification forgoes. A request whose
step verifies proposals sits out the step planned meanwhile (its next position is known only once its accepted
count is), so the decision covers both steps, the *window*: without proposals each sampled request emits 2
tokens in ``2 T(n)``; one proposing ``k`` emits ``expected_tokens(alpha, k)`` instead of 2, this step grows by
``k`` tokens and the next shrinks by its one. Where every request of the step proposes and the step carries
nothing else, the next step does not exist and the pipeline drains: the window's second part is ``bubble_s``
(the controller's work between a result and the next step, otherwise hidden behind the step in flight) instead
of a step. A request's first proposal therefore has a negative gain (``alpha - 1``: it gives up its token of
the next step), so proposals come per request as a bundle: :func:`plan_proposals` takes the best window rate among
no proposals, the best plan that keeps the next step (Dinkelbach's iteration over each request's best ``k`` at
the rate so far) and the best that drains it, and proposes nothing unless the window's expected tokens per
second beat the plain window's (:func:`window`).

Example:
    >>> plan_proposals([0.9, 0.0], [4, 4], StepCost(base_s=1.0, per_token_s=0.01), step_tokens=2, emitted=2)
    [4, 0]
    >>> plan_proposals([0.9], [4], StepCost(base_s=0.0, per_token_s=1.0), step_tokens=8, emitted=8)
    [0]
    >>> plan_proposals([0.6], [4], StepCost(base_s=1.0, per_token_s=0.0), step_tokens=8, emitted=8, ahead=True)
    [4]
    >>> plan_proposals([0.4], [4], StepCost(base_s=1.0, per_token_s=0.0), step_tokens=8, emitted=8, ahead=True)
    [0]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["StepCost", "CostFit", "plan_proposals", "window", "expected_tokens", "update_acceptance"]


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's time against the tokens it carries.

    Args:
        base_s: seconds a step takes whatever it carries (>= 0).
        per_token_s: seconds each more token adds (>= 0).
    """

    base_s: float
    per_token_s: float

    def __post_init__(self) -> None:
        if not (self.base_s >= 0 and self.per_token_s >= 0):
            raise ValueError(f"StepCost(base_s={self.base_s}, per_token_s={self.per_token_s}): both must be >= 0 "
                             "seconds")

    def time(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits on average for a request proposing ``k`` tokens, each accepted with ``alpha``."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def window(ks: Sequence[int], acceptance: Sequence[float], cost: StepCost, *, step_tokens: int, emitted: int,
           ahead: bool = False, bubble_s: float = 0.0) -> tuple[float, float]:
    """Expected tokens and seconds of the window a plan ``ks`` decides (this step; with ``ahead``, also the next
    one, which the proposing requests sit out: see the module docstring)."""
    spec = [(a, k) for a, k in zip(acceptance, ks) if k > 0]
    now = cost.time(step_tokens + sum(ks))
    if not ahead:
        return emitted + sum(expected_tokens(a, k) - 1 for a, k in spec), now
    left = step_tokens - len(spec)
    nxt = cost.time(left) if left > 0 else bubble_s
    return 2 * emitted + sum(expected_tokens(a, k) - 2 for a, k in spec), now + nxt


def plan_proposals(acceptance: Sequence[float], limits: Sequence[int], cost: StepCost, *, step_tokens: int,
                   emitted: int, budget: int | None = None, ahead: bool = False, bubble_s: float = 0.0) -> list[int]:
    """Proposals per request (see the module docstring): ``acceptance`` and ``limits`` (the most each may propose)
    by request; ``step_tokens``: the tokens the step carries without proposals; ``emitted``: the tokens it samples
    without them (at least one per request given); ``budget``: the most proposals in all (``None``: no bound);
    ``ahead``: steps are planned ahead, and ``bubble_s`` is what a drained pipeline costs (seconds, >= 0)."""
    if len(acceptance) != len(limits):
        raise ValueError(f"{len(acceptance)} acceptance rates for {len(limits)} limits; give one of each per request")
    if bubble_s < 0 or (ahead and not len(limits) <= emitted <= step_tokens):
        raise ValueError(f"bubble_s={bubble_s}, emitted={emitted}, step_tokens={step_tokens} for {len(limits)} "
                         "requests: need bubble_s >= 0 and step_tokens >= emitted (>= the requests, ahead)")
    left = sum(limits) if budget is None else budget
    if not ahead:
        return _fill([0] * len(limits), acceptance, limits, cost, left, emitted, cost.time(step_tokens))
    def measure(ks: list[int]) -> tuple[float, float]:
        return window(ks, acceptance, cost, step_tokens=step_tokens, emitted=emitted, ahead=True, bubble_s=bubble_s)

    plans = [[0] * len(limits), _keep_next(acceptance, limits, cost, left, measure, step_tokens, emitted)]
    if step_tokens == len(limits) and all(n > 0 and a > 0 for a, n in zip(acceptance, limits)) and left >= len(limits):
        # Every request proposes: the next step is gone; from one proposal each, more while they pay.
        ones = [1] * len(limits)
        plans.append(_fill(ones, acceptance, limits, cost, left - len(limits), *measure(ones)))
    rate = [got / took if took > 0 else math.inf for got, took in map(measure, plans)]
    best = max(range(len(plans)), key=lambda i: (rate[i], -i))
    return plans[best] if rate[best] > rate[0] * (1 + 1e-12) else plans[0]


def _fill(ks: list[int], acceptance: Sequence[float], limits: Sequence[int], cost: StepCost, left: int,
          gained: float, seconds: float) -> list[int]:
    """``ks`` with more proposals, the largest expected gain first, while each raises ``gained / seconds``."""
    ks = list(ks)
    heap = [(-float(a) ** (k + 1), i) for i, (a, n, k) in enumerate(zip(acceptance, limits, ks)) if n > k and a > 0]
    heapq.heapify(heap)  # a request's next gain (alpha ** (k + 1)) is never above its last: the order is global
    while heap and left > 0:
        neg, i = heapq.heappop(heap)
        gain = -neg
        if gain * seconds <= cost.per_token_s * gained:  # gain / cost <= tokens per second so far: stop
            break
        ks[i] += 1
        left -= 1
        gained, seconds = gained + gain, seconds + cost.per_token_s
        if ks[i] < limits[i]:
            heapq.heappush(heap, (-float(acceptance[i]) ** (ks[i] + 1), i))
    return ks


def _keep_next(acceptance: Sequence[float], limits: Sequence[int], cost: StepCost, left: int,
               measure: Callable[[list[int]], tuple[float, float]], step_tokens: int, emitted: int) -> list[int]:
    """The best plan that leaves the next step at least one request: at the window rate ``lam``, each request takes
    the ``k`` with the most ``gain(k) - lam * seconds(k)`` (``gain = expected_tokens - 2``, ``seconds = (k - 1) *
    per_token_s``); then ``lam`` is the plan's rate, until it stops rising (Dinkelbach). Over the budget, the
    requests whose bundles are worth least go first."""
    c, n = cost.per_token_s, len(limits)
    ks = [0] * n
    if cost.time(step_tokens) <= 0:  # nothing costs anything: no rate to improve on
        return ks
    lam = emitted / cost.time(step_tokens)
    for _ in range(32):
        vals = []
        for a, most in zip(acceptance, limits):
            options = [(expected_tokens(a, k) - 2 - lam * (k - 1) * c, k) for k in range(1, most + 1)]
            vals.append(max(options, default=(0.0, 0)))
        new = [k if v > 0 else 0 for v, k in vals]
        if any(new) and step_tokens - sum(k > 0 for k in new) <= 0:  # would drain the pipeline: the least worth one stays
            new[min((i for i in range(n) if new[i]), key=lambda i: vals[i][0])] = 0
        while sum(new) > left:
            new[min((i for i in range(n) if new[i]), key=lambda i: vals[i][0] / new[i])] -= 1
        got, took = measure(new)  # the window's expected tokens and seconds
        if new == ks or took <= 0 or got / took <= lam * (1 + 1e-12):
            return new if got / max(took, 1e-300) > lam * (1 + 1e-12) else ks
        ks, lam = new, got / took
    return ks


def update_acceptance(alpha: float, proposed: int, accepted: int, weight: float = 0.3) -> float:
    """The per-token acceptance rate after a step that accepted ``accepted`` of ``proposed`` proposals (an
    exponentially weighted mean; a step's own estimate counts the rejection that ended it as one failed trial)."""
    if proposed < 1 or not 0 <= accepted <= proposed:
        raise ValueError(f"accepted={accepted} of proposed={proposed}: need 0 <= accepted <= proposed and proposed >= 1")
    observed = accepted / (accepted + (accepted < proposed))
    return (1.0 - weight) * alpha + weight * observed


class CostFit:
    """:class:`StepCost` fitted online to ``(tokens, seconds)`` of the steps seen (least squares, each step's
    weight decaying by ``decay``), so it follows a load that changes. Until two sizes are seen it answers
    ``prior``.

    Args:
        prior: the cost assumed before measurements (default: memory-bound, tokens free).
        decay: the weight an older step keeps at each new one.
    """

    def __init__(self, prior: StepCost = StepCost(base_s=1.0, per_token_s=0.0), decay: float = 0.95):
        self.prior, self.decay = prior, decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._w, self._n, self._t = d * self._w + 1, d * self._n + tokens, d * self._t + seconds
        self._nn, self._nt = d * self._nn + tokens * tokens, d * self._nt + tokens * seconds

    def cost(self) -> StepCost:
        if self._w == 0:
            return self.prior
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var < 1e-9 * max(1.0, mean_n * mean_n):  # one size only: the slope is unknown, keep the prior's
            slope = self.prior.per_token_s
        else:
            slope = max(0.0, (self._nt / self._w - mean_n * mean_t) / var)
        return StepCost(base_s=max(0.0, mean_t - slope * mean_n), per_token_s=slope)
