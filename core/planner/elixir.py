"""Elixir planner: the fastest sharding x offloading x recomputation plan that fits, from profiles alone.

``search(model_profile, cluster)`` returns an :class:`ElixirPlan` that FSDP2 executes unit by unit:

* a **unit** is a contiguous run of blocks (first-use order) wrapped by one ``fully_shard`` call
  (a list of modules when it spans several blocks; a unit holding the root block ``""`` is the
  root's own ``fully_shard``); unit size plays the role of Elixir's chunk size;
* per unit a **mode**: ``"reshard"`` (``reshard_after_forward=True``, ZeRO-3-like), ``"keep"``
  (``reshard_after_forward=False``: sharded at rest, kept gathered from forward to backward,
  ZeRO-2-like) or ``"replicate"`` (every rank holds the full unit: ``fully_shard`` on a
  ``(world, 1)`` replicate x shard mesh, gradients all-reduced); and an **offload** flag
  (``CPUOffloadPolicy(pin_memory=True)``: sharded parameters, gradients and optimizer state on
  the host, the optimizer step on the host);
* per block **activation checkpointing**; **prefetch depths** for forward and backward
  (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` with the next
  ``k`` units); **mixed precision** dtypes (``MixedPrecisionPolicy(param_dtype, reduce_dtype)``).

The cost model (:mod:`tightfit.planner._elixir_sim`, formulas in its docstrings) prices compute
from FLOPs over the measured matmul rate, collectives over measured bus bandwidth with overlap
against neighbouring units, host<->device copies of offloaded units, host and device optimizer
throughput, and a per-device memory timeline with a fragmentation margin. Search: exact branch and
bound on small spaces, a greedy Pareto frontier on large ones (:mod:`tightfit.planner._elixir_search`).

Profiles describe one rank's micro-batch: with ``W`` ranks a step trains ``W`` times that batch.

Example:
    >>> from tightfit.planner.elixir import search
    >>> plan = search(model_profile, cluster, memory_budget="40GiB")  # doctest: +SKIP
    >>> print(plan.explain())                                           # doctest: +SKIP
    >>> plan.to_json("plan.json")                                       # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tightfit.planner import _elixir_search as S
from tightfit.planner._elixir_sim import MODES, Context, Detail, build_context
from tightfit.planner.errors import PlanInfeasibleError, PlanMismatchError
from tightfit.profiler.types import ClusterSpec, ModelProfile
from tightfit.serde import dump_json, load_json
from tightfit.units import format_bytes, parse_bytes

__all__ = [
    "MODES",
    "BASELINES",
    "ElixirConstraints",
    "UnitPlan",
    "StepBreakdown",
    "MemoryBreakdown",
    "RunnerUp",
    "ElixirPlan",
    "search",
    "estimate",
    "baseline",
    "frontier",
    "mixed_budget",
    "resolve_budget",
    "model_identity",
    "PlanInfeasibleError",
    "PlanMismatchError",
]

Progress = Callable[[int, int, str], None]
_CUDA_RESERVE = 1 << 30  # CUDA context + cuBLAS/NCCL workspaces: 0.8-1 GiB on A100/H100 with torch 2.x


@dataclass(frozen=True, kw_only=True, slots=True)
class ElixirConstraints:
    """Limits on the search space and model margins.

    Args:
        modes: unit modes the search may use (subset of ``("reshard", "keep", "replicate")``).
        allow_offload: whether units may be offloaded to host memory.
        allow_checkpointing: whether blocks may be checkpointed.
        prefetch_depths: prefetch depths to try, forward and backward independently.
        unit_blocks: blocks per unit the greedy search tries (``None``: 1, 2 and 4 after merging tiny blocks).
        fragmentation: margin on the predicted peak for allocator fragmentation (0.10 = 10%).
        reserved_bytes: per-device bytes the plan may not use (``None``: 1 GiB on CUDA, 0 on CPU).
        host_memory_fraction: fraction of each host's memory offloaded state may take.
        exhaustive: ``True`` exact search, ``False`` greedy, ``None`` exact when the space has at
            most ``exhaustive_limit`` plans.
        exhaustive_limit: see ``exhaustive``.
    """

    modes: tuple[str, ...] = MODES
    allow_offload: bool = True
    allow_checkpointing: bool = True
    prefetch_depths: tuple[int, ...] = (1, 2)
    unit_blocks: tuple[int, ...] | None = None
    fragmentation: float = 0.10
    reserved_bytes: int | None = None
    host_memory_fraction: float = 0.8
    exhaustive: bool | None = None
    exhaustive_limit: int = 50_000

    def __post_init__(self) -> None:
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"ElixirConstraints.modes={self.modes!r}: give a non-empty subset of {MODES}")
        if not self.prefetch_depths or any(d < 1 for d in self.prefetch_depths):
            raise ValueError(f"ElixirConstraints.prefetch_depths={self.prefetch_depths!r}: depths must be >= 1 "
                             "(FSDP2 always fetches the next unit)")
        if self.unit_blocks is not None and (not self.unit_blocks or any(k < 1 for k in self.unit_blocks)):
            raise ValueError(f"ElixirConstraints.unit_blocks={self.unit_blocks!r}: give sizes >= 1 or None")
        if not 0 <= self.fragmentation < 1:
            raise ValueError(f"ElixirConstraints.fragmentation={self.fragmentation}: must be in [0, 1), e.g. 0.1")
        if not 0 < self.host_memory_fraction <= 1:
            raise ValueError(f"ElixirConstraints.host_memory_fraction={self.host_memory_fraction}: must be in (0, 1]")
        if self.reserved_bytes is not None and self.reserved_bytes < 0:
            raise ValueError(f"ElixirConstraints.reserved_bytes={self.reserved_bytes}: must be >= 0")

    def space(self) -> S.Space:
        return S.Space(modes=tuple(self.modes), offload=(False, True) if self.allow_offload else (False,),
                       checkpointing=self.allow_checkpointing, depths=tuple(sorted(set(self.prefetch_depths))),
                       unit_blocks=self.unit_blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitPlan:
    """One FSDP2 unit of a plan.

    Args:
        blocks: block names, contiguous in first-use order.
        mode: ``"reshard"``, ``"keep"`` or ``"replicate"``.
        offload: parameters, gradients and optimizer state on the host (``CPUOffloadPolicy``).
        checkpoint: blocks of this unit run under activation checkpointing.
        param_numel: parameter elements of the unit.
        device_bytes: sharded state (parameters, gradients, optimizer) resident on each device.
        host_bytes: state each rank keeps in host memory.
        gathered_bytes: unsharded parameters while the unit is live.
        time_s: predicted share of the step (compute, recompute, waits on its fetches, its optimizer step).
    """

    blocks: tuple[str, ...]
    mode: str = "reshard"
    offload: bool = False
    checkpoint: tuple[str, ...] = ()
    param_numel: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    gathered_bytes: int = 0
    time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("UnitPlan.blocks is empty: a unit holds at least one block")
        if self.mode not in MODES:
            raise ValueError(f"UnitPlan.mode={self.mode!r}: use one of {MODES}")
        stray = [b for b in self.checkpoint if b not in self.blocks]
        if stray:
            raise ValueError(f"UnitPlan.checkpoint names {stray} that are not blocks of this unit {self.blocks}")

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's flag: only ``keep`` units stay gathered between forward and backward."""
        return self.mode != "keep"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBreakdown:
    """Where one predicted step's time goes (seconds): the parts add up to the step time."""

    compute_s: float
    recompute_s: float
    exposed_comm_s: float
    optimizer_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """The predicted peak, taken apart (bytes per device, before the margin)."""

    phase: str
    block: str
    state_bytes: int
    params_bytes: int
    activation_bytes: int
    margin_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerUp:
    """The best plan of another family (grouping x prefetch depths) and why it lost."""

    family: str
    step_time_s: float
    peak_bytes: int
    units: int
    offloaded: int
    checkpointed: int
    why: str


