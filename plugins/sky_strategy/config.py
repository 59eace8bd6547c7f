"""``SkyConfig``: every knob of :class:`~sky_strategy.SkyStrategy`, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tightfit.checks import check_number
from tightfit.planner.pipeline import SCHEDULES, partitioners
from tightfit.units import parse_bytes

__all__ = ["SkyConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SkyConfig:
    """Configuration of the Sky pipeline strategy.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (``torch.distributed.pipelining`` schedules).
        microbatches: microbatches per step (1F1B needs at least one per stage).
        virtual_stages: chunks per rank for ``"interleaved"``.
        partition: a partitioner registered in ``tightfit.planner.pipeline.partitioners``:
            ``"balanced"`` (our planner), ``"even"``, ``"parameter-balanced"``, ``"sky"`` (Sky
            Computing's allocator), ``"sky-fixed"``; or explicit layer boundaries ``(0, b1, ..., L)``.
        order: device-order search for ``"balanced"``: ``"search"`` or ``"given"`` (interleaved: given).
        speed_factors: per rank, the speed this rank plays (``0.33``: three times slower); ``None``: 1.0.
        memory_caps: per rank, the memory a stage may use (bytes or ``"2GiB"``); ``None``: measured.
        link_bandwidth: bytes/s between ranks, replacing the measured links; ``None``: measure.
        throttle: make injected speed factors real (a slowed rank sleeps for the time it would lack).
        replan_every: every N optimizer steps compare measured stage times and re-plan if they drifted.
        replan_threshold: relative drift of any rank's stage time that triggers a re-plan.
        profile_repeats: timed repeats per layer when profiling.
        profile_clock: ``"wall"`` (elapsed time) or ``"cpu"`` (process CPU time, CPU devices only: immune
            to other jobs on a shared host, see :func:`tightfit.profiler.timing.clock_of`).
        optimizer_state_factor: optimizer-state bytes per parameter byte; ``None``: from the optimizer
            (Adam/AdamW 2, SGD with momentum 1, otherwise 0).
        check_forward: verify once that ``forward`` equals the declared layers applied in order.
        verbose: log profiling progress, the plan and re-plans on rank 0 (logger ``sky_strategy``, INFO).
        data_parallel: replicas of the pipeline. ``1``: one pipeline over all ranks; ``N``: the world is
            ``N`` replicas x ``world / N`` pipeline ranks (world must be a multiple of ``N``); ``"auto"``:
            ``world / pipeline_ranks`` replicas (``pipeline_ranks`` given, or read from explicit
            ``partition`` boundaries). Replicas see different data and average their gradients.
        pipeline_ranks: ranks per pipeline (one stage each; interleaved: ``virtual_stages`` each); with
            ``data_parallel="auto"`` it sets the replica count, with an integer it must agree.
    """

    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 2
    partition: str | tuple[int, ...] = "balanced"
    order: str = "search"
    speed_factors: tuple[float, ...] | None = None
    memory_caps: tuple[int, ...] | None = None
    link_bandwidth: float | None = None
    throttle: bool = True
    replan_every: int | None = None
    replan_threshold: float = 0.25
    profile_repeats: int = 3
    profile_clock: str = "wall"
    optimizer_state_factor: float | None = None
    check_forward: bool = True
    verbose: bool = True
    data_parallel: int | str = 1
    pipeline_ranks: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"SkyStrategy: schedule={self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        where = "SkyStrategy"
        check_number(self.microbatches, "microbatches", where=where, integer=True, low=1,
                     fix="give a whole count per step, e.g. microbatches=4 (1F1B needs at least one per stage)")
        check_number(self.virtual_stages, "virtual_stages", where=where, integer=True, low=1,
                     fix="give whole chunks per rank, e.g. virtual_stages=2")
        if isinstance(self.partition, str):
            if self.partition not in partitioners:
                raise ValueError(f"SkyStrategy: partition={self.partition!r} is unknown; use one of "
                                 f"{', '.join(partitioners.names())} or explicit boundaries like (0, 3, 8)")
        else:
            b = list(self.partition)
            if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
                raise ValueError(f"SkyStrategy: partition boundaries {b} must rise strictly from 0 to the layer "
                                 "count, e.g. (0, 3, 8) for 8 layers on 2 stages")
        if self.order not in ("search", "given"):
            raise ValueError(f"SkyStrategy: order={self.order!r}; use 'search' or 'given'")
        if self.speed_factors is not None and any(
                isinstance(f, bool) or not isinstance(f, (int, float)) or not (f > 0 and math.isfinite(f))
                for f in self.speed_factors):
            raise ValueError(f"SkyStrategy: speed_factors={list(self.speed_factors)} must all be finite and > 0 "
                             "(1.0 = full speed, 0.33 = three times slower)")
        if self.memory_caps is not None:
            caps = []
            for i, c in enumerate(self.memory_caps):
                try:
                    caps.append(parse_bytes(c))
                except ValueError as err:
                    raise ValueError(f"SkyStrategy: memory_caps[{i}]: {err}") from None
            object.__setattr__(self, "memory_caps", tuple(caps))
        if self.memory_caps is not None and any(c <= 0 for c in self.memory_caps):
            raise ValueError(f"SkyStrategy: memory_caps={list(self.memory_caps)} must all be > 0 bytes; give the "
                             "memory a stage may use on each rank, e.g. ('2GiB', '2GiB'), or None to measure it")
        if self.link_bandwidth is not None:
            check_number(self.link_bandwidth, "link_bandwidth", where=where, low=0, low_open=True,
                         fix="give bytes/s between ranks, e.g. 10e9, or None to measure the links")
        if self.replan_every is not None:
            check_number(self.replan_every, "replan_every", where=where, integer=True, low=1,
                         fix="give a whole number of optimizer steps, or None to never re-plan")
        check_number(self.replan_threshold, "replan_threshold", where=where, low=0, low_open=True,
                     fix="a relative drift, e.g. 0.25 = 25%")
        check_number(self.profile_repeats, "profile_repeats", where=where, integer=True, low=1,
                     fix="give whole timed repeats per layer, e.g. 3")
        if self.profile_clock not in ("wall", "cpu"):
            raise ValueError(f"SkyStrategy: profile_clock={self.profile_clock!r}; use 'wall' (elapsed time) or 'cpu' "
                             "(process CPU time, for CPU ranks on a shared host)")
        if self.optimizer_state_factor is not None:
            check_number(self.optimizer_state_factor, "optimizer_state_factor", where=where, low=0,
                         fix="optimizer-state bytes per parameter byte: Adam 2, SGD+momentum 1, SGD 0; or None")
        if not (self.data_parallel == "auto" or (isinstance(self.data_parallel, int)
                                                 and not isinstance(self.data_parallel, bool)
                                                 and self.data_parallel >= 1)):
            raise ValueError(f"SkyStrategy: data_parallel={self.data_parallel!r}; give a replica count >= 1 or 'auto'")
        if self.pipeline_ranks is not None:
            check_number(self.pipeline_ranks, "pipeline_ranks", where=where, integer=True, low=1,
                         fix="give whole ranks per pipeline, or None")

    def layout(self, world: int) -> tuple[int, int]:
        """``(replicas, ranks per pipeline)`` for ``world`` ranks; raises if the world cannot be split so."""
        if self.data_parallel != "auto":
            replicas = int(self.data_parallel)
            if world % replicas:
                raise ValueError(f"SkyStrategy: world size {world} is not a multiple of data_parallel={replicas}; "
                                 f"every replica needs the same number of stage ranks. Use {replicas * max(1, world // replicas)} "
                                 f"or {replicas * (world // replicas + 1)} ranks, or a data_parallel that divides {world}")
            if self.pipeline_ranks is not None and world // replicas != self.pipeline_ranks:
                raise ValueError(f"SkyStrategy: data_parallel={replicas} x pipeline_ranks={self.pipeline_ranks} = "
                                 f"{replicas * self.pipeline_ranks} ranks, but the world has {world}; make them agree "
                                 "or give only one of them")
            return replicas, world // replicas
        ranks = self.pipeline_ranks
        if ranks is None and not isinstance(self.partition, str):
            chunks = self.virtual_stages if self.schedule == "interleaved" else 1
            ranks = max(1, (len(self.partition) - 1) // chunks)
        if ranks is None:
            raise ValueError("SkyStrategy: data_parallel='auto' needs the pipeline depth: pass pipeline_ranks=N "
                             "(ranks per pipeline) or explicit partition boundaries, or give data_parallel=N")
        if world % ranks:
            raise ValueError(f"SkyStrategy: world size {world} is not a multiple of the stage count ({ranks} ranks per "
                             "pipeline); data_parallel='auto' runs world / stages replicas. Use a multiple of "
                             f"{ranks} ranks or change pipeline_ranks")
        return world // ranks, ranks

    def check_world(self, world: int) -> None:
        """Raise if the schedule cannot run on ``world`` ranks (replicas x ranks per pipeline)."""
        for name, values in (("speed_factors", self.speed_factors), ("memory_caps", self.memory_caps)):
            if values is not None and len(values) != world:
                raise ValueError(f"SkyStrategy: {name} has {len(values)} entries for {world} ranks; give one per rank")
        _replicas, world = self.layout(world)  # from here on: ranks of one pipeline
        stages = world * (self.virtual_stages if self.schedule == "interleaved" else 1)
        if self.schedule == "1f1b" and self.microbatches < world:
            raise ValueError(f"SkyStrategy: schedule '1f1b' needs microbatches >= stages; got microbatches="
                             f"{self.microbatches} for {world} stages. Raise microbatches or use schedule='gpipe'")
        if self.schedule == "interleaved":
            rounds = max(1, self.microbatches // world)
            if self.microbatches % rounds:
                raise ValueError(f"SkyStrategy: interleaved needs microbatches to be a multiple of "
                                 f"microbatches // world = {rounds}; got {self.microbatches}. Use a multiple of {world}")
        if not isinstance(self.partition, str) and len(self.partition) != stages + 1:
            raise ValueError(f"SkyStrategy: partition boundaries {list(self.partition)} give {len(self.partition) - 1} "
                             f"stages but {world} ranks with schedule {self.schedule!r} need {stages}")
