"""The pipeline partitioning problem, built and validated once, and its cost model.

A :class:`PipelineProblem` holds the layers (time and memory of each), the devices (speed and
memory), the links between them and the schedule; every partitioner takes one. Construction checks
the inputs once and derives the prefix sums the solvers read, so the solver and the baselines price
plans with the same numbers.

Cost model (one microbatch unless said otherwise; ``M`` microbatches, ``S`` stages):
    * compute of stage ``s`` on device ``d``: ``sum(layer_costs[stage]) / speed[d]``
      (``layer_costs`` are forward+backward seconds on a device of speed 1.0);
    * transfer after stage ``s``: its output activation forward and its gradient backward,
      ``2 * output_bytes / bandwidth(d, next d)``, charged to the sending stage (not overlapped:
      gloo and NCCL point-to-point both occupy the ranks that wait on them);
    * step time with ``t_s`` = compute + transfer: ``sum(t_s) + (M - 1) * max(t_s)`` for GPipe
      and 1F1B (a flow line of identical jobs: the first microbatch crosses every stage, the other
      ``M - 1`` leave at the bottleneck's rate); interleaved, with per-rank load ``R_r`` summed over
      its ``V`` chunks: ``M * max(R) + (sum(R) - max(R)) / V`` (the bubble shrinks ``V``-fold);
      without pipelining (Sky Computing's runtime: stage after stage over RPC): ``M * sum(t_s)``;
    * measured per device (``DeviceSpec.layer_seconds``, what each rank timed for itself): stage
      compute is the sum of *that device's* seconds for its layers, not one speed for all layer
      types (a slowed rank's embedding and its matmul blocks slow by different factors);
    * link latency (``link_latency``, alpha of an alpha-beta fit): a transfer *delays* its microbatch
      by alpha but does not occupy a rank (the sender goes on with its next microbatch), so it is paid
      on the pipeline's critical path once per boundary and direction, ``2 x alpha`` per boundary per
      step (the first activation forward, the last gradient back), and per microbatch without
      pipelining; on gloo over loopback alpha is most of what a small activation costs. Charged per
      microbatch to the sending stage instead, a loaded host's alpha would outweigh a small model's whole
      compute and every plan would put one layer on the first stage;
    * once per step, after the pipeline drains: ``step_overhead_s`` (what the runtime does per step
      whatever the partition: output broadcast, framework loop) plus, for the slowest device, its
      optimizer step (``param_bytes / optimizer_bytes_per_s``) and, with ``replicas > 1``, the
      gradient all-reduce over its copies (``alpha + 2 (R-1)/R x param_bytes / busbw``, blocking as
      ``SkyStrategy`` runs it). The DP balances the pipeline part; these terms are priced, not searched;
    * memory of a stage: ``param_bytes * (1 + gradient_copies + optimizer_state_factor)`` (weights, gradients,
      optimizer state) + ``activation_bytes * in_flight`` + boundary buffers, where ``in_flight`` is
      ``M`` for GPipe, ``min(M, S - s)`` for 1F1B at position ``s``, and for interleaved the warm-up
      depth of ``ScheduleInterleaved1F1B`` spread over the rank's chunks (each chunk gets 1/V of the cap).

Example:
    >>> devs = (DeviceSpec(name="fast", speed=1.0, memory_bytes=2**30),
    ...         DeviceSpec(name="slow", speed=0.5, memory_bytes=2**30))
    >>> problem = PipelineProblem(layer_costs=(1.0,) * 6, layer_memory=(1000,) * 6, devices=devs,
    ...                           microbatches=4, schedule="1f1b")
    >>> problem.price([0, 4, 6], (0, 1), "by hand").step_time_s   # 4 s + 4 s + 3 x 4 s
    20.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tightfit.checks import check_number
from tightfit.planner.errors import PlanError
from tightfit.planner.pipeline.plan import PartitionPlan, StagePlan

__all__ = ["SCHEDULES", "LayerMemory", "DeviceSpec", "PipelineProblem"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""The pipeline schedules a :class:`PipelineProblem` may name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerMemory:
    """Memory of one layer.

    Args:
        param_bytes: bytes of its parameters.
        activation_bytes: bytes it saves for backward, per microbatch.
        output_bytes: bytes of its output (sent to the next stage when a stage ends here), per microbatch.
    """

    param_bytes: int
    activation_bytes: int = 0
    output_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("param_bytes", "activation_bytes", "output_bytes"):
            check_number(getattr(self, name), name, where="LayerMemory", integer=True, low=0, error=PlanError,
                         fix="give whole bytes >= 0 (a profile's numbers, or tightfit.units.parse_bytes('2GiB'))")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One device as the partitioner sees it.

    Args:
        name: for plans and messages (``"rank1"``, ``"A100-0"``).
        speed: relative compute speed; a stage's time is its layer costs divided by this.
        memory_bytes: memory usable for the stage (weights, gradients, optimizer state, activations).
        layer_seconds: forward+backward seconds per microbatch of every layer *measured on this device*;
            when given they replace ``layer_costs / speed`` for it (``None``: scale the reference costs).
        optimizer_bytes_per_s: parameter bytes its optimizer step updates per second (measured);
            ``None``: the optimizer step is not priced.
    """

    name: str
    speed: float = 1.0
    memory_bytes: int
    layer_seconds: tuple[float, ...] | None = None
    optimizer_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        check_number(self.speed, "speed", where=where, low=0, low_open=True, error=PlanError,
                     fix="1.0 = the reference device the layer costs were measured on, 0.5 = twice as slow")
        check_number(self.memory_bytes, "memory_bytes", where=where, integer=True, low=0, low_open=True,
                     error=PlanError, fix="give the bytes a stage may use on it, e.g. parse_bytes('20GiB')")
        if self.layer_seconds is not None:
            secs = tuple(check_number(t, f"layer_seconds[{i}]", where=where, low=0, error=PlanError,
                                      fix="give measured forward+backward seconds per layer on this device")
                         for i, t in enumerate(self.layer_seconds))
            object.__setattr__(self, "layer_seconds", tuple(float(t) for t in secs))
        if self.optimizer_bytes_per_s is not None:
            check_number(self.optimizer_bytes_per_s, "optimizer_bytes_per_s", where=where, low=0, low_open=True,
                         error=PlanError, fix="give the measured parameter bytes per second, or None")


