"""Heterogeneous pipeline partitioning (Sky): contiguous stages sized to each device's speed and memory.

The package has the shape every tightfit planner has:

* :mod:`~tightfit.planner.pipeline.plan`: the plan types, :class:`PartitionPlan` (JSON round trip,
  ``explain()``) and :class:`StagePlan`;
* :mod:`~tightfit.planner.pipeline.problem`: :class:`PipelineProblem`, the inputs validated once, and
  the cost model that prices any partition;
* :mod:`~tightfit.planner.pipeline.solve`: :func:`balance`, the exact DP per device order and the
  order search; :func:`evaluate` prices given boundaries;
* :mod:`~tightfit.planner.pipeline.baselines`: :func:`even`, :func:`parameter_balanced`,
  :func:`sky_allocator` and the exhaustive oracle :func:`brute_force`;
* :mod:`~tightfit.planner.pipeline.diagnose`: why nothing fits, as a ``PlanInfeasibleError``;
* :mod:`~tightfit.planner.pipeline.registry`: partitioners by name and :func:`plan_pipeline`, the
  one call a runtime makes;
* :mod:`~tightfit.planner.pipeline.replicas`: :func:`merge_replicas`, the devices one plan is made
  for when data-parallel replicas of the pipeline step together.

Pure functions: no processes, no devices. ``sky_strategy`` gathers the measurements, calls
:func:`plan_pipeline` on rank 0, shares the plan as JSON and applies it.

Example:
    >>> from tightfit.planner.pipeline import DeviceSpec, PipelineProblem, balance
    >>> devs = [DeviceSpec(name="fast", speed=1.0, memory_bytes=2**30),
    ...         DeviceSpec(name="slow", speed=0.25, memory_bytes=2**30)]
    >>> problem = PipelineProblem(layer_costs=[1.0] * 10, layer_memory=[1000] * 10, devices=devs,
    ...                           microbatches=8, schedule="1f1b")
    >>> balance(problem, order="given").layer_counts()
    (8, 2)
"""

from __future__ import annotations

from tightfit.planner.pipeline.baselines import (
    brute_force,
    even,
    even_boundaries,
    parameter_balanced,
    sky_allocator,
)
from tightfit.planner.pipeline.diagnose import diagnose_infeasible
from tightfit.planner.pipeline.plan import PartitionPlan, StagePlan
from tightfit.planner.pipeline.problem import SCHEDULES, DeviceSpec, LayerMemory, PipelineProblem
from tightfit.planner.pipeline.registry import Partitioner, PartitionerRegistry, partitioners, plan_pipeline
from tightfit.planner.pipeline.replicas import merge_latency, merge_replicas
from tightfit.planner.pipeline.solve import EXACT_ORDER_LIMIT, balance, evaluate

__all__ = [
    "SCHEDULES",
    "EXACT_ORDER_LIMIT",
    "LayerMemory",
    "DeviceSpec",
    "PipelineProblem",
    "StagePlan",
    "PartitionPlan",
    "balance",
    "evaluate",
    "even",
    "even_boundaries",
    "parameter_balanced",
    "sky_allocator",
    "brute_force",
    "diagnose_infeasible",
    "Partitioner",
    "PartitionerRegistry",
    "partitioners",
    "plan_pipeline",
    "merge_replicas",
    "merge_latency",
]
