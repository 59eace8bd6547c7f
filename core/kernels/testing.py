"""Test harness for kernels: run both backends on the same inputs and compare.

Under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it before Triton is imported) the Triton
backend runs on CPU tensors, so every kernel is checked against its reference on any machine.

Example:
    >>> import torch
    >>> from tightfit.kernels import get_kernel
    >>> from tightfit.kernels.testing import assert_matches_reference
    >>> src, idx = torch.randn(5, 3), torch.tensor([4, 0, 4])
    >>> assert_matches_reference(get_kernel("gather_rows"), src, idx, torch.empty(3, 3))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from tightfit.kernels.dispatch import Kernel

__all__ = ["ODD_SHAPES", "FLOAT_DTYPES", "tolerance", "assert_matches_reference", "compile_for_gpu"]

# Sizes that are not multiples of any block size, plus the empty and single-element edges.
ODD_SHAPES = ((1, 1), (7, 3), (33, 129), (130, 65), (0, 5), (5, 0))
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``atol``/``rtol`` for comparing a kernel with its reference at ``dtype`` (order of summation differs)."""
    return {
        torch.float64: {"atol": 1e-12, "rtol": 1e-12},
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.float16: {"atol": 1e-3, "rtol": 1e-3},
        torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
    }.get(dtype, {"atol": 0.0, "rtol": 0.0})


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def assert_matches_reference(kernel: Kernel, *args: Any, atol: float | None = None, rtol: float | None = None,
                             **kwargs: Any) -> Any:
    """Run ``kernel`` with ``backend="triton"`` and ``backend="reference"`` on clones of the arguments;
    assert the returned tensors and every tensor argument (in-place outputs) match. Returns the Triton result."""
    args_t, args_r = [_clone(a) for a in args], [_clone(a) for a in args]
    kw_t, kw_r = {k: _clone(v) for k, v in kwargs.items()}, {k: _clone(v) for k, v in kwargs.items()}
    out_t = kernel(*args_t, backend="triton", **kw_t)
    out_r = kernel(*args_r, backend="reference", **kw_r)
    pairs = [("result", out_t, out_r)]
    pairs += [(f"argument {i}", a, b) for i, (a, b) in enumerate(zip(args_t, args_r))]
    pairs += [(f"argument {k!r}", kw_t[k], kw_r[k]) for k in kwargs]
    for what, got, want in pairs:
        if isinstance(want, torch.Tensor):
            tol = tolerance(want.dtype)
            try:
                torch.testing.assert_close(got, want, atol=tol["atol"] if atol is None else atol,
                                           rtol=tol["rtol"] if rtol is None else rtol)
            except AssertionError as exc:
                raise AssertionError(f"{kernel.name}: {what} differs between triton and reference: {exc}") from None
    return out_t


def compile_for_gpu(jit_fn: Any, signature: dict[str, str], constexprs: dict[str, int], *, arch: int = 90,
                    warp_size: int = 32) -> dict[str, Any]:
    """Compile a ``@triton.jit`` kernel to PTX and a cubin for ``sm_<arch>`` without a GPU (Triton ships ptxas).

    Catches what the interpreter lets through (type errors in the real code generator, unsupported
    ops) on a CPU-only machine. Must run in a process where ``TRITON_INTERPRET`` was unset when
    Triton was imported. Returns Triton's ``asm`` dict (``"ttir"``, ``"ptx"``, ``"cubin"``, ...).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(jit_fn, signature, constexprs=constexprs)
    return dict(triton.compile(source, target=GPUTarget("cuda", arch, warp_size)).asm)
