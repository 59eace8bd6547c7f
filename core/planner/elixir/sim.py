"""Elixir's cost model: one training step of an FSDP2 plan, priced from the profiles alone.

Part of :mod:`tightfit.planner.elixir`; the search calls :func:`step_time` and :func:`peak`
tens of thousands of times, so both are plain loops over precomputed per-unit numbers.

A plan is: units (contiguous runs of blocks, one ``fully_shard`` call each), a mode per unit
(``reshard``: ZeRO-3-like, ``keep``: sharded but kept gathered from forward to backward,
``replicate``: every rank holds the full state), a state tier per unit (``offload``: 0 = on the
device; 1 = FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state on the
host, optimizer step on the host; 2 = the same with the optimizer state on disk between steps,
streamed through a host staging area during the host optimizer step; 3 = master weights and optimizer state
on disk, streamed together in the step, and the parameters on disk between uses, read one unit ahead of the
forward and of the backward: only the gradients stay on the host; 4 = those too), a checkpoint flag per block,
and prefetch depths (``df``, ``db``: how many units ahead FSDP2 all-gathers in forward / backward).

Notation (per rank): ``P`` parameter elements of a unit, ``W`` world size, ``E = P/W`` (sharded
modes) or ``P`` (replicate) the elements a rank owns; ``m, c, r`` bytes per element of the master
parameter, the gathered (compute) parameter and the reduced gradient; ``o`` optimizer-state bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from tightfit.planner import cost
from tightfit.planner.elixir.disk import (
    DISK_CODES,
    DISK_STAGING_BYTES,
    disk_optimizer_seconds,
    fetched_around,
    per_element_on_disk,
    slowest_disk,
)
from tightfit.planner.elixir.terms import Detail, UnitTerms, slowest_overheads
from tightfit.planner.elixir.tied import lookup_blocks, tied_blocks, tied_params, tied_units
from tightfit.planner.memo import frozen
from tightfit.planner.tiers import disk_seconds
from tightfit.profiler.types import DTYPE_BYTES, ClusterSpec, DiskProfile, ModelProfile

__all__ = ["MODES", "Context", "UnitTerms", "build_context", "unit_terms", "step_time", "peak", "Detail"]

MODES = ("reshard", "keep", "replicate")
"""A unit's sharding: ``reshard`` (ZeRO-3-like), ``keep`` (gathered forward to backward), ``replicate``."""