def _derived() -> Any:
    """A field computed in ``__post_init__`` (not an argument, not compared)."""
    return field(init=False, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineProblem:
    """One partitioning problem: layers, devices, links and schedule, validated once.

    Sequences may be given as lists; they are stored as tuples, and plain integers in
    ``layer_memory`` become ``LayerMemory(param_bytes=n)``.

    Args:
        layer_costs: forward+backward seconds per microbatch of each layer on a device of speed 1.0.
        layer_memory: per layer, a :class:`LayerMemory` or plain parameter bytes.
        devices: one :class:`DeviceSpec` per pipeline rank.
        microbatches: microbatches per step.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        links: bandwidth in bytes/s between devices: ``None`` (free), one number, or a matrix with one
            row per device.
        virtual_stages: chunks per device for ``"interleaved"`` (other schedules use one).
        optimizer_state_factor: optimizer-state bytes per parameter byte (Adam 2, SGD+momentum 1, SGD 0).
        link_latency: seconds per message between devices (alpha): ``None`` or 0 (none), one number, or a
            matrix like ``links``.
        step_overhead_s: seconds every step costs whatever the partition (measured by the runtime).
        pipeline_overhead_s: seconds a step of the schedule itself costs with stages that compute
            nothing (per-microbatch bookkeeping, p2p posting; measured by a stand-in step), added to the step.
        replicas: data-parallel copies of the pipeline that average gradients every step.
        allreduce: ``(alpha s, bus bandwidth bytes/s)`` of an all-reduce among the replicas.
        gradient_copies: gradient buffers alive at a stage's peak: 1, or 2 where the previous step's
            gradients are freed only after the pipeline ran (``SkyStrategy`` under Lightning, whose
            ``zero_grad`` comes after the training step: such a stage peaks well above twice its
            parameters).
        accumulation_buffer: with more than one microbatch a layer's gradient for the next microbatch is
            computed whole before it is added into the accumulated one, so the stage's largest layer's
            parameters count once more (one block's weight above the model on every rank of an MLP). Off by
            default.

    Derived once (read by the solvers): ``num_layers``, ``num_devices``, ``chunks`` (chunks per
    device actually used), ``num_stages``; prefix sums ``cost_prefix``, ``param_prefix``,
    ``activation_prefix`` (entry ``j`` sums layers ``0 .. j - 1``); ``boundary_bytes[j]``, the
    activation crossing boundary ``j``; ``speeds``, ``device_memory`` and the ``bandwidth`` matrix.
    """

    layer_costs: tuple[float, ...]
    layer_memory: tuple[LayerMemory, ...]
    devices: tuple[DeviceSpec, ...]
    microbatches: int
    schedule: str
    links: float | tuple[tuple[float, ...], ...] | None = None
    virtual_stages: int = 2
    optimizer_state_factor: float = 2.0
    link_latency: float | tuple[tuple[float, ...], ...] | None = None
    step_overhead_s: float = 0.0
    pipeline_overhead_s: float = 0.0
    replicas: int = 1
    allreduce: tuple[float, float] | None = None
    gradient_copies: int = 1
    accumulation_buffer: bool = False

    num_layers: int = _derived()
    num_devices: int = _derived()
    chunks: int = _derived()
    num_stages: int = _derived()
    cost_prefix: np.ndarray = _derived()
    param_prefix: np.ndarray = _derived()
    activation_prefix: np.ndarray = _derived()
    boundary_bytes: np.ndarray = _derived()
    speeds: np.ndarray = _derived()
    device_memory: np.ndarray = _derived()
    bandwidth: np.ndarray = _derived()
    latency: np.ndarray = _derived()
    device_cost_prefix: np.ndarray = _derived()
    cost_model: str = _derived()

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule {self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        check_number(self.microbatches, "microbatches", where="PipelineProblem", integer=True, low=1,
                     error=PlanError, fix="give a whole count of microbatches per step, e.g. 4")
        check_number(self.virtual_stages, "virtual_stages", where="PipelineProblem", integer=True, low=1,
                     error=PlanError, fix="give whole chunks per device, e.g. 2")
        check_number(self.optimizer_state_factor, "optimizer_state_factor", where="PipelineProblem", low=0,
                     error=PlanError, fix="optimizer-state bytes per parameter byte: Adam 2, SGD+momentum 1, SGD 0")
        devices = tuple(self.devices)
        if not devices:
            raise PlanError("no devices given; pass one DeviceSpec per pipeline rank")
        for d in devices:
            if not isinstance(d, DeviceSpec):
                raise PlanError(f"{d!r} is not a DeviceSpec; build DeviceSpec(name=..., speed=..., memory_bytes=...)")
        costs = tuple(check_number(c, f"layer_costs[{i}]", where="PipelineProblem", low=0, error=PlanError,
                                   fix="give measured forward+backward seconds per layer") for i, c in
                      enumerate(self.layer_costs))
        if not costs:
            raise PlanError("PipelineProblem: layer_costs is empty; give finite seconds >= 0, one per layer")
        costs = tuple(float(c) for c in costs)
        mems = tuple(m if isinstance(m, LayerMemory) else LayerMemory(param_bytes=m) for m in self.layer_memory)
        if len(mems) != len(costs):
            raise PlanError(f"layer_memory has {len(mems)} entries but layer_costs has {len(costs)}; give one per layer")
        chunks = int(self.virtual_stages) if self.schedule == "interleaved" else 1
        if len(costs) < len(devices) * chunks:
            raise PlanError(f"{len(costs)} layers cannot fill {len(devices) * chunks} stages (every stage needs >= 1 "
                            "layer); use fewer devices" + (" or fewer virtual_stages" if chunks > 1 else ""))
        put(self, "layer_costs", costs)
        put(self, "layer_memory", mems)
        put(self, "devices", devices)
        put(self, "microbatches", int(self.microbatches))
        put(self, "optimizer_state_factor", float(self.optimizer_state_factor))
        put(self, "num_layers", len(costs))
        put(self, "num_devices", len(devices))
        put(self, "chunks", chunks)
        put(self, "num_stages", len(devices) * chunks)
        put(self, "cost_prefix", np.concatenate([[0.0], np.cumsum(costs)]))
        put(self, "param_prefix", np.concatenate([[0.0], np.cumsum([m.param_bytes for m in mems])]).astype(np.float64))
        put(self, "activation_prefix",
            np.concatenate([[0.0], np.cumsum([m.activation_bytes for m in mems])]).astype(np.float64))
        out = np.array([m.output_bytes for m in mems] + [0], dtype=np.float64)
        put(self, "boundary_bytes", np.concatenate([[0.0], out[:-1]]))  # [j]: bytes crossing boundary j (j >= 1)
        put(self, "speeds", np.array([d.speed for d in devices]))
        put(self, "device_memory", np.array([d.memory_bytes for d in devices], dtype=np.float64))
        self._set_links()
        self._set_step_terms()

    def _set_step_terms(self) -> None:
        put, n, where = object.__setattr__, self.num_devices, "PipelineProblem"
        lat = self.link_latency
        if lat is None:
            put(self, "latency", np.zeros((n, n)))
        else:
            arr = np.full((n, n), float(lat)) if isinstance(lat, (int, float)) else np.asarray(lat, dtype=np.float64)
            if arr.shape != (n, n) or not (np.isfinite(arr).all() and (arr >= 0).all()):
                raise PlanError(f"PipelineProblem: link_latency={lat!r} must be seconds >= 0, one number or a {n}x{n} "
                                "matrix (one row per device); give the fitted alpha of the links, or None")
            put(self, "link_latency", float(lat) if isinstance(lat, (int, float)) else
                tuple(tuple(float(x) for x in row) for row in arr))
            put(self, "latency", arr)
        check_number(self.step_overhead_s, "step_overhead_s", where=where, low=0, error=PlanError,
                     fix="give the measured seconds per step outside the pipeline, or 0")
        check_number(self.pipeline_overhead_s, "pipeline_overhead_s", where=where, low=0, error=PlanError,
                     fix="give the measured seconds of a stand-in step of the schedule, or 0")
        check_number(self.replicas, "replicas", where=where, integer=True, low=1, error=PlanError,
                     fix="give the data-parallel copies of the pipeline, 1 for none")
        check_number(self.gradient_copies, "gradient_copies", where=where, integer=True, low=1, error=PlanError,
                     fix="give the gradient buffers alive at a stage's peak: 1, or 2 if the last step's stay")
        if self.allreduce is not None:
            a, bw = self.allreduce
            if not (a >= 0 and bw > 0):
                raise PlanError(f"PipelineProblem: allreduce={self.allreduce!r} must be (alpha s >= 0, bus bandwidth "
                                "bytes/s > 0); give an alpha-beta fit, or None")
            put(self, "allreduce", (float(a), float(bw)))
        prefix = np.empty((n, self.num_layers + 1))
        for k, d in enumerate(self.devices):
            if d.layer_seconds is None:
                prefix[k] = self.cost_prefix / self.speeds[k]
                continue
            if len(d.layer_seconds) != self.num_layers:
                raise PlanError(f"device {d.name!r} has {len(d.layer_seconds)} layer_seconds for {self.num_layers} "
                                "layers; give one measured time per layer")
            prefix[k] = np.concatenate([[0.0], np.cumsum(d.layer_seconds)])
        put(self, "device_cost_prefix", prefix)
        measured = [d.layer_seconds is not None for d in self.devices]
        terms = ["measured per-device layer timings" if all(measured) else
                 "layer costs / device speed" + (" (measured timings on some devices)" if any(measured) else "")]
        if float(self.latency.max(initial=0.0)) > 0:
            terms.append("links alpha-beta")
        elif not np.isinf(self.bandwidth).all():
            terms.append("links bandwidth-only")
        if any(d.optimizer_bytes_per_s for d in self.devices):
            terms.append("optimizer step")
        if self.replicas > 1 and self.allreduce is not None:
            terms.append(f"gradient all-reduce over {self.replicas} replicas")
        if self.step_overhead_s > 0:
            terms.append(f"{self.step_overhead_s * 1e3:.2f} ms per-step overhead")
        if self.pipeline_overhead_s > 0:
            terms.append(f"{self.pipeline_overhead_s * 1e3:.2f} ms schedule overhead (stand-in step)")
        put(self, "cost_model", "; ".join(terms))

    def _set_links(self) -> None:
        put, n = object.__setattr__, self.num_devices
        links = self.links
        if links is None:
            put(self, "bandwidth", np.full((n, n), np.inf))
            return
        if isinstance(links, (int, float)):
            if not links > 0:  # NaN fails this too: a NaN bandwidth would price every transfer as free
                raise PlanError(f"PipelineProblem: links={links} bytes/s must be a number > 0; give the measured "
                                "bandwidth between ranks, e.g. 10e9, or None for free transfers")
            put(self, "links", float(links))
            put(self, "bandwidth", np.full((n, n), float(links)))
            return
        try:
            bw = np.asarray(links, dtype=np.float64)
        except (TypeError, ValueError):
            raise PlanError(f"PipelineProblem: links={links!r} is not a {n}x{n} matrix of numbers; give bytes/s "
                            "between devices, one row per device") from None
        if bw.shape != (n, n):
            raise PlanError(f"links must be a {n}x{n} matrix of bytes/s (one row per device); got shape {bw.shape}")
        off = bw[~np.eye(n, dtype=bool)]
        if not (off > 0).all():  # NaN fails too
            bad = [float(x) for x in off if not x > 0]
            raise PlanError(f"PipelineProblem: links has bandwidths {bad} between devices; every one must be a "
                            "number > 0 bytes/s (inf = free); give the measured rates")
        put(self, "links", tuple(tuple(float(x) for x in row) for row in bw))
        put(self, "bandwidth", bw)

    # -- the cost model ------------------------------------------------------------------------------
    def _largest_layer(self) -> np.ndarray:
        """``[i, j]``: the largest parameter bytes of one layer among layers ``i .. j - 1`` (0 when empty)."""
        n = self.num_layers + 1
        out = np.zeros((n, n))
        sizes = [float(m.param_bytes) for m in self.layer_memory]
        for i in range(n):
            top = 0.0
            for j in range(i + 1, n):
                top = max(top, sizes[j - 1])
                out[i, j] = top
        return out

    @property
    def state_factor(self) -> float:
        """Bytes of state per parameter byte: the weights, the live gradient buffers, the optimizer state."""
        return 1.0 + self.gradient_copies + self.optimizer_state_factor

    def in_flight(self, position: int) -> float:
        """Microbatches whose activations stage ``position`` holds at its peak."""
        m = self.microbatches
        if self.schedule == "gpipe":
            return m
        if self.schedule == "1f1b":
            return min(m, self.num_stages - position)
        # ScheduleInterleaved1F1B warms up (V - 1) * R + 2 * (R - 1 - r) + 1 chunk-microbatches on rank r
        # before its first backward; spread over the rank's V chunks.
        v, ranks = self.chunks, self.num_devices
        r = position % ranks
        warm = (v - 1) * ranks + 2 * (ranks - 1 - r) + 1
        return min(m, math.ceil(min(m * v, warm) / v))

    def uniform_links(self) -> bool:
        off = self.bandwidth[~np.eye(self.num_devices, dtype=bool)]
        return off.size == 0 or bool(np.all(off == off[0]))

    def device_at(self, order: Sequence[int], position: int) -> int:
        """The device at pipeline ``position`` (chunks go round-robin over ``order``)."""
        return int(order[position % self.num_devices])

    def comm(self, order: Sequence[int], position: int) -> np.ndarray:
        """Seconds per microbatch to send boundary j's activation and receive its gradient, by j."""
        if position == self.num_stages - 1:
            return np.zeros(self.num_layers + 1)
        a, b = self.device_at(order, position), self.device_at(order, position + 1)
        if a == b:
            return np.zeros(self.num_layers + 1)
        # activation forward + its gradient back: the bytes occupy the ranks; latency is priced per step
        return 2.0 * self.boundary_bytes / self.bandwidth[a, b]

    def matrices(self, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``time[k, i, j]``, ``memory[k, i, j]`` of a stage at position ``k`` holding layers ``i .. j - 1``,
        and ``cap[k]``; time is ``inf`` where such a stage cannot go (empty, over its cap, or not starting
        at layer 0 / ending at the last layer for the first / last position)."""
        n, stages = self.num_layers + 1, self.num_stages
        time = np.empty((stages, n, n))
        mem = np.empty((stages, n, n))
        caps = np.empty(stages)
        static = (self.param_prefix[None, :] - self.param_prefix[:, None]) * self.state_factor
        act = self.activation_prefix[None, :] - self.activation_prefix[:, None]
        buf_in = 2.0 * self.boundary_bytes[:, None]  # received activation + its gradient, boundary i
        if self.accumulation_buffer and self.microbatches > 1:
            static = static + self._largest_layer()
        for k in range(stages):
            d = self.device_at(order, k)
            inflight = self.in_flight(k)
            buf_out = 2.0 * self.boundary_bytes[None, :] if k < stages - 1 else 0.0
            mem[k] = static + act * inflight + buf_in * inflight + buf_out
            caps[k] = self.device_memory[d] / self.chunks
            pre = self.device_cost_prefix[d]
            time[k] = (pre[None, :] - pre[:, None]) + self.comm(order, k)[None, :]
        idx = np.arange(n)
        time[:, ~(idx[:, None] < idx[None, :])] = np.inf  # a stage holds >= 1 layer
        time[np.ceil(mem) > np.floor(caps)[:, None, None]] = np.inf
        time[0, 1:, :] = np.inf  # stage 0 starts at layer 0
        time[stages - 1, :, : self.num_layers] = np.inf  # the last stage ends at the last layer
        return time, mem, caps

    def price(self, boundaries: Sequence[int], order: Sequence[int], method: str,
              notes: Sequence[str] = ()) -> PartitionPlan:
        """The plan of these stage ``boundaries`` (``num_stages + 1`` of them) on devices in ``order``,
        priced by the cost model; an over-full stage gives ``feasible=False`` rather than an error."""
        b = [int(x) for x in boundaries]
        if len(b) != self.num_stages + 1 or b[0] != 0 or b[-1] != self.num_layers or any(
                x >= y for x, y in zip(b, b[1:])):
            raise PlanError(f"boundaries {b} must rise strictly from 0 to {self.num_layers} with "
                            f"{self.num_stages + 1} entries")
        stages = []
        for k in range(self.num_stages):
            i, j, d = b[k], b[k + 1], self.device_at(order, k)
            inflight = self.in_flight(k)
            extra = (max(m.param_bytes for m in self.layer_memory[i:j])
                     if self.accumulation_buffer and self.microbatches > 1 else 0.0)
            mem = (extra + (self.param_prefix[j] - self.param_prefix[i]) * self.state_factor
                   + (self.activation_prefix[j] - self.activation_prefix[i]) * inflight
                   + 2.0 * self.boundary_bytes[i] * inflight
                   + (2.0 * self.boundary_bytes[j] if k < self.num_stages - 1 else 0.0))
            stages.append(StagePlan(
                index=k, device=d, start=i, stop=j,
                compute_s=float(self.device_cost_prefix[d][j] - self.device_cost_prefix[d][i]),
                comm_s=float(self.comm(order, k)[j]), memory_bytes=int(math.ceil(mem)),
                memory_cap_bytes=int(self.device_memory[d] / self.chunks)))
        t = [s.time_s for s in stages]
        if self.schedule == "interleaved":
            load = [0.0] * self.num_devices
            for s in stages:
                load[s.device] += s.time_s
            bottleneck = max(load)
            step = self.microbatches * bottleneck + (sum(load) - bottleneck) / self.chunks
        else:
            bottleneck = max(t)
            step = sum(t) + (self.microbatches - 1) * bottleneck
        tail = self.tail_seconds(stages)
        # latency: each boundary's activation and gradient cross once on the fill / drain of a step
        lat = sum(2.0 * float(self.latency[a.device, b.device]) for a, b in zip(stages, stages[1:])
                  if a.device != b.device)
        step += lat + self.pipeline_overhead_s
        return PartitionPlan(
            method=method, schedule=self.schedule, microbatches=self.microbatches, virtual_stages=self.chunks,
            devices=tuple(d.name for d in self.devices), order=tuple(int(o) for o in order),
            stages=tuple(stages), step_time_s=float(step + tail), bottleneck_s=float(bottleneck),
            sequential_time_s=float(self.microbatches * (sum(t) + lat) + tail), feasible=all(s.fits for s in stages),
            notes=tuple(notes), cost_model=self.cost_model, step_tail_s=float(tail))

    def tail_seconds(self, stages: Sequence[StagePlan]) -> float:
        """Seconds per step after the pipeline drains: the per-step overhead plus the slowest device's
        optimizer step and gradient all-reduce over the replicas (0 when none of them is given)."""
        per_device: dict[int, float] = {}
        for s in stages:
            per_device[s.device] = per_device.get(s.device, 0.0) + float(self.param_prefix[s.stop] - self.param_prefix[s.start])
        worst = 0.0
        for d, nbytes in per_device.items():
            t = 0.0
            rate = self.devices[d].optimizer_bytes_per_s
            if rate:
                t += nbytes / rate
            if self.replicas > 1 and self.allreduce is not None:
                alpha, busbw = self.allreduce
                # SkyStrategy: one all-reduce of per-parameter flags, then the gradients in fp32 buckets
                t += 2 * alpha + 2.0 * (self.replicas - 1) / self.replicas * nbytes / busbw
            worst = max(worst, t)
        return self.step_overhead_s + worst
