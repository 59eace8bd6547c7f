"""The partitions ours is compared with, priced by the same cost model, and the exhaustive oracle.

* :func:`even`: equal layer counts per stage (what a user gets by default);
* :func:`parameter_balanced`: equal parameter bytes (DeepSpeed's ``partition_method="parameters"``);
* :func:`sky_allocator`: a re-implementation of Sky Computing's greedy allocator, its give-back
  slip included unless asked to fix it;
* :func:`brute_force`: every contiguous partition under every device order (small cases: the tests'
  and benchmarks' reference optimum).

Example:
    >>> from tightfit.planner.pipeline import DeviceSpec, PipelineProblem
    >>> devs = [DeviceSpec(name=f"d{i}", speed=1.0, memory_bytes=2**30) for i in range(2)]
    >>> problem = PipelineProblem(layer_costs=[1.0] * 6, layer_memory=[100, 100, 100, 100, 400, 400],
    ...                           devices=devs, microbatches=2, schedule="gpipe")
    >>> even(problem).boundaries, parameter_balanced(problem).boundaries
    ((0, 3, 6), (0, 4, 6))
"""

from __future__ import annotations

import itertools

import numpy as np

from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.pipeline.plan import PartitionPlan
from tightfit.planner.pipeline.problem import PipelineProblem
from tightfit.planner.pipeline.solve import bottleneck_dp, min_sum_dp
from tightfit.units import format_bytes

__all__ = ["even_boundaries", "even", "parameter_balanced", "sky_allocator", "brute_force"]


def even_boundaries(num_layers: int, stages: int) -> list[int]:
    """Equal layer counts; the first ``num_layers % stages`` stages get one more (Sky's even split)."""
    if num_layers < stages:
        raise PlanError(f"{num_layers} layers cannot fill {stages} stages; use fewer devices")
    base, extra = divmod(num_layers, stages)
    out = [0]
    for s in range(stages):
        out.append(out[-1] + base + (1 if s < extra else 0))
    return out


def even(problem: PipelineProblem) -> PartitionPlan:
    """Equal layer counts per stage, devices in the given order (what a user gets by default)."""
    return problem.price(even_boundaries(problem.num_layers, problem.num_stages),
                         tuple(range(problem.num_devices)), "even")


def parameter_balanced(problem: PipelineProblem) -> PartitionPlan:
    """Contiguous stages with the smallest largest parameter count (DeepSpeed ``partition_method="parameters"``),
    devices in the given order; speed and memory caps are ignored when choosing, priced afterwards."""
    prefix, layers = problem.param_prefix, problem.num_layers
    idx = np.arange(layers + 1)
    size = prefix[None, :] - prefix[:, None]
    mat = np.where(idx[:, None] < idx[None, :], size, np.inf)[None].repeat(problem.num_stages, axis=0)
    mat[0, 1:, :] = np.inf
    mat[-1, :, :layers] = np.inf
    _, bounds = min_sum_dp(mat, bottleneck_dp(mat))  # among min-max splits, the deterministic argmin
    assert bounds is not None
    return problem.price(bounds, tuple(range(problem.num_devices)), "parameter-balanced")