@dataclass(frozen=True, slots=True)
class Context:
    """Everything the model needs, precomputed once per (model, cluster, precision, optimizer)."""

    names: tuple[str, ...]
    numel: tuple[int, ...]
    fwd: tuple[float, ...]           # per block forward seconds
    tensors: tuple[int, ...]         # per block parameter tensors
    bwd: tuple[float, ...]           # per block backward seconds
    rfwd: tuple[float, ...]          # per block re-run forward seconds under checkpointing
    saved: tuple[float, ...]         # activation bytes kept when not checkpointed
    ckpt: tuple[float, ...]          # activation bytes kept when checkpointed (<= saved)
    transient: tuple[float, ...]     # backward: bytes above everything saved by it and the blocks before it
    fwd_transient: tuple[float, ...]  # forward: temporaries above its saved bytes while its forward runs
    loss_transient: tuple[float, ...]  # backward of the loss folded into a block, before the block's own (see peak)
    checkpointable: tuple[bool, ...]
    world: int
    ranks_per_node: int
    precision: cost.PrecisionSpec
    optimizer: str
    state_per_elem: float            # m (param) + m (grad) + o (optimizer state)
    temp_per_elem: float
    h2d: float
    d2h: float
    host_opt: float
    dev_opt: float
    fragmentation: float
    reserved: float
    notes: tuple[str, ...]
    device_name: str
    collective: object               # callable(kind, bytes) -> seconds (cost.CollectiveTimes)
    compute_model: str = "FLOPs / rate"  # or "measured block timings"
    overhead: tuple[tuple[str, tuple[float, float, float]], ...] = ()  # per-unit (fwd, bwd, opt) s by mode
    overlap: float = -1.0            # measured comm/compute overlap; < 0: full overlap assumed
    alias_replicated: bool = False   # calibrated, one dtype, replicate_on_ddp: DDP plans hold no copy (unit_terms)
    grads_on_demand: bool = False    # gradients exist from their backward on (zero_grad(set_to_none=True)), see peak
    unified: bool = False            # host and device are one memory: offloaded state counts in the device peak
    disk: DiskProfile | None = None  # the disk tier's profile (the slowest over the ranks); None: no disk tier
    disk_overlap: float = 1.0        # fraction of disk I/O hidden behind the host optimizer step (1.0: unmeasured)
    opt_state_per_elem: float = 0.0  # o: optimizer-state bytes per owned element (what a disk unit keeps on disk)
    tied_to: tuple[int, ...] = ()    # per block: the last block using one of its parameters (tied.py), else itself
    lookup: tuple[bool, ...] = ()    # per block: its backward needs none of its parameters (an embedding)

    def memo_key(self) -> tuple:
        """A hashable value, equal for contexts built from equal inputs (which price every plan alike): what
        a memo of searches over this context keys on (``space.greedy_pool``)."""
        return tuple(frozen(getattr(self, f.name)) for f in fields(self))

    def unit_overhead(self, mode: str, offload: int, tensors: int = 0,
                      nbytes: float = 0.0) -> tuple[float, float, float]:
        """Seconds one unit of ``mode`` holding ``tensors`` parameter tensors of ``nbytes`` unsharded bytes adds
        to forward, backward and the optimizer step: per unit + per tensor + per byte (0 when not measured)."""
        table = dict(self.overhead)
        # Where host and device are one memory, CPUOffloadPolicy's copies are no-ops and an offloaded unit runs
        # reshard's code path (full shard with and without offload time the same on CPU ranks); its tiny-unit
        # calibration can come out dearer, which is noise.
        key = "offload" if offload and not self.unified else mode
        unit = table.get(key, (0.0, 0.0, 0.0))
        per = table.get(f"{key}/tensor", (0.0, 0.0, 0.0))
        byte = table.get(f"{key}/byte", (0.0, 0.0, 0.0))
        return tuple(unit[i] + tensors * per[i] + nbytes * byte[i] for i in range(3))  # type: ignore[return-value]


