"""Host memory the disk tier frees must go back to the system, or a memory limit counts it still.

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and gives it back
on ``free``; smaller ones come from the heap, whose free space stays with the process. The threshold starts at
128 KiB and is *dynamic*: each freed mmap'd block raises it to that block's size (up to 32 MiB). A run that keeps
freeing 4-16 MiB tensors (parameters dropped between uses, gradients, staging buffers, FSDP2's unsharded
parameters) soon has its tensors on the heap, where freed pages stay resident and fragment: in
``benchmarks/elixir_disk.py``'s child the resident peak grows every step with the default and stays flat with the
threshold fixed at 1 MiB.

:func:`return_large_frees` fixes the threshold (setting it turns the dynamic adjustment off); it affects
allocations made after the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["return_large_frees", "MMAP_THRESHOLD_BYTES"]

MMAP_THRESHOLD_BYTES = 1 << 20  # 1 MiB: every tensor of 256 K fp32 elements or more is mmap'd and given back on free
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_frees(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make ``malloc`` map blocks of ``threshold`` bytes or more on their own (returned to the system when freed).

    Returns whether it took effect: ``False`` where the C library is not glibc (musl, macOS: nothing to do there,
    or no such knob). Raises ``ValueError`` for a threshold outside glibc's range."""
    if not 0 < threshold <= 32 << 20:
        raise ValueError(f"threshold={threshold}: the mmap threshold must be between 1 byte and 32 MiB "
                         "(glibc's maximum); pass e.g. 1 << 20")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