@dataclass(frozen=True, kw_only=True)
class ElixirPlan:
    """A plan FSDP2 can execute, with its predictions and the identity of what it was made for.

    Args:
        model / param_numel / blocks / blocks_hash / inputs / world_size: identity checked by
            :meth:`check_compatible` before a runtime applies the plan.
        precision / param_dtype / reduce_dtype / optimizer: what the plan was priced for.
        units: the units in first-use order.
        forward_prefetch / backward_prefetch: prefetch depths.
        step_time_s / peak_bytes / budget_bytes / host_bytes_per_rank: predictions and the budget.
        breakdown / memory: where the time and the peak memory go.
        runner_ups: the best plans of other families (fastest first).
        search_method / search_seconds / candidates_evaluated: how it was found.
        device: the device it was planned for; notes: assumptions the cost model made.
        checkpointable_blocks: how many of the model's blocks can be checkpointed.
    """

    model: str
    param_numel: int
    blocks: tuple[str, ...]
    blocks_hash: str
    inputs: dict[str, list[int]]
    world_size: int
    precision: str
    param_dtype: str
    reduce_dtype: str
    optimizer: str
    units: tuple[UnitPlan, ...]
    forward_prefetch: int
    backward_prefetch: int
    step_time_s: float
    peak_bytes: int
    budget_bytes: int
    host_bytes_per_rank: int
    breakdown: StepBreakdown
    memory: MemoryBreakdown
    runner_ups: tuple[RunnerUp, ...] = ()
    search_method: str = "estimate"
    search_seconds: float = 0.0
    candidates_evaluated: int = 0
    device: str = ""
    notes: tuple[str, ...] = ()
    checkpointable_blocks: int = 0

    # ---- views -------------------------------------------------------------------------------
    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    @property
    def offloaded_units(self) -> tuple[int, ...]:
        return tuple(i for i, u in enumerate(self.units) if u.offload)

    @property
    def checkpointed_blocks(self) -> tuple[str, ...]:
        return tuple(b for u in self.units for b in u.checkpoint)

    @property
    def is_mixed(self) -> bool:
        """Some units offloaded and some resident, some resharded, some blocks recomputed."""
        off = self.offloaded_units
        return (0 < len(off) < len(self.units) and any(u.mode == "reshard" for u in self.units)
                and bool(self.checkpointed_blocks))

    @property
    def variety(self) -> int:
        """How many of the plan's choices are mixed (0-3): offload, checkpointing, and modes."""
        return (int(0 < len(self.offloaded_units) < len(self.units))
                + int(0 < len(self.checkpointed_blocks) < self.checkpointable_blocks)
                + int(len({u.mode for u in self.units}) > 1))

    @property
    def samples_per_step(self) -> int:
        shapes = list(self.inputs.values())
        return self.world_size * (shapes[0][0] if shapes and shapes[0] else 1)

    @property
    def tokens_per_step(self) -> int:
        shapes = list(self.inputs.values())
        per = shapes[0][0] * shapes[0][1] if shapes and len(shapes[0]) >= 2 else (shapes[0][0] if shapes and shapes[0] else 1)
        return self.world_size * per

    # ---- I/O -----------------------------------------------------------------------------------
    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> ElixirPlan:
        return load_json(cls, source)

    # ---- identity ------------------------------------------------------------------------------
    def check_compatible(self, profile: ModelProfile, world_size: int, *, precision: str | None = None) -> None:
        """Raise :class:`PlanMismatchError` unless this plan was made for ``profile`` on ``world_size`` ranks."""
        fix = ("re-plan for this run (`tightfit plan elixir ...` with the same model, batch and --devices, "
               "or ElixirStrategy(plan=None) to plan at fit start)")
        if world_size != self.world_size:
            raise PlanMismatchError(
                f"plan was made for world size {self.world_size}, this run has {world_size} ranks; {fix}",
                field="world_size", expected=self.world_size, actual=world_size)
        if profile.param_numel != self.param_numel:
            raise PlanMismatchError(
                f"plan was made for a model with {self.param_numel:,} parameters ({self.model}), this model has "
                f"{profile.param_numel:,} ({profile.model}); {fix}",
                field="param_numel", expected=self.param_numel, actual=profile.param_numel)
        names, digest = model_identity(profile)
        if digest != self.blocks_hash:
            diff = next((f"block {i}: plan {a!r} vs model {b!r}" for i, (a, b) in enumerate(zip(self.blocks, names))
                         if a != b), f"plan has {len(self.blocks)} blocks, model has {len(names)}")
            raise PlanMismatchError(f"plan's blocks do not match the model's ({diff}); {fix}",
                                    field="blocks", expected=self.blocks_hash, actual=digest)
        if precision is not None and precision != self.precision:
            raise PlanMismatchError(f"plan was priced for precision {self.precision!r}, this run uses {precision!r}; "
                                    f"{fix}", field="precision", expected=self.precision, actual=precision)

    # ---- explanation --------------------------------------------------------------------------
    def explain(self, *, full: bool = False) -> str:
        """The plan as a table (runs of identical units folded unless ``full``), totals and runner-ups."""
        from tightfit.planner._elixir_explain import explain

        return explain(self, full=full)

    # ---- DeepSpeed ----------------------------------------------------------------------------
    def to_deepspeed_config(self) -> dict:
        """The closest DeepSpeed ZeRO configuration; :meth:`deepspeed_gaps` says what it cannot express."""
        from tightfit.planner._elixir_explain import deepspeed_config

        return deepspeed_config(self)[0]

    def deepspeed_gaps(self) -> tuple[str, ...]:
        """What of this plan the DeepSpeed configuration cannot express (one sentence each)."""
        from tightfit.planner._elixir_explain import deepspeed_config

        return deepspeed_config(self)[1]