def build_context(model: ModelProfile, cluster: ClusterSpec, *, precision: str, optimizer: str,
                  fragmentation: float, reserved: float) -> Context:
    spec = cost.precision_spec(precision)
    cost.optimizer_state_bytes(optimizer, spec.master_bytes)  # validates the name
    notes: list[str] = []
    devices = cluster.devices
    # The slowest rank paces a synchronous step: take the minimum rate over the ranks.
    blocks = model.blocks
    timed = model.timed
    rate = 0.0 if timed else min(cost.matmul_rate(d, spec.matmul_dtype, notes) for d in devices)
    unified = all(d.unified_memory for d in devices)
    ranks_per_node = cluster.world_size // cluster.nodes
    dev_opt = min(cost.device_optimizer_rate(d, notes) for d in devices)
    if unified:
        # Host and device are one memory (a CPU "device"): FSDP2's offload copies are no-ops, and the
        # "host" optimizer is the device optimizer each rank already measured for itself.
        h2d = d2h = float("inf")
        host_opt = dev_opt
    else:
        h2d = min(cost.copy_rate(d, "h2d", notes) for d in devices)
        d2h = min(cost.copy_rate(d, "d2h", notes) for d in devices)
        host_opt = min(cost.host_optimizer_rate(d, ranks_per_node, notes) for d in devices)
    # Activations were profiled with parameters in ``model.param_dtype``; under mixed precision the
    # matmuls run in the compute dtype, so saved activations shrink by the same ratio (bf16: 1/2).
    act_scale = spec.compute_bytes / max(1, DTYPE_BYTES.get(model.param_dtype, 4))
    world = cluster.world_size
    inter_node = cluster.inter_node_bytes_per_s if cluster.nodes > 1 else 0.0
    collective = cost.CollectiveTimes(devices[0], world, inter_node, notes)

    # Warm the notes about collectives now so they are reported even for single-unit plans.
    if world > 1:
        collective("all_gather", 1 << 20)
        collective("reduce_scatter", 1 << 20)
    disk = slowest_disk(devices)
    return Context(
        names=tuple(b.name for b in blocks),
        numel=tuple(b.param_numel for b in blocks),
        tensors=tuple(len(b.params) for b in blocks),
        fwd=tuple(b.fwd_s for b in blocks) if timed else tuple(b.fwd_flops / rate for b in blocks),
        bwd=tuple(b.bwd_s for b in blocks) if timed else tuple(b.bwd_flops / rate for b in blocks),
        rfwd=tuple(b.recompute_s or b.fwd_s for b in blocks) if timed else tuple(b.fwd_flops / rate for b in blocks),
        saved=tuple(b.saved_bytes * act_scale for b in blocks),
        ckpt=tuple(min(b.checkpoint_bytes, b.saved_bytes) * act_scale for b in blocks),
        transient=tuple(b.transient_bytes * act_scale for b in blocks),
        fwd_transient=tuple(getattr(b, "fwd_transient_bytes", 0) * act_scale for b in blocks),
        loss_transient=tuple(getattr(b, "loss_transient_bytes", 0) * act_scale for b in blocks),
        checkpointable=tuple(b.checkpointable for b in blocks),
        world=world,
        ranks_per_node=ranks_per_node,
        precision=spec,
        optimizer=optimizer,
        state_per_elem=2 * spec.master_bytes + cost.optimizer_state_bytes(optimizer, spec.master_bytes),
        temp_per_elem=cost.optimizer_temp_bytes(optimizer, spec.master_bytes),
        h2d=h2d, d2h=d2h, host_opt=host_opt, dev_opt=dev_opt,
        fragmentation=fragmentation, reserved=reserved,
        notes=tuple(dict.fromkeys(notes)),
        device_name=devices[0].name,
        collective=collective,
        compute_model="measured block timings" if timed else "FLOPs / rate",
        overhead=slowest_overheads(devices),
        overlap=min(d.comm_overlap for d in devices) if all(d.comm_overlap >= 0 for d in devices) else -1.0,
        alias_replicated=all(d.calibrated for d in devices)
        and spec.compute_bytes == spec.master_bytes == spec.reduce_bytes,
        grads_on_demand=all(d.calibrated for d in devices),
        unified=unified,
        disk=disk,
        disk_overlap=disk.compute_overlap if disk is not None and disk.compute_overlap >= 0 else 1.0,
        opt_state_per_elem=cost.optimizer_state_bytes(optimizer, spec.master_bytes),
        tied_to=tied_blocks(model), lookup=lookup_blocks(model),
    )


