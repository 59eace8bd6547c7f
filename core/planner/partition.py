"""Heterogeneous pipeline partitioning: contiguous stages sized to each device's speed and memory.

:func:`balance` splits a sequence of layers into one contiguous stage per device (``virtual_stages``
per device for the interleaved schedule) and picks the device order, minimising the predicted
step time of a synchronous pipeline subject to every device's memory. Baselines priced by the same
cost model: :func:`even` (equal layer counts), :func:`parameter_balanced` (equal parameter bytes,
DeepSpeed's ``partition_method="parameters"``) and :func:`sky_allocator` (a re-implementation of
Sky Computing's greedy allocator, its give-back bug included unless asked to fix it).
:func:`brute_force` enumerates every partition and order (small cases; tests and benchmarks).

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
    * memory of a stage: ``param_bytes * (2 + optimizer_state_factor)`` (weights, gradients,
      optimizer state) + ``activation_bytes * in_flight`` + boundary buffers, where ``in_flight`` is
      ``M`` for GPipe, ``min(M, S - s)`` for 1F1B at position ``s``, and for interleaved the warm-up
      depth of ``ScheduleInterleaved1F1B`` spread over the rank's chunks (each chunk gets 1/V of the cap).

Exactness: for a fixed device order the objective is minimised exactly (a min-max DP finds the
smallest bottleneck ``b*``; a branch and bound over bottleneck thresholds ``tau >= b*`` runs a
min-sum DP under ``tau``, pruning with ``(M - 1) * tau + g(tau_hi)``). The device order is searched
exhaustively up to :data:`EXACT_ORDER_LIMIT` distinct arrangements, else over a fixed set of
heuristic orders (speed, memory, link-greedy chains) plus adjacent-swap descent; ``plan.notes``
says which. The interleaved objective is not decomposable by stage: its DP minimises the chunk
bottleneck and the plan is priced with the interleaved formula (not proven optimal).

Example:
    >>> from tightfit.planner.partition import DeviceSpec, balance
    >>> devs = [DeviceSpec(name="fast", speed=1.0, memory_bytes=2**30),
    ...         DeviceSpec(name="slow", speed=0.25, memory_bytes=2**30)]
    >>> plan = balance([1.0] * 10, [1000] * 10, devs, microbatches=8, schedule="1f1b", order="given")
    >>> plan.layer_counts()
    (8, 2)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.serde import dump_json, load_json
from tightfit.units import format_bytes, format_table

__all__ = [
    "SCHEDULES",
    "EXACT_ORDER_LIMIT",
    "LayerMemory",
    "DeviceSpec",
    "StagePlan",
    "PartitionPlan",
    "balance",
    "evaluate",
    "even",
    "parameter_balanced",
    "sky_allocator",
    "brute_force",
    "even_boundaries",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# 120 = 5!: exhaustive order search stays ~0.1 s per arrangement batch on 160 layers.
EXACT_ORDER_LIMIT = 120
_INF = math.inf


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
            if getattr(self, name) < 0:
                raise PlanError(f"LayerMemory.{name}={getattr(self, name)} is negative; give bytes >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One device as the partitioner sees it.

    Args:
        name: for plans and messages (``"rank1"``, ``"A100-0"``).
        speed: relative compute speed; a stage's time is its layer costs divided by this.
        memory_bytes: memory usable for the stage (weights, gradients, optimizer state, activations).
    """

    name: str
    speed: float = 1.0
    memory_bytes: int

    def __post_init__(self) -> None:
        if not self.speed > 0 or not math.isfinite(self.speed):
            raise PlanError(f"device {self.name!r}: speed={self.speed} must be a finite number > 0 "
                            "(1.0 = the reference device the layer costs were measured on)")
        if self.memory_bytes <= 0:
            raise PlanError(f"device {self.name!r}: memory_bytes={self.memory_bytes} must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage of a plan.

    Args:
        index: position in the pipeline (0 = first).
        device: index into the plan's devices.
        start, stop: the stage holds layers ``start .. stop - 1``.
        compute_s: forward+backward seconds per microbatch on its device.
        comm_s: seconds per microbatch to send its output and receive the gradient back.
        memory_bytes: predicted peak memory; memory_cap_bytes: what the device (or chunk) may use.
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
        method: ``"balanced"``, ``"even"``, ``"parameter-balanced"``, ``"sky"`` or ``"sky-fixed"``...
        schedule: one of :data:`SCHEDULES`; microbatches: per step; virtual_stages: chunks per device.
        devices: device names as given; order: device index at each pipeline rank position.
        stages: the stages in pipeline order (``len(order) * virtual_stages`` of them).
        step_time_s: predicted step time with the schedule; bottleneck_s: slowest stage (or rank load);
        sequential_time_s: the same partition run stage after stage without pipelining.
        feasible: every stage fits its memory cap.
        notes: how the plan was found (order search, assumptions).
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
        head = (f"{self.method} partition of {self.num_layers} layers over {len(self.order)} devices, "
                f"schedule {self.schedule}, {self.microbatches} microbatches"
                + (f", {self.virtual_stages} chunks per device" if self.virtual_stages > 1 else ""))
        rows = [(s.index, self.devices[s.device], f"{s.start}-{s.stop - 1}", s.stop - s.start,
                 f"{s.compute_s * 1e3:.3f}", f"{s.comm_s * 1e3:.3f}",
                 f"{format_bytes(s.memory_bytes)} / {format_bytes(s.memory_cap_bytes)}" + ("" if s.fits else " OVER"))
                for s in self.stages]
        table = format_table(rows, ("stage", "device", "layers", "n", "compute ms", "comm ms", "memory / cap"),
                             align="rllrrrl")
        tail = [f"predicted step {self.step_time_s * 1e3:.3f} ms (bottleneck {self.bottleneck_s * 1e3:.3f} ms/mb); "
                f"without pipelining {self.sequential_time_s * 1e3:.3f} ms"]
        if not self.feasible:
            tail.append("INFEASIBLE: a stage exceeds its memory cap")
        return "\n".join([head, table, *tail, *self.notes])

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> PartitionPlan:
        return load_json(cls, source)


# --------------------------------------------------------------------------------------------------
# The problem: prefix sums and per-position cost matrices


def _in_flight(schedule: str, position: int, stages: int, microbatches: int, virtual: int, ranks: int) -> float:
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - position)
    # ScheduleInterleaved1F1B warms up (V - 1) * R + 2 * (R - 1 - r) + 1 chunk-microbatches on rank r
    # before its first backward; spread over the rank's V chunks.
    r = position % ranks
    warm = (virtual - 1) * ranks + 2 * (ranks - 1 - r) + 1
    return min(microbatches, math.ceil(min(microbatches * virtual, warm) / virtual))