BASELINES = ("ddp", "zero2", "zero2-offload", "zero3", "zero3-offload")


def model_identity(profile: ModelProfile) -> tuple[tuple[str, ...], str]:
    """Block names and a short hash of (name, parameter count) per block: what a plan is bound to."""
    names = tuple(b.name for b in profile.blocks)
    h = hashlib.sha256(";".join(f"{b.name}:{b.param_numel}" for b in profile.blocks).encode()).hexdigest()[:16]
    return names, h


def resolve_budget(memory_budget: int | float | str | None, cluster: ClusterSpec,
                   constraints: ElixirConstraints | None = None) -> tuple[int, int]:
    """(budget bytes per device, reserved bytes): ``None`` = the smallest device's memory; a float in
    (0, 1] = that fraction of it; an int or ``"40GiB"`` = bytes. The reserve (CUDA context) is part of
    the predicted peak, so a plan's peak is compared with the budget directly."""
    constraints = constraints or ElixirConstraints()
    smallest = min(d.memory_bytes for d in cluster.devices)
    reserved = constraints.reserved_bytes
    if reserved is None:
        reserved = _CUDA_RESERVE if any(d.kind == "cuda" for d in cluster.devices) else 0
    if memory_budget is None:
        budget = smallest
    elif isinstance(memory_budget, float) and 0 < memory_budget <= 1:
        budget = int(smallest * memory_budget)
    else:
        budget = parse_bytes(memory_budget)
    if budget <= 0:
        raise ValueError(f"memory_budget={memory_budget!r} gives {budget} bytes; give a positive size like '20GiB' "
                         "or a fraction like 0.8")
    return budget, reserved