def unit_terms(ctx: Context, start: int, end: int, mode: str, offload: int, *, on_ddp: bool = False) -> UnitTerms:
    """Price blocks ``[start, end)`` as one unit in state tier ``offload`` (0 device, 1 host, 2 disk; bools
    read as 0 and 1); the formulas are on :class:`UnitTerms`' fields. ``on_ddp``: the unit belongs to a plan
    that runs on DDP (``evaluator.runs_on_ddp``), whose replicated parameters and gradients are not copied."""
    if offload in DISK_CODES and ctx.disk is None:
        raise ValueError("a unit with its optimizer state on disk needs a disk tier: give every device a disk "
                         "profile (DeviceProfile.disk, from tightfit.profiler.profile_disk(disk_dir))")
    p = sum(ctx.numel[start:end])
    w = ctx.world
    spec = ctx.precision
    owned = p if mode == "replicate" or w == 1 else p / w
    coll = ctx.collective  # type: ignore[assignment]
    ag = coll("all_gather", p * spec.compute_bytes) if mode != "replicate" else 0.0  # type: ignore[operator]
    red = coll("reduce_scatter" if mode != "replicate" else "all_reduce", p * spec.reduce_bytes)  # type: ignore[operator]
    h2d = owned * spec.master_bytes / ctx.h2d if offload else 0.0
    ovh_f, ovh_b, ovh_o = ctx.unit_overhead(mode, offload, sum(ctx.tensors[start:end]), p * spec.compute_bytes)
    # Where host and device are one memory (a CPU "device"), an offloaded unit's state still occupies it: FSDP2's
    # CPUOffloadPolicy moves nothing (measured, 1.3 M parameters on 2 CPU ranks: full shard and full shard + offload
    # peak at the same 48.2 MiB; counting it as host-only let the planner "fit" a budget by offloading).
    on_device = not offload or ctx.unified
    on_disk = offload in DISK_CODES
    # A disk unit keeps its master parameters and gradients (2m) where a host unit keeps all its state; the
    # optimizer state (o) waits on disk and is read in and written back during its host optimizer step. A tier-3
    # unit keeps only its gradients (m): its master weights go to disk with the optimizer state (m + o streamed).
    # Tier 4 keeps nothing: its gradients are written behind its backward and read by the step (disk.py).
    streamed, grad_disk, fetched = per_element_on_disk(offload, ctx.opt_state_per_elem, spec.master_bytes)
    kept_state = ctx.state_per_elem - streamed - grad_disk if on_disk else ctx.state_per_elem
    opt = owned / (ctx.host_opt if offload else ctx.dev_opt)
    io = 0.0
    if on_disk and ctx.disk is not None:
        opt, io = disk_optimizer_seconds(ctx.disk, owned * streamed, compute=opt, sharers=ctx.ranks_per_node,
                                         overlap=ctx.disk_overlap, read_only=owned * grad_disk)
    fetch = owned * fetched
    fetch_s = disk_seconds(ctx.disk, fetch, sharers=ctx.ranks_per_node) if ctx.disk else 0.0
    grad_w = disk_seconds(ctx.disk, owned * grad_disk, write=True, sharers=ctx.ranks_per_node) if ctx.disk else 0.0
    # DDP computes on the master parameters and gradients (2 CPU ranks, 5.8 M fp32: DDP peaks at 140 MiB, state +
    # activations; priced with both copies, 228). In any other plan a replicate unit is an FSDP2 group on a (world, 1)
    # mesh, which copies its one-rank shard into the all-gather output and reduces through its own buffers.
    alias = mode == "replicate" and ctx.alias_replicated and on_ddp
    return UnitTerms(
        cf=sum(ctx.fwd[start:end]) + ovh_f,
        cb=sum(ctx.bwd[start:end]) + ovh_b,
        h2d_f=h2d,
        ag_f=ag,
        h2d_b=h2d if mode != "keep" else 0.0,
        ag_b=ag if mode == "reshard" else 0.0,
        red=red,
        d2h=owned * spec.master_bytes / ctx.d2h if offload else 0.0,
        opt=opt + ovh_o,
        state=owned * kept_state if on_device else 0.0,
        host=owned * kept_state if offload else 0.0,
        gathered=0.0 if alias else p * spec.compute_bytes,
        grads=0.0 if alias else p * (spec.compute_bytes + spec.reduce_bytes),
        red_buf=0.0 if alias else p * spec.reduce_bytes,
        opt_tmp=owned * ctx.temp_per_elem if on_device and not on_disk else 0.0,
        kept=mode == "keep",
        grad_state=owned * spec.master_bytes if on_device and not grad_disk else 0.0,  # tier 4: not in state
        disk=owned * (streamed + grad_disk) if on_disk else 0.0,
        disk_io=io,
        fetch=fetch,
        disk_f=fetch_s,
        disk_b=fetch_s + grad_w,  # tier 4's gradient write shares the disk with the backward's reads ahead
        grad_buf=owned * grad_disk,
    )


