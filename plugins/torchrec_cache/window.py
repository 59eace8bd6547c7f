"""The prefetch window as the cache sees it: which keys the batches after a prefetched one need, and when.

:func:`~torchrec_cache.swap.prefetching` keeps the next ``ahead`` batches in a window. The batch it
prefetches carries a :class:`Window` of the others, so a miss needed again inside the window takes the
slot of a row needed later (Belady inside the window); a batch entering the window only tells the cache
when its cached rows are used next (:meth:`~torchrec_cache.cache.FusedCache.enter_window`).

Example:
    >>> w = Window.of([(7, torch.tensor([4, 9])), (5, torch.tensor([9]))])
    >>> w.keys.tolist(), w.steps.tolist(), w.next_use(torch.tensor([4, 6])).tolist()
    ([4, 9, 9], [7, 5, 7], [7, 1099511627776])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrec_cache.policy import window_next_use

__all__ = ["Window"]

# A key and its step's offset in the window share one int64 for one sort: keys < 2**43 (tables of < 2**40
# rows), offsets < 2**20 (a window of a million batches).
_STEP_BITS = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class Window:
    """Sorted ``keys`` the later batches of a window need, each with the step of its first use there."""

    keys: torch.Tensor
    steps: torch.Tensor

    @staticmethod
    def of(batches: list[tuple[int, torch.Tensor]]) -> Window:
        """The window of ``(step, sorted keys)`` batches (non-empty list): a key's first use is its earliest step."""
        base = min(s for s, _ in batches)
        # Sorted by key, then step: the first entry of a key is its first use in the window.
        comp = torch.sort(torch.cat([k * 2**_STEP_BITS + (s - base) for s, k in batches])).values
        return Window(keys=comp >> _STEP_BITS, steps=(comp & (2**_STEP_BITS - 1)) + base)

    def next_use(self, uniq: torch.Tensor) -> torch.Tensor:
        """The step at which the window needs each of ``uniq`` (sorted keys), or ``policy.NEVER``."""
        return window_next_use(uniq, self.keys, self.steps)
