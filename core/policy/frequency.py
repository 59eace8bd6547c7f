"""A count-min frequency sketch (the frequency half of TinyLFU), shared by the project's caches.

Two caches rank what they hold by it: the embedding cache (``torchrec_cache``: rows, its ``lfu`` and ``static``
policies) and the expert cache (:mod:`tightfit.policy.experts`: an MoE layer's experts). A miss is admitted only
when the sketch says it is used more than what it would evict, so one-off keys do not push out hot ones. Counts
are halved every ``AGE_EVERY`` increments per slot (old traffic fades slowly); the embedding cache divides them
further when its hit rate shows that the hot set moved.

Keys are int64 tensors; :func:`mix_hash` spreads them over the counters (the embedding cache also picks a
row's set with it).

Example:
    >>> s = FrequencySketch(16)
    >>> s.add(torch.tensor([3, 9]), torch.tensor([5, 1])); s.estimate(torch.tensor([3, 9, 4])).tolist()
    [5, 1, 0]
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["SKETCH_DEPTH", "SKETCH_WIDTH_PER_SLOT", "AGE_EVERY", "SKETCH_BYTES_PER_SLOT", "FrequencySketch",
           "mix_hash"]

SKETCH_DEPTH = 2
SKETCH_WIDTH_PER_SLOT = 8
# Sketch increments per slot between halvings (TinyLFU's reset, after ~10x the sketch's counters: 8-16 per
# slot). A stationary trace wants counts that do not forget; a moving hot set is followed by the embedding
# cache's drift reset instead (``torchrec_cache.policy.DRIFT_DROP``). With that reset, halving every 40
# increments hits more than halving every 5 on both a stationary and a drifting Zipf trace.
AGE_EVERY = 40
# The count-min sketch has SKETCH_DEPTH rows of int32 counters, each a power of two >= 8 slots wide: at
# most 2 * 16 * 4 = 128 bytes per slot, charged to the plan with the 28 bytes of key, score, pin, hold,
# next use. 16 counters per slot instead of 8 raise the LFU hit rate only slightly for twice the memory.
SKETCH_BYTES_PER_SLOT = 128

_M32 = 0xFFFFFFFF


def mix_hash(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 keys (low bits of the products are exact under int64 wrap-around)."""
    x = (x ^ (x >> 32)) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


class FrequencySketch(nn.Module):
    """``SKETCH_DEPTH`` rows of int32 counters, a power of two >= ``SKETCH_WIDTH_PER_SLOT * slots`` wide.

    Args:
        slots: the cache's slots (sizes the sketch and its aging period).
        device: where the counters live.
    """

    table: torch.Tensor  # a registered buffer; annotated so type checkers do not read it as `Tensor | Module`

    def __init__(self, slots: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        width = 1 << max(6, math.ceil(math.log2(max(2, SKETCH_WIDTH_PER_SLOT * slots))))
        self.register_buffer("table", torch.zeros(SKETCH_DEPTH, width, dtype=torch.int32, device=device),
                             persistent=False)
        self.mask = width - 1
        self.slots = slots
        self.increments = 0  # uses added since the last halving (host-side: batch sizes are host ints)

    def _hashes(self, keys: torch.Tensor) -> list[torch.Tensor]:
        return [mix_hash(keys * (2 * d + 0x9E3779B1) + d) & self.mask for d in range(SKETCH_DEPTH)]

    def add(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Count ``counts`` more uses of ``keys``."""
        c = counts.to(torch.int32)
        for d, h in enumerate(self._hashes(keys)):
            self.table[d].index_add_(0, h, c)

    def estimate(self, keys: torch.Tensor) -> torch.Tensor:
        """Upper bounds of the keys' counts (int64): the minimum over the rows."""
        hs = self._hashes(keys)
        est = self.table[0].index_select(0, hs[0])
        for d in range(1, SKETCH_DEPTH):
            est = torch.minimum(est, self.table[d].index_select(0, hs[d]))
        return est.long()

    def record(self, keys: torch.Tensor, counts: torch.Tensor, uses: int) -> bool:
        """:meth:`add` (``uses``: the counts' sum, known on the host), then halve every count once ``AGE_EVERY``
        uses per slot came in (TinyLFU's reset: old traffic fades). Returns whether it halved."""
        self.add(keys, counts)
        self.increments += uses
        if self.increments <= AGE_EVERY * max(1, self.slots):
            return False
        self.halve()
        self.increments = 0
        return True

    def halve(self) -> None:
        self.table.bitwise_right_shift_(1)