def step_time(ctx: Context, units: list[tuple[int, int]], terms: list[UnitTerms], ckpt: list[bool],
              df: int, db: int, detail: Detail | None = None) -> float:
    """Predicted seconds of one step: a list schedule on four resources.

    Resources: the compute stream, the network (all-gathers and reduce-scatters share the link,
    in issue order), the host->device and the device->host copy engines (PCIe is full duplex).
    Forward: unit ``u``'s fetch (H2D copy of its shard, then all-gather) is issued when unit
    ``u - df`` starts computing (unit 0's at time 0), exactly where FSDP2 issues explicit
    prefetches; compute of ``u`` starts when both compute is free and the fetch is done.
    Backward (units in reverse): the same with ``db``, re-fetching only what was resharded;
    after a unit's backward its gradients are reduced on the network, then (offloaded) copied to
    the host. Recompute of checkpointed blocks adds their forward time to the unit's backward.
    The optimizer runs when every reduction and copy has landed; host and device steps are
    added (torch's foreach step processes the device groups one after another).
    The schedule is max-plus, so the step time never decreases when any duration grows.

    Measured overlap ``o`` (``ctx.overlap >= 0``): each collective of ``d`` seconds also takes
    ``(1 - o) * d`` from the compute stream (gloo's copies and reductions run on the cores the
    compute needs), paid before the next compute starts, less any time the compute stream sat
    idle waiting since it was issued (the collective ran alone then). Unmeasured: full overlap.
    """
    n = len(units)
    comp = net = h2d_free = d2h_free = disk_free = 0.0
    serial = 1.0 - ctx.overlap if ctx.overlap >= 0 else 0.0
    disk_serial = 1.0 - ctx.disk_overlap
    debt = 0.0  # compute-stream seconds owed to collectives issued and not yet paid
    fetch_end = [0.0] * n
    fwd_start = [0.0] * n

    def fetch(t: UnitTerms, issue: float, h2d_dur: float, ag_dur: float) -> float:
        nonlocal net, h2d_free, debt
        x = issue
        if h2d_dur > 0:
            h2d_free = max(h2d_free, x) + h2d_dur
            x = h2d_free
        if ag_dur > 0:
            net = max(net, x) + ag_dur
            x = net
            debt += serial * ag_dur
        return x

    def disk_read(dur: float, issue: float) -> float:
        """When a tier-3 unit's parameters, read from ``issue`` on, have landed (the disk serves in issue order)."""
        nonlocal disk_free, debt
        disk_free = max(disk_free, issue) + dur
        debt += disk_serial * dur
        return disk_free

    def begin(ready: float) -> tuple[float, float]:
        """(start, stall) of the next compute: after the stream is free, its input has landed and its debt is paid."""
        nonlocal debt
        stall = ready - comp if ready > comp else 0.0
        start = (ready if ready > comp else comp) + max(0.0, debt - stall)
        debt = 0.0
        return start, stall

    issued = 0
    fetch_end[0] = fetch(terms[0], 0.0, terms[0].h2d_f, terms[0].ag_f)
    recompute = [0.0] * n
    for u, (a, b) in enumerate(units):
        rc = 0.0
        for i in range(a, b):
            if ckpt[i]:
                rc += ctx.rfwd[i]
        recompute[u] = rc
    stall_f = [0.0] * n
    # Tier-3 units: the runtime reads unit u's parameters when unit u-1 starts (unit 0's at time 0), one unit
    # ahead whatever df is; its fetch (copy, all-gather) follows the read.
    prev_start = 0.0
    for u in range(n):
        ready = fetch_end[u]
        if terms[u].disk_f > 0:
            ready = max(ready, disk_read(terms[u].disk_f, prev_start) + terms[u].h2d_f + terms[u].ag_f)
        start, stall_f[u] = begin(ready)
        prev_start = start
        fwd_start[u] = start
        while issued < n - 1 and issued < u + df:
            issued += 1
            t = terms[issued]
            fetch_end[issued] = fetch(t, start, t.h2d_f, t.ag_f)
        comp = start + terms[u].cf
    fwd_end = comp
    # Backward: position k runs unit n-1-k.
    bfetch = [0.0] * n
    t0 = terms[n - 1]
    bfetch[0] = fetch(t0, fwd_end, t0.h2d_b, t0.ag_b)
    issued = 0
    stall_b = [0.0] * n
    for k in range(n):
        u = n - 1 - k
        t = terms[u]
        ready = bfetch[k]
        if t.disk_b > 0:
            ready = max(ready, disk_read(t.disk_b, prev_start) + t.h2d_b + t.ag_b)
        start, stall_b[u] = begin(ready)
        prev_start = start
        while issued < n - 1 and issued < k + db:
            issued += 1
            tt = terms[n - 1 - issued]
            bfetch[issued] = fetch(tt, start, tt.h2d_b, tt.ag_b)
        comp = start + t.cb + recompute[u]
        y = comp
        if t.red > 0:
            net = max(net, y) + t.red
            y = net
            debt += serial * t.red
        if t.d2h > 0:
            d2h_free = max(d2h_free, y) + t.d2h
    opt_start = max(comp + debt, net, d2h_free)
    opt = sum(t.opt for t in terms)
    total = opt_start + opt
    if detail is not None:
        detail.compute = sum(t.cf + t.cb for t in terms)
        detail.recompute = sum(recompute)
        detail.stall_fwd = tuple(stall_f)
        detail.stall_bwd = tuple(stall_b)
        detail.tail = opt_start - comp
        detail.optimizer = opt
    return total


