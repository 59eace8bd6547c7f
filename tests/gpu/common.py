"""Shared by the CUDA tests: the device they run on and the image's missing packages.

Every test in tests/gpu/ is ``@RunIf(cuda=True)``: collected everywhere (``make test`` counts them),
run only where a GPU is (``make gpu-check``). Most bodies take the device as an argument, so they were
dry-run on a CPU before any GPU saw them; only the GPU run counts.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

__all__ = ["cuda", "require", "kernels_compiled"]


def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def require(*modules: str) -> None:
    """Skip, naming what the GPU image lacks (it has torch, Triton, Lightning, transformers; no TorchRec,
    FBGEMM or DeepSpeed), instead of failing on an import."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, which this machine's image does not have")


def kernels_compiled() -> None:
    """Kernel tests must run the compiled kernels: under TRITON_INTERPRET=1 they would test the interpreter."""
    from tightfit.kernels.dispatch import interpreter_enabled, triton_available, triton_import_error

    if not triton_available():
        pytest.skip(f"Triton does not import: {triton_import_error()}")
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is set (tests/conftest.py's default): run `make gpu-check`, which sets "
                    "TRITON_INTERPRET=0, to test the compiled kernels")
