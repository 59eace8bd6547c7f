"""Model profiler (meta device), device profiler and disk profiler. See :mod:`tightfit.profiler.types`."""

from __future__ import annotations

from tightfit.profiler.calibrate import calibrate_device
from tightfit.profiler.device import DATASHEETS, cluster_spec, device_preset, profile_device
from tightfit.profiler.disk import profile_disk
from tightfit.profiler.memory import PeakEstimate, estimate_peak, optimizer_state_bytes
from tightfit.profiler.model import MetaProfilingError, profile_model
from tightfit.profiler.timing import time_blocks
from tightfit.profiler.types import (
    DTYPE_BYTES,
    BlockProfile,
    ClusterSpec,
    DeviceProfile,
    DiskProfile,
    MemoryEvent,
    ModelProfile,
    ParamInfo,
    ProfileError,
)

__all__ = [
    "profile_device",
    "profile_disk",
    "calibrate_device",
    "time_blocks",
    "device_preset",
    "cluster_spec",
    "DATASHEETS",
    "profile_model",
    "MetaProfilingError",
    "estimate_peak",
    "PeakEstimate",
    "optimizer_state_bytes",
    "DTYPE_BYTES",
    "BlockProfile",
    "ClusterSpec",
    "DeviceProfile",
    "DiskProfile",
    "MemoryEvent",
    "ModelProfile",
    "ParamInfo",
    "ProfileError",
]
