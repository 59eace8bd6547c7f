"""The balanced partition: an exact DP for one device order, and the search over device orders.

:func:`balance` splits the layers into one contiguous stage per device (``virtual_stages`` per
device for the interleaved schedule) and picks the device order, minimising the predicted step time
of a synchronous pipeline (:mod:`~tightfit.planner.pipeline.problem` has the cost model) subject to
every device's memory. :func:`evaluate` prices boundaries given from outside.

Exactness: for a fixed device order the objective is minimised exactly (a min-max DP finds the
smallest bottleneck ``b*``; a branch and bound over bottleneck thresholds ``tau >= b*`` runs a
min-sum DP under ``tau``, pruning with ``(M - 1) * tau + g(tau_hi)``). The device order is searched
exhaustively up to :data:`EXACT_ORDER_LIMIT` distinct arrangements, else over a fixed set of
heuristic orders (speed, memory, link-greedy chains) plus adjacent-swap descent; ``plan.notes``
says which. The interleaved objective is not decomposable by stage: its DP minimises the chunk
bottleneck and the plan is priced with the interleaved formula (not proven optimal).

Example:
    >>> from tightfit.planner.pipeline import DeviceSpec, PipelineProblem
    >>> devs = [DeviceSpec(name="fast", speed=1.0, memory_bytes=2**30),
    ...         DeviceSpec(name="slow", speed=0.25, memory_bytes=2**30)]
    >>> problem = PipelineProblem(layer_costs=[1.0] * 10, layer_memory=[1000] * 10, devices=devs,
    ...                           microbatches=8, schedule="1f1b")
    >>> balance(problem, order="given").layer_counts()
    (8, 2)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from tightfit.planner.errors import PlanError
from tightfit.planner.pipeline.diagnose import diagnose_infeasible
from tightfit.planner.pipeline.plan import PartitionPlan
from tightfit.planner.pipeline.problem import PipelineProblem

__all__ = ["EXACT_ORDER_LIMIT", "balance", "evaluate", "solve_order", "search_orders", "bottleneck_dp",
           "min_sum_dp"]

EXACT_ORDER_LIMIT = 120
"""Distinct device arrangements up to which the order search is exhaustive (``5!``, every order of five distinct
devices), which keeps it quick on 160 layers; past it the search tries heuristic orders."""


def balance(problem: PipelineProblem, *, order: str | Sequence[int] = "search") -> PartitionPlan:
    """The partition (and device order) with the smallest predicted step time that fits memory.

    Args:
        problem: the layers, devices, links and schedule.
        order: ``"search"`` (choose the device order), ``"given"`` (the devices as listed) or an
            explicit permutation of device indices.

    Raises:
        PlanInfeasibleError: no partition fits; the message carries the shortfall and the fixes.
    """
    plan, note = search_orders(problem, order)
    if plan is None:
        raise diagnose_infeasible(problem)
    notes = (note,) + (("interleaved: the DP balances chunks (stage bottleneck), priced per rank; not proven "
                        "optimal",) if problem.schedule == "interleaved" else ())
    return dataclasses.replace(plan, notes=notes)


def evaluate(problem: PipelineProblem, boundaries: Sequence[int], *, order: Sequence[int] | None = None,
             method: str = "given") -> PartitionPlan:
    """Price a given partition (``num_stages + 1`` boundaries) under the cost model; never raises
    for memory: an over-full plan comes back with ``feasible=False``."""
    return problem.price(boundaries, tuple(range(problem.num_devices)) if order is None else tuple(order), method)


# --------------------------------------------------------------------------------------------------
# Exact DP for one device order


def _window(k: int, stages: int, layers: int) -> tuple[slice, slice]:
    """Boundaries stage k can start (i) and end (j) at: every other stage needs >= 1 layer.
    For 162 layers on 64 stages this is a 99 x 99 window instead of 163 x 163 (2.7x less work)."""
    return slice(k, layers - stages + k + 1), slice(k + 1, layers - stages + k + 2)


def bottleneck_dp(time: np.ndarray) -> float:
    """The smallest possible largest stage time over contiguous splits, given ``time[k, i, j]``."""
    stages, layers = time.shape[0], time.shape[2] - 1
    best = np.full(layers + 1, np.inf)
    best[_window(0, stages, layers)[1]] = time[0, 0, _window(0, stages, layers)[1]]
    for k in range(1, stages):
        wi, wj = _window(k, stages, layers)
        new = np.full(layers + 1, np.inf)
        new[wj] = np.min(np.maximum(best[wi, None], time[k, wi, wj]), axis=0)
        best = new
    return float(best[-1])


def min_sum_dp(time: np.ndarray, tau: float) -> tuple[float, list[int] | None]:
    """Smallest sum of stage times with every stage <= tau, and its boundaries (None if none)."""
    stages, layers = time.shape[0], time.shape[2] - 1
    g = np.full(layers + 1, np.inf)
    wj0 = _window(0, stages, layers)[1]
    first = time[0, 0, wj0]
    g[wj0] = np.where(first <= tau, first, np.inf)
    back = []
    for k in range(1, stages):
        wi, wj = _window(k, stages, layers)
        sub = time[k, wi, wj]
        tot = g[wi, None] + np.where(sub <= tau, sub, np.inf)
        arg = np.argmin(tot, axis=0)
        back.append(arg + wi.start)
        new = np.full(layers + 1, np.inf)
        new[wj] = tot[arg, np.arange(tot.shape[1])]
        g = new
    if not math.isfinite(g[-1]):
        return math.inf, None
    bounds = [layers]
    for k, arg in zip(range(stages - 1, 0, -1), reversed(back)):
        j0 = _window(k, stages, layers)[1].start
        bounds.append(int(arg[bounds[-1] - j0]))
    bounds.append(0)
    return float(g[-1]), bounds[::-1]


def solve_order(problem: PipelineProblem, order: Sequence[int]) -> PartitionPlan | None:
    """The exact optimum for this device order (None when no partition fits)."""
    time, _, _ = problem.matrices(order)
    b_star = bottleneck_dp(time)
    if not math.isfinite(b_star):
        return None
    if problem.schedule == "interleaved" or problem.microbatches == 1:
        # interleaved: chunk bottleneck, ties broken by the smallest sum; M == 1: pure sum
        tau = b_star if problem.schedule == "interleaved" else math.inf
        _, bounds = min_sum_dp(time, tau)
        assert bounds is not None  # tau >= b* admits the bottleneck-optimal partition
        return problem.price(bounds, order, "balanced")
    weight = problem.microbatches - 1
    best: PartitionPlan | None = None
    seen: dict[float, tuple[float, list[int] | None]] = {}

    def g(tau: float) -> float:
        nonlocal best
        if tau not in seen:
            seen[tau] = total, bounds = min_sum_dp(time, tau)
            if bounds is None:
                return total
            plan = problem.price(bounds, order, "balanced")
            if best is None or plan.step_time_s < best.step_time_s:
                best = plan
        return seen[tau][0]

    g_inf = g(math.inf)
    g(b_star)
    assert best is not None
    # Thresholds worth trying: stage times in [b*, (best - g_inf) / (M - 1)]; above that even the
    # unconstrained smallest sum cannot win.
    hi_tau = (best.step_time_s - g_inf) / weight
    vals = time[np.isfinite(time) & (time >= b_star) & (time <= hi_tau * (1 + 1e-12))]
    cands = np.unique(vals)
    if len(cands) > 1:
        stack = [(0, len(cands) - 1)]
        g(float(cands[-1]))
        while stack:
            lo, hi = stack.pop()
            if hi - lo <= 1:
                continue
            if weight * cands[lo] + g(float(cands[hi])) >= best.step_time_s * (1 - 1e-12):
                continue
            mid = (lo + hi) // 2
            g(float(cands[mid]))
            stack.extend([(lo, mid), (mid, hi)])
    return best


# --------------------------------------------------------------------------------------------------
# Device order search


def _distinct_orders(problem: PipelineProblem) -> list[tuple[int, ...]] | None:
    """All arrangements, identical devices collapsed; None when more than EXACT_ORDER_LIMIT."""
    bw, lat = problem.bandwidth, problem.latency
    keys = [(d.speed, d.memory_bytes, d.layer_seconds, d.optimizer_bytes_per_s, tuple(bw[i]), tuple(bw[:, i]),
             tuple(lat[i]), tuple(lat[:, i])) for i, d in enumerate(problem.devices)]
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    labels = [next(n for n, members in enumerate(groups.values()) if i in members)
              for i in range(problem.num_devices)]
    count = math.factorial(problem.num_devices)
    for members in groups.values():
        count //= math.factorial(len(members))
    if count > EXACT_ORDER_LIMIT:
        return None
    firsts = list(groups.values())
    out = []
    for perm in sorted(set(itertools.permutations(labels))):
        used = [0] * len(firsts)
        order = []
        for lab in perm:
            order.append(firsts[lab][used[lab]])
            used[lab] += 1
        out.append(tuple(order))
    return out


def _heuristic_orders(problem: PipelineProblem) -> list[tuple[int, ...]]:
    ids = list(range(problem.num_devices))
    speed, mem, bw = problem.speeds, problem.device_memory, problem.bandwidth
    orders = [tuple(ids),
              tuple(sorted(ids, key=lambda i: (-speed[i], i))),
              tuple(sorted(ids, key=lambda i: (speed[i], i))),
              tuple(sorted(ids, key=lambda i: (-mem[i], i)))]
    if not problem.uniform_links():
        # chains that always take the widest link next, from the fastest and from device 0
        for start in dict.fromkeys([0, int(np.argmax(speed))]):
            chain, left = [start], set(ids) - {start}
            while left:
                nxt = max(left, key=lambda j: (bw[chain[-1], j], -j))
                chain.append(nxt)
                left.remove(nxt)
            orders.append(tuple(chain))
    return list(dict.fromkeys(orders))


def search_orders(problem: PipelineProblem, order: str | Sequence[int]) -> tuple[PartitionPlan | None, str]:
    """The best plan over the device orders ``order`` allows (None if none fits), and a note saying how
    the order was chosen."""
    n = problem.num_devices
    if not isinstance(order, str):
        fixed = tuple(int(o) for o in order)
        if sorted(fixed) != list(range(n)):
            raise PlanError(f"order {list(fixed)} must be a permutation of 0..{n - 1}")
        return solve_order(problem, fixed), "device order: given"
    if order not in ("search", "given"):
        raise PlanError(f"order={order!r}: use 'search', 'given' or a permutation of device indices")
    if order == "given":
        return solve_order(problem, tuple(range(n))), "device order: given"
    exact = _distinct_orders(problem)
    if exact is not None:
        plans = [p for p in (solve_order(problem, o) for o in exact) if p is not None]
        best = min(plans, key=lambda p: p.step_time_s, default=None)
        return best, f"device order: exhaustive over {len(exact)} distinct arrangement(s) (exact)"
    plans = [p for p in (solve_order(problem, o) for o in _heuristic_orders(problem)) if p is not None]
    best = min(plans, key=lambda p: p.step_time_s, default=None)
    swaps = 0
    if best is not None and n <= 16:
        # adjacent-swap descent; bounded so 16 devices x 160 layers stays near a second
        improved = True
        while improved and swaps < 4 * n:
            improved = False
            for p in range(n - 1):
                cand = list(best.order)
                cand[p], cand[p + 1] = cand[p + 1], cand[p]
                swaps += 1
                plan = solve_order(problem, cand)
                if plan is not None and plan.step_time_s < best.step_time_s * (1 - 1e-12):
                    best, improved = plan, True
    return best, (f"device order: heuristic ({n}! arrangements exceed {EXACT_ORDER_LIMIT}; speed/memory/"
                  f"link-greedy orders + {swaps} adjacent swaps; the partition is exact for the order chosen)")
