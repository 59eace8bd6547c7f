"""The pipeline plan: stages in pipeline order, each with its layers, device, time and memory.

A :class:`PartitionPlan` is what every partitioner returns and what ``sky_strategy`` applies. It is
a frozen dataclass that survives JSON exactly (``to_json`` / ``from_json``), so one rank can decide
it and send the text to the others (:func:`tightfit.distributed.decide_on_rank0`), and a plan made
on a laptop with ``tightfit plan sky --json`` is the same object a cluster run applies.

Example:
    >>> stage = StagePlan(index=0, device=0, start=0, stop=4, compute_s=0.5, comm_s=0.0,
    ...                   memory_bytes=100, memory_cap_bytes=1000)
    >>> plan = PartitionPlan(method="even", schedule="gpipe", microbatches=1, virtual_stages=1,
    ...                      devices=("cpu",), order=(0,), stages=(stage,), step_time_s=0.5,
    ...                      bottleneck_s=0.5, sequential_time_s=0.5, feasible=True)
    >>> PartitionPlan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tightfit.serde import dump_json, load_json
from tightfit.units import format_bytes, format_table

__all__ = ["StagePlan", "PartitionPlan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage of a plan.

    Args:
        index: position in the pipeline (0 = first).
        device: index into the plan's devices.
        start: the stage's first layer.
        stop: one past the stage's last layer (it holds layers ``start .. stop - 1``).
        compute_s: forward+backward seconds per microbatch on its device.
        comm_s: seconds per microbatch to send its output and receive the gradient back.
        memory_bytes: predicted peak memory.
        memory_cap_bytes: what the device (or chunk) may use.
    """

    index: int
    device: int
    start: int
    stop: int
    compute_s: float
    comm_s: float
    memory_bytes: int
    memory_cap_bytes: int

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_cap_bytes


@dataclass(frozen=True, kw_only=True)
class PartitionPlan:
    """A pipeline partition with its predicted time and memory.

    Args:
        method: the partitioner's name (``"balanced"``, ``"even"``, ``"parameter-balanced"``, ``"sky"``,
            ``"sky-fixed"``, ``"brute-force"``) or ``"given"`` for boundaries priced as they came.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``; microbatches: per step;
            virtual_stages: chunks per device (1 unless interleaved).
        devices: device names as given; order: device index at each pipeline rank position.
        stages: the stages in pipeline order (``len(order) * virtual_stages`` of them).
        step_time_s: predicted step time with the schedule; bottleneck_s: slowest stage (or rank load);
        sequential_time_s: the same partition run stage after stage without pipelining.
        feasible: every stage fits its memory cap.
        notes: how the plan was found (order search, assumptions).
        cost_model: what priced it (``"measured per-device layer timings; links alpha-beta; ..."`` or
            ``"layer costs / device speed"``), as :class:`tightfit.planner.check.PredictionRecord` reports it.
        step_tail_s: of ``step_time_s``, the seconds after the pipeline drains (per-step overhead,
            optimizer step, gradient all-reduce over replicas).
    """

    method: str
    schedule: str
    microbatches: int
    virtual_stages: int
    devices: tuple[str, ...]
    order: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    step_time_s: float
    bottleneck_s: float
    sequential_time_s: float
    feasible: bool
    notes: tuple[str, ...] = field(default=())
    cost_model: str = ""
    step_tail_s: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """The largest predicted stage memory (each device's own peak is its stages' ``memory_bytes``)."""
        return max(s.memory_bytes for s in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        return tuple(s.start for s in self.stages) + (self.stages[-1].stop,)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].stop

    def layers_of(self, device: int) -> tuple[range, ...]:
        """Layer ranges held by ``device`` (one per chunk), in pipeline order."""
        return tuple(range(s.start, s.stop) for s in self.stages if s.device == device)

    def stages_of(self, device: int) -> tuple[int, ...]:
        return tuple(s.index for s in self.stages if s.device == device)

    def layer_counts(self) -> tuple[int, ...]:
        """Layers per device, indexed by device (not by pipeline position)."""
        counts = [0] * len(self.devices)
        for s in self.stages:
            counts[s.device] += s.stop - s.start
        return tuple(counts)

    def explain(self) -> str:
        """A table of the stages (layers, compute, transfer, memory against the cap), the predicted step
        time and how the plan was found."""
        head = (f"{self.method} partition of {self.num_layers} layers over {len(self.order)} devices, "
                f"schedule {self.schedule}, {self.microbatches} microbatches"
                + (f", {self.virtual_stages} chunks per device" if self.virtual_stages > 1 else ""))
        rows = [(s.index, self.devices[s.device], f"{s.start}-{s.stop - 1}", s.stop - s.start,
                 f"{s.compute_s * 1e3:.3f}", f"{s.comm_s * 1e3:.3f}",
                 f"{format_bytes(s.memory_bytes)} / {format_bytes(s.memory_cap_bytes)}" + ("" if s.fits else " OVER"))
                for s in self.stages]
        table = format_table(rows, ("stage", "device", "layers", "n", "compute ms", "comm ms", "memory / cap"),
                             align="rllrrrl")
        tail = [f"predicted step {self.step_time_s * 1e3:.3f} ms (bottleneck {self.bottleneck_s * 1e3:.3f} ms/mb"
                + (f"; {self.step_tail_s * 1e3:.3f} ms per step after the pipeline" if self.step_tail_s else "")
                + f"); without pipelining {self.sequential_time_s * 1e3:.3f} ms"]
        if self.cost_model:
            tail.append(f"cost model: {self.cost_model}")
        if not self.feasible:
            tail.append("INFEASIBLE: a stage exceeds its memory cap")
        return "\n".join([head, table, *tail, *self.notes])

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON text (also written to ``path`` when given); floats keep every digit."""
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> PartitionPlan:
        """A plan from JSON text or a file written by :meth:`to_json`."""
        return load_json(cls, source)
