"""Frequency-aware embedding cache: full tables in host memory, hot rows on the device.

    from torchrec_cache import CacheConfig, RowOptimizer, swap_in
    model = swap_in(model, cache=CacheConfig(capacity=0.015, optimizer=RowOptimizer(kind="adam", lr=1e-3)))

The heavy names (they import TorchRec) load on first use, so ``tightfit plugins`` can report this
plugin as unavailable, with the reason, where TorchRec is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from tightfit.plugins import Plugin

__all__ = [
    "plugin",
    "CacheConfig",
    "RowOptimizer",
    "CachedEmbeddingBagCollection",
    "CachedEmbeddingCollection",
    "FrequencyStats",
    "collect_frequencies",
    "swap_in",
    "swap_out",
    "prefetching",
    "CacheStatsCallback",
    "model_cache_stats",
    "CachedEmbeddingBagCollectionSharder",
    "cached_sharding_plan",
]

_LAZY = {
    "CacheConfig": "torchrec_cache.config",
    "RowOptimizer": "torchrec_cache.config",
    "CachedEmbeddingBagCollection": "torchrec_cache.modules",
    "CachedEmbeddingCollection": "torchrec_cache.modules",
    "FrequencyStats": "torchrec_cache.frequency",
    "collect_frequencies": "torchrec_cache.frequency",
    "swap_in": "torchrec_cache.swap",
    "swap_out": "torchrec_cache.swap",
    "prefetching": "torchrec_cache.swap",
    "CacheStatsCallback": "torchrec_cache.callback",
    "model_cache_stats": "torchrec_cache.stats",
    "CachedEmbeddingBagCollectionSharder": "torchrec_cache.sharder",
    "cached_sharding_plan": "torchrec_cache.sharder",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrec_cache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def _demo(quick: bool) -> str:
    from torchrec_cache.demo import run_demo

    return run_demo(quick)


plugin = Plugin(
    name="torchrec_cache",
    kind="embedding-cache",
    summary="Frequency-aware embedding cache: full tables in host memory, hot rows on the device",
    requires=("torchrec", "fbgemm_gpu"),
    demo=_demo,
)
"""The embedding cache's entry in tightfit's plugin registry (the ``tightfit.plugins`` entry point):
its name, what it needs, its demo."""
