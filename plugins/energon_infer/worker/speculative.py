"""Speculative decoding, the workers' side: score a step's proposed tokens and keep the accepted ones.

A speculating sequence's item is ``[last token, d1, ..., dk]`` (``Step.proposals[seq_id] = k``; see
:mod:`energon_infer.scheduling.speculation`). The step runs as any packed step (an extend of ``k + 1`` query
tokens over the paged cache, the path a chunk of a prompt takes) with every position's logits kept; position
``j`` is then sampled exactly as a decode after ``d1 .. dj`` would be (the same sampler, the same counter-based
noise of the request's seed and the position), and the proposals are accepted while each equals the token its
position drew. The first position that differs gives its own draw (the correction); if all ``k`` are accepted
the last position's draw is a bonus token. For a deterministic proposal ``d`` this is the standard speculative
rejection rule (accept with ``min(1, p(d) / q(d)) = p(d)``, else draw from ``p`` without ``d``, normalised), and
a request's tokens are those it would draw without speculation (greedy: identical; sampled: identical for the
same seed, hence exact in distribution). The sequence's cache then forgets the rejected proposals
(:meth:`~energon_infer.worker.kv_cache.KVCache.truncate`): the scheduler has already counted them back.

:func:`accept_lengths` is the pure acceptance rule; :class:`SpeculativeVerify` is the runner's step with
proposals (mixed into :class:`~energon_infer.worker.runtime.ModelRunner`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from energon_infer.sampling import SamplingParams
    from energon_infer.worker.grammar import GrammarSampler
    from energon_infer.worker.kv_cache import KVCache

__all__ = ["SpeculativeVerify", "accept_lengths", "verify_rows"]


def _proposed_before(items: Sequence[tuple[int, Sequence[int]]], proposals: Mapping[int, int]) -> list[list[int]]:
    """By sampled row (:func:`verify_rows`' order): the proposals before that row's position (``[]`` for a
    sequence's first row and for every row of one that does not speculate)."""
    out: list[list[int]] = []
    for seq_id, tokens in items:
        k = proposals.get(seq_id, 0)
        drafts = list(tokens[len(tokens) - k:]) if k else []
        out.extend(drafts[:j] for j in range(k + 1))
    return out


def accept_lengths(proposed: Sequence[int], drawn: Sequence[int]) -> int:
    """How many of ``proposed`` (``k`` tokens) are accepted given each position's draw (``k + 1`` tokens)."""
    a = 0
    while a < len(proposed) and proposed[a] == drawn[a]:
        a += 1
    return a


def verify_rows(items: Sequence[tuple[int, Sequence[int]]], starts: Mapping[int, int], proposals: Mapping[int, int]
                ) -> tuple[list[int], list[int], list[int]]:
    """The logits rows a step samples (all-token logits, packed in item order): each item's last row, and a
    speculating item's last ``k + 1``; with each row's sequence and context length (the position it draws at)."""
    rows, ids, positions, at = [], [], [], 0
    for seq_id, tokens in items:
        n, take = len(tokens), proposals.get(seq_id, 0) + 1
        for j in range(n - take, n):
            rows.append(at + j)
            ids.append(seq_id)
            positions.append(starts[seq_id] + j + 1)
        at += n
    return rows, ids, positions


class SpeculativeVerify:
    """:meth:`verify`: the second half of :meth:`ModelRunner.step` for a step with proposals (see the module)."""

    cache: KVCache
    sampler: GrammarSampler
    grid: Any
    device: torch.device
    _params: dict[int, SamplingParams]
    _last: dict[int, int]
    if TYPE_CHECKING:  # the runner's own (ModelRunner._observe, ModelRunner._banned)
        def _observe(self, items: Sequence[tuple[int, Sequence[int]]], starts: Mapping[int, int]) -> None: ...

        def _banned(self, ids: Sequence[int], params: Sequence[SamplingParams], positions: Sequence[int]
                    ) -> dict[int, tuple[int, ...]]: ...

    def verify(self, items: Sequence[tuple[int, Sequence[int]]], starts: Mapping[int, int], logits: Any,
               proposals: Mapping[int, int]) -> tuple[list[int], dict[int, Any], dict[int, str], dict[int, Any]]:
        """Sample every kept row, accept proposals, truncate the caches; returns the step's ``StepResult`` fields
        (tokens, logprobs, errors, accepted). The emitted tokens go to every rank (each rank's cache forgets the same
        rejected slots)."""
        rows, ids, positions = verify_rows(items, starts, proposals)
        width = max(proposals.values()) + 1
        # Per item: the emitted tokens, padded with -1; then its count (every rank truncates by it).
        out = torch.full((len(items), width + 1), -1, dtype=torch.long, device=self.device)
        logprobs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        accepted: dict[int, list[tuple[int, Any]]] = {}
        if self.grid.rank == self.grid.result_rank:
            assert logits is not None
            # The penalties count what the sequence emitted: its fed token now, its accepted proposals below; the
            # row after proposals d1..dj counts them too (as a decode after them would).
            self._observe([(s, t[:len(t) - proposals.get(s, 0)]) for s, t in items], starts)
            params = [self._params[s] for s in ids]
            extra = {r: ahead for r, ahead in enumerate(_proposed_before(items, proposals))
                     if ahead and params[r].penalised}
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            sampled = self.sampler.sample_rows(logits.index_select(0, index), ids, params, positions,
                                               self._banned(ids, params, positions), extra_output=extra)
            row = 0
            for i, (seq_id, tokens) in enumerate(items):
                k = proposals.get(seq_id, 0)
                drawn, mine = sampled.tokens[row:row + k + 1], range(row, row + k + 1)
                bad = next((sampled.errors[r] for r in mine if r in sampled.errors), None)
                proposed = list(tokens[len(tokens) - k:]) if k else []
                a = 0 if bad is not None else accept_lengths(proposed, drawn)
                emitted = [*proposed[:a], drawn[a]]  # the accepted proposals (equal to their draws), then a draw
                out[i, :a + 1] = torch.tensor(emitted, dtype=torch.long)
                out[i, width] = a + 1
                lps = [sampled.logprobs.get(r) for r in range(row, row + a + 1)]
                if bad is not None:
                    errors[seq_id] = bad
                if lps[-1] is not None:
                    logprobs[seq_id] = lps[-1]
                if k:
                    accepted[seq_id] = list(zip(emitted, lps))
                    if a:  # the accepted proposals are output now (never fed again: they are in the cache)
                        self._observe([(seq_id, proposed[:a])], {seq_id: starts[seq_id] + len(tokens) - k})
                row += k + 1
        out = self.grid.broadcast_result(out)
        tokens_out: list[int] = []
        for (seq_id, tokens), line in zip(items, out.tolist()):
            n = line[width]
            k = proposals.get(seq_id, 0)
            if k:
                self.cache.truncate(seq_id, starts[seq_id] + len(tokens) - k + n - 1)
                if seq_id not in accepted:  # another rank: the tokens, without logprobs
                    accepted[seq_id] = [(t, None) for t in line[:n]]
            tokens_out.append(line[n - 1])
        self._last.update((s, t) for (s, _), t in zip(items, tokens_out))
        return tokens_out, logprobs, errors, accepted
