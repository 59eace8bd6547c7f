"""A candidate plan of Elixir's search and the evaluator that prices it (part of :mod:`tightfit.planner.elixir`).

:class:`Evaluator` prices a plan's units with :func:`tightfit.planner.elixir.sim.unit_terms`, once per choice, and
knows which runtime a plan runs on: one that replicates every unit on the device without recomputation is data
parallelism, which the strategy runs on DDP (``lightning_elixir.replicate``); every other plan runs on FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tightfit.planner.elixir.disk import disk_bytes, host_bytes
from tightfit.planner.elixir.sim import Context, UnitTerms, peak, step_time, unit_terms

__all__ = ["Candidate", "Evaluator", "runs_on_ddp"]


def runs_on_ddp(modes: Sequence[str], offload: Sequence[int], ckpt: Sequence[bool | None]) -> bool:
    """Whether a plan runs on DDP rather than FSDP2 (the rule ``lightning_elixir.replicate.replicates_everything``
    applies): every unit replicated and on the device, no block recomputed. The dtype half of that rule is in
    :attr:`Context.alias_replicated`."""
    return bool(modes) and all(m == "replicate" for m in modes) and not any(offload) and not any(ckpt)


@dataclass(frozen=True, slots=True)
class Candidate:
    units: tuple[tuple[int, int], ...]
    modes: tuple[str, ...]
    offload: tuple[int, ...]  # state tier per unit: 0 device, 1 host, 2 optimizer state on disk (bools read as 0/1)
    ckpt: tuple[bool, ...]
    df: int
    db: int
    time: float
    peak: float
    host: float
    disk: float = 0.0

    def fits(self, host_budget: float, disk_budget: float) -> bool:
        """Within the host and disk budgets (the device budget is the caller's)."""
        return self.host <= host_budget and self.disk <= disk_budget

    @property
    def changes(self) -> int:
        # A disk unit counts as two changes (host offload, then its state to disk): equal times prefer the host.
        return sum(self.offload) + sum(self.ckpt)

    @property
    def key(self) -> tuple[float, int, float]:
        # Fastest first; among equal times (1e-9 relative) the one that offloads and recomputes least.
        return (float(f"{self.time:.9e}"), self.changes, self.peak)

    @property
    def family(self) -> str:
        lengths = [b - a for a, b in self.units]
        sizes = sorted(set(lengths))
        if len(sizes) == 1:
            return f"{len(self.units)} units of {sizes[0]} block(s)"
        if len(lengths) <= 6:
            return f"{len(self.units)} units of {'+'.join(map(str, lengths))} blocks"
        return f"{len(self.units)} units of {sizes[0]}-{sizes[-1]} blocks"


class Evaluator:
    """Prices candidates, caching each unit's terms. A plan that replicates everything is priced as DDP runs it
    where ``ctx.alias_replicated`` (calibrated, one dtype, and ``ElixirConstraints.replicate_on_ddp``)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._terms: dict[tuple[int, int, str, int, bool], UnitTerms] = {}
        self.evaluations = 0

    def terms(self, a: int, b: int, mode: str, off: int, on_ddp: bool = False) -> UnitTerms:
        key = (a, b, mode, off, on_ddp)
        t = self._terms.get(key)
        if t is None:
            t = self._terms[key] = unit_terms(self.ctx, a, b, mode, off, on_ddp=on_ddp)
        return t

    def on_ddp(self, modes: Sequence[str], offload: Sequence[int], ckpt: Sequence[bool | None]) -> bool:
        """Whether a plan of these choices runs on DDP (priced without FSDP2's copies of replicated units)."""
        return self.ctx.alias_replicated and runs_on_ddp(modes, offload, ckpt)

    def terms_for(self, units: Sequence[tuple[int, int]], modes: Sequence[str], offload: Sequence[int],
                  ckpt: Sequence[bool]) -> list[UnitTerms]:
        """Every unit's terms in a complete plan."""
        ddp = self.on_ddp(modes, offload, ckpt)
        return [self.terms(a, b, m, o, ddp) for (a, b), m, o in zip(units, modes, offload)]

    def make(self, units: Sequence[tuple[int, int]], modes: Sequence[str], offload: Sequence[int],
             ckpt: Sequence[bool], df: int, db: int) -> Candidate:
        self.evaluations += 1
        u = list(units)
        ck = list(ckpt)
        terms = self.terms_for(u, modes, offload, ck)
        return Candidate(units=tuple(u), modes=tuple(modes), offload=tuple(offload), ckpt=tuple(ck), df=df, db=db,
                         time=step_time(self.ctx, u, terms, ck, df, db), peak=peak(self.ctx, u, terms, ck, df, db),
                         host=host_bytes(self.ctx, terms), disk=disk_bytes(terms))
