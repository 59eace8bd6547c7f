"""Property-based input checks (issue 18): random valid input never raises, random invalid input always
raises the library's own error type (``PlanError``, ``ProfileError``, ``ValueError``), never a bare
``TypeError``/``ZeroDivisionError`` or a silently wrong object. Bounded example counts keep ``make test`` fast.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.planner.errors import PlanError
from tightfit.planner.pipeline import DeviceSpec, LayerMemory, PipelineProblem, plan_pipeline
from tightfit.planner.pool import plan_pool
from tightfit.profiler.types import ClusterSpec, DeviceProfile, ProfileError
from tightfit.units import parse_bytes

FAST = settings(max_examples=60, deadline=None)

# Values no planner can use where a positive finite number is needed.
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
NOT_A_NUMBER = st.sampled_from(["2", None, [1], True, {"a": 1}])
BAD_POSITIVE = st.one_of(NON_FINITE, NOT_A_NUMBER, st.floats(max_value=0.0, allow_nan=False),
                         st.integers(max_value=0))
BAD_COUNT = st.one_of(BAD_POSITIVE, st.floats(min_value=1.01, max_value=1e6).filter(lambda x: x != int(x)))

speeds = st.floats(min_value=0.05, max_value=20.0)
mems = st.integers(min_value=2**20, max_value=2**40)
layer_cost = st.floats(min_value=0.0, max_value=10.0)
layer_mem = st.builds(LayerMemory, param_bytes=st.integers(0, 2**30), activation_bytes=st.integers(0, 2**28),
                      output_bytes=st.integers(0, 2**26))


@st.composite
def problems(draw):
    devices = draw(st.integers(1, 4))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    chunks = draw(st.integers(1, 3)) if schedule == "interleaved" else 1
    layers = draw(st.integers(devices * chunks, devices * chunks + 6))
    links = draw(st.one_of(st.none(), st.floats(min_value=1e6, max_value=1e12)))
    return dict(layer_costs=draw(st.lists(layer_cost, min_size=layers, max_size=layers)),
                layer_memory=draw(st.lists(layer_mem, min_size=layers, max_size=layers)),
                devices=tuple(DeviceSpec(name=f"d{i}", speed=draw(speeds), memory_bytes=draw(mems))
                              for i in range(devices)),
                microbatches=draw(st.integers(1, 8)), schedule=schedule, links=links, virtual_stages=chunks,
                optimizer_state_factor=draw(st.floats(min_value=0.0, max_value=4.0)))


@FAST
@given(problems())
def test_valid_pipeline_problems_build_and_plan(kw):
    problem = PipelineProblem(**kw)
    plan = plan_pipeline(problem, "even")
    assert math.isfinite(plan.step_time_s) and plan.step_time_s >= 0
    assert plan.boundaries[0] == 0 and plan.boundaries[-1] == problem.num_layers


@FAST
@given(problems(), st.sampled_from(["microbatches", "virtual_stages", "optimizer_state_factor", "links",
                                    "layer_costs"]), st.data())
def test_invalid_pipeline_problems_raise_plan_error(kw, field, data):
    if field in ("microbatches", "virtual_stages"):
        kw[field] = data.draw(BAD_COUNT)
    elif field == "optimizer_state_factor":
        kw[field] = data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.floats(max_value=-1e-9, allow_nan=False)))
    elif field == "links":
        kw[field] = data.draw(st.one_of(st.just(float("nan")), st.floats(max_value=0.0, allow_nan=False)))
    else:
        costs = list(kw["layer_costs"])
        costs[data.draw(st.integers(0, len(costs) - 1))] = data.draw(
            st.one_of(NON_FINITE, NOT_A_NUMBER, st.floats(max_value=-1e-9, allow_nan=False)))
        kw[field] = costs
    with pytest.raises(PlanError):
        PipelineProblem(**kw)


FRACTIONAL = st.floats(min_value=0.5, max_value=2**40).filter(lambda x: x != int(x))


@FAST
@given(BAD_POSITIVE, st.one_of(BAD_POSITIVE, FRACTIONAL),
       st.one_of(NON_FINITE, NOT_A_NUMBER, st.integers(max_value=-1), FRACTIONAL))
def test_invalid_device_specs_and_layer_memory_raise_plan_error(speed, memory, param_bytes):
    with pytest.raises(PlanError, match="speed"):
        DeviceSpec(name="d", speed=speed, memory_bytes=2**30)
    with pytest.raises(PlanError, match="memory_bytes"):
        DeviceSpec(name="d", memory_bytes=memory)
    with pytest.raises(PlanError, match="param_bytes"):
        LayerMemory(param_bytes=param_bytes)


def test_reported_cases_nan_memory_and_fractional_microbatches():
    """Issue 18: Sky accepted NaN memory and microbatches=2.5; a NaN link priced transfers as free."""
    dev = DeviceSpec(name="a", memory_bytes=2**30)
    with pytest.raises(PlanError, match=r"device 'b': memory_bytes=nan must be a whole number > 0"):
        DeviceSpec(name="b", memory_bytes=float("nan"))
    with pytest.raises(PlanError, match=r"microbatches=2\.5 must be a whole number >= 1; give a whole count"):
        PipelineProblem(layer_costs=[1.0] * 4, layer_memory=[1] * 4, devices=[dev], microbatches=2.5,
                        schedule="gpipe")
    with pytest.raises(PlanError, match=r"links has bandwidths \[nan, nan\] between devices"):
        PipelineProblem(layer_costs=[1.0] * 4, layer_memory=[1] * 4, devices=[dev, dev], microbatches=2,
                        schedule="gpipe", links=[[0, float("nan")], [float("nan"), 0]])


# ---- the pool planner ----------------------------------------------------------------------------
@FAST
@given(st.lists(st.integers(0, 2**30), min_size=1, max_size=12), st.integers(0, 2**30),
       st.one_of(st.none(), st.integers(0, 2**34)), st.floats(0.0, 1.0), st.integers(0, 4))
def test_valid_pool_inputs_give_a_plan_or_infeasible(layers, resident, budget, fraction, lookahead):
    from tightfit.planner.errors import PlanInfeasibleError

    try:
        plan = plan_pool(layers, resident_bytes=resident, budget_bytes=budget, fraction=fraction, lookahead=lookahead)
    except PlanInfeasibleError as err:
        assert budget is not None and err.needed_bytes > budget
        return
    assert budget is None or plan.device_bytes <= budget


@FAST
@given(st.sampled_from(["layer", "resident_bytes", "budget_bytes", "fraction", "lookahead"]), st.data())
def test_invalid_pool_inputs_raise_plan_error(field, data):
    kw = dict(resident_bytes=0, budget_bytes=None, fraction=0.5, lookahead=1)
    layers = [100, 200, 300]
    if field == "layer":
        layers[1] = data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.integers(max_value=-1), st.just(1.5)))
    elif field == "fraction":
        kw[field] = data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.floats(min_value=1.001, max_value=1e9),
                                        st.floats(max_value=-1e-9, allow_nan=False)))
    else:
        kw[field] = data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.integers(max_value=-1), st.just(2.5))
                              .filter(lambda v: not (field == "budget_bytes" and v is None)))  # None: no budget
    with pytest.raises(PlanError):
        plan_pool(layers, **kw)  # type: ignore[arg-type]


# ---- device profiles and clusters ----------------------------------------------------------------
def _profile(**changes) -> DeviceProfile:
    base = dict(name="cpu", kind="cpu", memory_bytes=2**34, free_bytes=2**33, matmul_flops={"float32": 5e10},
                host_adam_elems_per_s=3e8, collective_bytes_per_s={"all_gather": {2**20: 1e9}})
    return DeviceProfile(**{**base, **changes})


rates = st.floats(min_value=1e3, max_value=1e15)


@FAST
@given(rates, rates, st.integers(1, 2**45), st.integers(1, 8))
def test_valid_device_profiles_and_clusters(flops, coll, memory, count):
    prof = _profile(matmul_flops={"float32": flops}, memory_bytes=memory,
                    collective_bytes_per_s={"all_gather": {2**20: coll}, "reduce_scatter": {2**24: coll}})
    assert DeviceProfile.from_json(prof.to_json()) == prof
    assert ClusterSpec.uniform(prof, count).world_size == count


@FAST
@given(st.sampled_from(["collective", "matmul", "memory_bytes", "free_bytes", "host_adam_elems_per_s",
                        "world_size", "h2d"]), st.data())
def test_invalid_device_profiles_raise_profile_error(field, data):
    bad_rate = data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.floats(max_value=0.0, allow_nan=False)))
    changes = {
        "collective": {"collective_bytes_per_s": {"all_gather": {2**20: bad_rate}}},
        "matmul": {"matmul_flops": {"float32": bad_rate}},
        "h2d": {"h2d_bytes_per_s": {"pinned": bad_rate}},
        "memory_bytes": {"memory_bytes": data.draw(BAD_POSITIVE)},
        "free_bytes": {"free_bytes": data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.integers(max_value=-1)))},
        "host_adam_elems_per_s": {"host_adam_elems_per_s": data.draw(
            st.one_of(NON_FINITE, NOT_A_NUMBER, st.floats(max_value=-1e-9, allow_nan=False)))},
        "world_size": {"world_size": data.draw(BAD_COUNT)},
    }[field]
    with pytest.raises(ProfileError):
        _profile(**changes)


def test_reported_case_nan_or_zero_collective_bandwidth():
    """Issue 18: NaN collective bandwidth gave a plan with free communication; 0 gave ZeroDivisionError."""
    for bad in (float("nan"), 0.0):
        with pytest.raises(ProfileError, match=rf"collective_bytes_per_s\['all_gather'\]\['1048576'\]={bad!r} must be "
                                               r"a finite number > 0; leave the entry out when it was not measured"):
            _profile(collective_bytes_per_s={"all_gather": {2**20: bad}})
    with pytest.raises(ProfileError, match=r"ClusterSpec: inter_node_bytes_per_s=nan must be a finite number >= 0"):
        ClusterSpec(devices=(_profile(),), inter_node_bytes_per_s=float("nan"))
    # A profile file with a NaN (written as null) is refused when read back, not planned with.
    text = _profile().to_json().replace("1000000000.0", "null")
    with pytest.raises(ProfileError, match=r"collective_bytes_per_s\['all_gather'\]\['1048576'\]=None"):
        DeviceProfile.from_json(text)


# ---- byte sizes ----------------------------------------------------------------------------------
units = st.sampled_from(["B", "KiB", "MiB", "GiB", "KB", "MB", "GB", ""])


@FAST
@given(st.integers(0, 2**50), st.sampled_from(["B", "KiB", "MiB", "GiB", "KB", "MB", "GB", ""]))
def test_valid_byte_sizes_parse(n, unit):
    assert parse_bytes(f"{n}{unit}") >= n
    assert parse_bytes(n) == n


# Text that reads as a size: digits (a fraction too), then a unit tightfit knows or none, in any case, spaces around.
# ("0B" once passed the old filter, which only left out bare digits, and failed the test below.)
SIZE_TEXT = re.compile(r"\s*[0-9]*\.?[0-9]+\s*(b|k|kb|m|mb|g|gb|t|tb|kib|mib|gib|tib)?\s*", re.IGNORECASE)


@FAST
@given(st.one_of(NON_FINITE, st.integers(max_value=-1), st.floats(min_value=0.001, max_value=1e9).filter(
    lambda x: x != int(x)), st.text(max_size=8).filter(lambda t: not SIZE_TEXT.fullmatch(t))))
def test_invalid_byte_sizes_raise_value_error(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)
    if isinstance(bad, float) and math.isfinite(bad) and bad > 0:
        with pytest.raises(ValueError, match="not a whole number of bytes; add a unit"):
            parse_bytes(str(bad))  # issue 18: "1.5" was read as 1 byte


def test_reported_case_a_fraction_is_not_a_byte_size():
    with pytest.raises(ValueError, match=r"memory size '1\.5' is not a whole number of bytes; add a unit \('1\.5GiB'\)"):
        parse_bytes("1.5")
    assert parse_bytes("1.5GiB") == 3 * 2**29


# ---- the Elixir planner's knobs ------------------------------------------------------------------
@FAST
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.floats(0.0, 0.99), st.floats(0.01, 1.0),
       st.one_of(st.none(), st.integers(0, 2**34)), st.integers(1, 10**6))
def test_valid_elixir_constraints(depths, fragmentation, host_fraction, reserved, limit):
    from tightfit.planner.elixir import ElixirConstraints

    cons = ElixirConstraints(prefetch_depths=tuple(depths), fragmentation=fragmentation,
                             host_memory_fraction=host_fraction, reserved_bytes=reserved, exhaustive_limit=limit)
    assert cons.space() is not None


@FAST
@given(st.sampled_from(["prefetch_depths", "fragmentation", "host_memory_fraction", "reserved_bytes",
                        "exhaustive_limit"]), st.data())
def test_invalid_elixir_constraints_raise_plan_error(field, data):
    from tightfit.planner.elixir import ElixirConstraints

    if field == "prefetch_depths":
        bad = (data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.integers(max_value=0), st.just(1.5))),)
    elif field in ("fragmentation", "host_memory_fraction"):
        bad = data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.floats(min_value=1.001, max_value=9),
                                  st.floats(max_value=-1e-9, allow_nan=False)))
    else:
        bad = data.draw(st.one_of(NON_FINITE, NOT_A_NUMBER, st.integers(max_value=-1), st.just(2.5))
                        .filter(lambda v: not (field == "reserved_bytes" and v is None)))  # None: the default
    with pytest.raises(PlanError):
        ElixirConstraints(**{field: bad})


def test_reported_case_a_budget_of_one_and_a_half_is_not_one_byte():
    """Issue 18: ``plan elixir --budget 1.5`` was read as 1 byte ("no plan fits 1 B")."""
    from tightfit.planner.elixir import resolve_budget

    cluster = ClusterSpec.uniform(_profile(), 2)
    assert resolve_budget(0.5, cluster)[0] == 2**33  # a fraction of the smallest device
    for bad in (1.5, "1.5", float("nan"), "abc"):
        with pytest.raises(PlanError, match=r"memory_budget: .*(whole number of bytes|finite|cannot read)"):
            resolve_budget(bad, cluster)
