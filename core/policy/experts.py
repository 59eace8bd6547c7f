"""The expert cache's policy: which of an MoE layer's experts stay in its fast-tier slots between steps.

Each MoE layer has a fixed number of slots in the fast tier (the device; on a CPU, memory). Every step the router's
chosen experts are looked up: a resident one is a hit (no read); a missing one is read, and is admitted into a slot
by the embedding cache's rule (TinyLFU, over the shared :class:`~tightfit.policy.frequency.FrequencySketch`): it
takes the slot of the least-frequent resident only when the sketch counts it used more often, so a one-off expert
does not push out a hot one; a miss that is not admitted is read for its step only (streamed). A hint,
:meth:`ExpertCache.prefetch` (the next layer's experts predicted from the hidden state, or a prefill batch's known
routing), reads experts ahead and keeps the experts it names from being evicted before their use: inside that known
window the rule is Belady's (an expert needed later leaves for one needed sooner), as in the embedding cache's
prefetch window. Nothing here moves bytes: the cache answers which experts to read, keep and drop, and the caller
moves them.

An expert read ahead is not a hit when it is used: its bytes were read for that use, only earlier. So the hit
count is that of a cache that reads on demand, and :func:`belady_hits` (the offline optimum at the same capacity,
reading on demand and free to not keep a miss) bounds it: benchmarks report hits against it.

The sketch counts steps (one per expert a step needs, whatever its token count: one read serves the whole step),
keyed ``layer * num_experts + expert`` and sized by that key space (a few thousand keys), so it is near exact
and ages every ``AGE_EVERY`` steps per expert.

Example:
    >>> cache = ExpertCache(num_layers=1, num_experts=8, slots=2)
    >>> cache.lookup(0, [1, 2]).loads
    (1, 2)
    >>> step = cache.lookup(0, [1, 3]); step.hits, step.streamed  # 3 used as often as 2: not admitted
    ((1,), (3,))
    >>> step = cache.lookup(0, [1, 3]); step.loads, step.evicted  # 3 used more often now: takes 2's slot
    ((3,), (2,))
    >>> hint = cache.prefetch(0, [2]); hint.loads, hint.evicted, cache.lookup(0, [2]).ready  # read ahead: no hit
    ((2,), (3,), (2,))
    >>> belady_hits([[1, 2], [1, 3], [1, 3], [3]], capacity=2)
    4
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tightfit.checks import check_number
from tightfit.policy.frequency import FrequencySketch

__all__ = ["ExpertStep", "ExpertPrefetch", "ExpertCacheStats", "ExpertCache", "belady_hits"]

_NEVER = 2**62  # "no known next use"


@dataclass(frozen=True, slots=True)
class ExpertStep:
    """What one lookup of a layer's routed experts decided (experts in the order the caller gave them).

    Args:
        layer: the MoE layer.
        hits: resident and used before (no read).
        ready: read ahead by :meth:`ExpertCache.prefetch` and used now for the first time (the read was earlier).
        loads: misses to read into a slot and keep.
        streamed: misses to read for this step only (not admitted).
        evicted: residents whose slots the loads take (the caller drops them).
    """

    layer: int
    hits: tuple[int, ...]
    ready: tuple[int, ...]
    loads: tuple[int, ...]
    streamed: tuple[int, ...]
    evicted: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ExpertPrefetch:
    """What a prefetch hint decided: experts to read into slots now, and the residents they replace."""

    layer: int
    loads: tuple[int, ...]
    evicted: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ExpertCacheStats:
    """Totals over every lookup: uses served by a resident (``hits``), read ahead (``ready``), read and kept
    (``loads``), read for one step (``streamed``); ``evictions`` counts slots given up (lookups and prefetches)."""

    hits: int
    ready: int
    loads: int
    streamed: int
    evictions: int

    @property
    def uses(self) -> int:
        return self.hits + self.ready + self.loads + self.streamed

    @property
    def hit_rate(self) -> float:
        """Hits per use (0 before the first use)."""
        return self.hits / self.uses if self.uses else 0.0


class ExpertCache:
    """Resident experts of every MoE layer of a model, each layer with its own fixed number of slots.

    Args:
        num_layers: MoE layers.
        num_experts: routed experts per layer.
        slots: fast-tier slots per layer (one int for every layer, or one per layer; 0: every expert is streamed).
    """

    def __init__(self, *, num_layers: int, num_experts: int, slots: int | Sequence[int]) -> None:
        where = "ExpertCache"
        check_number(num_layers, "num_layers", where=where, integer=True, low=1, fix="give the model's MoE layers")
        check_number(num_experts, "num_experts", where=where, integer=True, low=1,
                     fix="give the routed experts per layer")
        per_layer = [slots] * num_layers if isinstance(slots, int) else list(slots)
        if len(per_layer) != num_layers:
            raise ValueError(f"{where}: slots has {len(per_layer)} entries for {num_layers} layers; give one int, "
                             "or one per layer")
        for i, n in enumerate(per_layer):
            check_number(n, f"slots[{i}]", where=where, integer=True, low=0, fix="give slots >= 0 per layer")
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self.slots = tuple(int(n) for n in per_layer)
        self.sketch = FrequencySketch(self.num_layers * self.num_experts)
        self._resident: list[dict[int, None]] = [{} for _ in range(num_layers)]  # insertion-ordered sets
        self._ahead: list[set[int]] = [set() for _ in range(num_layers)]  # read ahead, not used since
        self._window: list[dict[int, list[int]]] = [{} for _ in range(num_layers)]  # expert -> steps hinted
        self._step = [0] * num_layers  # lookups of each layer so far
        self._totals = [0, 0, 0, 0, 0]  # hits, ready, loads, streamed, evictions

    def resident(self, layer: int) -> tuple[int, ...]:
        """The experts in ``layer``'s slots, in the order they came in."""
        self._check_layer(layer, "resident")
        return tuple(self._resident[layer])

    def stats(self) -> ExpertCacheStats:
        return ExpertCacheStats(*self._totals)

    def lookup(self, layer: int, experts: Iterable[int]) -> ExpertStep:
        """One step of ``layer``: the experts its router chose (repeats count once) are hits, reads or streams.

        Misses needed again inside the prefetch window come first (sooner first), then by frequency; each meets the
        coldest resident this step does not use and takes its slot by the rule in the module docstring.
        """
        needed = self._experts(layer, experts, "lookup")
        step, res, ahead = self._step[layer], self._resident[layer], self._ahead[layer]
        keys = torch.tensor([layer * self.num_experts + e for e in needed], dtype=torch.long)
        self.sketch.record(keys, torch.ones_like(keys), len(needed))
        est = self._estimates(layer, set(needed) | set(res))
        hits = tuple(e for e in needed if e in res and e not in ahead)
        ready = tuple(e for e in needed if e in ahead)
        ahead.difference_update(ready)
        misses = sorted((e for e in needed if e not in res),
                        key=lambda e: (self._next_use(layer, e, step + 1), -est[e]))
        loads, streamed, evicted = [], [], []
        for e in misses:
            nxt = self._next_use(layer, e, step + 1)
            victim = self._admit(layer, nxt, est[e], set(needed), step + 1, est)
            if victim is None:
                streamed.append(e)
                continue
            loads.append(e)
            if victim >= 0:
                evicted.append(victim)
            res[e] = None
        window = self._window[layer]
        for e in list(window):
            window[e] = [t for t in window[e] if t > step]
            if not window[e]:
                del window[e]
        self._step[layer] = step + 1
        for i, n in enumerate((len(hits), len(ready), len(loads), len(streamed), len(evicted))):
            self._totals[i] += n
        order = {e: i for i, e in enumerate(needed)}
        return ExpertStep(layer=layer, hits=hits, ready=ready, loads=tuple(sorted(loads, key=order.__getitem__)),
                          streamed=tuple(sorted(streamed, key=order.__getitem__)), evicted=tuple(evicted))

    def prefetch(self, layer: int, experts: Iterable[int], steps_ahead: int = 0) -> ExpertPrefetch:
        """Hint that ``layer`` needs ``experts`` at its lookup ``steps_ahead`` lookups from now (0: the next one).

        The experts are kept until that lookup (a resident leaves for them only if it is needed later or not known
        to be needed); those not resident are read now into slots when one can be freed.
        """
        check_number(steps_ahead, "steps_ahead", where="ExpertCache.prefetch", integer=True, low=0,
                     fix="0 for the layer's next lookup, 1 for the one after, ...")
        hinted = self._experts(layer, experts, "prefetch")
        when = self._step[layer] + int(steps_ahead)
        for e in hinted:
            steps = self._window[layer].setdefault(e, [])
            steps.append(when)
            steps.sort()
        res = self._resident[layer]
        est = self._estimates(layer, set(hinted) | set(res))
        loads, evicted = [], []
        for e in sorted((e for e in hinted if e not in res), key=lambda e: (self._next_use(layer, e, when), -est[e])):
            victim = self._admit(layer, self._next_use(layer, e, self._step[layer]), est[e], set(hinted),
                                 self._step[layer], est)
            if victim is None:
                continue
            loads.append(e)
            if victim >= 0:
                evicted.append(victim)
            res[e] = None
            self._ahead[layer].add(e)
        self._totals[4] += len(evicted)
        return ExpertPrefetch(layer=layer, loads=tuple(loads), evicted=tuple(evicted))

    def _admit(self, layer: int, nxt: int, count: int, keep: set[int], start: int, est: dict[int, int]) -> int | None:
        """The slot a miss takes: -1 a free one, an expert the one it evicts (removed here), ``None``: not admitted.

        ``nxt``: the miss's next use in the window (``_NEVER``: none known); ``keep``: residents that may not leave;
        ``start``: the first step the window's hints count from.
        """
        res = self._resident[layer]
        if len(res) < self.slots[layer]:
            return -1
        # Cheapest to evict first: residents the window does not need by frequency, then the window's, latest first.
        cands = [(0, est[v], v) if (t := self._next_use(layer, v, start)) == _NEVER else (1, -t, v)
                 for v in res if v not in keep]
        if not cands:
            return None
        needed_later, key, victim = min(cands)
        admit = nxt < -key if needed_later else (nxt < _NEVER or count > key)
        if not admit:
            return None
        del res[victim]
        self._ahead[layer].discard(victim)
        return victim

    def _next_use(self, layer: int, expert: int, start: int) -> int:
        return next((t for t in self._window[layer].get(expert, ()) if t >= start), _NEVER)

    def _estimates(self, layer: int, experts: set[int]) -> dict[int, int]:
        order = sorted(experts)
        if not order:
            return {}
        keys = torch.tensor([layer * self.num_experts + e for e in order], dtype=torch.long)
        return dict(zip(order, self.sketch.estimate(keys).tolist()))

    def _check_layer(self, layer: int, what: str) -> None:
        check_number(layer, "layer", where=f"ExpertCache.{what}", integer=True, low=0, high=self.num_layers - 1,
                     fix=f"give an MoE layer index below num_layers={self.num_layers}")

    def _experts(self, layer: int, experts: Iterable[int], what: str) -> list[int]:
        """``experts`` checked against the layer's range, repeats dropped (first occurrence kept)."""
        self._check_layer(layer, what)
        out = list(dict.fromkeys(int(e) if isinstance(e, torch.Tensor) else e for e in experts))
        for e in out:
            check_number(e, "expert", where=f"ExpertCache.{what} (layer {layer})", integer=True, low=0,
                         high=self.num_experts - 1, fix=f"give router indices in [0, {self.num_experts})")
        return [int(e) for e in out]


