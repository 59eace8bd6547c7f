"""``RunIf(...)``: one marker factory that skips a test when the machine cannot run it.

    @RunIf(cuda=True)
    @RunIf(triton=True, min_cpus=2)
    @RunIf(lightning=True, torchrec=True)
"""

from __future__ import annotations

import os

import pytest

from tightfit.plugins import missing_modules

__all__ = ["RunIf"]


def RunIf(  # noqa: N802 - a marker factory, named like Lightning's
    *, cuda: bool = False, min_cuda_gpus: int = 0, triton: bool = False, lightning: bool = False,
    torchrec: bool = False, deepspeed: bool = False, transformers: bool = False, serve: bool = False,
    min_world: int = 0, min_cpus: int = 0, native: bool = False,
) -> pytest.MarkDecorator:
    """Skip unless every condition holds.

    Args:
        cuda: needs a CUDA device.
        min_cuda_gpus: needs at least this many CUDA devices.
        triton: needs Triton importable (kernels run under ``TRITON_INTERPRET=1`` on CPU).
        lightning / torchrec / deepspeed / transformers / serve: needs that host framework.
        min_world: needs gloo and this many processes can be spawned (always true on CPU; documents intent).
        min_cpus: needs at least this many CPU cores.
        native: needs the native CPU kernels to build here (a C compiler; tightfit.kernels.native).
    """
    import torch

    reasons = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (cuda or min_cuda_gpus) and gpus < max(1, min_cuda_gpus):
        reasons.append(f"needs {max(1, min_cuda_gpus)} CUDA GPU(s), found {gpus}")
    needed = {
        "triton": triton, "lightning": lightning, "torchrec": torchrec, "deepspeed": deepspeed,
        "transformers": transformers, "fastapi": serve, "uvicorn": serve,
    }
    missing = missing_modules(*[m for m, want in needed.items() if want])
    if missing:
        reasons.append(f"needs {', '.join(missing)} (make setup installs it)")
    if min_world and not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        reasons.append("needs torch.distributed with gloo")
    if min_cpus and (os.cpu_count() or 1) < min_cpus:
        reasons.append(f"needs {min_cpus} CPUs, found {os.cpu_count()}")
    if native:
        from tightfit.kernels.varlen_attention_cpu import native_attention_error

        why = native_attention_error()
        if why:
            reasons.append(f"needs the native CPU kernels ({why})")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "runs here")