def _setup(model: ModelProfile, cluster: ClusterSpec, optimizer: str, precision: str,
           memory_budget: int | float | str | None, constraints: ElixirConstraints | None,
           act_scale: float = 1.0) -> tuple[ElixirConstraints, int, Context, float]:
    if model.step != "train":
        raise ValueError(f"profile of {model.model!r} is a {model.step!r} profile; Elixir plans training steps: "
                         "profile with step='train'")
    if not model.blocks:
        raise ValueError(f"profile of {model.model!r} has no blocks; profile_model finds them for nn.Module models")
    cons = constraints or ElixirConstraints()
    budget, reserved = resolve_budget(memory_budget, cluster, cons)
    ctx = build_context(model, cluster, precision=precision, optimizer=optimizer,
                        fragmentation=cons.fragmentation, reserved=reserved)
    if act_scale != 1.0:
        ctx = replace(ctx, saved=tuple(x * act_scale for x in ctx.saved), ckpt=tuple(x * act_scale for x in ctx.ckpt),
                      transient=tuple(x * act_scale for x in ctx.transient),
                      fwd_transient=tuple(x * act_scale for x in ctx.fwd_transient),
                      fwd=tuple(x * act_scale for x in ctx.fwd), bwd=tuple(x * act_scale for x in ctx.bwd))
    hosts = [d.host_memory_bytes for d in cluster.devices if d.host_memory_bytes > 0]
    host_budget = (min(hosts) * cons.host_memory_fraction / ctx.ranks_per_node) if hosts else float("inf")
    return cons, budget, ctx, host_budget


