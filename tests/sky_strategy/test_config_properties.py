"""Property-based checks of ``SkyConfig`` (issue 18): valid knobs never raise; NaN memory, ``microbatches=2.5``,
negative or non-numeric values always raise ``ValueError`` naming the knob."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.runif import RunIf

pytestmark = RunIf(lightning=True)
FAST = settings(max_examples=80, deadline=None)
NON_FINITE = st.sampled_from([float("nan"), float("inf"), -float("inf")])
JUNK = st.one_of(NON_FINITE, st.just("2"), st.just([1]), st.booleans())


@FAST
@given(st.sampled_from(["gpipe", "1f1b", "interleaved"]), st.integers(1, 64), st.integers(1, 4),
       st.one_of(st.none(), st.lists(st.floats(0.01, 10.0), min_size=1, max_size=4)),
       st.one_of(st.none(), st.lists(st.integers(1, 2**40), min_size=1, max_size=4)),
       st.one_of(st.none(), st.floats(1e3, 1e12)), st.floats(0.01, 5.0), st.integers(1, 10),
       st.one_of(st.none(), st.floats(0.0, 4.0)))
def test_valid_sky_configs(schedule, microbatches, chunks, speeds, caps, link, threshold, repeats, factor):
    from sky_strategy.config import SkyConfig

    cfg = SkyConfig(schedule=schedule, microbatches=microbatches, virtual_stages=chunks,
                    speed_factors=None if speeds is None else tuple(speeds),
                    memory_caps=None if caps is None else tuple(caps), link_bandwidth=link,
                    replan_threshold=threshold, profile_repeats=repeats, optimizer_state_factor=factor)
    assert cfg.microbatches == microbatches


@FAST
@given(st.sampled_from(["microbatches", "virtual_stages", "profile_repeats", "replan_every", "pipeline_ranks",
                        "link_bandwidth", "replan_threshold", "optimizer_state_factor", "memory_caps",
                        "speed_factors"]), st.data())
def test_invalid_sky_configs_raise_value_error(field, data):
    from sky_strategy.config import SkyConfig

    if field in ("microbatches", "virtual_stages", "profile_repeats", "replan_every", "pipeline_ranks"):
        bad = data.draw(st.one_of(JUNK, st.integers(max_value=0), st.just(2.5)))
    elif field in ("memory_caps", "speed_factors"):
        one = data.draw(st.one_of(NON_FINITE, st.just(-1), st.just(0), *([st.just("x")] if field == "speed_factors"
                                                                          else [st.just("2 gigs"), st.just(1.5)])))
        bad = (one,)
    else:
        bad = data.draw(st.one_of(JUNK, st.floats(max_value=-1e-9, allow_nan=False),
                                  *([st.just(0.0)] if field != "optimizer_state_factor" else [])))
    with pytest.raises(ValueError, match=field):
        SkyConfig(**{field: bad})


def test_reported_cases_nan_memory_and_fractional_microbatches():
    from sky_strategy.config import SkyConfig

    with pytest.raises(ValueError, match=r"SkyStrategy: microbatches=2\.5 must be a whole number >= 1"):
        SkyConfig(microbatches=2.5)
    with pytest.raises(ValueError, match=r"SkyStrategy: memory_caps\[1\]: memory size nan is not a finite number"):
        SkyConfig(memory_caps=(2**30, float("nan")))
    with pytest.raises(ValueError, match=r"SkyStrategy: link_bandwidth=nan must be a finite number > 0"):
        SkyConfig(link_bandwidth=float("nan"))
