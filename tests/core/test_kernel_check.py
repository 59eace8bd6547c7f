"""The dispatcher's first-use self-check: a Triton kernel that disagrees with its reference falls back.

On a GPU the check runs when ``auto`` sends CUDA tensors to Triton; here the same path is forced with
``TIGHTFIT_KERNELS=triton`` under Triton's interpreter (``TRITON_INTERPRET=1``, tests/conftest.py).
The wrong kernel is a real Triton launch (``gather_rows``' kernel reading the next row), registered
through the public ``register_kernel``.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from tests.helpers.runif import RunIf
from tightfit.kernels import gather_rows, scatter_add_rows
from tightfit.kernels.dispatch import (
    CHECK_ENV_VAR,
    ENV_VAR,
    KernelCheckWarning,
    interpreter_enabled,
    kernel_checks,
    register_kernel,
    reset_kernel_checks,
)
from tightfit.kernels.index_rows import gather_rows_reference, gather_rows_triton
from tightfit.kernels.varlen_attention import paged_attention

pytestmark = [RunIf(triton=True),
              pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 to run Triton on CPU")]
_names = itertools.count()


@pytest.fixture(autouse=True)
def _fresh_checks(monkeypatch):
    reset_kernel_checks()
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.delenv(CHECK_ENV_VAR, raising=False)
    yield
    reset_kernel_checks()


def _off_by_one(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # The real gather kernel, fed the wrong rows: what a bad offset computation in a kernel does.
    return gather_rows_triton(src, (index.long() + 1) % src.shape[0], out)


def _wrong_gather():
    return register_kernel(f"wrong_gather_for_test_{next(_names)}", reference=gather_rows_reference,
                           triton=_off_by_one, doc="gather that reads the next row (deliberately wrong)")


def test_a_wrong_kernel_falls_back_to_the_reference_with_one_warning():
    kernel = _wrong_gather()
    src, index = torch.randn(9, 5), torch.tensor([3, 0, 8, 3])
    with pytest.warns(KernelCheckWarning, match=r"wrong_gather_for_test_\d+.*differs from the reference.*"
                                                r"elements differ.*using the reference for this class"):
        out = kernel(src, index, torch.empty(4, 5))
    assert torch.equal(out, src[index])                      # the reference's answer, not the kernel's
    [verdict] = kernel_checks()
    assert verdict.kernel == kernel.name and not verdict.passed and verdict.device == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # decided once per class: no second check or warning
        again = kernel(src, index.flip(0), torch.empty(4, 5))
    assert torch.equal(again, src[index.flip(0)]) and len(kernel_checks()) == 1
    with pytest.warns(KernelCheckWarning):                   # another dtype is another class: checked again
        kernel(src.double(), index, torch.empty(4, 5, dtype=torch.float64))
    assert len(kernel_checks()) == 2


def test_without_the_check_the_wrong_kernel_would_have_run(monkeypatch):
    monkeypatch.setenv(CHECK_ENV_VAR, "0")
    kernel = _wrong_gather()
    src, index = torch.randn(9, 5), torch.tensor([3, 0])
    assert not torch.equal(kernel(src, index, torch.empty(2, 5)), src[index])
    assert kernel_checks() == []


def test_an_explicit_backend_is_not_checked():
    """Tests and benchmarks compare the raw kernel with ``backend="triton"``: no check may hide it."""
    kernel = _wrong_gather()
    src, index = torch.randn(9, 5), torch.tensor([3, 0])
    assert torch.equal(kernel(src, index, torch.empty(2, 5), backend="triton"), src[(index + 1) % 9])
    assert kernel_checks() == []


def test_a_kernel_that_raises_falls_back_too():
    def broken(src, index, out):
        raise RuntimeError("PTX JIT compilation failed")

    kernel = register_kernel(f"broken_for_test_{next(_names)}", reference=gather_rows_reference, triton=broken)
    src = torch.randn(4, 3)
    with pytest.warns(KernelCheckWarning, match="RuntimeError: PTX JIT compilation failed"):
        assert torch.equal(kernel(src, torch.tensor([1]), torch.empty(1, 3)), src[[1]])


def test_the_real_kernels_pass_their_checks_and_run_triton():
    """Every registered kernel's probe, through the public functions: all pass, so Triton keeps running."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCheckWarning)
        table = torch.randn(20, 6)
        idx = torch.tensor([4, 19, 4, 0])
        assert torch.equal(gather_rows(table, idx), table[idx])
        acc = scatter_add_rows(torch.zeros(20, 6, dtype=torch.bfloat16), idx, torch.ones(4, 6, dtype=torch.bfloat16))
        assert acc[4].tolist() == [2.0] * 6
        q, kc, vc = torch.randn(3, 2, 8), torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
        out = paged_attention(q, kc, vc, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 3]),
                              torch.tensor([5]), scale=8 ** -0.5, max_q_len=3)
        assert out.shape == (3, 2, 8)
    verdicts = {v.kernel: v for v in kernel_checks()}
    assert set(verdicts) == {"gather_rows", "scatter_add_rows", "paged_attention"}
    assert all(v.passed and v.error == "" for v in verdicts.values()), verdicts
    assert verdicts["gather_rows"].shape_class == ("torch.float32", "torch.int64", 6, True, True)
