"""Elixir's search space and its greedy Pareto frontier (the exact search is in ``exact``).

Part of :mod:`tightfit.planner.elixir` (the search space and its two searches). Both produce :class:`Candidate` objects priced by
:mod:`tightfit.planner.elixir.sim`.

* Exact: branch and bound over every family of plans, in :mod:`tightfit.planner.elixir.exact`
  (its result equals brute-force enumeration).
* Greedy frontier (large spaces, e.g. GPT-2 20B: 26 blocks): for each grouping, start from the
  fastest plan (best mode per unit, nothing offloaded or recomputed) and repeatedly apply the
  change that loses the least time per byte saved (lazy re-evaluation), recording every plan on
  the way down to the least-memory one. The pool of recorded plans, with their prefetch variants
  and their "stripped" variants (offload and recompute removed), does not depend on the budget:
  the answer for a budget is the fastest pool plan under it, so a smaller budget can never give
  a faster plan.

With a disk tier (state tiers 2 and 3 in :attr:`Space.offload`) the greedy pool also holds every plan of the
same search without it, so adding the tier never makes the answer slower; its descents add a "to disk"
move (optimizer state, tier 2), a "parameters to disk" move (master weights and parameters too, tier 3) and a
"gradients to disk" move (tier 4), and an offload the host cannot hold is repaired by moving host units one tier
deeper (host -> 2 -> 3 -> 4), the least time lost per host byte saved first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from tightfit.planner.elixir.disk import (
    DISK_CODES,
    DISK_STAGING_BYTES,
    Tier,
    disk_bytes,
    host_bytes,
)
from tightfit.planner.elixir.evaluator import Candidate, Evaluator
from tightfit.planner.elixir.sim import MODES, Context
from tightfit.planner.memo import LruMemo

__all__ = ["Space", "Candidate", "Evaluator", "host_bytes", "disk_bytes", "greedy_pool", "pareto", "count_space",
           "groupings", "compositions", "least_memory_choice", "pool_memo"]

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True, slots=True)
class Space:
    """What the search may choose from (built from ``ElixirConstraints``)."""

    modes: tuple[str, ...]
    offload: tuple[int, ...]           # state tiers a unit may take: (0,), (1,), (0, 1), (0, 1, 2), (1, 2), (2,)
    checkpointing: bool
    depths: tuple[int, ...]
    unit_blocks: tuple[int, ...] | None  # blocks per unit to try in greedy mode (None: auto)


def compositions(n: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every split of ``n`` blocks into contiguous units (2**(n-1) of them)."""
    for cuts in itertools.product((False, True), repeat=max(0, n - 1)):
        units, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                units.append((start, i))
                start = i
        units.append((start, n))
        yield tuple(units)


def count_space(ctx: Context, space: Space) -> int:
    """Number of complete plans in the exact space (to decide exact vs greedy)."""
    n = len(ctx.numel)
    per_unit = len(space.modes) * len(space.offload)
    ck = 2 ** sum(ctx.checkpointable) if space.checkpointing else 1
    # Compositions of n into k parts: C(n-1, k-1).
    from math import comb

    return sum(comb(n - 1, k - 1) * per_unit ** k for k in range(1, n + 1)) * ck * len(space.depths) ** 2


def least_memory_choice(ev: Evaluator, space: Space, a: int, b: int) -> tuple[str, int]:
    """The allowed (mode, offload) of blocks ``[a, b)`` that uses the least memory at every point of the step
    (resharded and offloaded when allowed: nothing resident, gathered only while live)."""
    return min(((m, o) for m in space.modes for o in space.offload),
               key=lambda mo: (lambda t: (t.state, t.opt_tmp, t.kept))(ev.terms(a, b, *mo)))