class _Problem:
    def __init__(self, layer_costs, layer_memory, devices, *, microbatches, schedule, links, virtual_stages,
                 optimizer_state_factor):
        if schedule not in SCHEDULES:
            raise PlanError(f"schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        if microbatches < 1:
            raise PlanError(f"microbatches={microbatches} must be >= 1")
        self.schedule = schedule
        self.M = int(microbatches)
        self.V = int(virtual_stages) if schedule == "interleaved" else 1
        if self.V < 1:
            raise PlanError(f"virtual_stages={virtual_stages} must be >= 1")
        self.devices = list(devices)
        if not self.devices:
            raise PlanError("no devices given; pass one DeviceSpec per pipeline rank")
        for d in self.devices:
            if not isinstance(d, DeviceSpec):
                raise PlanError(f"{d!r} is not a DeviceSpec; build DeviceSpec(name=..., speed=..., memory_bytes=...)")
        self.D = len(self.devices)
        self.S = self.D * self.V
        costs = np.asarray(list(layer_costs), dtype=np.float64)
        self.L = len(costs)
        if self.L == 0 or (costs < 0).any() or not np.isfinite(costs).all():
            raise PlanError("layer_costs must be a non-empty sequence of finite seconds >= 0, one per layer")
        mems = [m if isinstance(m, LayerMemory) else LayerMemory(param_bytes=int(m)) for m in layer_memory]
        if len(mems) != self.L:
            raise PlanError(f"layer_memory has {len(mems)} entries but layer_costs has {self.L}; give one per layer")
        if self.L < self.S:
            raise PlanError(f"{self.L} layers cannot fill {self.S} stages (every stage needs >= 1 layer); "
                            "use fewer devices" + (" or fewer virtual_stages" if self.V > 1 else ""))
        self.opt = float(optimizer_state_factor)
        self.costs = costs
        self.mems = mems
        self.pc = np.concatenate([[0.0], np.cumsum(costs)])
        self.pp = np.concatenate([[0.0], np.cumsum([m.param_bytes for m in mems])]).astype(np.float64)
        self.pa = np.concatenate([[0.0], np.cumsum([m.activation_bytes for m in mems])]).astype(np.float64)
        out = np.array([m.output_bytes for m in mems] + [0], dtype=np.float64)
        self.out_at = np.concatenate([[0.0], out[:-1]])  # out_at[j]: bytes crossing boundary j (j>=1)
        self.speed = np.array([d.speed for d in self.devices])
        self.cap = np.array([d.memory_bytes for d in self.devices], dtype=np.float64)
        self.bw = self._links(links)
        idx = np.arange(self.L + 1)
        self.valid = idx[:, None] < idx[None, :]  # i < j: a stage holds >= 1 layer

    def _links(self, links) -> np.ndarray:
        if links is None:
            return np.full((self.D, self.D), np.inf)
        if isinstance(links, (int, float)):
            if links <= 0:
                raise PlanError(f"links={links} bytes/s must be > 0 (or None for free transfers)")
            return np.full((self.D, self.D), float(links))
        bw = np.asarray(links, dtype=np.float64)
        if bw.shape != (self.D, self.D):
            raise PlanError(f"links must be a {self.D}x{self.D} matrix of bytes/s (one row per device); got shape "
                            f"{bw.shape}")
        if (bw[~np.eye(self.D, dtype=bool)] <= 0).any():
            raise PlanError("links: every bandwidth between two devices must be > 0 bytes/s")
        return bw

    def uniform_links(self) -> bool:
        off = self.bw[~np.eye(self.D, dtype=bool)]
        return off.size == 0 or bool(np.all(off == off[0]))

    def device_at(self, order: Sequence[int], position: int) -> int:
        return order[position % self.D]

    def comm(self, order, position: int) -> np.ndarray:
        """Seconds per microbatch to send boundary j's activation and receive its gradient, by j."""
        if position == self.S - 1:
            return np.zeros(self.L + 1)
        a, b = self.device_at(order, position), self.device_at(order, position + 1)
        bw = self.bw[a, b] if a != b else np.inf
        return 2.0 * self.out_at / bw

    def matrices(self, order) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """time[k, i, j], memory[k, i, j], cap[k] for every position k (inf time where a stage cannot go)."""
        L1 = self.L + 1
        time = np.empty((self.S, L1, L1))
        mem = np.empty((self.S, L1, L1))
        caps = np.empty(self.S)
        static = (self.pp[None, :] - self.pp[:, None]) * (2.0 + self.opt)
        act = self.pa[None, :] - self.pa[:, None]
        cost = self.pc[None, :] - self.pc[:, None]
        buf_in = 2.0 * self.out_at[:, None]   # received activation + its gradient, boundary i
        for k in range(self.S):
            d = self.device_at(order, k)
            inflight = _in_flight(self.schedule, k, self.S, self.M, self.V, self.D)
            buf_out = 2.0 * self.out_at[None, :] if k < self.S - 1 else 0.0
            mem[k] = static + act * inflight + buf_in * inflight + buf_out
            caps[k] = self.cap[d] / self.V
            time[k] = cost / self.speed[d] + self.comm(order, k)[None, :]
        time[:, ~self.valid] = _INF
        time[np.ceil(mem) > np.floor(caps)[:, None, None]] = _INF
        # stage 0 starts at layer 0; the last stage ends at layer L
        time[0, 1:, :] = _INF
        time[self.S - 1, :, : self.L] = _INF
        return time, mem, caps

    # -- pricing -------------------------------------------------------------------------------
    def price(self, boundaries: Sequence[int], order: Sequence[int], method: str, notes=()) -> PartitionPlan:
        b = list(boundaries)
        if len(b) != self.S + 1 or b[0] != 0 or b[-1] != self.L or any(x >= y for x, y in zip(b, b[1:])):
            raise PlanError(f"boundaries {b} must rise strictly from 0 to {self.L} with {self.S + 1} entries")
        stages = []
        for k in range(self.S):
            i, j, d = b[k], b[k + 1], self.device_at(order, k)
            inflight = _in_flight(self.schedule, k, self.S, self.M, self.V, self.D)
            mem = ((self.pp[j] - self.pp[i]) * (2.0 + self.opt) + (self.pa[j] - self.pa[i]) * inflight
                   + 2.0 * self.out_at[i] * inflight + (2.0 * self.out_at[j] if k < self.S - 1 else 0.0))
            stages.append(StagePlan(
                index=k, device=int(d), start=int(i), stop=int(j),
                compute_s=float((self.pc[j] - self.pc[i]) / self.speed[d]),
                comm_s=float(self.comm(order, k)[j]), memory_bytes=int(math.ceil(mem)),
                memory_cap_bytes=int(self.cap[d] / self.V)))
        t = [s.time_s for s in stages]
        if self.schedule == "interleaved":
            load = [0.0] * self.D
            for s in stages:
                load[s.device] += s.time_s
            bottleneck = max(load)
            step = self.M * bottleneck + (sum(load) - bottleneck) / self.V
        else:
            bottleneck = max(t)
            step = sum(t) + (self.M - 1) * bottleneck
        return PartitionPlan(
            method=method, schedule=self.schedule, microbatches=self.M, virtual_stages=self.V,
            devices=tuple(d.name for d in self.devices), order=tuple(int(o) for o in order),
            stages=tuple(stages), step_time_s=float(step), bottleneck_s=float(bottleneck),
            sequential_time_s=float(self.M * sum(t)), feasible=all(s.fits for s in stages), notes=tuple(notes))

    def objective(self, plan: PartitionPlan) -> float:
        return plan.step_time_s if plan.feasible else _INF


# --------------------------------------------------------------------------------------------------
# Exact DP for one device order


def _window(k: int, S: int, L: int) -> tuple[slice, slice]:
    """Boundaries stage k can start (i) and end (j) at: every other stage needs >= 1 layer.
    For 162 layers on 64 stages this is a 99 x 99 window instead of 163 x 163 (2.7x less work)."""
    return slice(k, L - S + k + 1), slice(k + 1, L - S + k + 2)


def _bottleneck_dp(time: np.ndarray) -> float:
    S, L = time.shape[0], time.shape[2] - 1
    best = np.full(L + 1, _INF)
    best[_window(0, S, L)[1]] = time[0, 0, _window(0, S, L)[1]]
    for k in range(1, S):
        wi, wj = _window(k, S, L)
        new = np.full(L + 1, _INF)
        new[wj] = np.min(np.maximum(best[wi, None], time[k, wi, wj]), axis=0)
        best = new
    return float(best[-1])


def _min_sum_dp(time: np.ndarray, tau: float) -> tuple[float, list[int] | None]:
    """Smallest sum of stage times with every stage <= tau, and its boundaries."""
    S, L = time.shape[0], time.shape[2] - 1
    g = np.full(L + 1, _INF)
    wj0 = _window(0, S, L)[1]
    first = time[0, 0, wj0]
    g[wj0] = np.where(first <= tau, first, _INF)
    back = []
    for k in range(1, S):
        wi, wj = _window(k, S, L)
        sub = time[k, wi, wj]
        tot = g[wi, None] + np.where(sub <= tau, sub, _INF)
        arg = np.argmin(tot, axis=0)
        back.append(arg + wi.start)
        new = np.full(L + 1, _INF)
        new[wj] = tot[arg, np.arange(tot.shape[1])]
        g = new
    if not math.isfinite(g[-1]):
        return _INF, None
    bounds = [L]
    for k, arg in zip(range(S - 1, 0, -1), reversed(back)):
        j0 = _window(k, S, L)[1].start
        bounds.append(int(arg[bounds[-1] - j0]))
    bounds.append(0)
    return float(g[-1]), bounds[::-1]


def _solve_order(prob: _Problem, order: Sequence[int]) -> PartitionPlan | None:
    """The exact optimum for this device order (None when no partition fits)."""
    time, _, _ = prob.matrices(order)
    b_star = _bottleneck_dp(time)
    if not math.isfinite(b_star):
        return None
    if prob.schedule == "interleaved" or prob.M == 1:
        # interleaved: chunk bottleneck, ties broken by the smallest sum; M == 1: pure sum
        tau = b_star if prob.schedule == "interleaved" else _INF
        _, bounds = _min_sum_dp(time, tau)
        assert bounds is not None  # tau >= b* admits the bottleneck-optimal partition
        return prob.price(bounds, order, "balanced")
    weight = prob.M - 1
    best: PartitionPlan | None = None
    seen: dict[float, tuple[float, list[int] | None]] = {}

    def g(tau: float) -> float:
        if tau not in seen:
            seen[tau] = total, bounds = _min_sum_dp(time, tau)
            nonlocal best
            if bounds is None:
                return total
            plan = prob.price(bounds, order, "balanced")
            if best is None or plan.step_time_s < best.step_time_s:
                best = plan
        return seen[tau][0]

    g_inf = g(_INF)
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


def _distinct_orders(prob: _Problem) -> list[tuple[int, ...]] | None:
    """All arrangements, identical devices collapsed; None when more than EXACT_ORDER_LIMIT."""
    keys = [(d.speed, d.memory_bytes, tuple(prob.bw[i]), tuple(prob.bw[:, i])) for i, d in enumerate(prob.devices)]
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    labels = [next(n for n, members in enumerate(groups.values()) if i in members) for i in range(prob.D)]
    count = math.factorial(prob.D)
    for members in groups.values():
        count //= math.factorial(len(members))
    if count > EXACT_ORDER_LIMIT:
        return None
    firsts = [members for members in groups.values()]
    out = []
    for perm in sorted(set(itertools.permutations(labels))):
        used = [0] * len(firsts)
        order = []
        for lab in perm:
            order.append(firsts[lab][used[lab]])
            used[lab] += 1
        out.append(tuple(order))
    return out


def _heuristic_orders(prob: _Problem) -> list[tuple[int, ...]]:
    ids = list(range(prob.D))
    orders = [tuple(ids),
              tuple(sorted(ids, key=lambda i: (-prob.speed[i], i))),
              tuple(sorted(ids, key=lambda i: (prob.speed[i], i))),
              tuple(sorted(ids, key=lambda i: (-prob.cap[i], i)))]
    if not prob.uniform_links():
        # chains that always take the widest link next, from the fastest and from device 0
        for start in dict.fromkeys([0, int(np.argmax(prob.speed))]):
            chain, left = [start], set(ids) - {start}
            while left:
                nxt = max(left, key=lambda j: (prob.bw[chain[-1], j], -j))
                chain.append(nxt)
                left.remove(nxt)
            orders.append(tuple(chain))
    return list(dict.fromkeys(orders))


def _search(prob: _Problem, order: str | Sequence[int]) -> tuple[PartitionPlan | None, str]:
    if not isinstance(order, str):
        fixed = tuple(int(o) for o in order)
        if sorted(fixed) != list(range(prob.D)):
            raise PlanError(f"order {list(fixed)} must be a permutation of 0..{prob.D - 1}")
        return _solve_order(prob, fixed), "device order: given"
    if order not in ("search", "given"):
        raise PlanError(f"order={order!r}: use 'search', 'given' or a permutation of device indices")
    if order == "given":
        return _solve_order(prob, tuple(range(prob.D))), "device order: given"
    exact = _distinct_orders(prob)
    if exact is not None:
        plans = [p for p in (_solve_order(prob, o) for o in exact) if p is not None]
        best = min(plans, key=lambda p: p.step_time_s, default=None)
        return best, f"device order: exhaustive over {len(exact)} distinct arrangement(s) (exact)"
    plans = [p for p in (_solve_order(prob, o) for o in _heuristic_orders(prob)) if p is not None]
    best = min(plans, key=lambda p: p.step_time_s, default=None)
    swaps = 0
    if best is not None and prob.D <= 16:
        # adjacent-swap descent; bounded so 16 devices x 160 layers stays near a second
        improved = True
        while improved and swaps < 4 * prob.D:
            improved = False
            for p in range(prob.D - 1):
                cand = list(best.order)
                cand[p], cand[p + 1] = cand[p + 1], cand[p]
                swaps += 1
                plan = _solve_order(prob, cand)
                if plan is not None and plan.step_time_s < best.step_time_s * (1 - 1e-12):
                    best, improved = plan, True
    return best, (f"device order: heuristic ({prob.D}! arrangements exceed {EXACT_ORDER_LIMIT}; speed/memory/"
                  f"link-greedy orders + {swaps} adjacent swaps; the partition is exact for the order chosen)")


def _infeasible(prob: _Problem) -> PlanInfeasibleError:
    in_flight = max(_in_flight(prob.schedule, k, prob.S, prob.M, prob.V, prob.D) for k in range(prob.S))
    per_layer = [(prob.pp[i + 1] - prob.pp[i]) * (2 + prob.opt) + (prob.pa[i + 1] - prob.pa[i]) * (
        _in_flight(prob.schedule, prob.S - 1, prob.S, prob.M, prob.V, prob.D)) for i in range(prob.L)]
    need_total = sum(per_layer)
    have = float(prob.cap.sum())
    biggest = max(per_layer)
    fix = ("add devices or raise their memory caps; " + ("use schedule='1f1b' (GPipe keeps all "
           f"{prob.M} microbatches' activations) or " if prob.schedule == "gpipe" else "") + "use fewer microbatches"
           " or activation checkpointing; an optimizer with less state (optimizer_state_factor="
           f"{prob.opt:g})")
    if need_total > have:
        short = need_total - have
        msg = (f"no partition of {prob.L} layers fits {prob.D} devices: weights + gradients + optimizer state + "
               f"activations need at least {format_bytes(need_total)} but the devices hold "
               f"{format_bytes(have)} together, short by {format_bytes(short)}. Fix: {fix}")
        return PlanInfeasibleError(msg, needed_bytes=int(need_total), budget_bytes=int(have), suggestions=(fix,))
    short = biggest - float(prob.cap.max()) / prob.V
    msg = (f"no contiguous partition of {prob.L} layers fits {prob.D} devices ({format_bytes(have)} in all, "
           f"the model needs ~{format_bytes(need_total)} with up to {in_flight} microbatches in flight): "
           f"the largest layer needs {format_bytes(biggest)}"
           + (f", {format_bytes(short)} more than the largest device holds" if short > 0 else
              " and contiguous stages cannot pack the memory the devices have")
           + f". Fix: {fix}")
    return PlanInfeasibleError(msg, needed_bytes=int(max(biggest, need_total / prob.D)),
                               budget_bytes=int(prob.cap.max()), suggestions=(fix,))


# --------------------------------------------------------------------------------------------------
# Public API


def balance(layer_costs: Sequence[float], layer_memory: Sequence[LayerMemory | int], devices: Sequence[DeviceSpec],
            *, microbatches: int, schedule: str, links: float | Sequence[Sequence[float]] | None = None,
            virtual_stages: int = 2, optimizer_state_factor: float = 2.0,
            order: str | Sequence[int] = "search") -> PartitionPlan:
    """The partition (and device order) with the smallest predicted step time that fits memory.

    Args:
        layer_costs: forward+backward seconds per microbatch of each layer on a device of speed 1.0.
        layer_memory: per layer, a :class:`LayerMemory` or plain parameter bytes.
        devices: one :class:`DeviceSpec` per pipeline rank.
        microbatches: microbatches per step.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        links: bandwidth in bytes/s between devices: ``None`` (free), one number, or a matrix.
        virtual_stages: chunks per device for ``"interleaved"``.
        optimizer_state_factor: optimizer-state bytes per parameter byte (Adam 2, SGD+momentum 1, SGD 0).
        order: ``"search"`` (choose the device order), ``"given"`` or an explicit permutation.

    Raises:
        PlanInfeasibleError: no partition fits; the message carries the shortfall and the fixes.
    """
    prob = _Problem(layer_costs, layer_memory, devices, microbatches=microbatches, schedule=schedule,
                    links=links, virtual_stages=virtual_stages, optimizer_state_factor=optimizer_state_factor)
    plan, note = _search(prob, order)
    if plan is None:
        raise _infeasible(prob)
    notes = (note,) + (("interleaved: the DP balances chunks (stage bottleneck), priced per rank; not proven "
                        "optimal",) if prob.schedule == "interleaved" else ())
    return PartitionPlan(**{**_fields(plan), "notes": notes})


def _fields(plan: PartitionPlan) -> dict:
    return {f: getattr(plan, f) for f in PartitionPlan.__dataclass_fields__}


def evaluate(boundaries: Sequence[int], layer_costs, layer_memory, devices, *, microbatches: int, schedule: str,
             links=None, virtual_stages: int = 2, optimizer_state_factor: float = 2.0,
             order: Sequence[int] | None = None, method: str = "given") -> PartitionPlan:
    """Price a given partition (``len(devices) * V + 1`` boundaries) under the cost model; never raises
    for memory: an over-full plan comes back with ``feasible=False``."""
    prob = _Problem(layer_costs, layer_memory, devices, microbatches=microbatches, schedule=schedule,
                    links=links, virtual_stages=virtual_stages, optimizer_state_factor=optimizer_state_factor)
    return prob.price(boundaries, tuple(range(prob.D)) if order is None else tuple(order), method)


def even_boundaries(num_layers: int, stages: int) -> list[int]:
    """Equal layer counts; the first ``num_layers % stages`` stages get one more (Sky's even split)."""
    if num_layers < stages:
        raise PlanError(f"{num_layers} layers cannot fill {stages} stages; use fewer devices")
    base, extra = divmod(num_layers, stages)
    out = [0]
    for s in range(stages):
        out.append(out[-1] + base + (1 if s < extra else 0))
    return out


def even(layer_costs, layer_memory, devices, *, microbatches: int, schedule: str, links=None,
         virtual_stages: int = 2, optimizer_state_factor: float = 2.0) -> PartitionPlan:
    """Equal layer counts per stage, devices in the given order (what a user gets by default)."""
    prob = _Problem(layer_costs, layer_memory, devices, microbatches=microbatches, schedule=schedule,
                    links=links, virtual_stages=virtual_stages, optimizer_state_factor=optimizer_state_factor)
    return prob.price(even_boundaries(prob.L, prob.S), tuple(range(prob.D)), "even")


def parameter_balanced(layer_costs, layer_memory, devices, *, microbatches: int, schedule: str, links=None,
                       virtual_stages: int = 2, optimizer_state_factor: float = 2.0) -> PartitionPlan:
    """Contiguous stages with the smallest largest parameter count (DeepSpeed ``partition_method="parameters"``),
    devices in the given order; speed and memory caps are ignored when choosing, priced afterwards."""
    prob = _Problem(layer_costs, layer_memory, devices, microbatches=microbatches, schedule=schedule,
                    links=links, virtual_stages=virtual_stages, optimizer_state_factor=optimizer_state_factor)
    size = prob.pp[None, :] - prob.pp[:, None]
    mat = np.where(prob.valid, size, _INF)[None].repeat(prob.S, axis=0)
    mat[0, 1:, :] = _INF
    mat[-1, :, : prob.L] = _INF
    b = _bottleneck_dp(mat)
    _, bounds = _min_sum_dp(mat, b)  # among min-max splits, the deterministic argmin
    assert bounds is not None
    return prob.price(bounds, tuple(range(prob.D)), "parameter-balanced")


def sky_allocator(layer_costs, layer_memory, devices, *, microbatches: int, schedule: str, links=None,
                  virtual_stages: int = 1, optimizer_state_factor: float = 2.0, fix_give_back: bool = False,
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
    prob = _Problem(layer_costs, layer_memory, devices, microbatches=microbatches, schedule=schedule,
                    links=links, virtual_stages=virtual_stages, optimizer_state_factor=optimizer_state_factor)
    if prob.V != 1:
        raise PlanError("sky_allocator places one stage per device; use schedule 'gpipe' or '1f1b'")
    # The original works in FLOP counts and floors the average load (``//``); our costs are seconds,
    # so they are rescaled to FLOP-like magnitudes (smallest layer = 1e6) to keep that floor harmless.
    positive = [c for c in prob.costs if c > 0]
    scale = 1e6 / min(positive) if positive else 1.0
    flops = [float(c) * scale for c in prob.costs]
    mem = [m.param_bytes * (2 + prob.opt) + m.activation_bytes * prob.M for m in prob.mems]
    avail = [float(c) for c in prob.cap]
    wtime = [1.0 / s for s in prob.speed]
    D = prob.D
    p = even_boundaries(prob.L, D)
    p = _sky_fit_memory(p, mem, avail)
    wt = [t / min(wtime) for t in wtime]

    def load(j: int) -> float:
        return sum(flops[p[j]:p[j + 1]]) * wt[j]

    for _ in range(max_iterations):
        target = sum(load(j) for j in range(D)) // D  # floor division, as in the original
        before = list(p)
        for j in range(D - 1):
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
    return prob.price(p, tuple(range(D)), "sky-fixed" if fix_give_back else "sky")


def _sky_fit_memory(p: list[int], mem: list[float], avail: list[float]) -> list[int]:
    """Sky's first pass: shift boundaries until each worker's layer memory is below what it has."""
    D = len(avail)

    def used() -> list[float]:
        return [sum(mem[p[j]:p[j + 1]]) for j in range(D)]

    def ok() -> bool:
        return all(a >= u for a, u in zip(avail, used()))

    while not ok():
        before = list(p)
        done = False
        for j in range(D - 1):
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


def brute_force(layer_costs, layer_memory, devices, *, microbatches: int, schedule: str, links=None,
                virtual_stages: int = 2, optimizer_state_factor: float = 2.0,
                search_order: bool = True) -> PartitionPlan | None:
    """Every contiguous partition under every device order (tiny cases only); None if none fits."""
    prob = _Problem(layer_costs, layer_memory, devices, microbatches=microbatches, schedule=schedule,
                    links=links, virtual_stages=virtual_stages, optimizer_state_factor=optimizer_state_factor)
    orders = list(itertools.permutations(range(prob.D))) if search_order else [tuple(range(prob.D))]
    best = None
    for order in orders:
        for cuts in itertools.combinations(range(1, prob.L), prob.S - 1):
            plan = prob.price([0, *cuts, prob.L], order, "brute-force")
            if plan.feasible and (best is None or plan.step_time_s < best.step_time_s):
                best = plan
    return best
