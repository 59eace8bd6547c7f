"""Elixir's exact search: branch and bound over every family of plans.

Part of :mod:`tightfit.planner.elixir`. A *family* is a grouping of blocks into units and a pair of
prefetch depths; inside one, a depth-first search over the units' (mode, offload, checkpoint subset)
choices, pruned by two lower bounds that are valid because the cost model is monotone: the memory
bound prices every undecided unit at the field-wise least bytes over its choices and every undecided
block at its least memory at every point (see :func:`tightfit.planner.elixir.sim.peak`), the time
bound at the shortest of each duration with nothing recomputed. The result equals brute-force enumeration (tests check it
on random small instances, and a property test on random problems).

What keeps it fast without giving up exactness:

* **Dominated choices are never branched on.** Two (mode, offload) choices of a unit with identical
  durations and device bytes differ only in host bytes and in how many changes the plan makes; the
  one with more of both can never be the answer (the plan's key prefers fewer changes). Where host
  and device are one memory (a CPU "device"), offloading is exactly that (copies are no-ops), which
  halves the choices per unit. Likewise checkpointing a block whose checkpoint keeps as many bytes
  as it saves (a parameter-free dropout or head) only adds recompute time.
  With a disk tier, a unit's host and disk choices of equal durations are both kept unless one
  uses no more host bytes, no more disk bytes and no more changes than the other (Pareto).
* **Fast choices first**, so the first complete plan is a good incumbent.
* **Only the families that can be shown matter.** The solver reports the best plan and the next
  ``keep - 1`` families (by :attr:`Candidate.family`); families are searched in order of their
  root time bound, and a family's search is cut off at the time of the ``keep``-th best other
  family found so far: a plan slower than that can never be listed. Families whose root bound is
  already slower are skipped (``None``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tightfit.planner.elixir.disk import DISK_STAGING_BYTES, in_flight
from tightfit.planner.elixir.sim import UnitTerms, peak, step_time
from tightfit.planner.elixir.space import (
    Candidate,
    Evaluator,
    Progress,
    Space,
    compositions,
    )

__all__ = ["exhaustive", "family_of"]

_TOL = 1 + 1e-9  # relative tolerance of equal times (the key rounds to 9 significant digits), and of the peak bounds
# against the budget (a bound sums the same bytes in another order than the plan's own peak: it may round above it)


def family_of(units: Sequence[tuple[int, int]]) -> str:
    """:attr:`Candidate.family` of a grouping (it depends on the units only)."""
    return Candidate(units=tuple(units), modes=(), offload=(), ckpt=(), df=0, db=0, time=0.0, peak=0.0,
                     host=0.0).family


def exhaustive(ev: Evaluator, space: Space, budget: float, host_budget: float, progress: Progress | None = None,
               keep: int | None = None, *, disk_budget: float = math.inf) -> dict[str, Candidate | None]:
    """Best feasible candidate of every family (``None`` where nothing fits), by branch and bound: peak within
    ``budget`` per device, host bytes within ``host_budget`` and disk bytes within ``disk_budget`` per rank.

    With ``keep``, exact only for the ``keep`` best families by :attr:`Candidate.family` (the best plan
    and its runner-ups); any other family may come back ``None`` or with a plan that is not its best.
    """
    ctx = ev.ctx
    n = len(ctx.numel)
    families = [(g, df, db) for g in compositions(n) for df in space.depths for db in space.depths]
    prepared = [_Family(ev, space, units, df, db, budget) for units, df, db in families]
    order = sorted(range(len(prepared)), key=lambda i: prepared[i].root_time)
    out: dict[str, Candidate | None] = {}
    best_of: dict[str, Candidate] = {}  # best plan found so far per Candidate.family
    for done, i in enumerate(order):
        if progress:
            progress(done, len(families), "exhaustive search")
        fam = prepared[i]
        cutoff = math.inf
        if keep is not None:
            name = fam.family
            if name in best_of:
                cutoff = best_of[name].time
            others = sorted(c.time for f, c in best_of.items() if f != name)
            if len(others) >= keep:
                cutoff = min(cutoff, others[keep - 1])
        best = None
        if fam.root_peak <= budget * _TOL and fam.root_time <= cutoff * _TOL:
            best = fam.search(host_budget, cutoff, disk_budget)
        out[fam.label] = best
        if best is not None and (best.family not in best_of or best.key < best_of[best.family].key):
            best_of[best.family] = best
    if progress:
        progress(len(families), len(families), "exhaustive search")
    return out


def _bound_terms(ev: Evaluator, space: Space, a: int, b: int) -> tuple[UnitTerms, UnitTerms]:
    """(least-memory terms, shortest-duration terms) over the allowed choices of one unit.

    Both are field-wise minima, so at every point of the step the unit adds no more than any real choice.
    The memory one is not one real choice: with calibrated costs a replicated unit on one rank's shard group
    holds no gathered copy or unsharded gradients (aliased) while a resharded one holds less state, and the
    single least-state choice priced the gathered copy where the replicated plan has none (found by the
    property test: a feasible plan pruned at world size 1). ``state - grad_state`` (the state the forward
    holds when gradients exist only from their backward on) takes its own minimum through ``grad_state``;
    ``kept=False`` is the least at every point for the same gathered bytes.
    """
    # A replicated unit of a plan that runs on DDP holds no copies at all: its terms count among the minima too,
    # where plans may run on DDP (Evaluator.on_ddp).
    on_ddp = (False, True) if ev.ctx.alias_replicated else (False,)
    opts = [ev.terms(a, b, m, o, ddp) for m in space.modes for o in space.offload for ddp in on_ddp]
    state = min(t.state for t in opts)
    red_buf = min(t.red_buf for t in opts)
    # Two terms peak() prices are not monotone in one field: a unit's own backward holds ``grads - red_buf``
    # (calibrated) or ``grads``, and the unit before it holds this one's ``grad_buf`` in place of its ``red_buf``
    # where gradients are written to disk on a unified device. Their bound fields are set so that both are minima:
    # min(g - r) + min(r) <= min(g), and the buffer the unit before holds is the least of any choice's.
    grads = min(t.grads for t in opts) and min(t.grads - t.red_buf for t in opts) + red_buf
    held = min(t.grad_buf if ev.ctx.unified and t.grad_buf else t.red_buf for t in opts)
    mem = UnitTerms(
        cf=0.0, cb=0.0, h2d_f=0.0, ag_f=0.0, h2d_b=0.0, ag_b=0.0, red=0.0, d2h=0.0, opt=0.0,
        state=state, host=0.0, gathered=min(t.gathered for t in opts), grads=grads,
        red_buf=red_buf, opt_tmp=min(t.opt_tmp for t in opts), kept=False,
        grad_state=state - min(t.state - t.grad_state for t in opts), grad_buf=held if ev.ctx.unified else 0.0,
    )
    fast = UnitTerms(
        cf=min(t.cf for t in opts), cb=min(t.cb for t in opts),
        h2d_f=min(t.h2d_f for t in opts), ag_f=min(t.ag_f for t in opts), h2d_b=min(t.h2d_b for t in opts),
        ag_b=min(t.ag_b for t in opts), red=min(t.red for t in opts), d2h=min(t.d2h for t in opts),
        opt=min(t.opt for t in opts), state=0.0, host=0.0, gathered=0.0, grads=0.0, red_buf=0.0, opt_tmp=0.0,
        kept=False,
    )
    return mem, fast


_OFF_DEVICE = ("host", "disk", "disk_io")  # UnitTerms fields that do not act on the device or the step time


def _choices(ev: Evaluator, space: Space, a: int, b: int) -> list[tuple[str, int, tuple[bool, ...], UnitTerms]]:
    """The unit's undominated (mode, offload, checkpoint subset) choices, fastest first."""
    ctx = ev.ctx
    kept: dict[tuple, list[tuple[int, float, float, str, int]]] = {}
    for m in space.modes:
        for o in space.offload:
            t = ev.terms(a, b, m, o)
            # Everything but the host and disk bytes: equal signatures behave identically on the device.
            sig = tuple(getattr(t, f) for f in UnitTerms.__slots__ if f not in _OFF_DEVICE)  # type: ignore[attr-defined]
            # A choice a DDP plan can be made of is not interchangeable with one that has the same FSDP2 terms.
            sig += (ev.on_ddp((m,), (o,), ()),)
            mine = (int(o), t.host, t.disk, m, o)
            same = kept.setdefault(sig, [])
            if any(all(x <= y for x, y in zip(other[:3], mine[:3])) for other in same):
                continue  # another choice is no worse in changes, host bytes and disk bytes
            same[:] = [other for other in same if not all(x <= y for x, y in zip(mine[:3], other[:3]))]
            same.append(mine)
    # Checkpointing a block that keeps as many bytes as it saves only adds recompute (and a change).
    flags: list[tuple[bool, ...]] = [(False, True) if space.checkpointing and ctx.checkpointable[i] and ctx.ckpt[i] < ctx.saved[i]
             else (False,) for i in range(a, b)]
    out = []
    for _, _, _, m, o in (c for same in kept.values() for c in same):
        t = ev.terms(a, b, m, o)
        base = t.cf + t.cb + t.opt + t.h2d_f + t.ag_f + t.h2d_b + t.ag_b + t.red + t.d2h
        for subset in _product(flags):
            rc = sum(ctx.rfwd[i] for i, f in zip(range(a, b), subset) if f)
            # A choice that a DDP plan can be made of is bounded by its DDP terms (no more memory, the same
            # durations) until the leaf prices the whole plan with the terms it really runs with.
            bound = ev.terms(a, b, m, o, True) if ev.on_ddp((m,), (o,), subset) else t
            out.append((base + rc, int(o) + sum(subset), m, o, subset, bound))
    out.sort(key=lambda c: (c[0], c[1]))
    return [(m, o, s, t) for _, _, m, o, s, t in out]


