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

Example:
    >>> plan_proposals([0.9, 0.0], [4, 4], StepCost(base_s=1.0, per_token_s=0.01), step_tokens=2, emitted=2)
    [4, 0]
    >>> plan_proposals([0.9], [4], StepCost(base_s=0.0, per_token_s=1.0), step_tokens=8, emitted=8)
    [0]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StepCost", "CostFit", "plan_proposals", "expected_tokens", "update_acceptance"]


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


def plan_proposals(acceptance: Sequence[float], limits: Sequence[int], cost: StepCost, *, step_tokens: int,
                   emitted: int, budget: int | None = None) -> list[int]:
    """Proposals per request (see the module docstring): ``acceptance`` and ``limits`` (the most each may propose)
    by request; ``step_tokens``: the tokens the step carries without proposals; ``emitted``: the tokens it samples
    without them; ``budget``: the most proposals in all (``None``: no bound)."""
    if len(acceptance) != len(limits):
        raise ValueError(f"{len(acceptance)} acceptance rates for {len(limits)} limits; give one of each per request")
    ks = [0] * len(limits)
    left = sum(limits) if budget is None else budget
    gained, seconds = float(emitted), cost.time(step_tokens)
    # Largest gain first; a request's next gain (alpha ** (k + 1)) is never above its last, so the order is global.
    heap = [(-float(a), i) for i, (a, n) in enumerate(zip(acceptance, limits)) if n > 0 and a > 0]
    heapq.heapify(heap)
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