def sky_allocator(problem: PipelineProblem, *, fix_give_back: bool = False,
                  max_iterations: int = 1000) -> PartitionPlan:
    """Sky Computing's ``dynamic_allocate``, re-implemented from its description and behaviour.

    The original starts from the even split, moves boundaries until every worker's layer memory is
    below its available memory, then iterates: each worker below the average of ``flops * time``
    takes the next worker's first layer (if memory allows); a worker above the average should give
    its last layer away, but the original compares the *worker's own* load where the next worker's
    belongs, so that branch never fires. ``fix_give_back=True`` compares the next worker's load.
    It sees one speed number per device (``time = 1 / speed``), layer costs, and per-layer memory
    (here: our estimate of weights, gradients, optimizer state and a whole batch of activations,
    since its runtime runs the batch through each stage at once); it ignores links and the
    schedule, keeps devices in rank order, and is priced with our cost model afterwards.
    """
    if problem.chunks != 1:
        raise PlanError("sky_allocator places one stage per device; use schedule 'gpipe' or '1f1b'")
    # The original works in FLOP counts and floors the average load (``//``); our costs are seconds,
    # so they are rescaled to FLOP-like magnitudes (smallest layer = 1e6) to keep that floor harmless.
    positive = [c for c in problem.layer_costs if c > 0]
    scale = 1e6 / min(positive) if positive else 1.0
    flops = [c * scale for c in problem.layer_costs]
    mem = [m.param_bytes * (2 + problem.optimizer_state_factor) + m.activation_bytes * problem.microbatches
           for m in problem.layer_memory]
    avail = [float(c) for c in problem.device_memory]
    wtime = [1.0 / s for s in problem.speeds]
    workers = problem.num_devices
    p = _sky_fit_memory(even_boundaries(problem.num_layers, workers), mem, avail)
    wt = [t / min(wtime) for t in wtime]

    def load(j: int) -> float:
        return sum(flops[p[j]:p[j + 1]]) * wt[j]

    for _ in range(max_iterations):
        target = sum(load(j) for j in range(workers)) // workers  # floor division, as in the original
        before = list(p)
        for j in range(workers - 1):
            cur = load(j)
            if cur < target and p[j + 2] - p[j + 1] > 1:
                if sum(mem[p[j]:p[j + 1] + 1]) < avail[j]:
                    p[j + 1] += 1
            else:
                last = flops[p[j + 1] - 1] * wt[j]
                other = load(j + 1) if fix_give_back else cur  # the original's slip: its own load
                if other < target and cur > target + last and p[j + 1] - p[j] > 1:
                    if sum(mem[p[j + 1] - 1:p[j + 2]]) < avail[j + 1]:
                        p[j + 1] -= 1
        if p == before:
            break
    return problem.price(p, tuple(range(workers)), "sky-fixed" if fix_give_back else "sky")


def _sky_fit_memory(p: list[int], mem: list[float], avail: list[float]) -> list[int]:
    """Sky's first pass: shift boundaries until each worker's layer memory is below what it has."""
    workers = len(avail)

    def used() -> list[float]:
        return [sum(mem[p[j]:p[j + 1]]) for j in range(workers)]

    def ok() -> bool:
        return all(a >= u for a, u in zip(avail, used()))

    while not ok():
        before = list(p)
        done = False
        for j in range(workers - 1):
            while used()[j] > avail[j] and p[j + 1] - p[j] > 1:
                p[j + 1] -= 1  # give layers to the next worker
                if ok():
                    done = True
                    break
            if done:
                break
            while used()[j] < avail[j] and p[j + 2] - p[j + 1] > 1:
                if sum(mem[p[j]:p[j + 1] + 1]) < avail[j]:
                    p[j + 1] += 1  # take layers while they fit
                else:
                    break
                if ok():
                    done = True
                    break
            if done:
                break
        if p == before:
            raise PlanInfeasibleError(
                f"Sky's allocator found no memory-feasible split (boundaries stuck at {p}); per-worker need "
                f"{[format_bytes(u) for u in used()]} vs {[format_bytes(a) for a in avail]}",
                needed_bytes=int(max(used())), budget_bytes=int(max(avail)))
    return p


def brute_force(problem: PipelineProblem, *, search_order: bool = True) -> PartitionPlan | None:
    """Every contiguous partition under every device order (tiny cases only); None if none fits."""
    n = problem.num_devices
    orders = list(itertools.permutations(range(n))) if search_order else [tuple(range(n))]
    best = None
    for order in orders:
        for cuts in itertools.combinations(range(1, problem.num_layers), problem.num_stages - 1):
            plan = problem.price([0, *cuts, problem.num_layers], order, "brute-force")
            if plan.feasible and (best is None or plan.step_time_s < best.step_time_s):
                best = plan
    return best
