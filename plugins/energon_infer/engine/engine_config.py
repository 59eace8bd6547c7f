"""The engine's one configuration tree, and the flat keywords of ``Engine.from_pretrained`` that map onto it.

    EngineConfig(scheduler=SchedulerConfig(...),   # batching: the token budget, queue, policy, caching
                 runtime=RuntimeConfig(...),       # each worker's layout and cache: tp, pp, dtype, KV tokens
                 faults=FaultConfig(...),          # restarts and the watchdog
                 launch=LaunchConfig(...),         # how the workers are started
                 speculative=SpeculativeConfig(...))  # speculative decoding (None: off)

Every field is declared once, with one default and one validation, in the part that owns it; the
engine derives the rest: the scheduler's cache shape from what the workers report
(:meth:`EngineConfig.scheduler_for`), the workers' ``max_batch_tokens`` from the scheduler's, the
steps in flight from ``pp``. A flat keyword (``max_queue=64``, ``tp=2``) names exactly one field
(:data:`FLAT_OPTIONS`); an unknown one raises naming it and listing the known ones.

Example:
    >>> cfg = engine_config(tp=2, max_queue=64, max_restarts=0)
    >>> (cfg.runtime.tp, cfg.scheduler.max_queue, cfg.faults.max_restarts, cfg.scheduler.prefix_caching)
    (2, 64, 0, True)
    >>> engine_config(max_qeue=3)
    Traceback (most recent call last):
    ...
    energon_infer.errors.UnknownOptionError: unknown option(s) ['max_qeue'] (did you mean max_queue?); ...
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from energon_infer.errors import OptionError, UnknownOptionError, check_choice
from energon_infer.scheduling.rope_switch import switch_of
from energon_infer.scheduling.scheduler_config import AUTO, DEFAULT_MAX_BATCH_TOKENS, SchedulerConfig
from energon_infer.scheduling.speculation import SpeculativeConfig
from energon_infer.worker.runtime_config import RuntimeConfig

if TYPE_CHECKING:
    from energon_infer.protocol import WorkerInfo
    from energon_infer.worker.memory_pool import MemoryPoolConfig

__all__ = ["EngineConfig", "FaultConfig", "LaunchConfig", "FLAT_OPTIONS", "engine_config", "pool_config", "as_speculative",
           "Launcher", "Backend", "SpeculativeConfig"]

Launcher = Literal["spawn", "torchrun"]
Backend = Literal["gloo", "nccl", None]


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultConfig:
    """What the engine does when its workers fail.

    Args:
        restart_workers: restart the worker group after a failure.
        max_restarts: restarts allowed within any ``restart_window_s``; a failure beyond that fails the engine
            closed.
        restart_window_s: the window of ``max_restarts`` (``float("inf")``: over the engine's life).
        step_timeout_s: the watchdog: a step without an answer after this long counts as a hung worker group.
        start_timeout_s: how long loading may take.
    """

    restart_workers: bool = True
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    step_timeout_s: float = 300.0
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise OptionError(f"max_restarts={self.max_restarts} must be >= 0 (0: never restart)")
        if not self.restart_window_s > 0:
            raise OptionError(f"restart_window_s={self.restart_window_s} must be > 0 (inf: over the engine's life)")
        if not self.step_timeout_s > 0 or not self.start_timeout_s > 0:
            raise OptionError(f"step_timeout_s={self.step_timeout_s} and start_timeout_s={self.start_timeout_s} "
                              "must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """How the workers are started.

    Args:
        launcher: ``"spawn"`` (start ``tp * pp`` local worker processes) or ``"torchrun"`` (join the world
            torchrun started, on one or many nodes; this process must be rank 0, the others call
            :func:`energon_infer.worker.torchrun.run_worker`; no restarts).
        backend: ``"gloo"`` or ``"nccl"`` (``None``: NCCL with CUDA, else gloo).
        threads_per_worker: intra-op threads of each worker (0: CPU cores / workers).
    """

    launcher: Launcher = "spawn"
    backend: Backend = None
    threads_per_worker: int = 0

    def __post_init__(self) -> None:
        check_choice("launcher", self.launcher, Launcher)
        check_choice("backend", self.backend, Backend)
        if self.threads_per_worker < 0:
            raise OptionError(f"threads_per_worker={self.threads_per_worker} must be >= 0 (0: CPU cores / workers)")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Everything an :class:`~energon_infer.engine.engine.Engine` is started with, one part per concern.

    Args:
        scheduler: batching options (:class:`~energon_infer.scheduling.scheduler_config.SchedulerConfig`; its cache
            shape comes from the workers, so it is left 0 here).
        runtime: each worker's layout and cache (:class:`~energon_infer.worker.runtime.RuntimeConfig`); its
            ``max_batch_tokens`` is the scheduler's, and ``microbatches=0`` becomes 1 while more than one
            group is in flight (the engine already keeps a step per stage in flight; splitting each step again
            only shrinks the matmuls).
        faults: restarts and the watchdog (:class:`FaultConfig`).
        launch: how the workers start (:class:`LaunchConfig`).
        speculative: speculative decoding (:class:`~energon_infer.scheduling.speculation.SpeculativeConfig`;
            ``None``: off). Its steps are verified before the next is planned: one step of a group in flight.
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name, kind in (("scheduler", SchedulerConfig), ("runtime", RuntimeConfig), ("faults", FaultConfig),
                           ("launch", LaunchConfig)):
            if not isinstance(getattr(self, name), kind):
                raise OptionError(f"{name}={getattr(self, name)!r} must be a {kind.__name__}")
        s, rt = self.scheduler, self.runtime
        if s.bound:
            raise OptionError(f"scheduler.kv_blocks={s.kv_blocks}, block_size={s.block_size} and max_context="
                              f"{s.max_context} come from the workers; leave them 0 and set runtime.kv_cache_tokens / "
                              "runtime.block_size instead")
        if rt.max_batch_tokens not in (DEFAULT_MAX_BATCH_TOKENS, s.max_batch_tokens):
            raise OptionError(f"runtime.max_batch_tokens={rt.max_batch_tokens} differs from scheduler.max_batch_tokens="
                              f"{s.max_batch_tokens}; the engine has one token budget: set scheduler.max_batch_tokens")
        if self.speculative is not None:
            _check_speculative(self.speculative, s, rt)
        if s.preemption == "swap" and not rt.swap_space_tokens:
            raise OptionError("preemption='swap' needs host swap space: pass swap_space_tokens (e.g. 8192), or use "
                              "preemption='auto' / 'recompute'")
        derived = replace(rt, max_batch_tokens=s.max_batch_tokens,
                          microbatches=rt.microbatches or (1 if self.groups > 1 else 0))
        object.__setattr__(self, "runtime", derived)

    @property
    def groups(self) -> int:
        """Groups of requests in flight: the scheduler's, or one per pipeline stage (the non-blocking pipeline)."""
        return self.runtime.pp if self.scheduler.groups == AUTO else self.scheduler.groups

    @property
    def depth(self) -> int:
        """Steps of each group in flight: the scheduler's, or 2 at pp=1 and 1 at pp > 1 (see ``SchedulerConfig.depth``);
        speculating requests sit out a step planned before their proposals are verified (``Speculator.waits``)."""
        if self.scheduler.depth != AUTO:
            return self.scheduler.depth
        return 2 if self.runtime.pp == 1 else 1

    def scheduler_for(self, *, kv_blocks: int, block_size: int, max_context: int, host_blocks: int = 0,
                      swap_s_per_block: float = 0.0, recompute_s_per_token: float = 0.0,
                      kv_window: int = 0, rope_switch: int = 0, kv_groups: tuple[int, ...] = ()) -> SchedulerConfig:
        """The scheduler's limits once the workers have reported their cache: these options with its shape."""
        return replace(self.scheduler, kv_blocks=kv_blocks, block_size=block_size, max_context=max_context,
                       groups=self.groups, depth=self.depth,
                       late_admission=self.scheduler.late_admission and self.runtime.tp * self.runtime.pp == 1,
                       preemption=self.scheduler.preemption if host_blocks else "recompute",
                       host_blocks=host_blocks, swap_s_per_block=swap_s_per_block,
                       recompute_s_per_token=recompute_s_per_token, kv_window=kv_window, rope_switch=rope_switch,
                       kv_groups=kv_groups)

    def scheduler_from(self, info: WorkerInfo, *, max_context: int) -> SchedulerConfig:
        """:meth:`scheduler_for` with what a worker reported: its cache, swap costs, window and model's rope switch."""
        return self.scheduler_for(kv_blocks=info.kv_blocks, block_size=info.block_size, max_context=max_context,
                                  host_blocks=info.host_blocks, swap_s_per_block=info.swap_s_per_block,
                                  recompute_s_per_token=info.recompute_s_per_token, kv_window=info.kv_window,
                                  rope_switch=switch_of(info.config.get("rope")), kv_groups=tuple(info.kv_groups))


def _check_speculative(spec: Any, s: SchedulerConfig, rt: RuntimeConfig) -> None:
    if not isinstance(spec, SpeculativeConfig):
        raise OptionError(f"speculative={spec!r} must be a SpeculativeConfig (or, as a keyword, 'ngram' or a draft "
                          "model directory)")
    if rt.tp * rt.pp != 1:
        raise OptionError(f"speculative decoding runs on one worker (tp=1, pp=1), not tp={rt.tp} x pp={rt.pp}; serve "
                          "without speculative=, or on one device")


def as_speculative(value: Any) -> SpeculativeConfig | None:
    """``speculative=`` as given to ``from_pretrained`` / ``serve``: a :class:`SpeculativeConfig`, ``"ngram"``, a draft
    model's directory, a dict of its fields, or ``None`` (off)."""
    if value is None or value is False or isinstance(value, SpeculativeConfig):
        return value or None
    if isinstance(value, dict):
        return SpeculativeConfig(**value)
    if isinstance(value, str) and value == "ngram":
        return SpeculativeConfig(method="ngram")
    if isinstance(value, (str, os.PathLike)):
        return SpeculativeConfig(method="draft", draft_model=os.fspath(value))
    raise OptionError(f"speculative={value!r}: give 'ngram', a draft model directory, or a SpeculativeConfig")


# Scheduler fields the workers report, not options; and the runtime's token budget, which is the scheduler's.
_REPORTED = {"kv_blocks", "block_size", "max_context", "host_blocks", "swap_s_per_block", "recompute_s_per_token",
             "groups", "depth", "kv_window", "rope_switch", "kv_groups"}
# The flat names of the steps in flight predate the tree (``Engine.from_pretrained(d, pipeline_depth=3)``).
_RENAMED = {"pipeline_groups": "groups", "pipeline_depth": "depth"}


def _flat_options() -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {flat: ("scheduler", name) for flat, name in _RENAMED.items()}
    for section, kind, skip in (("scheduler", SchedulerConfig, _REPORTED), ("runtime", RuntimeConfig,
                                                                             {"max_batch_tokens"}),
                                ("faults", FaultConfig, set()), ("launch", LaunchConfig, set())):
        for f in dataclasses.fields(kind):
            if f.name not in skip:
                assert f.name not in out, f"flat option {f.name!r} would name two fields"
                out[f.name] = (section, f.name)
    return out


#: Flat keyword -> (part of the tree, field): each keyword names exactly one field.
FLAT_OPTIONS: dict[str, tuple[str, str]] = _flat_options()


def engine_config(base: EngineConfig | None = None, **options: Any) -> EngineConfig:
    """``base`` (default: every default) with each flat keyword set on the one field it names.

    Raises :class:`~energon_infer.errors.UnknownOptionError` (a ``TypeError``) for a keyword that names no
    field, listing the known ones, and :class:`~energon_infer.errors.OptionError` for a value a field refuses.
    """
    if "speculative" in options:  # a part of its own, not a field of one: set whole
        base = replace(base or EngineConfig(), speculative=as_speculative(options.pop("speculative")))
    unknown = sorted(set(options) - set(FLAT_OPTIONS))
    if unknown:
        close = [m[0] for u in unknown if (m := difflib.get_close_matches(u, list(FLAT_OPTIONS), 1))]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UnknownOptionError(f"unknown option(s) {unknown}{hint}; the engine takes {sorted(FLAT_OPTIONS)}, or "
                                 "config=EngineConfig(scheduler=..., runtime=..., faults=..., launch=...)")
    base = base or EngineConfig()
    parts: dict[str, dict[str, Any]] = {}
    for flat, value in options.items():
        section, name = FLAT_OPTIONS[flat]
        parts.setdefault(section, {})[name] = value
    # The runtime's budget is the scheduler's: re-derived in __post_init__ from the new scheduler.
    changed = {section: replace(getattr(base, section), **values) for section, values in parts.items()}
    if "scheduler" in changed and "max_batch_tokens" in parts["scheduler"]:
        changed["runtime"] = replace(changed.get("runtime", base.runtime), max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS)
    return replace(base, **changed)


def pool_config(memory_pool: Any) -> MemoryPoolConfig | None:
    """The ``memory_pool=`` argument of the engine's factories as a :class:`MemoryPoolConfig` (``None``: off)."""
    from energon_infer.worker.memory_pool import MemoryPoolConfig  # torch: not for `serve --help`

    if memory_pool is None or memory_pool is False or memory_pool == 0:
        return None
    if isinstance(memory_pool, MemoryPoolConfig):
        return memory_pool
    if isinstance(memory_pool, (int, float)) and not isinstance(memory_pool, bool):
        return MemoryPoolConfig(fraction=float(memory_pool))
    if isinstance(memory_pool, str):
        return MemoryPoolConfig(device_budget=memory_pool)
    if isinstance(memory_pool, dict):
        return MemoryPoolConfig(**memory_pool)
    raise TypeError(f"memory_pool={memory_pool!r}: give a fraction of layers (0.5), a device budget ('2GiB'), "
                    "a MemoryPoolConfig, or None")
