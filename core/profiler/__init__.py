"""Model profiler (meta device) and device profiler. See :mod:`tightfit.profiler.types`."""

from __future__ import annotations

from tightfit.profiler.types import (
    DTYPE_BYTES,
    BlockProfile,
    ClusterSpec,
    DeviceProfile,
    MemoryEvent,
    ModelProfile,
    ParamInfo,
)

__all__ = [
    "DTYPE_BYTES",
    "BlockProfile",
    "ClusterSpec",
    "DeviceProfile",
    "MemoryEvent",
    "ModelProfile",
    "ParamInfo",
]
