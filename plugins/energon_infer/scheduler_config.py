"""The scheduler's limits and its errors (:class:`SchedulerConfig`, :class:`QueueFullError`); see :mod:`energon_infer.scheduler`."""

from __future__ import annotations

from dataclasses import dataclass

from energon_infer.errors import BusyError

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "KV_ADMISSION", "PLACEHOLDER", "POLICIES", "QueueFullError", "SchedulerConfig"]

POLICIES = ("continuous", "static")
KV_ADMISSION = ("on_demand", "reserve")
#: The token of a step planned before its input was sampled (``depth > 1``); workers fill it in.
PLACEHOLDER = -1


#: Tokens per step unless told otherwise: the one default of ``SchedulerConfig``, ``EngineConfig``,
#: ``RuntimeConfig`` and the engine's factories (4096 was the engine's and the CLI's default; the
#: runtime and the scheduler had 8192 before they shared this one).
DEFAULT_MAX_BATCH_TOKENS = 4096


class QueueFullError(BusyError, RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP: 429)."""

    def __init__(self, waiting: int, limit: int, *, asked: int = 1):
        self.waiting, self.limit, self.asked = waiting, limit, asked
        what = "the request queue is full" if asked == 1 else f"the request queue has no room for {asked} requests"
        super().__init__(
            f"{what} ({waiting} waiting, max_queue={limit}); retry later, or start the engine "
            "with a larger max_queue if the workers keep up"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Limits of one step and of the queue.

    Args:
        kv_blocks: blocks in each worker's KV cache (all ranks have the same number).
        block_size: tokens per block.
        max_context: the model's context (tokens); a request stops with ``"length"`` there.
        max_batch_tokens: tokens per step: one per running request plus each admitted prompt.
        max_running: sequences running at once (all groups together).
        max_queue: waiting requests at most; more raise :class:`QueueFullError`.
        groups: steps in flight at once (1: each step waits for the previous one's tokens).
        policy: ``"continuous"`` (requests join at the next step) or ``"static"`` (a group admits
            only when its whole batch has finished).
        kv_admission: ``"on_demand"`` (grow, preempt, recompute) or ``"reserve"`` (prompt + ``max_tokens`` at admission).
        prefix_caching: share full KV blocks of equal prefixes between requests (:mod:`energon_infer.blocks`).
        chunked_prefill: split prompts so each step stays within ``max_batch_tokens`` (longer prompts accepted).
        depth: steps of a group in flight. Beyond 1 a step is planned before the previous one's tokens
            are back: a request feeds :data:`PLACEHOLDER`, which the first stage replaces with the token the
            last stage sent it; a request that stopped meanwhile has that one token dropped.
        preemption: how an on-demand victim gives its blocks back: ``"recompute"``, ``"swap"`` (to
            ``host_blocks`` of host memory when they have room) or ``"auto"`` (whichever the measured
            ``swap_s_per_block`` / ``recompute_s_per_token`` say is cheaper; see :mod:`energon_infer.swap`).
    """

    kv_blocks: int
    block_size: int
    max_context: int
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_running: int = 256
    max_queue: int = 1024
    groups: int = 1
    policy: str = "continuous"
    kv_admission: str = "on_demand"
    prefix_caching: bool = False
    chunked_prefill: bool = False
    depth: int = 1
    preemption: str = "recompute"
    host_blocks: int = 0
    swap_s_per_block: float = 0.0
    recompute_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("kv_blocks", "block_size", "max_context", "max_batch_tokens", "max_running", "groups", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue} must be >= 0 (0 accepts no waiting request)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}")
        if self.kv_admission not in KV_ADMISSION:
            raise ValueError(f"kv_admission={self.kv_admission!r} must be one of {KV_ADMISSION}")
        if self.preemption == "swap" and self.host_blocks < 1:
            raise ValueError("preemption='swap' needs host swap space: load the workers with swap_space_tokens > 0 "
                             "(host_blocks=0 here), or use preemption='recompute'")
