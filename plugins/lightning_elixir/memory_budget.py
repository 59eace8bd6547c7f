"""The whole process's memory budget: the device and host budgets Elixir plans with, from core's one reading of
memory (:mod:`tightfit.memory_limit`) when the user gives none, and the budgets a user gives checked against it.

On a CPU the "device" and the host are one memory, and the process lives under the memory limit of its container,
slice or job: the plan's peak must fit what the limit leaves this rank, counting what the process already holds
(the interpreter, torch, Lightning, the data: the plan's reserve) and the allocator's slack (the planner's
fragmentation margin). Budgets are decided here, once, before the search; core prices the plan; nothing here
re-prices one.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tightfit.memory_limit import MemoryReading
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.units import format_bytes, parse_bytes

__all__ = ["MemoryLimitError", "ProcessBudget", "process_budget", "check_given_budgets", "module_bytes",
           "LIMIT_HEADROOM"]

LIMIT_HEADROOM = 0.10
"""Share of a hard memory limit a default budget leaves unplanned. The kernel kills at the limit, not near it, and
the plan does not price everything the process touches: page cache the disk tier dirties before it is written
back counts against the group, as do threads, Lightning's loop and the cost model's own error."""


class MemoryLimitError(PlanInfeasibleError):
    """A budget the user gave exceeds the memory limit this process runs under, or no plan fits what that limit
    leaves; ``needed_bytes`` is what the budget or the least-memory plan needs, ``budget_bytes`` the limit's share."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessBudget:
    """What the search is given.

    Args:
        memory_budget: the device budget (the user's, or on a CPU what the limit leaves this rank).
        host_budget: the host budget per rank (the user's, or one derived from the limit; ``None``: core's default).
        reserved_bytes: bytes the process holds outside the plan (on a CPU: measured now; ``None``: core's default).
        source: where the device budget came from, one phrase for the plan's explanation (``""``: given).
    """

    memory_budget: int | float | str | None
    host_budget: int | str | None
    reserved_bytes: int | None
    source: str = ""


def module_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that are materialised (the meta device holds none): the plan
    counts them as training state, so they are not part of what the process holds outside the plan."""
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type == "meta" or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _limit_words(reading: MemoryReading, ranks: int) -> str:
    share = f", {format_bytes(reading.share(ranks))} for each of {ranks} ranks" if ranks > 1 else ""
    return f"the memory limit of {format_bytes(reading.capacity)} ({reading.limit_file}){share}"


def check_given_budgets(owner: str, memory_budget: int | float | str | None, host_budget: int | str | None, *,
                        device_type: str, ranks_per_node: int, reading: MemoryReading) -> None:
    """Raise :class:`MemoryLimitError` (one line) where a budget in bytes exceeds this rank's share of the memory
    limit: the device budget on a CPU (device and host are one memory), the host budget on any device. Nothing to
    check without a limit below the machine's memory."""
    if not reading.limited:
        return
    share = reading.share(ranks_per_node)
    given = [("host_budget", host_budget)]
    if device_type == "cpu" and not isinstance(memory_budget, float):
        given.insert(0, ("memory_budget", memory_budget))
    for name, value in given:
        if value is None:
            continue
        nbytes = parse_bytes(value)
        if nbytes > share:
            raise MemoryLimitError(
                f"{owner}({name}={value!r}) asks for {format_bytes(nbytes)}, more than "
                f"{_limit_words(reading, ranks_per_node)} this process runs under: give at most "
                f"{format_bytes(share)}, or leave {name}=None to plan within the limit",
                needed_bytes=nbytes, budget_bytes=share, tier="device" if name == "memory_budget" else "host")


def process_budget(memory_budget: int | float | str | None, host_budget: int | str | None, *, device_type: str,
                   ranks_per_node: int, held_by_model: int, reading: MemoryReading,
                   reserved_given: bool) -> ProcessBudget:
    """The budgets for a search on this machine.

    On a CPU without a given device budget: this rank's share of the limit (or of the machine), at most what it
    holds now plus its share of what is free, less :data:`LIMIT_HEADROOM` of a hard limit, and the reserve what the
    process holds now (``reading.resident``) less the model's own materialised tensors (``held_by_model``), unless the user set
    ``ElixirConstraints.reserved_bytes``, and the host budget, the same memory, defaults to that device budget (a
    budget the user gives is the plan's alone: no reserve, core's host default). Elsewhere (a GPU) the host budget
    defaults, under a limit, to this rank's share of what the limit leaves free.
    """
    ranks = max(1, ranks_per_node)
    if device_type != "cpu":
        if host_budget is None and reading.limited:
            return ProcessBudget(memory_budget=memory_budget, host_budget=max(1, reading.free // ranks),
                                 reserved_bytes=None)
        return ProcessBudget(memory_budget=memory_budget, host_budget=host_budget, reserved_bytes=None)
    if not reading.capacity:
        return ProcessBudget(memory_budget=memory_budget, host_budget=host_budget, reserved_bytes=None)
    reserved, source = None, ""
    if memory_budget is None:  # a budget the user gives is the plan's own; the whole process is ours to fit
        reserved = None if reserved_given else max(0, reading.resident - held_by_model)
        headroom = int(reading.share(ranks) * LIMIT_HEADROOM) if reading.limited else 0
        planned = min(reading.share(ranks), reading.resident + reading.free // ranks) - headroom
        memory_budget = planned
        where = _limit_words(reading, ranks) if reading.limited else f"this machine's {format_bytes(reading.total)}"
        source = (f"what {where} leaves this process: {format_bytes(reading.resident)} held now + "
                  f"{format_bytes(reading.free // ranks)} free"
                  + (f" - {LIMIT_HEADROOM:.0%} of the limit left unplanned" if headroom else ""))
        if host_budget is None:  # one memory: host-resident state counts in the device peak too
            host_budget = planned
    return ProcessBudget(memory_budget=memory_budget, host_budget=host_budget, reserved_bytes=reserved, source=source)