def search(model: ModelProfile, cluster: ClusterSpec, *, optimizer: str = "adamw", precision: str = "bf16-mixed",
           memory_budget: int | float | str | None = None, constraints: ElixirConstraints | None = None,
           progress: Progress | None = None) -> ElixirPlan:
    """The fastest plan (by the cost model) whose predicted peak per device fits ``memory_budget``.

    Args:
        model: the training-step profile of one rank's micro-batch.
        cluster: the devices, one per rank.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"adagrad"``.
        precision: Lightning precision string (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``, ``"bf16-true"``).
        memory_budget: bytes per device (int, ``"40GiB"``), a fraction of the smallest device's
            memory, or ``None`` for all of it.
        constraints: :class:`ElixirConstraints`.
        progress: ``progress(done, total, what)`` called while searching.

    Raises:
        PlanInfeasibleError: nothing fits; carries the smallest budget that does and the cheapest change.
    """
    t0 = time.perf_counter()
    cons, budget, ctx, host_budget = _setup(model, cluster, optimizer, precision, memory_budget, constraints)
    ev = S.Evaluator(ctx)
    space = cons.space()
    exact = cons.exhaustive if cons.exhaustive is not None else S.count_space(ctx, space) <= cons.exhaustive_limit
    if exact:
        per_family = S.exhaustive(ev, space, budget, host_budget, progress)
        feasible = [c for c in per_family.values() if c is not None]
    else:
        pool = S.greedy_pool(ev, space, host_budget, progress)
        feasible = [c for c in pool if c.peak <= budget]
    best_of: dict[str, S.Candidate] = {}
    for c in feasible:
        if c.family not in best_of or c.key < best_of[c.family].key:
            best_of[c.family] = c
    feasible = list(best_of.values())
    if not feasible:
        raise _infeasible(model, cluster, optimizer, precision, memory_budget, cons, budget, ctx, exact)
    ranked = sorted(feasible, key=lambda c: c.key)
    best = ranked[0]
    plan = _to_plan(ev, best, model, budget, cluster)
    best_detail = _detail(ev, best)
    runner_ups = tuple(_runner_up(ev, c, best, best_detail) for c in ranked[1:4])
    return replace(plan, runner_ups=runner_ups, search_method="exhaustive" if exact else "greedy frontier",
                   search_seconds=time.perf_counter() - t0, candidates_evaluated=ev.evaluations)


def estimate(model: ModelProfile, cluster: ClusterSpec, units: Sequence[UnitPlan], *, forward_prefetch: int = 1,
             backward_prefetch: int = 1, optimizer: str = "adamw", precision: str = "bf16-mixed",
             memory_budget: int | float | str | None = None,
             constraints: ElixirConstraints | None = None) -> ElixirPlan:
    """Price a given plan (units with their blocks, mode, offload and checkpoint) on ``cluster``."""
    _, budget, ctx, _ = _setup(model, cluster, optimizer, precision, memory_budget, constraints)
    index = {name: i for i, name in enumerate(ctx.names)}
    spans, modes, offs = [], [], []
    ckpt = [False] * len(ctx.names)
    expect = 0
    for u in units:
        try:
            ids = [index[b] for b in u.blocks]
        except KeyError as e:
            raise ValueError(f"unit names block {e.args[0]!r}, which the profile of {model.model!r} does not have") from None
        if ids != list(range(expect, expect + len(ids))):
            raise ValueError(f"unit {u.blocks} is not the next contiguous run of blocks (expected to start at "
                             f"{ctx.names[expect] if expect < len(ctx.names) else 'the end'!r}); units must cover "
                             "the blocks in first-use order")
        spans.append((ids[0], ids[-1] + 1))
        modes.append(u.mode)
        offs.append(u.offload)
        for b in u.checkpoint:
            ckpt[index[b]] = True
        expect = ids[-1] + 1
    if expect != len(ctx.names):
        raise ValueError(f"units cover {expect} of {len(ctx.names)} blocks; add units for {list(ctx.names[expect:])}")
    ev = S.Evaluator(ctx)
    cand = ev.make(spans, modes, offs, ckpt, forward_prefetch, backward_prefetch)
    return _to_plan(ev, cand, model, budget, cluster)


