"""Gumbel-max draws with counter-based noise (``tightfit.kernels.gumbel``): the native CPU kernel against its
PyTorch reference over hypothesis-drawn batches, the noise's range, the draws' distribution and their
independence from the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.runif import RunIf
from tightfit.kernels.gumbel import counter_uniform, gumbel_argmax

BACKENDS = ["reference", pytest.param("native", marks=RunIf(native=True))]


@RunIf(native=True)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 12), vocab=st.integers(1, 3000), extra=st.integers(0, 3),
       masked=st.sampled_from([0.0, 0.5, 0.99]), odd=st.sampled_from(["none", "nan", "inf", "all -inf"]),
       scale=st.sampled_from([0.1, 3.0, 50.0]), seed=st.integers(0, 2**62 - 1), position=st.integers(0, 10**6))
def test_native_gumbel_argmax_equals_the_reference(rows, vocab, extra, masked, odd, scale, seed, position):
    g = torch.Generator().manual_seed(rows * 7919 + vocab)
    wide = torch.randn(rows, vocab + extra, generator=g) * scale
    scores = wide[:, :vocab]  # rows further apart than their width, as a slice of a wider logits buffer
    scores[torch.rand(rows, vocab, generator=g) < masked] = float("-inf")  # top-k / top-p filtered out
    if rows and odd != "none":
        col = int(torch.randint(vocab, (1,), generator=g))
        if odd == "all -inf":
            scores[rows // 2] = float("-inf")
        else:
            scores[rows // 2, col] = float("nan") if odd == "nan" else float("inf")
    seeds = (torch.arange(rows) * 0x9E3779B97F4A7C1 + seed) % 2**62
    positions = torch.arange(rows) + position
    got = gumbel_argmax(scores, seeds, positions, backend="native")
    want = gumbel_argmax(scores, seeds, positions, backend="reference")
    assert got.dtype == torch.long and got.shape == (rows,)
    assert torch.equal(got, want)


@settings(max_examples=30, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**62 - 1), min_size=1, max_size=4), position=st.integers(0, 10**7))
def test_the_noise_is_exact_in_fp32_and_never_reaches_0_or_1(seeds, position):
    u = counter_uniform(torch.tensor(seeds), torch.full((len(seeds),), position), 50_000)
    assert float(u.min()) >= 2.0 ** -24 and float(u.max()) <= 1 - 2.0 ** -24
    k = u.double() * 2**23 - 0.5  # (k + 1/2) / 2**23 for an integer k
    assert torch.equal(k, k.round())
    assert torch.isfinite(-torch.log(-torch.log(u))).all()  # so a filtered-out token can never be drawn
    assert abs(float(u.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("backend", BACKENDS)
def test_draws_follow_the_softmax_and_never_take_a_filtered_token(backend):
    n = 6000
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf")]).repeat(n, 1)
    drawn = gumbel_argmax(logits, torch.arange(n) * 7 + 11, torch.full((n,), 5), backend=backend)
    freq = torch.bincount(drawn, minlength=4).double() / n
    want = torch.softmax(logits[0].double(), dim=0)
    sigma = (want * (1 - want) / n).sqrt()
    assert freq[3] == 0
    assert (freq[:3] - want[:3]).abs().le(5 * sigma[:3]).all(), (freq.tolist(), want.tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_draws_the_same_token_alone_or_in_any_batch(backend):
    g = torch.Generator().manual_seed(3)
    batch = torch.randn(9, 500, generator=g)
    seeds, positions = torch.randint(0, 2**62, (9,), generator=g), torch.randint(0, 4096, (9,), generator=g)
    together = gumbel_argmax(batch, seeds, positions, backend=backend)
    alone = [int(gumbel_argmax(batch[i:i + 1], seeds[i:i + 1], positions[i:i + 1], backend=backend)) for i in range(9)]
    order = torch.randperm(9, generator=g)
    shuffled = gumbel_argmax(batch[order], seeds[order], positions[order], backend=backend)
    assert together.tolist() == alone
    assert torch.equal(shuffled, together[order])
    # Another position of the same request is another draw (the noise is not reused).
    moved = gumbel_argmax(batch, seeds, positions + 1, backend=backend)
    assert not torch.equal(moved, together)


def test_bad_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"scores must be \(B, V\).*got \(4,\), \(4,\) and \(4,\)"):
        gumbel_argmax(torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"got \(2, 3\), \(3,\) and \(2,\)"):
        gumbel_argmax(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="no columns"):
        gumbel_argmax(torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