def peak(ctx: Context, units: list[tuple[int, int]], terms: list[UnitTerms], ckpt: Sequence[bool | None],
         df: int, db: int, detail: Detail | None = None) -> float:
    """Predicted peak bytes on one device, with the fragmentation margin and the reserve.

    ``peak = max over the step of (S + params(t) + acts(t)) * (1 + fragmentation) + reserved``, where
    ``S`` is the device-resident state of every unit (constant), and at a point of
      * forward of block ``i`` of unit ``u``: params = gathered(u) + gathered(u+1..u+df) (prefetched)
        + gathered(v) for kept units ``v < u``; acts = sum_{j<i} a_j + saved_i + fwd_transient_i with
        ``a_j`` = checkpoint bytes (its output) if block ``j`` is checkpointed else saved bytes (a
        checkpointed block's forward still builds its activations before dropping them);
      * backward of block ``i`` of unit ``u``: params = gathered(u) + grads(u) + red_buf(u+1) (calibrated: u's own
        reduce buffer only in its reduction, after its blocks, u's parameters resharded; on one memory a tier-4
        unit's gradient being written instead of its reduce buffer) + gathered(prefetched u-1..u-db not kept) +
        gathered(kept v < u) + tied units (:mod:`~tightfit.planner.elixir.tied`) (calibrated: + gathered(u+1..u+df)
        when block ``i`` is recomputed); acts = sum_{j<i} a_j + saved_i + transient_i (recomputed: to its full
        saved size, ``max(transient_i, fwd_transient_i)``): :func:`tightfit.profiler.memory.estimate_peak`'s;
      * the optimizer step: params = 0, acts = 0, plus the foreach temporaries of resident units, plus the
        disk tier's staging area (:data:`DISK_STAGING_BYTES`) where host and device are one memory.
    """
    n = len(units)
    state = sum((t.state for t in terms), 0.0)
    opt_tmp = sum((t.opt_tmp for t in terms), 0.0)
    kept_before = [0.0] * (n + 1)  # kept_before[u] = sum of gathered over kept units v < u
    for u in range(n):
        kept_before[u + 1] = kept_before[u] + (terms[u].gathered if terms[u].kept else 0.0)
    if ctx.unified and any(t.disk > 0 for t in terms):
        opt_tmp += DISK_STAGING_BYTES
    best, where = state + opt_tmp, ("optimizer", "", state, 0.0, 0.0)  # the optimizer step: no activations
    # Calibrated: gradients freed after the step (zero_grad(set_to_none=True)); unit u's backward holds units >= u's.
    grads_after = [0.0] * (n + 1)  # grads_after[u] = sum of grad_state over units >= u
    if ctx.grads_on_demand:
        for u in range(n - 1, -1, -1):
            grads_after[u] = grads_after[u + 1] + terms[u].grad_state
    state_fwd = state - grads_after[0]
    acc = 0.0  # sum_{j<i} a_j
    prefix: list[float] = [0.0] * len(ctx.saved)
    saved, ck, tr, ftr, ltr = ctx.saved, ctx.ckpt, ctx.transient, ctx.fwd_transient, ctx.loss_transient
    tr = tr if ctx.grads_on_demand else tuple(map(max, tr, ltr))  # uncalibrated: a block's whole backward at once
    # Tier-3 shards read for a unit and ahead of it: on the host (here where it is the device). Tied units: tied.py.
    fetch = [t.fetch if ctx.unified else 0.0 for t in terms]
    tied = tied_units(ctx.tied_to, ctx.lookup, ctx.numel, units) if ctx.tied_to else []
    tied_fwd, tied_bwd = tied_params(tied, [t.gathered for t in terms], [t.kept for t in terms], n)
    lookups = {t.unit for t in tied if t.lookup}
    bfetch = [0.0 if u in lookups else f for u, f in enumerate(fetch)]  # a tied lookup is not read for backward
    for u, (a, b) in enumerate(units):
        params = terms[u].gathered + kept_before[u] + fetched_around(fetch, u, 1) + tied_fwd[u]
        for v in range(u + 1, min(n, u + df + 1)):
            params += terms[v].gathered
        worst_act = 0.0
        worst_i = a
        for i in range(a, b):
            prefix[i] = acc
            ai = ck[i] if ckpt[i] or ckpt[i] is None else saved[i]  # None: undecided, least memory (a bound)
            act = acc + saved[i] + ftr[i]
            if act > worst_act:
                worst_act, worst_i = act, i
            acc += ai
        total = state_fwd + params + worst_act
        if total > best:
            best = total
            where = ("forward", ctx.names[worst_i], state_fwd, params, worst_act)
    for u in range(n - 1, -1, -1):
        a, b = units[u]
        # Calibrated: its reduce buffer comes in its reduction (below). A tied lookup is not gathered (tied.py).
        split = ctx.grads_on_demand or u in lookups
        own = terms[u].grads - (terms[u].red_buf if split else 0.0) + (0.0 if u in lookups else terms[u].gathered)
        params = own + kept_before[u] + fetched_around(bfetch, u, -1) + tied_bwd[u]
        if u + 1 < n and u not in lookups:  # the unit after's reduce buffer, or (CPU, tier 4) its gradient being written
            params += terms[u + 1].grad_buf if ctx.unified and terms[u + 1].grad_buf else terms[u + 1].red_buf
        for v in range(max(0, u - db), u):
            if not terms[v].kept:
                params += terms[v].gathered
        base = params
        # Calibrated: parameter-free blocks a unit ends with (a tied head) and the loss's backward run before FSDP2's
        # pre-backward hook gathers the unit, prefetches the next or allocates its gradients (measured, 1.3 M on 2
        # CPU ranks: full shard peaks at state + activations, 48.2 MiB, in the cross-entropy's backward; 51.2 priced
        # with the unit's parameters and gradients). Live then: kept units, this unit if a backward prefetched it.
        last_param = max((i for i in range(a, b) if ctx.numel[i] > 0), default=a - 1) if ctx.grads_on_demand else b
        before_hook = kept_before[u] + (terms[u].gathered if terms[u].kept or (u + 1 < n and db > 0) else 0.0)
        if u + 1 < n:
            before_hook += terms[u + 1].red_buf
        early = before_hook if last_param < b - 1 else params
        worst_total = worst_act = worst_params = 0.0
        worst_i = a
        # A sharded unit's gradient shard appears when its reduce-scatter lands (its unsharded gradients are
        # in ``params``); an aliased replicate unit's gradients appear block by block, as autograd makes them.
        local = terms[u].grad_state if ctx.grads_on_demand else 0.0
        unit_numel = sum(ctx.numel[a:b]) or 1
        alias = ctx.alias_replicated and not terms[u].grads and local > 0
        before = 0.0  # numel of blocks a .. i-1: their gradients do not exist yet while block i runs backward
        state_bwd = state_fwd + grads_after[u]
        # Calibrated: a recomputed forward re-prefetches the next df units, resharded after their backward (measured,
        # LlamaForCausalLM 4.9 M, 2 CPU ranks, layers recomputed: 65.5 MiB with forward prefetch 1, 62.9 without).
        refetch = sum(terms[v].gathered for v in range(u + 1, min(n, u + df + 1))) if ctx.grads_on_demand else 0.0
        for i in range(a, b):
            # A checkpointed block's backward first re-runs its forward: that forward's temporaries count too.
            act = prefix[i] + saved[i] + (max(tr[i], ftr[i]) if ckpt[i] else tr[i])
            g = grads_after[u + 1] + (local * (unit_numel - before) / unit_numel if alias else 0.0)
            before += ctx.numel[i]
            par = (early if i > last_param else params) + (refetch if ckpt[i] else 0.0)
            if state_fwd + g + act + par > worst_total:
                worst_total, worst_act, worst_i, state_bwd, worst_params = (state_fwd + g + act + par, act, i,
                                                                            state_fwd + g, par)
            if ctx.grads_on_demand and ltr[i] > 0:
                # The loss folded into this block runs first, before the hook and the block's gradients (measured,
                # LlamaForCausalLM 4.9 M, untied head, 2 CPU ranks, full shard: 92.0 MiB there; 106.6 priced).
                act = prefix[i] + saved[i] + ltr[i]
                g = grads_after[u + 1] + (local * (unit_numel - before) / unit_numel if alias else 0.0)
                if state_fwd + g + act + before_hook > worst_total:
                    worst_total, worst_act, worst_i, state_bwd, worst_params = (state_fwd + g + act + before_hook,
                                                                                act, i, state_fwd + g, before_hook)
        reduction = base - own + terms[u].grads  # FSDP2 reshards, then copies the gradients into its reduce buffer
        if split and state_fwd + grads_after[u + 1] + reduction + prefix[a] > worst_total:
            state_bwd, worst_params, worst_act = state_fwd + grads_after[u + 1], reduction, prefix[a]
        params = worst_params
        total = state_bwd + params + worst_act
        if total > best:
            best = total
            where = ("backward", ctx.names[worst_i], state_bwd, params, worst_act)
    for t in tied:  # the tied block's backward gathers the owner again: its shards and the gathered copy at once
        i, st, par = t.block, state_fwd + grads_after[t.until + 1], terms[t.unit].gathered + fetch[t.unit]
        act = prefix[i] + saved[i] + ltr[i]
        if st + par + act > best:
            best, where = st + par + act, ("backward", ctx.names[i], st, par, act)
    if detail is not None:
        detail.peak_phase, detail.peak_block, detail.peak_state, detail.peak_params, detail.peak_acts = where
        if where[0] == "optimizer":
            detail.peak_params = opt_tmp
    return best * (1.0 + ctx.fragmentation) + ctx.reserved
