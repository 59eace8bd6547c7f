"""The engine's one configuration tree: one default and one validation per field, flat keywords that each name one
field, an unknown keyword named with the known ones, ``Literal`` choices refused in one line, and the defaults the
engine ran with before the tree (prefix caching on, preemption auto, one group per stage, depth 2 at pp=1)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer.engine.engine_config import (
    FLAT_OPTIONS,
    EngineConfig,
    FaultConfig,
    LaunchConfig,
    engine_config,
)
from energon_infer.errors import EnergonError, OptionError, UnknownOptionError
from energon_infer.scheduling.scheduler_config import AUTO, DEFAULT_MAX_BATCH_TOKENS, SchedulerConfig
from energon_infer.worker.runtime import RuntimeConfig

PARTS = {"scheduler": SchedulerConfig, "runtime": RuntimeConfig, "faults": FaultConfig, "launch": LaunchConfig}


def _names(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


def test_each_field_is_declared_in_one_part_except_the_two_the_engine_derives():
    seen: dict[str, list[str]] = {}
    for part, kind in PARTS.items():
        for name in _names(kind):
            seen.setdefault(name, []).append(part)
    twice = {name: parts for name, parts in seen.items() if len(parts) > 1}
    # block_size: the scheduler's is reported by the workers (0 in the options); max_batch_tokens: the runtime's is
    # the scheduler's (derived), both checked below.
    assert twice == {"block_size": ["scheduler", "runtime"], "max_batch_tokens": ["scheduler", "runtime"]}
    cfg = EngineConfig()
    assert cfg.scheduler.block_size == 0 and cfg.runtime.block_size == RuntimeConfig().block_size
    assert cfg.runtime.max_batch_tokens == cfg.scheduler.max_batch_tokens == DEFAULT_MAX_BATCH_TOKENS
    assert engine_config(max_batch_tokens=123).runtime.max_batch_tokens == 123
    with pytest.raises(OptionError, match="the engine has one token budget: set scheduler.max_batch_tokens"):
        EngineConfig(runtime=RuntimeConfig(max_batch_tokens=100))


def test_the_defaults_are_what_the_engine_ran_before_the_tree():
    cfg = EngineConfig()
    s = cfg.scheduler
    assert (s.prefix_caching, s.preemption, s.policy, s.kv_admission) == (True, "auto", "continuous", "on_demand")
    assert (s.max_running, s.max_queue, s.chunked_prefill) == (256, 1024, False)
    assert (cfg.groups, cfg.depth, cfg.runtime.microbatches) == (1, 2, 0)
    pp2 = engine_config(pp=2)
    assert (pp2.groups, pp2.depth, pp2.runtime.microbatches) == (2, 1, 1)  # one step per stage, not re-split
    assert engine_config(pp=2, microbatches=2).runtime.microbatches == 2
    assert (cfg.faults, cfg.launch) == (FaultConfig(max_restarts=3, restart_window_s=3600.0), LaunchConfig())
    # A scheduler of its own (no pipeline) runs one group, one step at a time.
    alone = SchedulerConfig(kv_blocks=8, block_size=4, max_context=32)
    assert (alone.groups, alone.depth) == (1, 1)


def test_scheduler_for_fills_the_cache_shape_the_workers_report():
    cfg = engine_config(pp=2, max_queue=7, preemption="auto")
    limits = cfg.scheduler_for(kv_blocks=10, block_size=4, max_context=64)
    assert (limits.kv_blocks, limits.block_size, limits.max_context, limits.max_queue) == (10, 4, 64, 7)
    assert (limits.groups, limits.depth, limits.preemption) == (2, 1, "recompute")  # no host blocks: recompute
    swap = cfg.scheduler_for(kv_blocks=10, block_size=4, max_context=64, host_blocks=3, swap_s_per_block=1e-3)
    assert (swap.preemption, swap.host_blocks) == ("auto", 3)
    with pytest.raises(OptionError, match="come from the workers"):
        EngineConfig(scheduler=SchedulerConfig(kv_blocks=4, block_size=4, max_context=16))
    with pytest.raises(OptionError, match="must all be >= 1"):
        SchedulerConfig(kv_blocks=4)


def test_every_flat_keyword_names_exactly_one_field_and_reaches_it():
    targets = list(FLAT_OPTIONS.values())
    assert len(targets) == len(set(targets))  # no two keywords for one field
    for flat, (part, name) in FLAT_OPTIONS.items():
        assert name in _names(PARTS[part]), flat
    values = dict(tp=2, max_queue=64, max_restarts=0, launcher="torchrun", pipeline_depth=3, pipeline_groups=2,
                  max_batch_tokens=100, kv_cache_tokens=8192, prefix_caching=False, threads_per_worker=2)
    cfg = engine_config(**values)
    for flat, value in values.items():
        part, name = FLAT_OPTIONS[flat]
        assert getattr(getattr(cfg, part), name) == value, flat
    # On a base tree, only the named fields change.
    again = engine_config(cfg, max_queue=5)
    assert again.scheduler.max_queue == 5 and again.runtime.tp == 2 and again.scheduler.depth == 3
    # What the workers report is no option.
    assert not {"kv_blocks", "max_context", "host_blocks", "groups", "depth"} & set(FLAT_OPTIONS)


def test_an_unknown_keyword_is_named_with_the_known_ones():
    with pytest.raises(UnknownOptionError) as info:
        engine_config(max_qeue=3, tp=1)
    message = str(info.value)
    assert message.startswith("unknown option(s) ['max_qeue'] (did you mean max_queue?)")
    assert all(repr(name) in message for name in FLAT_OPTIONS)
    assert isinstance(info.value, TypeError) and isinstance(info.value, EnergonError)


@pytest.mark.parametrize("make,field,bad", [
    (lambda v: SchedulerConfig(policy=v), "policy", "greedy"),
    (lambda v: SchedulerConfig(kv_admission=v), "kv_admission", "lazy"),
    (lambda v: SchedulerConfig(preemption=v), "preemption", "evict"),
    (lambda v: LaunchConfig(launcher=v), "launcher", "ssh"),
    (lambda v: LaunchConfig(backend=v), "backend", "mpi"),
])
def test_a_literal_choice_outside_its_values_fails_in_one_line(make, field, bad):
    with pytest.raises(OptionError) as info:
        make(bad)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{field}={bad!r} must be one of (")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=12))
def test_any_policy_string_is_accepted_only_if_it_is_a_choice(text):
    if text in ("continuous", "static"):
        assert SchedulerConfig(policy=text).policy == text  # type: ignore[arg-type]
    else:
        with pytest.raises(OptionError, match="must be one of"):
            SchedulerConfig(policy=text)  # type: ignore[arg-type]


def test_each_number_is_checked_once_where_it_is_declared():
    for make, needle in [(lambda: FaultConfig(max_restarts=-1), "max_restarts=-1"),
                         (lambda: FaultConfig(step_timeout_s=0), "step_timeout_s=0"),
                         (lambda: LaunchConfig(threads_per_worker=-2), "threads_per_worker=-2"),
                         (lambda: SchedulerConfig(depth=0), "depth=0 must be >= 1"),
                         (lambda: SchedulerConfig(max_queue=-1), "max_queue=-1")]:
        with pytest.raises(OptionError, match=needle):
            make()
    assert SchedulerConfig(groups=AUTO).groups == AUTO  # the engine chooses
    with pytest.raises(OptionError, match="preemption='swap' needs host swap space: pass swap_space_tokens"):
        engine_config(preemption="swap")
    assert engine_config(preemption="swap", swap_space_tokens=64).scheduler.preemption == "swap"
    with pytest.raises(OptionError, match="must be a RuntimeConfig"):
        EngineConfig(runtime=FaultConfig())  # type: ignore[arg-type]
