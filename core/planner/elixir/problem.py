"""The Elixir search input: :class:`ElixirConstraints` (limits, forced choices) and :class:`ElixirProblem`
(profile, devices, optimizer, precision, the device, host and disk budgets), with the budget arithmetic
(:func:`resolve_budget`, :meth:`ElixirProblem.prepare_tiers`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tightfit.checks import check_number
from tightfit.planner.elixir.disk import Tier
from tightfit.planner.elixir.sim import MODES, Context, build_context
from tightfit.planner.elixir.space import Space
from tightfit.planner.errors import PlanError
from tightfit.planner.optimizers import optimizer_spec, precision_spec
from tightfit.planner.tiers import MemoryTiers, memory_tiers
from tightfit.profiler.types import ClusterSpec, ModelProfile
from tightfit.units import parse_bytes

__all__ = ["ElixirConstraints", "ElixirProblem", "resolve_budget", "prepare"]

_CUDA_RESERVE = 1 << 30  # CUDA context + cuBLAS/NCCL workspaces: 0.8-1 GiB on A100/H100 with torch 2.x


@dataclass(frozen=True, kw_only=True, slots=True)
class ElixirConstraints:
    """Limits on the search space and model margins.

    Args:
        modes: unit modes the search may use (subset of ``("reshard", "keep", "replicate")``).
        allow_offload: whether units may be offloaded to host memory.
        allow_disk: whether offloaded units may keep their optimizer state on disk (only where every device
            has a disk profile, ``DeviceProfile.disk``; without one there is no disk tier).
        allow_disk_params: whether a disk unit may keep its fp32 master weights on disk too, with its
            parameters waiting there between uses (state tier 3: read ahead of forward and backward); off: only
            optimizer state goes to disk (tier 2).
        allow_disk_grads: whether a unit with its master weights on disk may keep its gradients there too,
            between backward and the optimizer step (state tier 4: written behind its backward, read by the
            step); off: gradients stay on the host.
        allow_checkpointing: whether blocks may be checkpointed.
        force_offload: every unit offloaded (the search still picks units, modes and prefetch depths).
        force_disk: every unit offloaded with its optimizer state on disk, and where ``allow_disk_params`` its
            master weights too if that is faster within the budgets (needs the disk tier).
        force_checkpointing: every checkpointable block checkpointed (the search picks the rest, then
            the plan is priced with every block recomputed).
        prefetch_depths: prefetch depths to try, forward and backward independently.
        unit_blocks: blocks per unit the greedy search tries (``None``: 1, 2 and 4 after merging tiny blocks).
        fragmentation: margin on the predicted peak for allocator fragmentation (0.10 = 10%).
        reserved_bytes: per-device bytes the plan may not use (``None``: 1 GiB on CUDA, 0 on CPU).
        host_memory_fraction: fraction of each host's memory offloaded state may take.
        exhaustive: ``True`` exact search, ``False`` greedy, ``None`` exact when the space has at
            most ``exhaustive_limit`` plans.
        exhaustive_limit: see ``exhaustive``.
        replicate_on_ddp: a plan that replicates every unit on the device without recompute runs on DDP
            (``ElixirStrategy``'s default), which computes on the replicated parameters and gradients themselves;
            ``False`` where it runs on FSDP2 (``ElixirStrategy(replan=True)``), whose one-rank groups copy them.
        replication_margin: with memory to spare, the plan DDP would run (one unit, replicated, nothing
            offloaded or recomputed) is kept unless another is predicted faster by more than this fraction
            (0.10 = 10%, about the calibrated model's error; 0 = the fastest prediction always wins).
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
    force_offload: bool = False
    force_checkpointing: bool = False
    allow_disk: bool = True
    force_disk: bool = False
    allow_disk_params: bool = True
    allow_disk_grads: bool = True
    replication_margin: float = 0.10
    replicate_on_ddp: bool = True

    def __post_init__(self) -> None:
        where = "ElixirConstraints"
        for d in tuple(self.prefetch_depths) + tuple(self.unit_blocks or ()):
            check_number(d, "prefetch_depths / unit_blocks entry", where=where, integer=True, low=1, error=PlanError,
                         fix="give whole counts >= 1, e.g. prefetch_depths=(1, 2)")
        for name in ("fragmentation", "host_memory_fraction"):
            check_number(getattr(self, name), name, where=where, error=PlanError, fix="give a fraction, e.g. 0.1")
        if self.reserved_bytes is not None:
            check_number(self.reserved_bytes, "reserved_bytes", where=where, integer=True, low=0, error=PlanError,
                         fix="give whole bytes per device, e.g. 2**30, or None for the default")
        check_number(self.exhaustive_limit, "exhaustive_limit", where=where, integer=True, low=1, error=PlanError,
                     fix="give the largest number of plans to search exactly, e.g. 50000")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise PlanError(f"ElixirConstraints.modes={self.modes!r}: give a non-empty subset of {MODES}")
        if not self.prefetch_depths or any(d < 1 for d in self.prefetch_depths):
            raise PlanError(f"ElixirConstraints.prefetch_depths={self.prefetch_depths!r}: depths must be >= 1 "
                             "(FSDP2 always fetches the next unit)")
        if self.unit_blocks is not None and (not self.unit_blocks or any(k < 1 for k in self.unit_blocks)):
            raise PlanError(f"ElixirConstraints.unit_blocks={self.unit_blocks!r}: give sizes >= 1 or None")
        if not (isinstance(self.replication_margin, (int, float)) and 0 <= self.replication_margin < 1):
            raise PlanError(f"ElixirConstraints.replication_margin={self.replication_margin!r}: must be in [0, 1), "
                            "e.g. 0.1 (0: always take the fastest prediction)")
        if not isinstance(self.replicate_on_ddp, bool):
            raise PlanError(f"ElixirConstraints.replicate_on_ddp={self.replicate_on_ddp!r}: use True (an all-replicate "
                            "plan runs on DDP) or False (it runs on FSDP2)")
        if not 0 <= self.fragmentation < 1:
            raise PlanError(f"ElixirConstraints.fragmentation={self.fragmentation}: must be in [0, 1), e.g. 0.1")
        if not 0 < self.host_memory_fraction <= 1:
            raise PlanError(f"ElixirConstraints.host_memory_fraction={self.host_memory_fraction}: must be in (0, 1]")
        if self.reserved_bytes is not None and self.reserved_bytes < 0:
            raise PlanError(f"ElixirConstraints.reserved_bytes={self.reserved_bytes}: must be >= 0")
        if self.force_offload and not self.allow_offload:
            raise PlanError("ElixirConstraints(force_offload=True, allow_offload=False) contradict each other; "
                             "drop one of them")
        if self.force_disk and not (self.allow_disk and self.allow_offload):
            raise PlanError("ElixirConstraints(force_disk=True) needs allow_disk=True and allow_offload=True (a disk "
                            "unit is offloaded, with its optimizer state on disk); drop one of them")
        if self.force_checkpointing and not self.allow_checkpointing:
            raise PlanError("ElixirConstraints(force_checkpointing=True, allow_checkpointing=False) contradict "
                             "each other; drop one of them")

    def space(self, disk: bool = False) -> Space:
        """The search space these constraints leave (forced offload: every unit offloaded); ``disk``: there is a
        disk tier, so offloaded units may keep their optimizer state on disk (where ``allow_disk``)."""
        tiers = (Tier.HOST,) if self.force_offload else (Tier.DEVICE, Tier.HOST) if self.allow_offload else (Tier.DEVICE,)
        if disk and self.allow_disk and self.allow_offload:
            deep = ((Tier.DISK, Tier.DISK_PARAMS, Tier.DISK_GRADS) if self.allow_disk_params and self.allow_disk_grads
                    else (Tier.DISK, Tier.DISK_PARAMS) if self.allow_disk_params else (Tier.DISK,))
            tiers = deep if self.force_disk else tiers + deep
        return Space(modes=tuple(self.modes), offload=tiers,
                       checkpointing=self.allow_checkpointing, depths=tuple(sorted(set(self.prefetch_depths))),
                       unit_blocks=self.unit_blocks)



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
        try:
            budget = parse_bytes(memory_budget)
        except ValueError as err:  # "1.5" is neither a fraction in (0, 1] nor whole bytes
            raise PlanError(f"memory_budget: {err}") from None
    if budget <= 0:
        raise PlanError(f"memory_budget={memory_budget!r} gives {budget} bytes; give a positive size like '20GiB' "
                         "or a fraction like 0.8")
    return budget, reserved


@dataclass(frozen=True, kw_only=True, slots=True)
class ElixirProblem:
    """What the Elixir search is asked: one rank's training-step profile, the devices, the training
    setup and the limits. Built once and validated here; :func:`~tightfit.planner.elixir.solve` answers it.

    Args:
        model: the training-step profile of one rank's micro-batch (``step="train"``, with blocks).
        cluster: the devices, one per rank.
        optimizer: a name of :data:`tightfit.planner.optimizers.OPTIMIZERS` (``"adamw"``).
        precision: Lightning precision string (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``, ``"bf16-true"``).
        memory_budget: bytes per device (int, ``"40GiB"``), a fraction of the smallest device's
            memory, or ``None`` for all of it.
        constraints: :class:`ElixirConstraints` (``None``: the defaults).
        host_budget: host bytes per rank (int, ``"4GiB"``); ``None``: the host's memory x
            ``host_memory_fraction`` / ranks per node (unbounded where the profile does not say).
        disk_budget: disk bytes per rank for optimizer state (int, ``"100GiB"``, at most what is free);
            ``None``: the disk's free bytes / ranks per node. The disk tier exists only where every
            device has a disk profile (``DeviceProfile.disk``).

    Example:
        >>> ElixirProblem(model=profile, cluster=cluster, memory_budget="6GiB")  # doctest: +SKIP
    """

    model: ModelProfile
    cluster: ClusterSpec
    optimizer: str = "adamw"
    precision: str = "bf16-mixed"
    memory_budget: int | float | str | None = None
    constraints: ElixirConstraints | None = None
    host_budget: int | str | None = None
    disk_budget: int | str | None = None

    def __post_init__(self) -> None:
        model = self.model
        if model.step != "train":
            raise ValueError(f"profile of {model.model!r} is a {model.step!r} profile; Elixir plans training steps: "
                             "profile with step='train'")
        if not model.blocks:
            raise ValueError(f"profile of {model.model!r} has no blocks; profile_model finds them for nn.Module models")
        precision_spec(self.precision)
        optimizer_spec(self.optimizer)
        for name in ("host_budget", "disk_budget"):
            value = getattr(self, name)
            try:
                if value is not None and (isinstance(value, bool) or parse_bytes(value) < 0):
                    raise ValueError(f"{value!r} is not a size")
            except ValueError as err:
                raise PlanError(f"ElixirProblem.{name}={value!r}: {err}; give bytes (an int or '4GiB'), or None for "
                                "the default") from None

    @property
    def limits(self) -> ElixirConstraints:
        """The constraints in force (the defaults when none were given)."""
        return self.constraints or ElixirConstraints()

    def prepare(self, act_scale: float = 1.0) -> tuple[ElixirConstraints, int, Context, float]:
        """(constraints, budget bytes, cost-model context, host budget per rank); ``act_scale`` scales activations
        (the diagnosis prices smaller batches with it)."""
        cons, ctx, tiers = self.prepare_tiers(act_scale)
        return cons, int(tiers.device_bytes or 0), ctx, _or_inf(tiers.host_bytes)

    def prepare_tiers(self, act_scale: float = 1.0) -> tuple[ElixirConstraints, Context, MemoryTiers]:
        """(constraints, cost-model context, the three tiers' budgets per device / rank): :meth:`prepare` with the
        disk tier (``disk_bytes`` 0 and ``disk`` ``None`` where there is none or ``allow_disk`` is off)."""
        model, cluster = self.model, self.cluster
        cons = self.limits
        budget, reserved = resolve_budget(self.memory_budget, cluster, cons)
        ctx = build_context(model, cluster, precision=self.precision, optimizer=self.optimizer,
                            fragmentation=cons.fragmentation, reserved=reserved)
        if not cons.replicate_on_ddp:
            ctx = replace(ctx, alias_replicated=False)
        if act_scale != 1.0:
            ctx = replace(ctx, saved=tuple(x * act_scale for x in ctx.saved), ckpt=tuple(x * act_scale for x in ctx.ckpt),
                          transient=tuple(x * act_scale for x in ctx.transient),
                          fwd_transient=tuple(x * act_scale for x in ctx.fwd_transient),
                          loss_transient=tuple(x * act_scale for x in ctx.loss_transient),
                          fwd=tuple(x * act_scale for x in ctx.fwd), bwd=tuple(x * act_scale for x in ctx.bwd),
                          rfwd=tuple(x * act_scale for x in ctx.rfwd))
        host: int | str | None = self.host_budget
        if host is None:
            hosts = [d.host_memory_bytes for d in cluster.devices if d.host_memory_bytes > 0]
            host = int(min(hosts) * cons.host_memory_fraction / ctx.ranks_per_node) if hosts else None
        if self.disk_budget is not None and ctx.disk is None:
            raise PlanError(f"ElixirProblem.disk_budget={self.disk_budget!r} but there is no disk tier: give every "
                            "device a disk profile (DeviceProfile.disk, tightfit.profiler.profile_disk(disk_dir)), or "
                            "drop disk_budget")
        disk = ctx.disk if cons.allow_disk and cons.allow_offload else None
        tiers = memory_tiers(device_bytes=budget, host_bytes=host, disk=disk, disk_bytes=self.disk_budget,
                             unified=ctx.unified, sharers=ctx.ranks_per_node)
        if cons.force_disk and not tiers.has_disk:
            raise PlanError("ElixirConstraints(force_disk=True) but there is no disk tier: give every device a disk "
                            "profile (DeviceProfile.disk, tightfit.profiler.profile_disk(disk_dir)) with free space")
        return cons, ctx, tiers


def _or_inf(value: int | None) -> float:
    return float("inf") if value is None else float(value)


def prepare(model: ModelProfile, cluster: ClusterSpec, optimizer: str, precision: str,
            memory_budget: int | float | str | None, constraints: ElixirConstraints | None,
            act_scale: float = 1.0, *, host_budget: int | str | None = None,
            disk_budget: int | str | None = None) -> tuple[ElixirConstraints, int, Context, float]:
    """:meth:`ElixirProblem.prepare` of the problem these arguments make."""
    return ElixirProblem(model=model, cluster=cluster, optimizer=optimizer, precision=precision,
                         memory_budget=memory_budget, constraints=constraints, host_budget=host_budget,
                         disk_budget=disk_budget).prepare(act_scale)