def baseline(model: ModelProfile, cluster: ClusterSpec, name: str, *, checkpoint: bool | str = "auto",
             **kwargs: object) -> ElixirPlan:
    """A configuration users pick by hand, priced by the same cost model (one unit per block, merged
    like the search merges tiny blocks): ``ddp`` (replicate), ``zero2`` (keep), ``zero3``
    (reshard), ``-offload`` variants (every unit offloaded). ``checkpoint="auto"`` checkpoints every
    block only when the plan does not fit otherwise (what a user does after an out-of-memory error)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    mode = {"ddp": "replicate", "zero2": "keep", "zero3": "reshard"}[name.split("-")[0]]
    offload = name.endswith("-offload")
    _, _, ctx, _ = _setup(model, cluster, str(kwargs.get("optimizer", "adamw")),
                          str(kwargs.get("precision", "bf16-mixed")), None, None)
    spans = S.groupings(ctx, (1,))[0]

    def units(ck: bool) -> list[UnitPlan]:
        return [UnitPlan(blocks=ctx.names[a:b], mode=mode, offload=offload,
                         checkpoint=tuple(n for i, n in enumerate(ctx.names[a:b], a) if ck and ctx.checkpointable[i]))
                for a, b in spans]

    plan = estimate(model, cluster, units(checkpoint is True), **kwargs)  # type: ignore[arg-type]
    if checkpoint == "auto" and not plan.fits:
        plan = estimate(model, cluster, units(True), **kwargs)  # type: ignore[arg-type]
    return replace(plan, search_method=f"baseline {name}")


def frontier(model: ModelProfile, cluster: ClusterSpec, *, optimizer: str = "adamw", precision: str = "bf16-mixed",
             constraints: ElixirConstraints | None = None) -> list[ElixirPlan]:
    """The greedy search's Pareto frontier (peak ascending, time descending), budget-independent."""
    _, budget, ctx, host_budget = _setup(model, cluster, optimizer, precision, None, constraints)
    ev = S.Evaluator(ctx)
    pool = S.greedy_pool(ev, (constraints or ElixirConstraints()).space(), host_budget)
    return [_to_plan(ev, c, model, budget, cluster) for c in S.pareto(pool)]


def mixed_budget(model: ModelProfile, cluster: ClusterSpec, **kwargs: object) -> int:
    """A per-device budget under which :func:`search` returns a *mixed* plan (:attr:`ElixirPlan.is_mixed`:
    some units offloaded and some resident, some resharded, some blocks recomputed), preferring plans
    where checkpointing and unit modes are mixed too (:attr:`ElixirPlan.variety`). It is the peak of
    such a frontier plan, verified by searching with it; runtime tests use it to exercise every kind
    of unit on a small model.

    Raises:
        ValueError: no budget gives a mixed plan for this model (e.g. a single unit); the message says why.
    """
    plans = frontier(model, cluster, **kwargs)  # type: ignore[arg-type]
    mixed = [p for p in plans if p.is_mixed]
    # Most varied first; among equals, the middle of the mixed range (furthest from both extremes).
    middle = (len(mixed) - 1) / 2
    order = sorted(range(len(mixed)), key=lambda i: (-mixed[i].variety, abs(i - middle)))
    for p in (mixed[i] for i in order):
        if search(model, cluster, memory_budget=p.peak_bytes, **kwargs).is_mixed:  # type: ignore[arg-type]
            return p.peak_bytes
    raise ValueError(f"no budget gives a mixed plan for {model.model!r} on {cluster.world_size} device(s): the "
                     f"frontier has {len(plans)} plans, {len(mixed)} of them mixed; a model needs at least two "
                     "units (two blocks with parameters) for a mixed plan")


# ---- internals --------------------------------------------------------------------------------
def _detail(ev: S.Evaluator, c: S.Candidate) -> Detail:
    from tightfit.planner._elixir_sim import peak, step_time

    d = Detail()
    terms = [ev.terms(a, b, m, o) for (a, b), m, o in zip(c.units, c.modes, c.offload)]
    step_time(ev.ctx, list(c.units), terms, list(c.ckpt), c.df, c.db, d)
    peak(ev.ctx, list(c.units), terms, list(c.ckpt), c.df, c.db, d)
    return d


