from __future__ import annotations

import os

import pytest

# Kernels run under Triton's interpreter on CPU (set before Triton is imported anywhere).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep caches (device profiles, kernels) out of the user's home during tests.
os.environ.setdefault("TIGHTFIT_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "tightfit"))


@pytest.fixture(autouse=True)
def _destroy_process_group():
    """A test that leaves a process group behind must not leak it into the next test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
