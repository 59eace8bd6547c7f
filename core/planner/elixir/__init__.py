"""Elixir planner: the fastest sharding x offloading x recomputation plan that fits, from profiles alone.

``search(model_profile, cluster)`` returns an :class:`ElixirPlan` that FSDP2 executes unit by unit:

* a **unit** is a contiguous run of blocks (first-use order) wrapped by one ``fully_shard`` call
  (a list of modules when it spans several blocks; a unit holding the root block ``""`` is the
  root's own ``fully_shard``); unit size plays the role of Elixir's chunk size;
* per unit a **mode**: ``"reshard"`` (``reshard_after_forward=True``, ZeRO-3-like), ``"keep"``
  (``reshard_after_forward=False``: sharded at rest, kept gathered from forward to backward,
  ZeRO-2-like) or ``"replicate"`` (every rank holds the full unit: ``fully_shard`` on a
  ``(world, 1)`` replicate x shard mesh, gradients all-reduced); and a **state tier**
  (``UnitPlan.tier``, a :class:`Tier`): ``HOST`` is ``CPUOffloadPolicy(pin_memory=True)``, sharded
  parameters, gradients and optimizer state on the host, the optimizer step on the host; where
  every device has a disk profile (``DeviceProfile.disk``), the deeper tiers keep the optimizer
  state, then the master weights, then the gradients on disk (priced by :mod:`.disk`, within
  ``host_budget`` and ``disk_budget``);
* per block **activation checkpointing**; **prefetch depths** for forward and backward
  (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` with the next
  ``k`` units); **mixed precision** dtypes (``MixedPrecisionPolicy(param_dtype, reduce_dtype)``).

The cost model (:mod:`tightfit.planner.elixir.sim`, formulas in its docstrings) prices compute
from FLOPs over the measured matmul rate, collectives over measured bus bandwidth with overlap
against neighbouring units, host<->device copies of offloaded units, host and device optimizer
throughput, and a per-device memory timeline with a fragmentation margin. Search: exact branch and
bound on small spaces, a greedy Pareto frontier on large ones (:mod:`tightfit.planner.elixir.space`).

The package has the parts every planner has: plan types (:mod:`.plan`), the problem
(:mod:`.problem`: :class:`ElixirProblem`, :class:`ElixirConstraints`), the solver (:mod:`.solver`
over :mod:`.space` and :mod:`.sim`), the baselines (:mod:`.baselines`) and explain/diagnose
(:mod:`.explain`, :mod:`.diagnose`).

Profiles describe one rank's micro-batch: with ``W`` ranks a step trains ``W`` times that batch.

Example:
    >>> from tightfit.planner.elixir import search
    >>> plan = search(model_profile, cluster, memory_budget="40GiB")  # doctest: +SKIP
    >>> print(plan.explain())                                           # doctest: +SKIP
    >>> plan.to_json("plan.json")                                       # doctest: +SKIP
"""

from __future__ import annotations

from tightfit.planner.elixir.baselines import baseline, frontier, mixed_budget
from tightfit.planner.elixir.plan import (
    BASELINES,
    DISK_BASELINES,
    MODES,
    ElixirPlan,
    MemoryBreakdown,
    RunnerUp,
    StepBreakdown,
    Tier,
    UnitPlan,
    model_identity,
)
from tightfit.planner.elixir.problem import ElixirConstraints, ElixirProblem, resolve_budget
from tightfit.planner.elixir.solver import Progress, estimate, search, solve
from tightfit.planner.errors import PlanInfeasibleError, PlanMismatchError

__all__ = [
    "MODES",
    "BASELINES",
    "DISK_BASELINES",
    "ElixirConstraints",
    "ElixirProblem",
    "UnitPlan",
    "Tier",
    "StepBreakdown",
    "MemoryBreakdown",
    "RunnerUp",
    "ElixirPlan",
    "Progress",
    "search",
    "solve",
    "estimate",
    "baseline",
    "frontier",
    "mixed_budget",
    "resolve_budget",
    "model_identity",
    "PlanInfeasibleError",
    "PlanMismatchError",
]
