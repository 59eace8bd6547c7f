"""Which rows a batch loads into which slots: the eviction and admission rules of a
:class:`~torchrec_cache.cache.FusedCache`, as tensor functions over its per-slot state (no host reads).

Per set, its ways are ranked by a victim key (free first; pinned, held or disabled never) and the
batch's misses by priority; the ``r``-th miss of a set meets the ``r``-th coldest way and takes it
only if it is worth more. Inside a prefetch window the rule is Belady's (a row needed later leaves
for a row needed sooner); beyond it, the policy's frequency (``lfu``, ``static``: TinyLFU-style
admission, a miss must be used more than its victim) or recency (``lru``: always admitted).

Example:
    >>> window_next_use(torch.tensor([3, 5]), torch.tensor([5, 9]), torch.tensor([7, 8])).tolist()
    [1099511627776, 7]
"""

from __future__ import annotations

import torch

from torchrec_cache.sketch import FrequencySketch

__all__ = ["FREE", "DISABLED", "TRASH_KEY", "NEVER", "DRIFT_DROP", "DRIFT_SHIFT", "window_next_use", "observe",
           "drift_reset", "victim_keys", "choose_slots", "free_ways"]

FREE, DISABLED, TRASH_KEY = -1, -2, -3  # slot keys that are not rows
NEVER = 2**40  # "no known next use"
_INF = 2**62
_WINDOW = 2**61  # victim keys of rows a prefetch window needs: _WINDOW - next step (above any count)
# Drift reset (lfu): a batch whose traffic hit rate (hit uses / uses) falls below DRIFT_DROP of its recent
# level (an average halving its weight per batch) means the hot set moved: every count, sketch and resident
# scores, is shifted right by DRIFT_SHIFT bits, so the new hot rows win their slots within a batch. A
# stationary trace never triggers it and keeps its counts (aged only every AGE_EVERY increments per slot).
# With it, on a Zipf table cached at a few percent, the policy beats the static cache on a stationary trace and
# LRU on a drifting one (benchmarks/results/REPORT.md#torchrec_cache). Halving a resident row's count for every
# few steps it goes unused instead loses to static when stationary and to LRU when drifting.
DRIFT_DROP = 0.7
DRIFT_SHIFT = 8


def window_next_use(uniq: torch.Tensor, reuse: torch.Tensor | None, reuse_steps: torch.Tensor | None) -> torch.Tensor:
    """The step at which the prefetch window needs each of ``uniq`` again (sorted ``reuse`` keys and their
    first step there), or :data:`NEVER` as far as it knows."""
    if reuse is None or reuse_steps is None or reuse.numel() == 0:
        return torch.full_like(uniq, NEVER)
    at = torch.searchsorted(reuse, uniq).clamp(max=reuse.numel() - 1)
    return torch.where(reuse.index_select(0, at) == uniq, reuse_steps.index_select(0, at), NEVER)


def observe(policy: str, sketch: FrequencySketch, slot_score: torch.Tensor, hit_level: torch.Tensor,
            hit_slots: torch.Tensor, hit: torch.Tensor, uniq: torch.Tensor, counts: torch.Tensor, step: int,
            uses: int) -> None:
    """A counted batch: score its hits (``lfu``: add their uses, after which a drift reset may divide every
    count; ``lru``: their step), then add its uses to the sketch (``static`` keeps the dataset counts); when
    the sketch ages (halves), ``lfu`` scores halve with it. ``hit_slots``: the hits' slots (others: trash);
    ``uses``: the batch's ids (the counts' sum, a host int)."""
    if policy == "lfu":
        slot_score.index_add_(0, hit_slots, counts)
        drift_reset(sketch.table, slot_score, hit_level, counts, hit)
    elif policy == "lru":
        slot_score.index_fill_(0, hit_slots, step)
    if policy != "static" and sketch.record(uniq, counts, uses) and policy == "lfu":
        slot_score.bitwise_right_shift_(1)


