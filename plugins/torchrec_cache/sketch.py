"""The embedding cache's frequency sketch: core's :mod:`tightfit.policy.frequency`, the one policy module the
embedding cache and the expert cache share (re-exported here for the cache's own modules).

The cache's ``lfu`` and ``static`` policies rank rows by it: a miss is admitted only when the sketch says it is
used more than the way it would evict.
"""

from __future__ import annotations

from tightfit.policy.frequency import (
    AGE_EVERY,
    SKETCH_BYTES_PER_SLOT,
    SKETCH_DEPTH,
    SKETCH_WIDTH_PER_SLOT,
    FrequencySketch,
    mix_hash,
)

__all__ = ["SKETCH_DEPTH", "SKETCH_WIDTH_PER_SLOT", "AGE_EVERY", "SKETCH_BYTES_PER_SLOT", "FrequencySketch",
           "mix_hash"]
