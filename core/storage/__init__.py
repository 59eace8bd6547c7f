"""The disk tier: a file-backed store of tensors and flat buffers (``docs/disk-tier.md``).

Example:
    >>> import tempfile, torch
    >>> from tightfit.storage import TensorStore
    >>> with TensorStore(tempfile.mkdtemp()) as store:
    ...     fut = store.write("x", torch.ones(3))
    ...     _ = fut.result()
    ...     out = torch.empty(3)
    ...     store.read_into("x", out).result().tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

from tightfit.storage.buffers import aligned_empty
from tightfit.storage.checksums import DEFAULT_CHECKSUM
from tightfit.storage.engine import ExtentIO, IOEngine, checksum
from tightfit.storage.errors import ChecksumError, DiskFullError, StorageError, StoreLockedError
from tightfit.storage.external import ExternalFile, direct_buffer_bytes
from tightfit.storage.fs import ALIGN, Mount, check_disk_dir, free_bytes, mount_of
from tightfit.storage.host import return_large_frees
from tightfit.storage.staging import (
    IOCounters,
    IOTotals,
    ReadAhead,
    StagingBuffers,
    Tally,
    WriteBehind,
    WriteBehindError,
)
from tightfit.storage.store import DEFAULT_EXTENT_BYTES, DEFAULT_WORKERS, TensorInfo, TensorStore

__all__ = [
    "TensorStore",
    "TensorInfo",
    "StorageError",
    "ChecksumError",
    "DiskFullError",
    "StoreLockedError",
    "check_disk_dir",
    "mount_of",
    "Mount",
    "free_bytes",
    "return_large_frees",
    "aligned_empty",
    "StagingBuffers",
    "ReadAhead",
    "WriteBehind",
    "WriteBehindError",
    "IOCounters",
    "IOTotals",
    "Tally",
    "IOEngine",
    "ExtentIO",
    "ExternalFile",
    "direct_buffer_bytes",
    "checksum",
    "DEFAULT_CHECKSUM",
    "ALIGN",
    "DEFAULT_EXTENT_BYTES",
    "DEFAULT_WORKERS",
]