def belady_hits(trace: Iterable[Iterable[int]], capacity: int) -> int:
    """The most hits any cache of ``capacity`` slots gets on ``trace`` (one layer's per-step expert sets).

    Belady's MIN with bypass over steps: a step's experts are needed together (repeats inside a step count once);
    after it the cache keeps, of what it held and what the step read, the ``capacity`` experts needed again soonest
    (none that is never needed again). A cache may keep only what it held or read (reading ahead is not a hit, as in
    :class:`ExpertCache`).

    >>> belady_hits([[0, 1], [0, 2], [1, 2], [0]], capacity=1)  # 0 at step 1, then 2 at step 2
    2
    """
    check_number(capacity, "capacity", where="belady_hits", integer=True, low=0, fix="give the slots per layer")
    steps = [list(dict.fromkeys(step)) for step in trace]
    next_use: list[dict[int, int]] = [{} for _ in steps]  # per step, each of its experts' next step
    last: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        next_use[t] = {e: last.get(e, _NEVER) for e in steps[t]}
        last.update((e, t) for e in steps[t])
    cache: dict[int, int] = {}  # expert -> the step it is needed next
    hits = 0
    for t, step in enumerate(steps):
        hits += sum(e in cache for e in step)
        cache.update(next_use[t])
        kept = sorted((n, e) for e, n in cache.items() if n < _NEVER)[:capacity]
        cache = {e: n for n, e in kept}
    return hits
