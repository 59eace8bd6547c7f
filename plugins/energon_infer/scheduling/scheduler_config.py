"""The scheduler's limits and its errors (:class:`SchedulerConfig`, :class:`QueueFullError`); see :mod:`energon_infer.scheduling.scheduler`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from energon_infer.errors import BusyError, InvalidRequestError, OptionError, check_choice

__all__ = ["AUTO", "DEFAULT_MAX_BATCH_TOKENS", "KV_ADMISSION", "PLACEHOLDER", "POLICIES", "PREEMPTIONS", "KVAdmission",
           "Policy", "Preemption", "QueueFullError", "SchedulerConfig", "TokenBudgetMode", "check_request",
           "request_blocks"]

Policy = Literal["continuous", "static"]
KVAdmission = Literal["on_demand", "reserve"]
Preemption = Literal["auto", "swap", "recompute"]
TokenBudgetMode = Literal["fixed", "measured"]
POLICIES: tuple[str, ...] = get_args(Policy)
KV_ADMISSION: tuple[str, ...] = get_args(KVAdmission)
PREEMPTIONS: tuple[str, ...] = get_args(Preemption)
#: ``groups`` / ``depth``: chosen from the pipeline stages by the engine (a scheduler of its own: 1).
AUTO = -1
#: The token of a step planned before its input was sampled (``depth > 1``); workers fill it in.
PLACEHOLDER = -1


#: Tokens per step unless told otherwise: the default of ``SchedulerConfig.max_batch_tokens`` (the engine's one
#: budget: ``tightfit serve --max-batch-tokens`` shows it) and of a lone ``ModelRunner``'s ``RuntimeConfig``; an
#: engine's ``RuntimeConfig`` takes its scheduler's (4096 was the engine's and the CLI's default; the runtime
#: and the scheduler had 8192 before they shared this one).
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
    """Limits of one step and of the queue: ``EngineConfig.scheduler``, and what a :class:`Scheduler` runs by.

    Two kinds of fields. The batching options (every one with its one default: the engine's) are what
    a user sets. The cache's shape (``kv_blocks``, ``block_size``, ``max_context``, ``host_blocks`` and
    the measured costs) is what the workers report after loading: 0 in an engine's options, filled in by
    :meth:`EngineConfig.scheduler_for <energon_infer.engine.engine_config.EngineConfig.scheduler_for>`. A
    scheduler of its own (tests, :meth:`ModelRunner.generate`) gives all three of the shape's sizes.

    Args:
        kv_blocks: blocks in each worker's KV cache (all ranks have the same number).
        block_size: tokens per block.
        max_context: the model's context (tokens); a request stops with ``"length"`` there.
        max_batch_tokens: tokens per step: one per running request plus each admitted prompt.
        max_running: sequences running at once (all groups together).
        max_queue: waiting requests at most; more raise :class:`QueueFullError`.
        groups: steps in flight at once (1: each step waits for the previous one's tokens).
            :data:`AUTO` (the default): one per pipeline stage in an engine (the non-blocking pipeline), 1 for a
            scheduler of its own.
        policy: ``"continuous"`` (requests join at the next step) or ``"static"`` (a group admits
            only when its whole batch has finished).
        kv_admission: ``"on_demand"`` (grow, preempt, recompute) or ``"reserve"`` (prompt + ``max_tokens`` at admission).
        prefix_caching: share full KV blocks of equal prefixes between requests (:mod:`energon_infer.scheduling.blocks`).
        chunked_prefill: split prompts so each step stays within ``max_batch_tokens`` (longer prompts accepted).
        depth: steps of a group in flight. Beyond 1 a step is planned before the previous one's tokens
            are back: a request feeds :data:`PLACEHOLDER`, which the first stage replaces with the token the
            last stage sent it; a request that stopped meanwhile has that one token dropped. :data:`AUTO` (the
            default): in an engine 2 at pp=1, where it hides the controller's round trip between steps, and 1 at pp > 1, where
            the groups already keep every stage busy and planning ahead only adds the token messages (depth 1
            is the fastest there);
            1 for a scheduler of its own.
        late_admission: with steps planned ahead (``depth > 1``), a request that arrives while every step of its
            group is in flight is admitted at once in a late, admissions-only step
            (:meth:`~energon_infer.scheduling.scheduler.Scheduler.schedule_late`), which a single worker runs
            together with the step planned ahead when that one has not started yet: the request's prompt runs
            one step sooner. The engine uses it at ``tp = pp = 1`` only (several ranks could not agree on a merge).
        preemption: how an on-demand victim gives its blocks back: ``"recompute"``, ``"swap"`` (to
            ``host_blocks`` of host memory when they have room) or ``"auto"`` (whichever the measured
            ``swap_s_per_block`` / ``recompute_s_per_token`` say is cheaper, recompute without host blocks;
            see :mod:`energon_infer.scheduling.swap`).
        host_blocks: the workers' host swap space, in KV blocks (reported by the workers, not set).
        swap_s_per_block: the measured seconds to swap one block out and back (reported, not set).
        recompute_s_per_token: the measured seconds to recompute one token's KV (reported, not set).
        kv_window: tokens back from a query that every layer of the model reads at most, its sliding window (0:
            some layer reads the whole context). A running sequence's blocks before its window are released
            (:meth:`~energon_infer.scheduling.blocks.BlockManager.trim`). Reported by the workers, not set.
        kv_groups: each KV group's window where the model's windowed and global layers keep their keys and values in
            block tables of their own (:mod:`energon_infer.scheduling.kv_groups`; ``kv_blocks`` then counts pages,
            which every group draws from); ``()``: one group, windowed by ``kv_window``. Reported, not set.
        token_budget: ``"fixed"``: every step may hold ``max_batch_tokens``; ``"measured"``: the running decodes
            plus the prefill their TPOT target leaves room for at the measured cost per token, at most
            ``max_batch_tokens`` (:mod:`energon_infer.scheduling.budget`).
        tpot_target_s: with ``token_budget="measured"``, the step time prefill may fill decode steps up to (0: twice
            the decode-only step's measured time).
        rope_switch: the context length past which a sequence's cached keys no longer hold (a ``longrope`` model's
            ``original_max_position_embeddings``; 0: none). A running sequence about to pass it is recomputed whole,
            as transformers' ``generate`` does (:mod:`energon_infer.scheduling.rope_switch`). Reported, not set.
    """

    kv_blocks: int = 0
    block_size: int = 0
    max_context: int = 0
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_running: int = 256
    max_queue: int = 1024
    groups: int = AUTO
    policy: Policy = "continuous"
    kv_admission: KVAdmission = "on_demand"
    prefix_caching: bool = True
    chunked_prefill: bool = False
    depth: int = AUTO
    late_admission: bool = True
    preemption: Preemption = "auto"
    host_blocks: int = 0
    swap_s_per_block: float = 0.0
    recompute_s_per_token: float = 0.0
    kv_window: int = 0
    kv_groups: tuple[int, ...] = ()
    rope_switch: int = 0
    token_budget: TokenBudgetMode = "fixed"
    tpot_target_s: float = 0.0

    @property
    def bound(self) -> bool:
        """Whether the cache's shape is known (a scheduler's limits), not only the options (an engine's)."""
        return self.kv_blocks > 0

    def __post_init__(self) -> None:
        shape = {"kv_blocks": self.kv_blocks, "block_size": self.block_size, "max_context": self.max_context}
        if any(shape.values()) and min(shape.values()) < 1:
            raise OptionError(f"{shape} must all be >= 1 (a scheduler of its own) or all 0 (an engine's options: "
                              "the workers report them)")
        for name in ("max_batch_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise OptionError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("groups", "depth"):
            value = getattr(self, name)
            if value != AUTO and value < 1:
                raise OptionError(f"{name}={value} must be >= 1 (or AUTO: chosen from the pipeline stages)")
            if value == AUTO and self.bound:
                object.__setattr__(self, name, 1)  # a scheduler of its own has no pipeline to choose from
        if self.max_queue < 0:
            raise OptionError(f"max_queue={self.max_queue} must be >= 0 (0 accepts no waiting request)")
        check_choice("policy", self.policy, Policy)
        check_choice("kv_admission", self.kv_admission, KVAdmission)
        check_choice("preemption", self.preemption, Preemption)
        check_choice("token_budget", self.token_budget, TokenBudgetMode)
        if not (self.tpot_target_s >= 0 and self.tpot_target_s < float("inf")):
            raise OptionError(f"tpot_target_s={self.tpot_target_s} must be a finite number of seconds >= 0 (0: twice "
                              "the measured decode step)")
        if self.host_blocks < 0 or self.swap_s_per_block < 0 or self.recompute_s_per_token < 0:
            raise OptionError(f"host_blocks={self.host_blocks}, swap_s_per_block={self.swap_s_per_block} and "
                              f"recompute_s_per_token={self.recompute_s_per_token} must be >= 0")
        if self.kv_window < 0 or self.rope_switch < 0 or any(w < 0 for w in self.kv_groups):
            raise OptionError(f"kv_window={self.kv_window}, kv_groups={self.kv_groups} and rope_switch="
                              f"{self.rope_switch} must be >= 0 (0: none)")
        if self.bound and self.preemption == "swap" and self.host_blocks < 1:
            raise OptionError("preemption='swap' needs host swap space: load the workers with swap_space_tokens > 0 "
                              "(host_blocks=0 here), or use preemption='recompute'")


def request_blocks(cfg: SchedulerConfig, peak: Callable[[int, int], int], prompt_len: int, max_tokens: int) -> int:
    """KV blocks a request needs at most: its prompt plus ``max_tokens``, capped at the context; with a window,
    at most its largest step (the prompt, or a chunk of it) plus the window, and one block more (``peak``:
    :meth:`~energon_infer.scheduling.blocks.BlockManager.peak` of the scheduler's blocks)."""
    step = min(prompt_len, cfg.max_batch_tokens) if cfg.chunked_prefill else prompt_len
    return peak(min(prompt_len + max_tokens, cfg.max_context), step)


def most_tokens(cfg: SchedulerConfig, window: int, prompt_len: int, budget: int) -> int:
    """Tokens one step may run of a request whose prompt has ``prompt_len``: ``budget`` with chunked prefill or in a
    recompute (prompt + output); with a ``window`` never more than its prompt (or a chunk of it) either, so a recompute
    after a preemption runs in steps that hold no more blocks than :func:`request_blocks` promised, however long its
    context has grown."""
    if not window:
        return budget
    most = min(prompt_len, cfg.max_batch_tokens) if cfg.chunked_prefill else prompt_len
    return min(most, budget) if cfg.chunked_prefill else most


def check_request(cfg: SchedulerConfig, peak: Callable[[int, int], int], n: int, max_tokens: int) -> int:
    """Raise :class:`InvalidRequestError` if a request of an ``n``-token prompt can never run under ``cfg``; return
    the blocks it needs at most (:func:`request_blocks`)."""
    if n == 0:
        raise InvalidRequestError("the prompt is empty; give at least one token")
    if n > cfg.max_context:
        raise InvalidRequestError(f"the prompt has {n} tokens but the model's context is {cfg.max_context}; shorten it")
    if n > cfg.max_batch_tokens and not cfg.chunked_prefill:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, more than max_batch_tokens={cfg.max_batch_tokens} (the tokens one step "
            "runs); shorten it, or start the engine with a larger max_batch_tokens or chunked_prefill=True"
        )
    blocks = request_blocks(cfg, peak, n, max_tokens)
    if blocks > cfg.kv_blocks:
        raise InvalidRequestError(
            f"prompt ({n} tokens) + max_tokens={max_tokens} needs {blocks} KV blocks of {cfg.block_size} "
            f"tokens but the cache has {cfg.kv_blocks}; lower max_tokens or load with a larger kv_cache_tokens"
        )
    return blocks