def drift_reset(sketch_table: torch.Tensor, slot_score: torch.Tensor, hit_level: torch.Tensor, counts: torch.Tensor,
                hit: torch.Tensor) -> None:
    """Divide every count by ``2**DRIFT_SHIFT`` when this batch's traffic hit rate dropped below ``DRIFT_DROP``
    of ``hit_level`` (then fold it into the level); decided on the device, no host read."""
    traffic_hit = (counts * hit).sum().float() / counts.sum().clamp(min=1).float()
    shift = (traffic_hit < DRIFT_DROP * hit_level).long() * DRIFT_SHIFT
    sketch_table.bitwise_right_shift_(shift.int())
    slot_score.bitwise_right_shift_(shift)
    hit_level.mul_(0.5).add_(traffic_hit, alpha=0.5)


def victim_keys(slot_key: torch.Tensor, slot_score: torch.Tensor, pinned_until: torch.Tensor, hold: torch.Tensor,
                next_use: torch.Tensor, step: int, keep_step: bool) -> torch.Tensor:
    """Per slot, how costly it is to evict (lowest first): free ``-inf``, a row the window needs above every
    count (the one needed last lowest of those), unavailable ``+inf``. ``keep_step``: the rows pinned for
    ``step`` are unavailable too."""
    pinned = pinned_until >= step if keep_step else pinned_until > step
    blocked = (slot_key == DISABLED) | pinned | (hold > 0)
    nxt = next_use.long()
    key = torch.where(nxt > step, _WINDOW - nxt, slot_score)
    return torch.where(blocked, torch.full_like(key, _INF), torch.where(slot_key == FREE, torch.full_like(key, -_INF),
                                                                        key))


def choose_slots(policy: str, vkey: torch.Tensor, ways: int, sets: torch.Tensor, miss: torch.Tensor,
                 prio: torch.Tensor, miss_next: torch.Tensor, step: int, *,
                 allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(admit, victim slot)`` of each unique key: the hottest misses of a set against its coldest ways.

    Args:
        policy: the cache's policy.
        vkey: (sets * ways,) :func:`victim_keys`.
        ways: slots per set.
        sets, miss, prio, miss_next: per unique key, its set, whether it missed, its frequency estimate
            and :func:`window_next_use`.
        step: the current step.
        allowed: the misses that may be admitted (all when ``None``); the others still take their rank.
    """
    num_sets = vkey.numel() // ways
    vk_sorted, vway = vkey.view(num_sets, ways).sort(dim=1)
    reused = miss_next < NEVER
    rank_prio = torch.where(reused, 2**31 + (2**30 - (miss_next - step)).clamp(0, 2**30), prio.clamp(0, 2**31 - 1))
    comp = torch.where(miss, sets * 2**32 + (2**32 - 1 - rank_prio), torch.full_like(sets, num_sets * 2**32))
    comp_sorted, order = torch.sort(comp)
    set_sorted = comp_sorted >> 32
    rank = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device) - torch.searchsorted(set_sorted, set_sorted))
    r = rank.clamp(max=ways - 1)
    vk = vk_sorted[sets, r]
    admit = (miss if allowed is None else allowed) & (rank < ways) & (vk < _INF)
    in_window = vk >= _WINDOW - 2**31
    if policy != "lru":
        # Belady inside the window, frequency beyond: a victim the window needs leaves only for a miss
        # needed sooner; any other victim for a miss the window needs, or one used more often.
        admit &= torch.where(in_window, miss_next < _WINDOW - vk, (vk == -_INF) | reused | (prio > vk))
    else:
        admit &= ~in_window | (miss_next < _WINDOW - vk)
    return admit, sets * ways + vway[sets, r]


def free_ways(slot_key: torch.Tensor, sets: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Warm-up placement: ``(positions in sets, slots)`` of the keys (hottest first) that find a free way in
    their set, in order; the others are left out."""
    order = torch.sort(sets, stable=True).indices
    s_sorted = sets.index_select(0, order)
    rank = torch.arange(s_sorted.numel(), device=sets.device) - torch.searchsorted(s_sorted, s_sorted)
    free = (slot_key.index_select(0, s_sorted * ways + rank.clamp(max=ways - 1)) == FREE) & (rank < ways)
    return order[free], (s_sorted * ways + rank)[free]
