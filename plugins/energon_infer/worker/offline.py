"""Offline generation: the engine's scheduler driven in this process over one runner (``ModelRunner.generate``).

The same batching policy as the engine (one :class:`~energon_infer.scheduling.scheduler.Scheduler`), and each
planned step applied the one way a step is applied, :meth:`~energon_infer.worker.runtime.ModelRunner.run_step`
(the engine's worker loop calls it too); only the transport differs: no controller, no queues.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from energon_infer.sampling import SamplingParams
from energon_infer.scheduling.rope_switch import switch_of
from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig
from energon_infer.scheduling.scheduler_config import KVAdmission, Preemption
from energon_infer.scheduling.speculation import Speculator
from energon_infer.scheduling.swap import swap_costs

if TYPE_CHECKING:
    from energon_infer.worker.runtime import ModelRunner

__all__ = ["Generation", "run_offline"]


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished request of :meth:`ModelRunner.generate`."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str


def run_offline(runner: ModelRunner, encoded: Sequence[list[int]], params: Sequence[SamplingParams], *,
                seq_ids: Iterator[int], decode: Callable[[Sequence[int]], str] | None, kv_admission: KVAdmission,
                prefix_caching: bool, chunked_prefill: bool, preemption: Preemption,
                stats: dict[str, int] | None, speculator: Speculator | None = None) -> list[Generation]:
    """Run validated prompts to the end on ``runner`` (see :meth:`ModelRunner.generate`); results in order.

    ``seq_ids``: the runner's own sequence ids (negative: never a caller's); ``decode``: ids -> text, or ``None``;
    ``speculator``: speculative decoding (:mod:`energon_infer.scheduling.speculation`; ``None``: off).
    """
    cache, budget = runner.cache, runner.runtime.max_batch_tokens
    sched = Scheduler(
        SchedulerConfig(kv_blocks=cache.num_blocks, block_size=cache.block_size, max_context=runner.max_context,
                        # a prompt longer than the budget still runs, alone in its step
                        max_batch_tokens=budget if chunked_prefill else max(budget, *map(len, encoded)),
                        max_running=len(encoded), max_queue=len(encoded), kv_admission=kv_admission,
                        prefix_caching=prefix_caching, chunked_prefill=chunked_prefill, preemption=preemption,
                        host_blocks=cache.host_k.shape[1], kv_window=runner.kv_window, kv_groups=cache.group_windows,
                        rope_switch=switch_of(getattr(runner.config, "rope", None)), **swap_costs(runner, preemption)),
        eos_token_ids=runner.eos_token_ids, decode=decode, seq_ids=seq_ids, block_ids=cache.free_block_ids(),
        speculator=speculator)
    requests = [sched.add(Request(str(i), e, p)) for i, (e, p) in enumerate(zip(encoded, params))]
    steps = 0
    try:
        while sched.waiting or sched.running:
            plan = sched.schedule(0)
            if plan is None:
                raise RuntimeError("the scheduler planned no step with requests left; this is a bug")
            result = runner.run_step(plan.step)
            sched.complete(plan, result.tokens, result.logprobs, result.errors, result.accepted)
            steps += 1
    finally:
        for seq_id in [*sched.take_frees(), *sched.running]:
            if seq_id in cache:
                runner.free(seq_id)
    if stats is not None:
        stats.update(steps=steps, preemptions=sched.preemptions, swaps=sched.swap.swaps,
                     prefix_hit_tokens=sched.blocks.hit_tokens, prefix_query_tokens=sched.blocks.query_tokens,
                     rope_recomputes=sched.rope_recomputes, **sched.speculator.stats())
    return [Generation(r.prompt, list(r.generated), r.text, r.finish_reason or "length") for r in requests]
