"""Preemption by swap to host memory, beside preemption by recompute, chosen per case by measured cost.

When the KV pool runs out the scheduler preempts the newest idle request. It can drop its blocks
and recompute them from prompt + generated tokens when the request is readmitted (costs a prefill of
every token it had), or copy its blocks to host swap space and back (costs two copies of its
blocks). Each worker measures both at load (:func:`measure_costs`: seconds to copy one block out
and back, seconds of prefill per token) and the scheduler takes the cheaper for each victim
(:meth:`SwapSpace.choose`): short contexts recompute, long ones swap, and a request whose blocks do
not fit in the free host blocks recomputes.

Ordering on the workers (one step): ``swap_out`` copies first (the blocks are freed in this very step
and may be written by it), then frees, block assignment and copy-on-write, then ``swap_in`` into the
readmitted sequence's fresh blocks, then the forward. A swapped request resumes at the token where it
stopped, with its sampling state re-sent as for a new sequence, so greedy and seeded outputs do not change.

Example:
    >>> space = SwapSpace(8, mode="auto", swap_s_per_block=1e-4, recompute_s_per_token=1e-4)
    >>> space.choose(blocks=2, tokens=30)   # 2 x 1e-4 s of copies < 30 x 1e-4 s of prefill
    True
    >>> space.choose(blocks=9, tokens=200)  # more blocks than the swap space has
    False
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

__all__ = ["PREEMPTION", "SwapSpace", "measure_costs", "swap_costs"]

PREEMPTION = ("recompute", "swap", "auto")


class SwapSpace:
    """The scheduler's view of the workers' host swap space: free host blocks and the swap-or-recompute rule.

    Args:
        host_blocks: blocks of host swap space on every worker.
        mode: ``"recompute"`` (never swap), ``"swap"`` (swap whenever the host blocks are free) or
            ``"auto"`` (swap when it is measured to be cheaper than recomputing).
        swap_s_per_block: measured seconds to copy one block (every layer) out and back in.
        recompute_s_per_token: measured seconds of prefill per token.
    """

    def __init__(self, host_blocks: int, *, mode: str = "auto", swap_s_per_block: float = 0.0,
                 recompute_s_per_token: float = 0.0):
        if mode not in PREEMPTION:
            raise ValueError(f"preemption={mode!r} must be one of {PREEMPTION}")
        if host_blocks < 0 or swap_s_per_block < 0 or recompute_s_per_token < 0:
            raise ValueError(f"host_blocks={host_blocks}, swap_s_per_block={swap_s_per_block} and "
                             f"recompute_s_per_token={recompute_s_per_token} must be >= 0")
        self.host_blocks, self.mode = host_blocks, mode
        self.swap_s_per_block, self.recompute_s_per_token = swap_s_per_block, recompute_s_per_token
        self._free: deque[int] = deque(range(host_blocks))
        self.swaps = 0
        self.recomputes = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def choose(self, *, blocks: int, tokens: int) -> bool:
        """Swap (True) or recompute (False) a victim holding ``blocks`` blocks for ``tokens`` tokens."""
        if self.mode == "recompute" or blocks > len(self._free) or blocks == 0:
            return False
        if self.mode == "swap":
            return True
        return blocks * self.swap_s_per_block < tokens * self.recompute_s_per_token

    def take(self, n: int) -> list[int]:
        return [self._free.popleft() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def reset(self) -> None:
        """The workers restarted: their swap space is empty."""
        self._free = deque(range(self.host_blocks))


def measure_costs(runner: Any, *, tokens: int = 64, repeats: int = 3) -> tuple[float, float]:
    """``(seconds to swap one block out and back, seconds of prefill per token)`` on this rank.

    The swap side times :meth:`KVCache.swap_out` + ``swap_in`` of up to 16 blocks; the recompute side a
    ``tokens``-token prefill through the runner (every rank of the grid must call this together: the
    forward is SPMD). Best of ``repeats``.
    """
    from energon_infer.sampling import SamplingParams

    cache = runner.cache
    n = min(16, cache.num_blocks, cache.host_k.shape[1])
    swap = float("inf")
    if n:
        pairs = list(zip(range(n), range(n)))
        for _ in range(repeats):
            start = time.perf_counter()
            cache.swap_out(pairs)
            cache.swap_in(pairs)
            if cache.k.is_cuda:
                torch.cuda.synchronize()
            swap = min(swap, (time.perf_counter() - start) / n)
    seq = -(1 << 41)  # never a controller's id nor the runner's own
    length = min(tokens, runner.max_context - 1, cache.num_blocks // cache.groups * cache.block_size)  # every group
    prefill = float("inf")
    params = SamplingParams(temperature=0, max_tokens=1)
    for _ in range(repeats):
        start = time.perf_counter()
        runner.step([(seq, [0] * length)], params, broadcast=False)
        if cache.k.is_cuda:
            torch.cuda.synchronize()
        prefill = min(prefill, (time.perf_counter() - start) / length)
        runner.free(seq)
    return swap, prefill


def swap_costs(runner: Any, preemption: str) -> dict[str, Any]:
    """``SchedulerConfig`` cost fields for ``runner`` (measured once, kept on it) when ``preemption="auto"``."""
    if preemption != "auto" or not runner.cache.host_k.shape[1]:
        return {}
    if getattr(runner, "swap_costs", None) is None:
        runner.swap_costs = measure_costs(runner)
    return {"swap_s_per_block": runner.swap_costs[0], "recompute_s_per_token": runner.swap_costs[1]}
