"""Property-based checks of ``CacheConfig`` and ``RowOptimizer`` (issue 18): random valid input never raises,
random invalid input raises ``ValueError`` (never a ``TypeError`` or a silently odd config)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_cache.config import OPTIMIZERS, POLICIES, CacheConfig, RowOptimizer

FAST = settings(max_examples=80, deadline=None)
NON_FINITE = st.sampled_from([float("nan"), float("inf"), -float("inf")])

capacities = st.one_of(st.floats(min_value=1e-6, max_value=1.0), st.integers(1, 10**9),
                       st.builds(lambda n, u: f"{n}{u}", st.integers(1, 4096), st.sampled_from(["KiB", "MiB", "GB"])))
optimizers = st.builds(RowOptimizer, kind=st.sampled_from(OPTIMIZERS), lr=st.floats(1e-8, 10.0),
                       eps=st.floats(0.0, 1e-3), beta1=st.floats(0.0, 0.999), beta2=st.floats(0.0, 0.9999),
                       initial_accumulator_value=st.floats(0.0, 1.0))


@FAST
@given(capacities, st.sampled_from(POLICIES), st.integers(0, 8), st.one_of(st.none(), optimizers))
def test_valid_cache_configs(capacity, policy, prefetch, optimizer):
    cfg = CacheConfig(capacity=capacity, policy=policy, prefetch=prefetch, optimizer=optimizer)
    assert cfg.capacity_kind() in ("ratio", "rows", "bytes")


@FAST
@given(st.sampled_from(["capacity", "policy", "prefetch", "optimizer"]), st.data())
def test_invalid_cache_configs_raise_value_error(field, data):
    bad = data.draw({
        "capacity": st.one_of(NON_FINITE, st.floats(min_value=1.001, max_value=1e9).filter(lambda x: x != int(x)),
                              st.floats(max_value=0.0, allow_nan=False), st.integers(max_value=0), st.booleans(),
                              st.just("0.5"), st.just("64 gigs"), st.just("0MiB")),
        "policy": st.one_of(st.text(max_size=5).filter(lambda t: t not in POLICIES), st.none()),
        "prefetch": st.one_of(st.integers(max_value=-1), st.just(1.5), st.booleans(), st.just("2")),
        "optimizer": st.one_of(st.just("sgd"), st.just({"kind": "sgd"})),
    }[field])
    with pytest.raises(ValueError):
        CacheConfig(**{field: bad})


@FAST
@given(st.sampled_from(["lr", "eps", "beta1", "beta2", "initial_accumulator_value"]), st.data())
def test_invalid_row_optimizers_raise_value_error(field, data):
    bad = data.draw(st.one_of(NON_FINITE, st.just("0.1"), st.none(), st.floats(max_value=-1e-9, allow_nan=False),
                              *([st.floats(min_value=1.0, max_value=9.0)] if field.startswith("beta") else []),
                              *([st.just(0.0)] if field == "lr" else [])))
    with pytest.raises(ValueError):
        RowOptimizer(**{field: bad})