def _to_plan(ev: S.Evaluator, c: S.Candidate, model: ModelProfile, budget: int, cluster: ClusterSpec) -> ElixirPlan:
    ctx = ev.ctx
    d = _detail(ev, c)
    units = []
    for u, ((a, b), m, o) in enumerate(zip(c.units, c.modes, c.offload)):
        t = ev.terms(a, b, m, o)
        rc = sum(ctx.fwd[i] for i in range(a, b) if c.ckpt[i])
        units.append(UnitPlan(
            blocks=ctx.names[a:b], mode=m, offload=o,
            checkpoint=tuple(ctx.names[i] for i in range(a, b) if c.ckpt[i]),
            param_numel=sum(ctx.numel[a:b]), device_bytes=int(t.state), host_bytes=int(t.host),
            gathered_bytes=int(t.gathered),
            time_s=t.cf + t.cb + rc + d.stall_fwd[u] + d.stall_bwd[u] + t.opt,
        ))
    raw = d.peak_state + d.peak_params + d.peak_acts
    names, digest = model_identity(model)
    spec = ctx.precision
    return ElixirPlan(
        model=model.model, param_numel=model.param_numel, blocks=names, blocks_hash=digest,
        inputs={k: list(v) for k, v in model.inputs.items()}, world_size=ctx.world, precision=spec.name,
        param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype, optimizer=ctx.optimizer, units=tuple(units),
        forward_prefetch=c.df, backward_prefetch=c.db, step_time_s=c.time, peak_bytes=math.ceil(c.peak),
        budget_bytes=int(budget), host_bytes_per_rank=int(c.host),
        breakdown=StepBreakdown(compute_s=d.compute, recompute_s=d.recompute,
                                exposed_comm_s=c.time - d.compute - d.recompute - d.optimizer, optimizer_s=d.optimizer),
        memory=MemoryBreakdown(phase=d.peak_phase, block=d.peak_block, state_bytes=int(d.peak_state),
                               params_bytes=int(d.peak_params), activation_bytes=int(d.peak_acts),
                               margin_bytes=int(c.peak - raw)),
        device=f"{cluster.world_size} x {ctx.device_name}", notes=ctx.notes,
        checkpointable_blocks=sum(ctx.checkpointable),
    )


def _runner_up(ev: S.Evaluator, c: S.Candidate, best: S.Candidate, best_detail: Detail) -> RunnerUp:
    d = _detail(ev, c)
    parts = {
        "compute": (d.compute, best_detail.compute),
        "recompute": (d.recompute, best_detail.recompute),
        "exposed communication": (c.time - d.compute - d.recompute - d.optimizer,
                                  best.time - best_detail.compute - best_detail.recompute - best_detail.optimizer),
        "optimizer": (d.optimizer, best_detail.optimizer),
    }
    name, (mine, theirs) = max(parts.items(), key=lambda kv: kv[1][0] - kv[1][1])
    slower = (c.time / best.time - 1) * 100 if best.time > 0 else 0.0
    if mine - theirs > 0:
        why = f"{slower:+.1f}%: {mine - theirs:.3g} s more {name} ({mine:.3g} s vs {theirs:.3g} s)"
    else:
        why = f"{slower:+.1f}%: same predicted time, but more offloading, recompute or memory"
    return RunnerUp(family=c.family, step_time_s=c.time, peak_bytes=int(c.peak), units=len(c.units),
                    offloaded=sum(c.offload), checkpointed=sum(c.ckpt), why=why)


def _least_memory(ctx: Context, space: S.Space, exact: bool) -> float:
    """Peak of the least-memory plan in the space (every unit at its least-memory choice, every block
    checkpointed, the shallowest prefetch), over the groupings the search considers."""
    ev = S.Evaluator(ctx)
    n = len(ctx.numel)
    groups = list(S.compositions(n)) if exact else S.groupings(ctx, space.unit_blocks)
    ck = [ctx.checkpointable[i] and space.checkpointing for i in range(n)]
    d = min(space.depths)
    best = float("inf")
    for units in groups:
        choice = [S.least_memory_choice(ev, space, a, b) for a, b in units]
        best = min(best, ev.make(units, [m for m, _ in choice], [o for _, o in choice], ck, d, d).peak)
    return best


