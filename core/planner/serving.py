"""The serving planner: the whole serving process inside the memory it may use, and the knobs chosen to fit.

A serving engine's memory is more than its weights. Each worker process holds its interpreter and libraries, the
weights it keeps (embedding, head, norms, the layers kept in memory and, on a CPU, their packed copies), the prefetch
slots and read buffers of the layers it streams from disk, the KV cache, and the working memory of one step at the
token budget. :func:`plan_serving` fits all of it into what the memory limit leaves (``free_bytes``, shared by the
ranks of the node), line by line, and chooses what the user left open:

* ``lookahead`` (prefetch slots = lookahead + 1) and the token budget (``max_batch_tokens``) walk down one ladder,
  each step lowering whichever of the two saves more bytes (lookahead 0, which overlaps no read with compute,
  last), until a setting fits and its token budget (activations and KV floor) takes at most half of what the
  limit leaves the layers and it (or every layer stays in memory). The prefetch slots are not traded for kept
  layers: a kept layer saves one read a pass, a slot overlaps every read with compute. A user's weights budget
  (``weight_budget_bytes``) is the layers' whole: the token budget falls until it fits beside it. Lowering the
  memory never raises either knob;
* the layers kept in memory: the most that fit (:func:`tightfit.planner.pool.plan_pool`, one memory: the rest are
  read from disk on every pass);
* the KV cache: what is left, up to ``kv_cache_tokens``, and never less than one step at the token budget.

Where even the least-memory setting (every layer on disk, the knobs at their floors) does not fit, it raises
:class:`~tightfit.planner.errors.PlanInfeasibleError` naming what that plan needs and the cheapest change.

Pure: numbers in, a frozen JSON-serialisable :class:`ServingPlan` out (the engine measures and applies).

Example:
    >>> from tightfit.profiler.types import DiskProfile
    >>> disk, MiB = DiskProfile(path="/nvme", free_bytes=10**12, read_fit=(0.0, 1e9)), 2**20
    >>> stage = StageShape(layer_bytes=(8 * MiB,) * 4, resident_bytes=4 * MiB, read_buffer_bytes=MiB,
    ...                    kv_bytes_per_token=1024, activation_bytes_per_token=4096)
    >>> plan = plan_serving([stage], free_bytes=240 * MiB, worker_bytes=100 * MiB, disk=disk)
    >>> plan.pools[0].disk_layers, plan.lookahead, plan.max_batch_tokens, plan.kv_cache_tokens
    ((), 2, 4096, 32768)
    >>> plan = plan_serving([stage], free_bytes=150 * MiB, worker_bytes=100 * MiB, disk=disk)
    >>> plan.pools[0].disk_layers, plan.lookahead, plan.max_batch_tokens, plan.kv_cache_tokens
    ((0, 1, 2), 1, 1024, 2048)
    >>> ServingPlan.from_json(plan.to_json()) == plan
    True
    >>> try:
    ...     plan_serving([stage], free_bytes=120 * MiB, worker_bytes=100 * MiB, disk=disk)
    ... except PlanInfeasibleError as err:
    ...     print(str(err)[:70], round(err.needed_bytes / MiB, 2))
    the least-memory serving plan (every layer read from disk, lookahead 0 126.94
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from tightfit.checks import check_number
from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.pool import PoolPlan, plan_pool, spread_layers
from tightfit.profiler.types import DiskProfile
from tightfit.units import format_bytes

__all__ = ["StageShape", "ServingPlan", "plan_serving", "TOKEN_BUDGET_FLOOR", "SLACK_FRACTION"]

#: The planner lowers the token budget no further by itself: below it a prefill chunk's matmuls get thin, and the
#: bytes saved are small next to one layer's.
TOKEN_BUDGET_FLOOR = 256

#: Share of each rank's memory left unplanned: the allocator's free lists and arenas, threads' stacks, the
#: controller's growth while it serves, and the page cache of the files read at load.
SLACK_FRACTION = 0.1


@dataclass(frozen=True, kw_only=True, slots=True)
class StageShape:
    """What one rank of a pipeline stage holds, per item, in bytes (the engine derives them from the model).

    Args:
        layer_bytes: each layer's bytes as held (quantized bytes where quantized), in execution order.
        resident_bytes: bytes that always stay in memory: embedding, head, norms (and their packed copies).
        kept_extra_bytes: bytes each layer adds while kept in memory (its projections' packed copy on a CPU); empty:
            none.
        read_buffer_bytes: the read buffers of all I/O threads, held while any layer is read from disk (part of a
            weights budget, as the pool plans them).
        read_work_bytes: the working copies the reads make (a transform, a finite check) that the I/O threads'
            allocator keeps, held while any layer is read from disk (outside a weights budget).
        kv_bytes_per_token: the KV cache of one token over the stage's layers (this rank's heads).
        activation_bytes_per_token: a step's working memory per token of the token budget.
        logits_bytes_per_row: the logits (and the sampler's copies) of one sequence sampled in a step.
        ranks: tensor-parallel ranks of the stage (each holds this shape).
        resident_what: what ``resident_bytes`` holds, as :meth:`ServingPlan.explain` names it.
    """

    layer_bytes: tuple[int, ...]
    resident_bytes: int
    kept_extra_bytes: tuple[int, ...] = ()
    read_buffer_bytes: int = 0
    read_work_bytes: int = 0
    kv_bytes_per_token: int = 0
    activation_bytes_per_token: int = 0
    logits_bytes_per_row: int = 0
    ranks: int = 1
    resident_what: str = "embedding, head and norms"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_bytes", tuple(int(b) for b in self.layer_bytes))
        object.__setattr__(self, "kept_extra_bytes", tuple(int(b) for b in self.kept_extra_bytes))
        for i, b in enumerate(self.layer_bytes + self.kept_extra_bytes):
            check_number(b, f"layer_bytes/kept_extra_bytes[{i}]", where="StageShape", integer=True, low=0,
                         error=PlanError, fix="give each layer's bytes from the stage's profile")
        if self.kept_extra_bytes and len(self.kept_extra_bytes) != len(self.layer_bytes):
            raise PlanError(f"StageShape: kept_extra_bytes has {len(self.kept_extra_bytes)} entries for "
                            f"{len(self.layer_bytes)} layers; give one per layer, or none")
        for name in ("resident_bytes", "read_buffer_bytes", "read_work_bytes", "kv_bytes_per_token", "activation_bytes_per_token",
                     "logits_bytes_per_row"):
            check_number(getattr(self, name), name, where="StageShape", integer=True, low=0, error=PlanError,
                         fix="give bytes (0 where there are none)")
        check_number(self.ranks, "ranks", where="StageShape", integer=True, low=1, error=PlanError,
                     fix="the tensor-parallel ranks of the stage, e.g. 1")

    def activation_bytes(self, tokens: int, max_running: int) -> int:
        """A step's working memory at ``tokens`` tokens, ``min(tokens, max_running)`` sequences sampled."""
        return tokens * self.activation_bytes_per_token + min(tokens, max_running) * self.logits_bytes_per_row


@dataclass(frozen=True, kw_only=True, slots=True)
class ServingPlan:
    """The knobs chosen, each stage's pool plan, and the whole-process budget line by line.

    Args:
        lookahead: pooled layers fetched ahead (slots = lookahead + 1, capped at the disk layers).
        max_batch_tokens: the token budget of a step.
        kv_cache_tokens: the KV cache of each rank, in tokens.
        pools: each stage's :class:`~tightfit.planner.pool.PoolPlan` (layers on disk: ``disk_layers``).
        weight_budgets: the weights budget of each stage the pool plan was made for (``memory_budget``).
        free_bytes: what the memory limit left when the plan was made (shared by all ranks).
        ranks: worker processes (tp x pp).
        lines: per stage, the budget of one rank, ``(what, bytes)`` in order, the last line the rank's share.
        where: what ``free_bytes`` is (e.g. "the memory limit (FILE)", naming the cgroup file it was read from).
    """

    lookahead: int
    max_batch_tokens: int
    kv_cache_tokens: int
    pools: tuple[PoolPlan, ...]
    weight_budgets: tuple[int, ...]
    free_bytes: int
    ranks: int
    lines: tuple[tuple[tuple[str, int], ...], ...] = field(default=())
    where: str = "free memory"

    @property
    def streams(self) -> bool:
        """Whether any stage reads layers from disk on every pass."""
        return any(p.disk_layers for p in self.pools)

    def explain(self) -> str:
        """The whole-process budget, one line per item, for each stage's rank."""
        out = [f"serving memory: {format_bytes(self.free_bytes)} free under {self.where}, shared by "
               f"{self.ranks} worker(s); lookahead {self.lookahead}, max_batch_tokens {self.max_batch_tokens}, "
               f"kv_cache_tokens {self.kv_cache_tokens}"]
        for s, lines in enumerate(self.lines):
            out.append(f"stage {s}, each rank:")
            width = max(len(what) for what, _ in lines)
            out += [f"  {what:<{width}}  {format_bytes(b):>11}" for what, b in lines]
        return "\n".join(out)

    def to_json(self) -> str:
        raw = asdict(self)
        raw["pools"] = [p.to_json() for p in self.pools]
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServingPlan:
        raw = json.loads(text)
        return cls(**{**raw, "pools": tuple(PoolPlan.from_json(p) for p in raw["pools"]),
                      "weight_budgets": tuple(raw["weight_budgets"]),
                      "lines": tuple(tuple((w, int(b)) for w, b in stage) for stage in raw["lines"])})


def _walk(lookahead: int, tokens: int, *, fix_lookahead: bool, fix_tokens: bool, slot: int, act: int,
          good: Callable[[int, int], bool], fits: Callable[[int, int], bool]) -> tuple[int, int]:
    """The first (lookahead, token budget) that is ``good``, from the given down to the floors, the floors where none
    is. Where the setting ``fits`` (only the token budget's share is too large) the token budget halves; where it
    does not, the knob that saves more (one slot of ``slot`` bytes, or half the tokens at ``act`` bytes each), and
    lookahead 1 -> 0 last. Every knob only falls along the way."""
    floor = tokens if fix_tokens else min(tokens, TOKEN_BUDGET_FLOOR)
    low = lookahead if fix_lookahead else 0
    a, t = lookahead, tokens
    while not good(a, t) and (a > low or t > floor):
        half = max(floor, t // 2)
        # Lookahead 0 (one slot) leaves no read overlapped with compute: the last step, after the token budget.
        if a > low and (t <= floor or (not fits(a, t) and a > 1 and slot >= (t - half) * act)):
            a -= 1
        else:
            t = half
    return a, t


def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block) * block


def plan_serving(stages: Sequence[StageShape], *, free_bytes: int, worker_bytes: int,
                 weight_budget_bytes: int | None = None, lookahead: int = 2, fix_lookahead: bool = False,
                 max_batch_tokens: int = 4096, fix_batch_tokens: bool = False, kv_cache_tokens: int = 32768,
                 fix_kv_tokens: bool = False, block_size: int = 16, max_running: int = 256, swap_tokens: int = 0,
                 disk: DiskProfile | None = None, slack_fraction: float = SLACK_FRACTION,
                 where: str = "free memory", fixes: Sequence[str] = ()) -> ServingPlan:
    """Fit the serving process into ``free_bytes`` (see the module docstring).

    Args:
        stages: one :class:`StageShape` per pipeline stage.
        free_bytes: what the memory limit leaves now (the controller's own memory already taken).
        worker_bytes: one worker process's interpreter, libraries and runtime before it loads (measured).
        weight_budget_bytes: the user's weights budget per rank (``memory_budget``): checked against the limit and
            kept; ``None``: the planner's.
        lookahead: the most pooled layers fetched ahead (the user's when ``fix_lookahead``).
        fix_lookahead: keep ``lookahead`` as given.
        max_batch_tokens: the largest token budget of a step (the user's when ``fix_batch_tokens``).
        fix_batch_tokens: keep ``max_batch_tokens`` as given.
        kv_cache_tokens: the largest KV cache, in tokens (the user's when ``fix_kv_tokens``).
        fix_kv_tokens: keep ``kv_cache_tokens`` as given.
        block_size: tokens per KV block (the cache is whole blocks).
        max_running: sequences sampled per step at most (their logits).
        swap_tokens: host swap space of the KV cache, in tokens.
        disk: the disk layers are read from (``None``: no disk tier, every layer stays in memory).
        slack_fraction: share of each rank's memory left unplanned (:data:`SLACK_FRACTION`).
        where: what ``free_bytes`` is, for the messages.
        fixes: changes outside the planner's reach to suggest when nothing fits, cheapest first (e.g. quantized
            weights, a larger limit).

    Raises:
        PlanInfeasibleError: the least-memory plan does not fit; the message names what it needs and the cheapest
            change.
    """
    where_fn = "plan_serving"
    for name, value, low in (("free_bytes", free_bytes, 0), ("worker_bytes", worker_bytes, 0),
                             ("lookahead", lookahead, 0), ("max_batch_tokens", max_batch_tokens, 1),
                             ("kv_cache_tokens", kv_cache_tokens, 1), ("block_size", block_size, 1),
                             ("max_running", max_running, 1), ("swap_tokens", swap_tokens, 0)):
        check_number(value, name, where=where_fn, integer=True, low=low, error=PlanError,
                     fix="give a whole number from the engine's configuration or its measurement")
    check_number(slack_fraction, "slack_fraction", where=where_fn, low=0, high=0.9, error=PlanError,
                 fix="a share of memory left unplanned, e.g. 0.1")
    if not stages:
        raise PlanError(f"{where_fn}: no stages; give one StageShape per pipeline stage")
    ranks = sum(s.ranks for s in stages)
    share = free_bytes // ranks
    slack = int(share * slack_fraction)
    kv_max = _blocks(kv_cache_tokens, block_size)

    def kv_floor(tokens: int) -> int:
        return kv_max if fix_kv_tokens else min(kv_max, _blocks(max(tokens, block_size), block_size))

    user = weight_budget_bytes  # None: no weights budget but the limit's

    def all_in(stage: StageShape) -> int:
        """Every layer kept. A user's weights budget is the pool's (``memory_budget``: its read buffers counted
        whether or not a layer streams); the planner's own counts what the process holds (no reads, no buffers)."""
        buffers = stage.read_buffer_bytes if user is not None and disk is not None else 0
        return stage.resident_bytes + sum(stage.layer_bytes) + sum(stage.kept_extra_bytes) + buffers

    def streamed(stage: StageShape, a: int) -> int | None:
        """The least the weights take with some layers read from disk (each pooled layer off, ``min(a + 1, k)``
        slots and the read buffers on; what ``plan_pool`` counts), or ``None`` without a disk tier."""
        n = len(stage.layer_bytes)
        if disk is None or not n:
            return None
        extra = stage.kept_extra_bytes or (0,) * n
        return min(stage.resident_bytes + stage.read_buffer_bytes
                   + sum(b + extra[i] for i, b in enumerate(stage.layer_bytes) if i not in pooled)
                   + min(a + 1, k) * max(stage.layer_bytes[i] for i in pooled)
                   for k in range(1, n + 1) for pooled in [set(spread_layers(n, k))])

    def least(stage: StageShape, a: int) -> int:
        """The least memory the weights take in the process (a streaming plan's reads' working copies included)."""
        low = streamed(stage, a)
        return all_in(stage) if low is None else min(all_in(stage), low + stage.read_work_bytes)

    def others(stage: StageShape, t: int, kv: int) -> int:
        """Everything but the weights, for one rank."""
        return worker_bytes + slack + (kv + swap_tokens) * stage.kv_bytes_per_token + \
            stage.activation_bytes(t, max_running)

    def room(stage: StageShape, t: int) -> int:
        """What the limit leaves the weights (with the KV cache at its floor)."""
        return share - others(stage, t, kv_floor(t))

    def keeps_all(stage: StageShape, t: int) -> bool:
        return all_in(stage) <= min(room(stage, t), user if user is not None else all_in(stage))

    def fits(stage: StageShape, a: int, t: int) -> bool:
        low = streamed(stage, a)
        return keeps_all(stage, t) or (low is not None and (user is None or low <= user)
                                       and low + stage.read_work_bytes <= room(stage, t))

    def knobs_leave_room(a: int, t: int) -> bool:
        """A user's weights budget is what the layers get, whole: the token budget takes the rest. The planner's
        own: the token budget (its activations and KV floor) takes at most half of what the limit leaves the layers
        and it together. The prefetch slots are the streaming's, not the token budget's: lookahead falls only where
        the setting does not fit, so a layer kept never costs the overlap of every read with compute."""
        for s in stages:
            if user is not None:
                if user + (0 if keeps_all(s, t) else s.read_work_bytes) > room(s, t):
                    return False
                continue
            slots = min(a + 1, len(s.layer_bytes)) * max(s.layer_bytes, default=0)
            fixed = worker_bytes + slack + s.resident_bytes + s.read_buffer_bytes + s.read_work_bytes + slots + \
                swap_tokens * s.kv_bytes_per_token
            knobs = s.activation_bytes(t, max_running) + kv_floor(t) * s.kv_bytes_per_token
            if 2 * knobs > share - fixed:
                return False
        return True

    if user is not None and not fix_lookahead:  # the user's weights budget bounds the slots alone
        while lookahead > 0 and any(min(all_in(s), streamed(s, lookahead) or all_in(s)) > user for s in stages):
            lookahead -= 1
    widest = max((max(s.layer_bytes, default=0) for s in stages), default=0)
    per_token = max((s.activation_bytes_per_token + s.kv_bytes_per_token for s in stages), default=0)

    def fits_all(a: int, t: int) -> bool:
        return all(fits(s, a, t) for s in stages)

    def good(a: int, t: int) -> bool:
        return all(keeps_all(s, t) for s in stages) or (fits_all(a, t) and knobs_leave_room(a, t))

    chosen = a, t = _walk(lookahead, max_batch_tokens, fix_lookahead=fix_lookahead, fix_tokens=fix_batch_tokens,
                          slot=widest, act=per_token, good=good, fits=fits_all)
    if not all(fits(s, a, t) for s in stages):
        # The slack is a share of each rank's memory: the smallest share that holds the rest and its slack.
        needs = [(-(-(least(s, a) + others(s, t, kv_floor(t)) - slack) // (1 - slack_fraction)),
                  least(s, a) <= room(s, t), min(all_in(s), streamed(s, a) or all_in(s))) for s in stages]
        raise _infeasible(needs, chosen, free_bytes=free_bytes, ranks=ranks, where=where, fixes=fixes,
                          weight_budget=user, fix_tokens=fix_batch_tokens, fix_kv=fix_kv_tokens)
    pools, budgets, lines, kv = [], [], [], kv_max
    for s in stages:
        if user is not None and user > room(s, t):
            left = max(0, room(s, t))
            raise PlanInfeasibleError(
                f"--memory-budget {format_bytes(user)} for each worker's weights is more than the "
                f"{format_bytes(left)} {where} leaves them ({format_bytes(free_bytes)} free for {ranks} worker(s), "
                "less each one's interpreter, KV cache, activations and slack); lower it to "
                f"{format_bytes(left)} or omit it (the planner then chooses)",
                needed_bytes=free_bytes + user - left, budget_bytes=free_bytes,
                suggestions=(f"lower --memory-budget to {format_bytes(left)}", "omit --memory-budget"))
        common = dict(lookahead=a, kept_extra_bytes=s.kept_extra_bytes or None)
        if disk is None or (user is None and keeps_all(s, t)):  # nothing read from disk: no read buffers either
            plan = plan_pool(s.layer_bytes, resident_bytes=s.resident_bytes, fraction=0.0, **common)
            budget = all_in(s) if user is None else user
        else:
            budget = room(s, t) - s.read_work_bytes if user is None else \
                (user if keeps_all(s, t) else min(user, room(s, t) - s.read_work_bytes))
            plan = plan_pool(s.layer_bytes, resident_bytes=s.resident_bytes + s.read_buffer_bytes,
                             budget_bytes=budget, disk=disk, unified=True, **common)
        pools.append(plan)
        budgets.append(budget)
        held = plan.device_bytes + plan.host_bytes + (s.read_work_bytes if plan.disk_layers else 0)
        left = share - others(s, t, 0) - held
        if not fix_kv_tokens and s.kv_bytes_per_token:
            kv = min(kv, max(kv_floor(t), (left // s.kv_bytes_per_token) // block_size * block_size))
    for s, plan in zip(stages, pools):
        lines.append(_lines(s, plan, a=a, t=t, kv=kv, worker=worker_bytes, slack=slack, share=share,
                            swap=swap_tokens, max_running=max_running))
    return ServingPlan(lookahead=a, max_batch_tokens=t, kv_cache_tokens=kv, pools=tuple(pools),
                       weight_budgets=tuple(budgets), free_bytes=free_bytes, ranks=ranks,
                       lines=tuple(lines), where=where)


def _lines(s: StageShape, plan: PoolPlan, *, a: int, t: int, kv: int, worker: int, slack: int, share: int,
           swap: int, max_running: int) -> tuple[tuple[str, int], ...]:
    n, disk = len(s.layer_bytes), plan.disk_layers
    kept = [i for i in range(n) if i not in disk]
    extra = s.kept_extra_bytes or (0,) * n
    slots = min(a + 1, len(disk)) if disk else 0
    out = [("interpreter, libraries and runtime", worker),
           (s.resident_what, s.resident_bytes),
           (f"{len(kept)} of {n} layers kept in memory", sum(s.layer_bytes[i] for i in kept)),
           ("their packed copies", sum(extra[i] for i in kept)),
           (f"{slots} prefetch slot(s), lookahead {a}", slots * plan.slot_bytes),
           (f"read buffers ({len(disk)} layer(s) read from disk each pass)", s.read_buffer_bytes if disk else 0),
           ("the reads' working copies", s.read_work_bytes if disk else 0),
           (f"KV cache, {kv} tokens", kv * s.kv_bytes_per_token),
           (f"activations of a step at {t} tokens", s.activation_bytes(t, max_running))]
    if swap:
        out.append((f"KV swap space, {swap} tokens", swap * s.kv_bytes_per_token))
    out.append(("allocator slack", slack))
    total = sum(b for _, b in out)
    return (*out, ("total", total), ("this rank's share of the limit", share))


def _infeasible(needs: list[tuple[float, bool, int]], chosen: tuple[int, int], *, free_bytes: int, ranks: int,
                where: str, fixes: Sequence[str], weight_budget: int | None, fix_tokens: bool,
                fix_kv: bool) -> PlanInfeasibleError:
    """One line: what the least-memory plan needs, what the limit leaves, the cheapest change. ``needs``: per stage
    (a rank's share that fits, whether it fits but for the weights budget, the least weights)."""
    per_rank = int(max(n for n, _, _ in needs))
    total = per_rank * ranks
    a, t = chosen
    changes: list[str] = []
    if weight_budget is not None and all(ok for _, ok, _ in needs):
        least = max(w for _, _, w in needs)
        return PlanInfeasibleError(
            f"--memory-budget {format_bytes(weight_budget)} is too small: the least-memory plan of each worker's "
            f"weights (layers read from disk, lookahead {a}: embedding, head, norms, the prefetch slot(s) and read "
            f"buffers) needs at least {format_bytes(least)}; raise it to {format_bytes(least)} or more, or omit it "
            "(the planner then chooses)",
            needed_bytes=least, budget_bytes=weight_budget,
            suggestions=(f"raise --memory-budget to at least {format_bytes(least)}", "omit --memory-budget"))
    if fix_tokens and t > TOKEN_BUDGET_FLOOR:
        changes.append("a smaller --max-batch-tokens (or omit it: the planner chooses)")
    if fix_kv:
        changes.append("a smaller --kv-cache-tokens (or omit it: the planner chooses)")
    changes += list(fixes)
    what = (f"the least-memory serving plan (every layer read from disk, lookahead {a}, max_batch_tokens {t}) "
            f"needs {format_bytes(total)} ({format_bytes(per_rank)} per worker x {ranks}, interpreter included) but "
            f"{where} leaves {format_bytes(free_bytes)}")
    fix = "; cheapest change: " + (", or ".join(changes[:3]) if changes else "a larger memory limit")
    return PlanInfeasibleError(what + fix, needed_bytes=total, budget_bytes=free_bytes,
                               suggestions=tuple(changes) or ("a larger memory limit",))
