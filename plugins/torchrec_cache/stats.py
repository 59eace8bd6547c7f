"""Cache statistics for a whole model, and a Lightning callback that logs them.

    from torchrec_cache.stats import model_cache_stats, CacheStatsCallback
    model_cache_stats(model)  # {'hit_rate': 0.93, 'misses': ..., 'last_bytes_to_device': ...}
    Trainer(callbacks=[CacheStatsCallback()])  # torchrec_cache.callback: logs cache/hit_rate... every step
"""

from __future__ import annotations

from torch import nn

from torchrec_cache.counters import STAT_KEYS
from torchrec_cache.swap import cached_collections

__all__ = ["model_cache_stats"]


def model_cache_stats(model: nn.Module) -> dict[str, float]:
    """Totals over every cached collection of ``model``: hit rates, misses, rows and bytes moved (last step too)."""
    totals = dict.fromkeys(STAT_KEYS, 0)
    last = dict.fromkeys(STAT_KEYS, 0)
    for c in cached_collections(model):
        s = c.cache_stats()
        for k in STAT_KEYS:
            totals[k] += s[k]
            if k != "steps":
                last[k] += s[f"last_{k}"]
    out: dict[str, float] = {
        "hit_rate": totals["hits"] / totals["lookups"] if totals["lookups"] else 0.0,
        "last_hit_rate": last["hits"] / last["lookups"] if last["lookups"] else 0.0,
    }
    out.update({k: float(v) for k, v in totals.items() if k != "steps"})
    out.update({f"last_{k}": float(v) for k, v in last.items() if k != "steps"})
    return out
