"""Cache policies shared by the project's caches: the frequency sketch (TinyLFU's counts, used by the embedding
cache and the expert cache) and the expert cache's admission, eviction and prefetch rules."""

from __future__ import annotations

from tightfit.policy.experts import ExpertCache, ExpertCacheStats, ExpertPrefetch, ExpertStep, belady_hits
from tightfit.policy.frequency import AGE_EVERY, FrequencySketch, mix_hash

__all__ = ["AGE_EVERY", "FrequencySketch", "mix_hash", "ExpertCache", "ExpertCacheStats", "ExpertPrefetch",
           "ExpertStep", "belady_hits"]