def _infeasible(model: ModelProfile, cluster: ClusterSpec, optimizer: str, precision: str,
                memory_budget: int | float | str | None, cons: ElixirConstraints, budget: int,
                ctx: Context, exact: bool) -> PlanInfeasibleError:
    space = cons.space()
    needed = _least_memory(ctx, space, exact)
    if needed <= budget:
        # The device budget is not what binds: every plan that fits it offloads more state than
        # the host memory can hold (host memory x host_memory_fraction / ranks per node).
        return _host_infeasible(model, cluster, precision, optimizer, cons, budget, ctx)
    suggestions: list[str] = []
    if not (cons.allow_checkpointing and cons.allow_offload):
        full = replace(cons, allow_checkpointing=True, allow_offload=True)
        need_full = _least_memory(ctx, full.space(), exact)
        if need_full <= budget:
            suggestions.append(f"allow activation checkpointing and offloading (ElixirConstraints(allow_checkpointing"
                               f"=True, allow_offload=True)): the least-memory plan then needs {format_bytes(need_full)}")
    shapes = list(model.inputs.values())
    batch = shapes[0][0] if shapes and shapes[0] else 0
    for smaller in range(batch - 1, 0, -1):
        _, _, c2, _ = _setup(model, cluster, optimizer, precision, memory_budget, cons, act_scale=smaller / batch)
        need = _least_memory(c2, space, exact)
        if need <= budget:
            suggestions.append(f"reduce the per-device batch from {batch} to {smaller} (use gradient accumulation "
                               f"to keep the global batch): needs {format_bytes(need)}")
            break
    rpn = cluster.world_size // cluster.nodes

    def need_at(count: int) -> float:
        nodes = max(1, count // rpn) if cluster.nodes > 1 else 1
        big = ClusterSpec(devices=(cluster.devices[0],) * count, nodes=nodes,
                          inter_node_bytes_per_s=cluster.inter_node_bytes_per_s)
        return _least_memory(_setup(model, big, optimizer, precision, memory_budget, cons)[2], space, exact)

    lo = cluster.world_size
    for more in [cluster.world_size * 2 ** k for k in range(1, 11)]:
        if need_at(more) <= budget:
            # Fewest devices that fit: bisect between the last doubling that failed and this one
            # (single node only: several nodes grow by whole nodes).
            while cluster.nodes == 1 and more - lo > 1:
                mid = (lo + more) // 2
                lo, more = (lo, mid) if need_at(mid) <= budget else (mid, more)
            suggestions.append(f"use {more} devices instead of {cluster.world_size} (sharded state shrinks as "
                               f"1/devices): needs {format_bytes(need_at(more))}")
            break
        lo = more
    if not suggestions:
        suggestions.append("use devices with more memory: the gathered parameters and activations of one unit "
                           "alone exceed the budget at any device count")
    msg = (f"no Elixir plan fits {format_bytes(budget)} per device for {model.model} (inputs {dict(model.inputs)}) on "
           f"{cluster.world_size} x {ctx.device_name} at {precision}/{optimizer}: the least-memory plan (every unit "
           f"at its least-memory choice, prefetch {min(space.depths)}) needs {format_bytes(needed)}. Smallest budget "
           f"that fits: {format_bytes(needed)}. Cheapest change: {suggestions[0]}"
           + (f". Other options: {'; '.join(suggestions[1:])}" if suggestions[1:] else ""))
    return PlanInfeasibleError(msg, needed_bytes=int(needed) + 1, budget_bytes=budget, suggestions=tuple(suggestions))


def _host_infeasible(model: ModelProfile, cluster: ClusterSpec, precision: str, optimizer: str,
                     cons: ElixirConstraints, budget: int, ctx: Context) -> PlanInfeasibleError:
    hosts = [d.host_memory_bytes for d in cluster.devices if d.host_memory_bytes > 0]
    host_budget = min(hosts) * cons.host_memory_fraction / ctx.ranks_per_node
    # Sharded training state per rank (parameters, gradients, optimizer state): whatever the
    # device does not hold must sit in host memory, so device budget + host budget must exceed it.
    state = sum(ctx.numel) * ctx.state_per_elem / ctx.world
    devices_needed = ctx.world
    while devices_needed < ctx.world * 1024 and \
            sum(ctx.numel) * ctx.state_per_elem / devices_needed > host_budget + budget * 0.5:
        devices_needed *= 2
    suggestions = (
        f"use about {devices_needed} devices instead of {ctx.world} (sharded state per rank shrinks as 1/devices)",
        f"run fewer ranks per host or on hosts with more memory ({format_bytes(min(hosts))} now, "
        f"{cons.host_memory_fraction:.0%} usable, shared by {ctx.ranks_per_node} rank(s))",
        "raise ElixirConstraints(host_memory_fraction=...) if the host really has that memory free",
    )
    msg = (f"no Elixir plan for {model.model} fits on {cluster.world_size} x {ctx.device_name} at {precision}/"
           f"{optimizer}: a least-memory plan fits the device budget of {format_bytes(budget)}, but the state it "
           f"offloads does not fit host memory: each rank holds {format_bytes(state)} of sharded training state "
           f"and may keep only {format_bytes(host_budget)} on the host. Cheapest change: {suggestions[0]}. "
           f"Other options: {'; '.join(suggestions[1:])}")
    return PlanInfeasibleError(msg, needed_bytes=int(state - host_budget) + 1, budget_bytes=budget,
                               suggestions=suggestions)
