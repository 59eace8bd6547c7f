"""tightfit.kernels.head_norm: q/k RMSNorm per head in place in a QKV output, against torch's F.rms_norm per head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.runif import RunIf
from tightfit.kernels.dispatch import get_kernel
from tightfit.kernels.head_norm import rms_norm_heads_

BACKENDS = ["reference", pytest.param("native", marks=RunIf(native=True))]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 40), heads=st.integers(1, 12), d=st.sampled_from([1, 4, 32, 33, 128]),
       values=st.integers(0, 16), offset=st.sampled_from([0.0, 1.0]), eps=st.sampled_from([1e-6, 1e-5]),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 99))
def test_each_head_normed_in_place_as_torch_norms_it(backend, tokens, heads, d, values, offset, eps, magnitude, seed):
    """A QKV output's query and key heads (tokens apart in memory: value features follow), the values untouched."""
    g = torch.Generator().manual_seed(seed)
    split = int(torch.randint(0, heads + 1, (1,), generator=g))
    qkv = torch.randn(tokens, heads * d + values, generator=g) * magnitude
    w1, w2 = torch.randn(d, generator=g), torch.randn(d, generator=g)
    before = qkv.clone()
    qk = qkv[:, :heads * d].view(tokens, heads, d)
    out = rms_norm_heads_(qk, split, w1, w2, eps, offset, backend=backend)
    x = before[:, :heads * d].view(tokens, heads, d).double()
    want = torch.cat([F.rms_norm(x[:, :split], (d,), w1.double() + offset, eps),
                      F.rms_norm(x[:, split:], (d,), w2.double() + offset, eps)], dim=1)
    assert out.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qk.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, heads * d:], before[:, heads * d:])


def test_bad_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"got qk \(2, 3, 4\), split 5"):
        rms_norm_heads_(torch.zeros(2, 3, 4), 5, torch.ones(4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"weights \(3,\) and \(4,\)"):
        rms_norm_heads_(torch.zeros(2, 3, 4), 1, torch.ones(3), torch.ones(4), 1e-6)


@RunIf(native=True)
def test_cpu_tensors_use_the_native_kernel(monkeypatch):
    monkeypatch.delenv("TIGHTFIT_KERNELS", raising=False)
    assert get_kernel("rms_norm_heads_").backend_for(torch.zeros(1, 2, 4), 1, torch.ones(4), torch.ones(4),
                                                     1e-6) == "native"
