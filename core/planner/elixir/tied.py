"""Tied parameters in Elixir's cost model (part of :mod:`tightfit.planner.elixir`; :func:`~.sim.peak` uses these).

A parameter tied to a later block (GPT's ``wte`` and ``lm_head``) is owned by the block that uses it first; the
runtime puts the later block's module into the owner's FSDP2 group (``lightning_elixir.apply.resolve_units``), so
the owner's unit is gathered:

* in forward, from its own forward until the tied block's forward ends (FSDP2 reshards a group of modules after
  the last of them ran);
* in backward, from the tied block's backward on. A unit whose blocks are all lookups (an embedding: its backward
  reads indices, not the weight) is resharded as soon as the tied block's backward is over and not gathered again
  in that backward (``lightning_elixir.tied``); any other such unit stays gathered until its own post-backward.

The tied block's gradient contribution waits in autograd's buffer from the tied block's backward to the owner's;
the profile already counts it (an activation of every block's backward in between). At the owner's lookup it is
summed with the lookup's own gradient into the parameter's gradient, a third copy beside the two the profile
holds, so a lookup unit's backward is priced as the profiled lookup plus that sum (no gathered parameters; the
units reduced before it have released their buffers, ``lightning_elixir.tied``), and its reduction (the gradient
and the reduce buffer) apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tightfit.profiler.types import ModelProfile

__all__ = ["LOOKUP_TYPES", "tied_blocks", "lookup_blocks", "TiedUnit", "tied_units", "tied_params"]

LOOKUP_TYPES = ("Embedding",)
"""Block types whose backward needs none of their parameters (``torch.nn.Embedding``: indices only)."""


def tied_blocks(model: ModelProfile) -> tuple[int, ...]:
    """Per block, the last block that uses one of its parameters under another name (a tied alias), else itself."""
    index = {b.name: i for i, b in enumerate(model.blocks)}
    owner = {p.name: index.get(p.block, -1) for p in model.params}
    last = list(range(len(model.blocks)))
    for p in model.params:
        i = owner[p.name]
        for alias in p.aliases:
            users = [j for name, j in index.items() if name and (alias == name or alias.startswith(name + "."))]
            if i >= 0 and users:
                last[i] = max(last[i], max(users))
    return tuple(last)


def lookup_blocks(model: ModelProfile) -> tuple[bool, ...]:
    """Per block, whether its backward needs none of its parameters (its type is in :data:`LOOKUP_TYPES`)."""
    return tuple(b.type in LOOKUP_TYPES for b in model.blocks)


@dataclass(frozen=True, slots=True)
class TiedUnit:
    """A unit owning a parameter tied to a block of a later unit.

    Args:
        unit: the owning unit's index; until: the unit holding the last tied block; block: that block's index.
        lookup: the owning unit's blocks with parameters are all lookups (resharded after the tied block's backward).
    """

    unit: int
    until: int
    block: int
    lookup: bool


def tied_units(tied_to: Sequence[int], lookup: Sequence[bool], numel: Sequence[int],
               units: Sequence[tuple[int, int]]) -> list[TiedUnit]:
    """The units of a plan that own a parameter tied to a block of a later unit."""
    where = {i: u for u, (a, b) in enumerate(units) for i in range(a, b)}
    out = []
    for u, (a, b) in enumerate(units):
        t = max((tied_to[i] for i in range(a, b)), default=a)
        if t >= b:
            out.append(TiedUnit(unit=u, until=where[t], block=t,
                                lookup=all(lookup[i] for i in range(a, b) if numel[i] > 0)))
    return out


def tied_params(tied: Sequence[TiedUnit], gathered: Sequence[float], kept: Sequence[bool],
                n: int) -> tuple[list[float], list[float]]:
    """(forward, backward): per unit, the gathered bytes of the tied units it runs beside (see the module docstring;
    a kept unit's are counted as kept already)."""
    fwd, bwd = [0.0] * n, [0.0] * n
    for t in tied:
        g = 0.0 if kept[t.unit] else gathered[t.unit]
        for w in range(t.unit + 1, t.until + 1):
            fwd[w] += g
            if w == t.until or not t.lookup:
                bwd[w] += g
    return fwd, bwd
