"""tightfit.kernels.gelu_mul: GeGLU's gelu_tanh(gate) * up against PyTorch's own gelu(approximate="tanh") times up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.runif import RunIf
from tests.helpers.threads import torch_threads
from tightfit.kernels.dispatch import get_kernel
from tightfit.kernels.gelu_mul import gelu_tanh_mul

BACKENDS = ["reference", pytest.param("native", marks=RunIf(native=True))]


def _torch(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 300), half=st.integers(1, 700), magnitude=st.sampled_from([0.01, 1.0, 8.0, 200.0]),
       strided=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_gelu_tanh_mul_equals_torch(backend, rows, half, magnitude, strided, threads, seed):
    """Any width, tiny to huge inputs (exp's overflow region included), rows apart in memory (a view of a wider
    output), calls large enough to split over threads."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, 2 * half + (5 if strided else 0), generator=g) * magnitude
    x = wide[:, : 2 * half]
    with torch_threads(threads):
        got = gelu_tanh_mul(x, backend=backend)
    want = _torch(x.double())
    assert got.shape == (rows, half) and got.dtype == torch.float32
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=1e-6 * magnitude ** 2, rtol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_dtypes_and_shapes(backend):
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(gelu_tanh_mul(x, backend=backend), _torch(x))


def test_an_odd_width_is_refused():
    with pytest.raises(ValueError, match=r"the last dimension \(7\) must be even"):
        gelu_tanh_mul(torch.zeros(2, 7))


@RunIf(native=True)
def test_cpu_tensors_use_the_native_kernel(monkeypatch):
    monkeypatch.delenv("TIGHTFIT_KERNELS", raising=False)
    assert get_kernel("gelu_tanh_mul").backend_for(torch.zeros(1, 4)) == "native"