def groupings(ctx: Context, unit_blocks: tuple[int, ...] | None) -> list[tuple[tuple[int, int], ...]]:
    """Candidate groupings for the greedy search.

    Blocks with under 10% of the median block's parameters (position embeddings, final norms,
    parameter-free heads) are merged into their next neighbour first: a unit of its own would cost
    a collective's latency for a few kilobytes. Then runs of ``k`` merged blocks form one unit, for
    ``k`` in ``unit_blocks`` (auto: 1, 2 and 4; bigger units mean fewer, larger collectives and a
    larger gathered working set: Elixir's chunk-size trade-off).
    """
    n = len(ctx.numel)
    sizes = sorted(ctx.numel)
    median = sizes[n // 2]
    base: list[list[int]] = []
    pending: list[int] = []
    for i in range(n):
        pending.append(i)
        if ctx.numel[i] >= 0.1 * median or i == n - 1:
            base.append(pending)
            pending = []
    if len(base) > 1 and sum(ctx.numel[i] for i in base[-1]) < 0.1 * median:
        base[-2].extend(base.pop())
    # Every block its own unit: the least-memory grouping (the smallest gathered working set).
    out: list[tuple[tuple[int, int], ...]] = [tuple((i, i + 1) for i in range(n))] if unit_blocks is None else []
    for k in unit_blocks or (1, 2, 4):
        if k > len(base) and out:
            continue
        units = []
        for j in range(0, len(base), k):
            run = [i for grp in base[j:j + k] for i in grp]
            units.append((run[0], run[-1] + 1))
        g = tuple(units)
        if g not in out:
            out.append(g)
    return out


# The pool does not depend on the device budget, so a search at several budgets (a frontier, a budget sweep,
# the strategy's re-plan) computes it once: keyed on every input of the search, the pool and the evaluations
# it took.
pool_memo = LruMemo(4)


def greedy_pool(ev: Evaluator, space: Space, host_budget: float, progress: Progress | None = None,
                rounds: int = 2, max_points: int = 32, *, disk_budget: float = math.inf) -> list[Candidate]:
    """Every plan visited by the greedy descents plus their neighbourhoods (budget-independent).

    Memoised on its inputs (``ev.ctx.memo_key()``, ``space``, the host and disk budgets, ``rounds``,
    ``max_points``): a repeated search returns the same candidates and adds the evaluations they took to
    ``ev.evaluations``, so the plans built from it are the same too (:data:`pool_memo`).

    After the descents, ``rounds`` times: every plan on the current Pareto frontier (at most
    ``max_points`` of them, evenly spread) adds its neighbours: each single change undone (faster,
    more memory), each swap of two changes of a kind (offload unit ``v`` instead of ``u``,
    checkpoint block ``j`` instead of ``i``: which ones matters), other modes and prefetch depths.
    They fill the gaps between the descent's steps, where a budget may fall.

    With the disk tier in ``space``, the pool of the same search without it comes first (a superset: the
    tier can only add faster plans under the same budgets), then this search's own plans.
    """
    key = (ev.ctx.memo_key(), space, float(host_budget), float(disk_budget), rounds, max_points)
    hit = pool_memo.get(key)
    if hit is not None:
        ev.evaluations += hit[1]
        if progress:
            progress(1, 1, "done (the pool of the same search, reused)")
        return list(hit[0])
    before = ev.evaluations
    pool = _search_pool(ev, space, host_budget, progress, rounds, max_points, disk_budget)
    pool_memo.put(key, (tuple(pool), ev.evaluations - before))
    return pool


def _search_pool(ev: Evaluator, space: Space, host_budget: float, progress: Progress | None, rounds: int,
                 max_points: int, disk_budget: float) -> list[Candidate]:
    base: list[Candidate] = []
    if has_disk(space) and any(o not in DISK_CODES for o in space.offload):
        without = replace(space, offload=tuple(o for o in space.offload if o not in DISK_CODES))
        base = greedy_pool(ev, without, host_budget, progress, rounds, max_points)
    return base + _pool(ev, space, host_budget, disk_budget, progress, rounds, max_points)


def _pool(ev: Evaluator, space: Space, host_budget: float, disk_budget: float, progress: Progress | None,
          rounds: int, max_points: int) -> list[Candidate]:
    seen: set[tuple] = set()
    ctx = ev.ctx
    pool: list[Candidate] = []
    gs = groupings(ctx, space.unit_blocks)
    d0 = space.depths[0]
    for g_i, units in enumerate(gs):
        if progress:
            progress(g_i, len(gs) + rounds + 1, f"greedy descent over {len(units)} units")
        visited = _descend(ev, space, units, d0, d0, host_budget, disk_budget)
        pool.extend(c for c in visited if c.fits(host_budget, disk_budget))
        if Tier.DISK_PARAMS in space.offload:
            # The descent's least-memory plan with every offloaded unit in tier 3: the least host a grouping can
            # have, where the host binds so hard that no single move repairs it.
            last = visited[-1]
            deepest = Tier.DISK_GRADS if Tier.DISK_GRADS in space.offload else Tier.DISK_PARAMS
            deep = ev.make(last.units, last.modes, [deepest if o else o for o in last.offload], last.ckpt, last.df, last.db)
            if deep.fits(host_budget, disk_budget):
                pool.append(deep)
    seen.update(_config(c) for c in pool)
    for r in range(rounds):
        if progress:
            progress(len(gs) + r, len(gs) + rounds + 1, f"refining the frontier ({r + 1}/{rounds})")
        pool.extend(c for c in _neighbours(ev, space, _spread(pareto(pool), max_points), seen)
                    if c.fits(host_budget, disk_budget))
    stripped = []
    no_off = False in space.offload
    for c in pareto(pool):
        if (c.changes and no_off) or (c.changes and any(c.ckpt)):
            off = tuple(False for _ in c.offload) if no_off else c.offload
            stripped.append(ev.make(c.units, c.modes, off, tuple(False for _ in c.ckpt), c.df, c.db))
    pool.extend(stripped)
    if progress:
        progress(len(gs) + rounds + 1, len(gs) + rounds + 1, "done")
    return [c for c in pool if c.fits(host_budget, disk_budget)]


def _config(c: Candidate) -> tuple:
    return (c.units, c.modes, c.offload, c.ckpt, c.df, c.db)


def _spread(points: list, k: int) -> list:
    if len(points) <= k:
        return points
    return [points[round(i * (len(points) - 1) / (k - 1))] for i in range(k)]


def _neighbours(ev: Evaluator, space: Space, points: list[Candidate], seen: set[tuple]) -> list[Candidate]:
    ctx = ev.ctx
    out: list[Candidate] = []

    def add(c: Candidate, modes: Sequence[str], offs: Sequence[int], ck: Sequence[bool], df: int, db: int) -> None:
        key = (c.units, tuple(modes), tuple(offs), tuple(ck), df, db)
        if key not in seen:
            seen.add(key)
            out.append(ev.make(c.units, modes, offs, ck, df, db))

    for c in points:
        k = len(c.units)
        for df in space.depths:
            for db in space.depths:
                add(c, c.modes, c.offload, c.ckpt, df, db)
        for u in _spread(list(range(k)), 16):
            for m in space.modes:
                if m != c.modes[u]:
                    add(c, c.modes[:u] + (m,) + c.modes[u + 1:], c.offload, c.ckpt, c.df, c.db)
        # Swaps: at most 8 x 8 per kind, spread over the model (neighbouring identical layers differ
        # only by their overlap position, so a spread sample finds the useful ones).
        on = _spread([u for u in range(k) if c.offload[u]], 8)
        off = _spread([u for u in range(k) if not c.offload[u]], 8)
        if False in space.offload:
            for u in on:
                flip = list(c.offload)
                flip[u] = False
                add(c, c.modes, flip, c.ckpt, c.df, c.db)
                for v in off:
                    swap = list(flip)
                    swap[v] = True
                    add(c, c.modes, swap, c.ckpt, c.df, c.db)
        if has_disk(space):  # between the host and the disk: which units keep what on the host
            for u in _spread([u for u in range(k) if c.offload[u] >= Tier.HOST], 16):
                for code in (Tier.HOST, *DISK_CODES):
                    if code != c.offload[u] and code in space.offload:
                        tier = list(c.offload)
                        tier[u] = code
                        add(c, c.modes, tier, c.ckpt, c.df, c.db)
        ck_on = _spread([i for i, f in enumerate(c.ckpt) if f], 8)
        ck_off = _spread([i for i, f in enumerate(c.ckpt) if not f and ctx.checkpointable[i]], 8)
        for i in ck_on:
            ck_flip = list(c.ckpt)
            ck_flip[i] = False
            add(c, c.modes, c.offload, ck_flip, c.df, c.db)
            for j in ck_off:
                ck_swap = list(ck_flip)
                ck_swap[j] = True
                add(c, c.modes, c.offload, ck_swap, c.df, c.db)
    return out


def _proxy(ev: Evaluator, c: Candidate) -> float:
    """An additive memory measure (state + kept parameters + activations) that orders plateau moves."""
    ctx = ev.ctx
    total = 0.0
    for (a, b), m, o in zip(c.units, c.modes, c.offload):
        t = ev.terms(a, b, m, o)
        total += t.state + (t.gathered if t.kept else 0.0)
    for i, flag in enumerate(c.ckpt):
        total += ctx.ckpt[i] if flag else ctx.saved[i]
    return total


def _host_to_disk(ev: Evaluator, c: Candidate, host_budget: float, disk_budget: float,
                  allowed: Sequence[int] = (Tier.DISK,)) -> Candidate | None:
    """``c`` with host units moved one tier deeper (host -> optimizer state on disk -> master weights and
    parameters on disk too, as far as ``allowed``) until its host bytes fit, the least time lost per host byte
    saved first; ``None`` where even that does not fit both budgets.

    Moving unit ``u`` from the host to tier 2 changes only its optimizer step (the schedule adds the optimizer
    steps after everything else), so each unit's loss per byte is independent of the others; tier 3 adds reads
    ahead of forward and backward, which the ordering prices per unit (one ordering, one pricing at the end).
    """
    order = []
    for u, ((a, b), m, o) in enumerate(zip(c.units, c.modes, c.offload)):
        src = ev.terms(a, b, m, o)
        for code in allowed:
            if Tier.HOST <= o < code:  # one tier deeper or more, from the host on
                dst = ev.terms(a, b, m, code)
                saved = src.host - dst.host
                loss = dst.opt + dst.disk_f + dst.disk_b - src.opt - src.disk_f - src.disk_b
                if saved > 0:
                    order.append((loss / saved, code, u, saved))
    order.sort()
    over = c.host - host_budget
    if c.disk == 0 and not ev.ctx.unified:
        over += DISK_STAGING_BYTES  # the first disk unit brings the staging area to the host
    tiers = list(c.offload)
    # Tier-3 units also bring two parameter shards to the host while used (see host_bytes): the largest counts.
    unified = ev.ctx.unified
    fetched = 0.0 if unified else 2 * max((ev.terms(a, b, m, o).fetch + ev.terms(a, b, m, o).grad_buf
                                           for (a, b), m, o in zip(c.units, c.modes, c.offload)), default=0.0)

    def move(u: int, code: int, saved: float) -> None:
        nonlocal over, fetched
        (a, b), m = c.units[u], c.modes[u]
        tiers[u] = code
        over -= saved
        if code >= Tier.DISK_PARAMS and not unified:
            t = ev.terms(a, b, m, code)
            new = max(fetched, 2 * (t.fetch + t.grad_buf))
            over += new - fetched
            fetched = new

    moved: set[int] = set()
    for _, code, u, saved in order:
        if over <= 0:
            break
        if u in moved:
            continue
        # A unit's options ordered by loss per byte: take the first; where a deeper one saves more and is
        # needed, the pass below takes it.
        moved.add(u)
        move(u, code, saved)
    for deep in (Tier.DISK_PARAMS, Tier.DISK_GRADS):
        if over <= 0 or deep not in allowed:
            continue
        for u, ((a, b), m, o) in enumerate(zip(c.units, c.modes, list(tiers))):
            if over <= 0:
                break
            if Tier.HOST <= o < deep:
                move(u, deep, ev.terms(a, b, m, o).host - ev.terms(a, b, m, deep).host)
    if tiers == list(c.offload):
        return None
    out = ev.make(c.units, c.modes, tiers, c.ckpt, c.df, c.db)
    return out if out.fits(host_budget, disk_budget) else None


def _fastest_modes(ev: Evaluator, space: Space, units: tuple[tuple[int, int], ...], offs: list[int],
                   ckpt: list[bool], df: int, db: int) -> Candidate:
    """Fastest modes by coordinate descent (two passes settle: a unit's best mode depends only on its neighbours)."""
    modes = ["keep" if "keep" in space.modes else space.modes[0]] * len(units)
    cur = ev.make(units, modes, offs, ckpt, df, db)
    for _ in range(2):
        for u in range(len(units)):
            for m in space.modes:
                if m == modes[u]:
                    continue
                trial = list(modes)
                trial[u] = m
                c = ev.make(units, trial, offs, ckpt, df, db)
                if c.key < cur.key:
                    cur, modes = c, trial
    return cur


def _descend(ev: Evaluator, space: Space, units: tuple[tuple[int, int], ...], df: int, db: int,
             host_budget: float, disk_budget: float = math.inf) -> list[Candidate]:
    ctx = ev.ctx
    k = len(units)
    n_blocks = len(ctx.numel)
    off0 = space.offload[0]
    cur = _fastest_modes(ev, space, units, [off0] * k, [False] * n_blocks, df, db)
    visited = [cur]

    def moves(c: Candidate) -> list[tuple[str, int, object]]:
        out: list[tuple[str, int, object]] = []
        for u in range(k):
            for m in space.modes:
                if m != c.modes[u]:
                    out.append(("mode", u, m))
            if not c.offload[u] and True in space.offload:
                out.append(("offload", u, True))
            if c.offload[u] not in DISK_CODES and Tier.DISK in space.offload:
                out.append(("disk", u, Tier.DISK))
            if c.offload[u] != Tier.DISK_PARAMS and Tier.DISK_PARAMS in space.offload:
                out.append(("disk", u, Tier.DISK_PARAMS))
            if c.offload[u] != Tier.DISK_GRADS and Tier.DISK_GRADS in space.offload:
                out.append(("disk", u, Tier.DISK_GRADS))
        if space.checkpointing:
            for i in range(n_blocks):
                if ctx.checkpointable[i] and not c.ckpt[i]:
                    out.append(("ckpt", i, True))
        return out

    def apply(c: Candidate, mv: tuple[str, int, object]) -> Candidate:
        kind, idx, val = mv
        md, of, ck = list(c.modes), list(c.offload), list(c.ckpt)
        if kind == "mode":
            md[idx] = str(val)
        elif kind == "offload":
            of[idx] = True
        elif kind == "disk":
            of[idx] = int(val)  # type: ignore[call-overload]
        else:
            ck[idx] = True
        return ev.make(units, md, of, ck, df, db)

    stale: dict[tuple[str, int, object], float] = {}
    cur_proxy = _proxy(ev, cur)
    steps = 0
    limit = 4 * (k + n_blocks) + 8
    while steps < limit:
        steps += 1
        if steps % 8 == 0:
            stale.clear()  # full refresh now and then: scores drift as the plan changes
        options = moves(cur)
        options.sort(key=lambda mv: stale.get(mv, float("-inf")))
        fresh: dict[tuple[str, int, object], tuple[float, Candidate, float]] = {}
        for mv in options:
            if fresh and min(v[0] for v in fresh.values()) <= stale.get(mv, float("-inf")):
                break
            c = apply(cur, mv)
            if has_disk(space) and not c.fits(host_budget, disk_budget):
                # the host binds: the disk makes room
                c = _host_to_disk(ev, c, host_budget, disk_budget,
                                  tuple(x for x in DISK_CODES if x in space.offload)) or c
            proxy = _proxy(ev, c)
            d_peak = cur.peak - c.peak
            d_mem = d_peak if d_peak > 1e-6 * cur.peak else 0.01 * (cur_proxy - proxy)
            if d_mem <= 0 or not c.fits(host_budget, disk_budget):
                stale[mv] = float("inf")
                continue
            score = (c.time - cur.time) / d_mem
            stale[mv] = score
            fresh[mv] = (score, c, proxy)
        if not fresh:
            break
        _, cur, cur_proxy = min(fresh.values(), key=lambda v: v[0])
        visited.append(cur)
    return visited


def has_disk(space: Space) -> bool:
    """Whether ``space`` lets units keep state on disk (tier 2 or 3)."""
    return any(code in space.offload for code in DISK_CODES)


def pareto(cands: Sequence[Candidate]) -> list[Candidate]:
    """Plans no other plan beats on both peak memory and time, sorted by peak (ascending)."""
    out: list[Candidate] = []
    for c in sorted(cands, key=lambda c: (c.peak, c.key)):
        if not out or c.key < out[-1].key:
            out.append(c)
    return out


def modes_ok(modes: Sequence[str]) -> None:
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unit mode {m!r} is not one of {MODES}")
