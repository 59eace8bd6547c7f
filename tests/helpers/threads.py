"""``torch_threads(n)``: run a block with ``torch.set_num_threads(n)``, restoring the old count after.

    with torch_threads(2):
        out = kernel(...)      # the native kernels split their work over torch.get_num_threads()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["torch_threads"]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
