"""The expert placement planner: which of an MoE model's experts live on the device, in host memory or on disk.

A token touches a few experts per MoE layer, and some experts far more often than others (the expert-popularity
profile, :class:`~tightfit.profiler.experts.ExpertPopularity`). So this planner keeps the dense parts of every
layer (attention, norms, router, shared or dense MLP) and the bytes that always stay (embedding, head) on the
device first; then each layer's experts, most used per byte first across all layers, on the device while the
budget lasts, then in host memory while the host budget lasts, and the rest on disk, read from the checkpoint's
own files (no bytes written to disk). Every layer with experts off the device gets ``cache_slots`` device slots
(at least one step's worth at batch 1: the router's top-k) that streamed experts are read into; the expert cache
(:class:`~tightfit.policy.experts.ExpertCache`) decides which streamed experts stay in them between steps. It is
the ``--n-cpu-moe`` a user would search for, expert by expert, priced.

On a CPU-only machine the device and the host are one memory (``unified``): ``budget_bytes`` covers everything
held, there is no host tier, and the disk tier is the only move that saves memory. On a GPU machine, an expert
read from disk goes through host memory (one layer's slots of staging, charged to the host budget) and every
expert off the device is copied to it before it runs.

Prices, per decode step of ``b`` tokens: a token picks expert ``i`` with probability ``p_i = min(1, k * share_i)``
(``k`` experts per token, ``share_i`` its share of the layer's routed uses); tokens are taken as independent, so
the step touches expert ``i`` with probability ``1 - (1 - p_i) ** b``. Compute reads the dense parts once and each
touched expert once at ``device_bytes_per_s`` (decode is bound by the weights' bytes), plus ``token_seconds`` per
token; moves cost ``bytes / host_bytes_per_s`` (host to device) and ``latency + bytes / bandwidth`` from the disk
profile's read fit, hidden behind compute as far as the profile's measured ``compute_overlap`` says (fully when
not measured). Hits of the device slots are not counted (a lower bound: a slot that keeps an expert only saves a
read). energon's engine serves its plans (``energon_infer.engine.expert_plan``).

Pure: numbers in, a frozen JSON-serialisable :class:`ExpertPlan` out.

Example:
    >>> layers = [MoELayerShape(dense_bytes=100, expert_bytes=(50,) * 4)] * 2
    >>> plan = plan_experts(layers, experts_per_token=1, budget_bytes=500, device_bytes_per_s=1e4,
    ...                     host_bytes_per_s=1e3)  # uniform routing
    >>> plan.placement[1], plan.slots, plan.device_bytes, plan.host_bytes  # layer 0 whole, layer 1 + 1 slot
    (('device', 'host', 'host', 'host'), (0, 1), 500, 150)
    >>> ExpertPlan.from_json(plan.to_json()) == plan
    True
    >>> from tightfit.profiler.types import DiskProfile
    >>> disk = DiskProfile(path="/nvme", free_bytes=10**9, read_fit=(0.0, 1e3))
    >>> plan = plan_experts(layers, experts_per_token=1, budget_bytes=400, device_bytes_per_s=1e4, unified=True,
    ...                     disk=disk)  # a CPU machine: one memory, the rest read from disk
    >>> plan.experts_in("disk"), plan.slots, plan.device_bytes  # dense 200 + 2 experts + 2 slots of 50
    (((2, 3), (0, 1, 2, 3)), (1, 1), 400)
    >>> try:
    ...     plan_experts(layers, experts_per_token=1, budget_bytes=250, device_bytes_per_s=1e4, unified=True,
    ...                  disk=disk)
    ... except PlanInfeasibleError as err:
    ...     print(err.needed_bytes, err.budget_bytes)  # dense parts and one slot per layer
    300 250
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tightfit.checks import check_number
from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.tiers import MemoryTiers, disk_seconds, tier_error
from tightfit.profiler.experts import ExpertPopularity
from tightfit.profiler.types import DiskProfile
from tightfit.serde import from_jsonable, to_jsonable
from tightfit.units import format_bytes, format_table

__all__ = ["MoELayerShape", "ExpertPlan", "plan_experts"]

_TIERS = ("device", "host", "disk")


@dataclass(frozen=True, kw_only=True, slots=True)
class MoELayerShape:
    """One MoE layer's bytes as held (quantized bytes where quantized).

    Args:
        dense_bytes: what always stays on the device: attention, norms, router, the shared or dense MLP.
        expert_bytes: each routed expert's bytes.
    """

    dense_bytes: int
    expert_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        check_number(self.dense_bytes, "dense_bytes", where="MoELayerShape", integer=True, low=0, error=PlanError,
                     fix="give the layer's attention, norms, router and dense MLP bytes")
        if not self.expert_bytes:
            raise PlanError("MoELayerShape: expert_bytes=() must name at least one expert; give each expert's bytes")
        for i, b in enumerate(self.expert_bytes):
            check_number(b, f"expert_bytes[{i}]", where="MoELayerShape", integer=True, low=1, error=PlanError,
                         fix="give each routed expert's bytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertPlan:
    """Where every expert lives and what that is predicted to give.

    Args:
        placement: per MoE layer, each expert's tier (``"device"``, ``"host"`` or ``"disk"``).
        slots: per layer, device slots streamed experts are read into (0 where every expert is on the device).
        slot_bytes: per layer, one slot (its largest expert off the device).
        experts_per_token: the router's top-k.
        unified: device and host are one memory (a CPU machine).
        budget_bytes: the device budget planned for.
        host_budget_bytes: the host budget planned for (``None``: no limit).
        dense_bytes: the device bytes that always stay (every layer's dense parts and ``resident_bytes``).
        device_bytes: what the plan holds on the device: dense parts, experts and slots.
        host_bytes: what it holds in host memory: its experts and the staging of disk reads.
        served: the share of routed expert uses served from each tier, device / host / disk (sums to 1).
        batches: the batch sizes priced.
        tokens_per_s: predicted decode tokens/s at each batch.
        disk_bytes_per_token: predicted bytes read from disk per token at each batch.
        host_bytes_per_token: predicted bytes copied from host to device per token at each batch (0 if unified).
        popularity: ``"profile"`` or ``"uniform"``.
    """

    placement: tuple[tuple[str, ...], ...]
    slots: tuple[int, ...]
    slot_bytes: tuple[int, ...]
    experts_per_token: int
    unified: bool
    budget_bytes: int
    host_budget_bytes: int | None
    dense_bytes: int
    device_bytes: int
    host_bytes: int
    served: tuple[float, float, float]
    batches: tuple[int, ...]
    tokens_per_s: tuple[float, ...]
    disk_bytes_per_token: tuple[float, ...]
    host_bytes_per_token: tuple[float, ...]
    popularity: str = "uniform"

    def __post_init__(self) -> None:
        n = len(self.placement)
        if any(t not in _TIERS for layer in self.placement for t in layer):
            raise PlanError(f"ExpertPlan: placement names tiers outside {_TIERS}; give one tier per expert")
        if len(self.slots) != n or len(self.slot_bytes) != n:
            raise PlanError(f"ExpertPlan: slots ({len(self.slots)}) and slot_bytes ({len(self.slot_bytes)}) must "
                            f"have one entry per layer ({n})")
        if not len(self.batches) == len(self.tokens_per_s) == len(self.disk_bytes_per_token) \
                == len(self.host_bytes_per_token):
            raise PlanError("ExpertPlan: tokens_per_s and bytes per token must have one entry per batch size")

    def tier_of(self, layer: int, expert: int) -> str:
        return self.placement[layer][expert]

    def experts_in(self, tier: str) -> tuple[tuple[int, ...], ...]:
        """Per layer, the experts living in ``tier``."""
        return tuple(tuple(i for i, t in enumerate(layer) if t == tier) for layer in self.placement)

    def count(self, tier: str) -> int:
        return sum(layer.count(tier) for layer in self.placement)

    def to_json(self) -> str:
        return json.dumps(to_jsonable(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ExpertPlan:
        return from_jsonable(cls, json.loads(text))

    def explain(self) -> str:
        """What lives where, what it costs, and the predicted speed (for people)."""
        n, experts = len(self.placement), sum(len(layer) for layer in self.placement)
        memory = "memory (device and host are one)" if self.unified else "device"
        host_budget = "no limit" if self.host_budget_bytes is None else format_bytes(self.host_budget_bytes)
        lines = [
            f"expert placement: {n} MoE layers, {experts} experts, top-{self.experts_per_token}, "
            f"popularity {self.popularity}",
            f"{memory}: {format_bytes(self.device_bytes)} of {format_bytes(self.budget_bytes)}: dense parts "
            f"{format_bytes(self.dense_bytes)}, {self.count('device')} experts, {sum(self.slots)} slots for streamed "
            "experts",
        ]
        if not self.unified:
            lines.append(f"host: {format_bytes(self.host_bytes)} ({host_budget}): {self.count('host')} experts")
        lines.append(f"disk: {self.count('disk')} experts, read from the checkpoint's files")
        lines.append("routed uses served from " + ", ".join(
            f"{t} {share:.1%}" for t, share in zip(_TIERS, self.served) if not (self.unified and t == "host")))
        for b, tps, disk, host in zip(self.batches, self.tokens_per_s, self.disk_bytes_per_token,
                                      self.host_bytes_per_token):
            moved = f"{format_bytes(disk)} read from disk" + ("" if self.unified else f", {format_bytes(host)} copied "
                                                                "from host")
            lines.append(f"batch {b}: {tps:.3g} tokens/s predicted, {moved} per token")
        rows = [(i, layer.count("device"), "-" if self.unified else layer.count("host"), layer.count("disk"), s,
                 format_bytes(sb) if s else "-") for i, (layer, s, sb) in
                enumerate(zip(self.placement, self.slots, self.slot_bytes))]
        lines.append(format_table(rows, ("layer", "device", "host", "disk", "slots", "slot"), align="rrrrrr"))
        return "\n".join(lines)


def plan_experts(layers: Sequence[MoELayerShape], *, experts_per_token: int, budget_bytes: int,
                 device_bytes_per_s: float, popularity: ExpertPopularity | None = None, resident_bytes: int = 0,
                 host_budget_bytes: int | None = None, unified: bool = False, disk: DiskProfile | None = None,
                 host_bytes_per_s: float | None = None, token_seconds: float = 0.0, cache_slots: int | None = None,
                 batches: Sequence[int] = (1, 32)) -> ExpertPlan:
    """Place every expert of an MoE model on the device, the host or the disk (the module docstring says how).

    Args:
        layers: each MoE layer's dense and expert bytes, in execution order.
        experts_per_token: the router's top-k.
        budget_bytes: what the device may hold (unified: everything the weights hold in memory).
        device_bytes_per_s: the rate compute reads weights at on the device (decode is bound by it).
        popularity: per-layer expert counts (``None``: uniform routing).
        resident_bytes: bytes that always stay on the device besides the layers (embedding, head, final norm).
        host_budget_bytes: what host memory may hold (``None``: no limit; not with ``unified``).
        unified: device and host are one memory (a CPU machine).
        disk: the disk the checkpoint is read from (``None``: no disk tier).
        host_bytes_per_s: host-to-device copy rate (required with a host tier: not unified).
        token_seconds: compute per token outside the weights' reads (attention over the cache, sampling).
        cache_slots: device slots per layer with streamed experts (``None``: ``experts_per_token``).
        batches: the batch sizes to predict tokens/s at.

    Raises:
        PlanInfeasibleError: the dense parts and the slots do not fit the device budget (``tier="device"``, naming
            that floor), or the host cannot hold what the device leaves and there is no disk (``tier="host"``).
    """
    _check(layers, experts_per_token, budget_bytes, device_bytes_per_s, popularity, resident_bytes,
           host_budget_bytes, unified, host_bytes_per_s, token_seconds, cache_slots, batches)
    slots_each = experts_per_token if cache_slots is None else int(cache_slots)
    probs = [popularity.token_probabilities(i) if popularity is not None else
             (min(1.0, experts_per_token / len(s.expert_bytes)),) * len(s.expert_bytes) for i, s in enumerate(layers)]
    # Most used per byte first, then layer and expert order: equal sizes keep each layer's hottest experts ahead.
    order = sorted(((lay, i) for lay, s in enumerate(layers) for i in range(len(s.expert_bytes))),
                   key=lambda li: (-probs[li[0]][li[1]] / layers[li[0]].expert_bytes[li[1]], li))
    dense = resident_bytes + sum(s.dense_bytes for s in layers)
    totals = _device_totals(layers, order, dense, slots_each)
    # With one memory and no disk, every expert stays in memory.
    choices = [len(order)] if unified and disk is None else range(len(totals))
    fits = [n for n in choices if totals[n] <= budget_bytes]
    if not fits:
        needed = min(totals[n] for n in choices)
        raise _device_error(needed, budget_bytes, unified, slots_each, needed - dense if disk or not unified else -1,
                            dense)
    n = fits[-1]
    tiers = MemoryTiers(device_bytes=budget_bytes, host_bytes=None if unified else host_budget_bytes, disk=disk,
                        unified=unified)
    m, host_bytes = _host_prefix(layers, order, n, slots_each, tiers)
    placement = [["disk"] * len(s.expert_bytes) for s in layers]
    for j, (lay, i) in enumerate(order[:m]):
        placement[lay][i] = "device" if j < n else "host"
    slots, slot_bytes = _slots(layers, placement, slots_each, "device")
    served, tps, disk_pt, host_pt = _price(layers, placement, probs, dense - resident_bytes, batches, unified, disk,
                                           device_bytes_per_s, host_bytes_per_s, token_seconds)
    return ExpertPlan(placement=tuple(tuple(p) for p in placement), slots=slots, slot_bytes=slot_bytes,
                      experts_per_token=experts_per_token, unified=unified, budget_bytes=budget_bytes,
                      host_budget_bytes=host_budget_bytes, dense_bytes=dense, device_bytes=totals[n],
                      host_bytes=host_bytes, served=served, batches=tuple(int(b) for b in batches),
                      tokens_per_s=tps, disk_bytes_per_token=disk_pt, host_bytes_per_token=host_pt,
                      popularity="uniform" if popularity is None else "profile")


def _check(layers: Sequence[MoELayerShape], k: int, budget: int, device_rate: float,
           popularity: ExpertPopularity | None, resident: int, host_budget: int | None, unified: bool,
           host_rate: float | None, token_seconds: float, cache_slots: int | None, batches: Sequence[int]) -> None:
    """Every argument of :func:`plan_experts`, refused in one line naming the value, the rule and the fix."""
    where = "plan_experts"
    if not layers or not all(isinstance(s, MoELayerShape) for s in layers):
        raise PlanError(f"{where}: layers must be a non-empty sequence of MoELayerShape; give one per MoE layer")
    least = min(len(s.expert_bytes) for s in layers)
    check_number(k, "experts_per_token", where=where, integer=True, low=1, high=least, error=PlanError,
                 fix="give the router's top-k (at most the experts of a layer)")
    check_number(budget, "budget_bytes", where=where, integer=True, low=0, error=PlanError,
                 fix="give the device bytes the weights may use")
    check_number(device_rate, "device_bytes_per_s", where=where, low=0, low_open=True, error=PlanError,
                 fix="give the device's weight-read rate (profile_device's memory bandwidth)")
    check_number(resident, "resident_bytes", where=where, integer=True, low=0, error=PlanError,
                 fix="give the embedding, head and final norm bytes, or 0")
    check_number(token_seconds, "token_seconds", where=where, low=0, error=PlanError, fix="give seconds, or 0")
    if cache_slots is not None:
        check_number(cache_slots, "cache_slots", where=where, integer=True, low=1, error=PlanError,
                     fix="give device slots per layer for streamed experts, e.g. experts_per_token")
    if not batches:
        raise PlanError(f"{where}: batches=() must name at least one batch size, e.g. (1, 32)")
    for b in batches:
        check_number(b, "batch", where=where, integer=True, low=1, error=PlanError, fix="batch sizes are >= 1")
    if unified and host_budget is not None:
        raise PlanError(f"{where}: host_budget_bytes={host_budget} with unified=True: device and host are one memory "
                        "there; give the whole budget as budget_bytes and no host budget")
    if host_budget is not None:
        check_number(host_budget, "host_budget_bytes", where=where, integer=True, low=0, error=PlanError,
                     fix="give host bytes, or None for no limit")
    if not unified:
        check_number(host_rate, "host_bytes_per_s", where=where, low=0, low_open=True, error=PlanError,
                     fix="give the host-to-device copy rate (profile_device), or unified=True on a CPU machine")
    if popularity is not None:
        shape = (len(layers), {len(s.expert_bytes) for s in layers}, k)
        if shape != (popularity.num_layers, {popularity.num_experts}, popularity.experts_per_token):
            raise PlanError(f"{where}: the popularity profile ({popularity!r}) is not of this model ({len(layers)} "
                            f"layers of {sorted(shape[1])} experts, top-{k}); give the model's own profile, or None")


def _device_totals(layers: Sequence[MoELayerShape], order: list[tuple[int, int]], dense: int, slots: int) -> list[int]:
    """Device bytes with the first ``n`` of ``order`` resident, for every ``n``: dense, experts, streamed slots."""
    off = [list(s.expert_bytes) for s in layers]  # each layer's experts still off the device, by bytes

    def slot_part(layer: int) -> int:
        left = [b for b in off[layer] if b]
        return min(slots, len(left)) * max(left, default=0)

    slot_total = sum(slot_part(lay) for lay in range(len(layers)))
    expert_total, totals = 0, [dense + slot_total]
    for lay, i in order:
        slot_total -= slot_part(lay)
        expert_total += off[lay][i]
        off[lay][i] = 0
        slot_total += slot_part(lay)
        totals.append(dense + expert_total + slot_total)
    return totals


def _host_prefix(layers: Sequence[MoELayerShape], order: list[tuple[int, int]], n: int, slots: int,
                 tiers: MemoryTiers) -> tuple[int, int]:
    """``(m, host bytes)``: ``order[n:m]`` on the host (the longest run that fits), ``order[m:]`` on disk."""
    size = [layers[lay].expert_bytes[i] for lay, i in order]
    if tiers.unified:
        return n, 0
    staging = _suffix_staging(layers, order, slots)
    limit, best, held = tiers.host_bytes, None, 0
    for m in range(n, len(order) + 1):
        held += size[m - 1] if m > n else 0
        if m < len(order) and tiers.disk is None:
            continue
        need = held + staging[m]
        if limit is None or need <= limit:
            best = (m, need)
    if best is None:
        if tiers.disk is None:
            raise tier_error(tiers, "host", needed=sum(size[n:]),
                             what=f"the {len(order) - n} experts the device leaves")
        raise tier_error(tiers, "host", needed=staging[n], what="the disk reads' staging",
                         suggestions=("raise host_budget", "lower cache_slots"))
    return best


def _suffix_staging(layers: Sequence[MoELayerShape], order: list[tuple[int, int]], slots: int) -> list[int]:
    """Host staging for disk reads on a GPU machine with ``order[m:]`` on disk, for every ``m``: the largest layer's
    slots of disk experts (layers are read one at a time)."""
    count: dict[int, int] = {}
    largest: dict[int, int] = {}
    out = [0] * (len(order) + 1)
    for m in range(len(order) - 1, -1, -1):
        lay, i = order[m]
        count[lay] = count.get(lay, 0) + 1
        largest[lay] = max(largest.get(lay, 0), layers[lay].expert_bytes[i])
        out[m] = max(out[m + 1], min(slots, count[lay]) * largest[lay])
    return out


def _slots(layers: Sequence[MoELayerShape], placement: list[list[str]], slots: int,
           resident: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    off = [[b for b, t in zip(s.expert_bytes, p) if t != resident] for s, p in zip(layers, placement)]
    return tuple(min(slots, len(o)) for o in off), tuple(max(o, default=0) for o in off)


def _price(layers: Sequence[MoELayerShape], placement: list[list[str]], probs: list[tuple[float, ...]],
           dense: int, batches: Sequence[int], unified: bool, disk: DiskProfile | None, device_rate: float,
           host_rate: float | None, token_seconds: float) -> tuple[tuple[float, float, float], tuple[float, ...],
                                                                   tuple[float, ...], tuple[float, ...]]:
    """Served shares per tier, and per batch size tokens/s and bytes moved per token (the module docstring's model)."""
    uses = [0.0, 0.0, 0.0]
    for layer, p in zip(placement, probs):
        total = sum(p)
        for t, pi in zip(layer, p):
            uses[_TIERS.index(t)] += pi / total / len(placement)
    overlap = disk.compute_overlap if disk is not None and disk.compute_overlap >= 0 else 1.0
    tps, disk_pt, host_pt = [], [], []
    for b in batches:
        compute, moves, disk_bytes, host_bytes = dense / device_rate + b * token_seconds, 0.0, 0.0, 0.0
        for s, layer, p in zip(layers, placement, probs):
            for nbytes, t, pi in zip(s.expert_bytes, layer, p):
                touched = 1.0 - (1.0 - pi) ** b
                compute += touched * nbytes / device_rate
                if t == "disk" and disk is not None:
                    disk_bytes += touched * nbytes
                    moves += touched * disk_seconds(disk, nbytes)
                if t != "device" and not unified:
                    host_bytes += touched * nbytes
                    moves += touched * nbytes / (host_rate or 1.0)
        step = compute + max(0.0, moves - overlap * compute)
        tps.append(b / step)
        disk_pt.append(disk_bytes / b)
        host_pt.append(host_bytes / b)
    return (uses[0], uses[1], uses[2]), tuple(tps), tuple(disk_pt), tuple(host_pt)


def _device_error(needed: int, budget: int, unified: bool, slots: int, slot_bytes: int,
                  dense: int) -> PlanInfeasibleError:
    """The device tier is short; ``slot_bytes`` < 0: one memory and no disk, every expert must stay in it."""
    where = "in memory" if unified else "on the device"
    what = (f"every expert, with no disk tier: {format_bytes(needed - dense)}" if slot_bytes < 0 else
            f"{slots} slots per layer for streamed experts: {format_bytes(slot_bytes)}")
    fix = "give a disk directory (disk_dir), raise the budget" if slot_bytes < 0 else \
        "raise the budget, lower cache_slots"
    return PlanInfeasibleError(
        f"the MoE model needs at least {format_bytes(needed)} {where} (dense parts and bytes that always stay "
        f"{format_bytes(dense)}, {what}) but the budget is {format_bytes(budget)}; {fix}, or quantize the model",
        needed_bytes=needed, budget_bytes=budget,
        suggestions=(*fix.split(", "), "quantize the model (int8/int4 weights)"))
