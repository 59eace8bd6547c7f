"""Frequency-aware embedding cache: full tables in host memory, hot rows on the device"""

from __future__ import annotations

from tightfit.plugins import Plugin

__all__ = ["plugin"]

plugin = Plugin(
    name="torchrec_cache",
    kind="embedding-cache",
    summary="Frequency-aware embedding cache: full tables in host memory, hot rows on the device",
    requires=("torchrec",),
    available=False,
    reason="not implemented yet (issue #6)",
)
