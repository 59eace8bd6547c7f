"""Partitioners by name, and the one call a runtime makes to get the plan it will apply.

The registry is string-keyed and strict, like :class:`tightfit.plugins.PluginRegistry`: adding a
name twice raises, asking for an unknown name raises and lists the known ones. One function may be
registered under several preset names (``"sky"`` and ``"sky-fixed"`` are Sky Computing's allocator
without and with its give-back comparison fixed). A third-party partitioner registers itself with
:meth:`PartitionerRegistry.register` and is then accepted by ``SkyStrategy(partition=...)`` and
``tightfit plan sky --compare``.

Example:
    >>> from tightfit.planner.pipeline import DeviceSpec, PipelineProblem
    >>> devs = [DeviceSpec(name="fast", speed=1.0, memory_bytes=2**30),
    ...         DeviceSpec(name="slow", speed=0.5, memory_bytes=2**30)]
    >>> problem = PipelineProblem(layer_costs=[1.0] * 6, layer_memory=[100] * 6, devices=devs,
    ...                           microbatches=4, schedule="1f1b")
    >>> plan_pipeline(problem, "even").layer_counts(), plan_pipeline(problem, [0, 4, 6]).method
    ((3, 3), 'given')
    >>> partitioners.names()
    ['balanced', 'even', 'parameter-balanced', 'sky', 'sky-fixed']
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tightfit.planner.errors import PlanError
from tightfit.planner.pipeline.baselines import even, parameter_balanced, sky_allocator
from tightfit.planner.pipeline.plan import PartitionPlan
from tightfit.planner.pipeline.problem import PipelineProblem
from tightfit.planner.pipeline.solve import balance, evaluate

__all__ = ["Partitioner", "PartitionerRegistry", "partitioners", "plan_pipeline"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Partitioner:
    """A named way to split a pipeline.

    Args:
        name: registry key (``"balanced"``); also what ``SkyStrategy(partition=...)`` takes.
        summary: one line for listings and error messages.
        solve: ``solve(problem) -> PartitionPlan``, or ``solve(problem, order=...)`` when
            ``searches_order``; raises :class:`~tightfit.planner.errors.PlanInfeasibleError` when
            nothing fits (an over-full but priced plan, ``feasible=False``, is also allowed).
        searches_order: it chooses the device order itself; the others keep the devices as listed.
    """

    name: str
    summary: str
    solve: Callable[..., PartitionPlan]
    searches_order: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise PlanError(f"partitioner name {self.name!r} is invalid: use letters, digits, '-' and '_' "
                            "(e.g. 'my-partitioner')")

    def __call__(self, problem: PipelineProblem, *, order: str | Sequence[int] = "search") -> PartitionPlan:
        if self.searches_order:
            return self.solve(problem, order=order)
        if not isinstance(order, str):
            raise PlanError(f"partitioner {self.name!r} keeps the devices as listed; an explicit order "
                            f"{list(order)} applies only to partitioners that search orders: reorder the devices instead")
        return self.solve(problem)


class PartitionerRegistry:
    """String-keyed, strict: a duplicate name raises, an unknown name raises listing the known ones."""

    def __init__(self) -> None:
        self._items: dict[str, Partitioner] = {}

    def add(self, partitioner: Partitioner) -> Partitioner:
        if not isinstance(partitioner, Partitioner):
            raise PlanError(f"{partitioner!r} is not a Partitioner; build Partitioner(name=..., summary=..., "
                            "solve=...) or call register()")
        known = self._items.get(partitioner.name)
        if known is not None:
            raise PlanError(f"a partitioner named {partitioner.name!r} is already registered ({known.summary!r}); "
                            "pick another name")
        self._items[partitioner.name] = partitioner
        return partitioner

    def register(self, name: str, solve: Callable[..., PartitionPlan], *, summary: str,
                 searches_order: bool = False) -> Partitioner:
        """Register ``solve`` under ``name`` (see :class:`Partitioner` for the arguments)."""
        return self.add(Partitioner(name=name, summary=summary, solve=solve, searches_order=searches_order))

    def get(self, name: str) -> Partitioner:
        try:
            return self._items[name]
        except KeyError:
            raise PlanError(f"unknown partitioner {name!r}; known partitioners: {', '.join(self.names())}, or "
                            "give explicit layer boundaries like (0, 3, 8)") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[Partitioner]:
        return iter(self._items[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._items)


partitioners = PartitionerRegistry()
"""The registered partitioners by name: ``"balanced"`` (ours), ``"even"``, ``"parameter-balanced"``, ``"sky"``,
``"sky-fixed"``; :func:`plan_pipeline` looks ``partition`` up here."""
partitioners.register("balanced", balance, searches_order=True,
                      summary="ours: the smallest predicted step time that fits memory (exact per device order)")
partitioners.register("even", even, summary="equal layer counts per stage")
partitioners.register("parameter-balanced", parameter_balanced,
                      summary="equal parameter bytes per stage (DeepSpeed partition_method='parameters')")
partitioners.register("sky", sky_allocator, summary="Sky Computing's allocator, as published")
partitioners.register("sky-fixed", functools.partial(sky_allocator, fix_give_back=True),
                      summary="Sky Computing's allocator with its give-back comparison fixed")


def plan_pipeline(problem: PipelineProblem, partition: str | Sequence[int] = "balanced", *,
                  order: str | Sequence[int] = "search") -> PartitionPlan:
    """The plan a pipeline runtime applies: ``partition`` names a registered partitioner, or gives the
    layer boundaries (``num_stages + 1`` of them), which are priced as they are (``method="given"``).

    ``order`` goes to partitioners that search the device order. An interleaved pipeline keeps the
    devices as listed: ``ScheduleInterleaved1F1B`` places chunk ``k`` on rank ``k % ranks`` and sizes
    each rank's warm-up by its rank, which is what the memory model prices (rank = position).
    """
    if not isinstance(partition, str):
        return evaluate(problem, partition, method="given")
    return partitioners.get(partition)(problem, order="given" if problem.schedule == "interleaved" else order)