def _product(flags: list[tuple[bool, ...]]) -> list[tuple[bool, ...]]:
    acc: list[tuple[bool, ...]] = [()]
    for f in flags:
        acc = [p + (x,) for p in acc for x in f]
    return acc


class _Family:
    """One family's bounds, prepared once (root bounds order the families before any search)."""

    def __init__(self, ev: Evaluator, space: Space, units: tuple[tuple[int, int], ...], df: int, db: int,
                 budget: float) -> None:
        ctx = ev.ctx
        self.ev, self.units, self.df, self.db, self.budget = ev, units, df, db, budget
        self.family = family_of(units)
        self.label = "|".join(f"{a}-{b}" for a, b in units) + f"@{df}/{db}"
        self.bounds = [_bound_terms(ev, space, a, b) for a, b in units]
        self.choices = [_choices(ev, space, a, b) for a, b in units]
        n_blocks = len(ctx.numel)
        # Undecided blocks are None: peak() prices them at their least memory at every point (checkpointed
        # in the prefix the later blocks see, not recomputed at their own backward), a true lower bound.
        # Pricing them as checkpointed was not one: recompute raises a block's own backward peak when its
        # forward transient exceeds its backward one, which pruned feasible plans.
        self.undecided: list[bool | None] = [None if ctx.checkpointable[i] and space.checkpointing else False
                                             for i in range(n_blocks)]
        ul = list(units)
        self.root_peak = peak(ctx, ul, [m for m, _ in self.bounds], self.undecided, df, db)
        self.root_time = step_time(ctx, ul, [f for _, f in self.bounds], [False] * n_blocks, df, db)

    def search(self, host_budget: float, cutoff: float, disk_budget: float = math.inf) -> Candidate | None:
        ev, units, df, db, budget = self.ev, self.units, self.df, self.db, self.budget
        ctx = ev.ctx
        k = len(units)
        bounds, choices = self.bounds, self.choices
        best: list[Candidate | None] = [None]
        terms: list[UnitTerms] = [bounds[u][0] for u in range(k)]
        fast: list[UnitTerms] = [bounds[u][1] for u in range(k)]
        modes: list[str] = [""] * k
        offs: list[int] = [0] * k
        # The disk tier's staging area is host memory once any unit is on disk (in the device peak when unified).
        staging = 0.0 if ctx.unified else DISK_STAGING_BYTES
        undecided = self.undecided
        ck_mem: list[bool | None] = list(undecided)
        ck_time = [False] * len(ctx.numel)  # undecided blocks not recomputed (least time)
        ul = list(units)

        # host_bytes' shards in flight (tier 3's fetched parameters, tier 4's gradients being written): the two
        # largest units', on the host where it is not the device; ``fx`` holds the two largest so far.
        counted = 0.0 if ctx.unified else 1.0

        def visit(u: int, host: float, disk: float, fx: tuple[float, float]) -> None:
            if u == k:
                decided = [bool(x) for x in ck_mem]  # every unit chose its subset: no None left
                real = ev.terms_for(ul, modes, offs, decided)
                cand = Candidate(units=units, modes=tuple(modes), offload=tuple(offs), ckpt=tuple(decided), df=df,
                                 db=db, time=step_time(ctx, ul, real, decided, df, db),
                                 peak=peak(ctx, ul, real, decided, df, db), host=host + counted * sum(fx), disk=disk)
                ev.evaluations += 1
                if cand.peak <= budget and (best[0] is None or cand.key < best[0].key):
                    best[0] = cand
                return
            a, b = units[u]
            for m, o, subset, t in choices[u]:
                extra = staging if t.disk > 0 and disk == 0 else 0.0
                fx_u = in_flight((*fx, t.fetch + t.grad_buf))
                if host + t.host + extra + counted * sum(fx_u) > host_budget or disk + t.disk > disk_budget:
                    continue
                terms[u] = t
                fast[u] = t
                for i, flag in zip(range(a, b), subset):
                    ck_mem[i] = flag
                    ck_time[i] = flag
                ev.evaluations += 1
                if u + 1 < k:
                    inc = best[0]
                    limit = cutoff if inc is None or inc.time > cutoff else inc.time
                    if limit < math.inf and step_time(ctx, ul, fast, ck_time, df, db) > limit * _TOL:
                        continue
                    if peak(ctx, ul, terms, ck_mem, df, db) > budget * _TOL:  # a bound: summed in another order
                        continue
                modes[u], offs[u] = m, o
                visit(u + 1, host + t.host + extra, disk + t.disk, fx_u)
            # restore the bounds of this unit for the siblings above
            terms[u] = bounds[u][0]
            fast[u] = bounds[u][1]
            for i in range(a, b):
                ck_mem[i] = undecided[i]
                ck_time[i] = False

        visit(0, 0.0, 0.0, (0.0, 0.0))
        return best[0]
