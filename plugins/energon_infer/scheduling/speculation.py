"""Speculative decoding, the scheduler's side: which decodes carry proposed tokens, how many, and from where.

A running request's decode item is ``[last token]``; a speculating one's is ``[last token, d1, ..., dk]`` with
``k`` proposed tokens, and ``Step.proposals[seq_id] = k``. The workers score every position in the one step
(an extend over the paged cache, as a chunk of a prompt) and keep the longest accepted prefix plus one token of
their own (:mod:`energon_infer.worker.speculative`); the scheduler then takes back the slots of the rejected
proposals (``Request.computed`` goes back: the next tokens are written over them) and names in the prefix cache
only blocks of accepted tokens.

:class:`Speculator` is what the scheduler holds: for each step it picks the requests that may speculate, asks
:func:`~energon_infer.scheduling.spec_plan.plan_proposals` how many tokens each should propose (their acceptance
rates, tracked online, and the step's cost, fitted online from the steps' sizes and times), asks the proposer for
them and grows the requests' blocks. Proposers: :class:`NgramProposer` (prompt lookup: the tokens that followed
the latest earlier occurrence of the sequence's last ``n`` tokens) and a draft model
(:class:`energon_infer.worker.draft.DraftProposer`). Both propose deterministically (a point mass), for which
the workers' check, "the token this position samples equals the proposal", is exact speculative rejection
sampling (accept with probability ``p(d)``, else draw from ``p`` without ``d``).

With steps planned ahead (``depth > 1``) a step is planned before the previous one's tokens are back: a request is
then fed a placeholder for its token being sampled, and a placeholder cannot carry proposals (nothing to look up,
and no position to put them at until the accepted count is known). So a request whose step in flight verifies
proposals sits out the next planned step, and one that is worth a proposal (:meth:`Speculator.waits`) sits out
the next step instead of running in it as a placeholder; every other request keeps two steps in flight as without
speculation.

Example:
    >>> ngram_propose([1, 2, 3, 4, 1, 2], k=3, min_n=1, max_n=3)
    [3, 4, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from energon_infer.errors import OptionError
from energon_infer.scheduling.spec_plan import CostFit, expected_tokens, plan_proposals, update_acceptance

if TYPE_CHECKING:
    from energon_infer.protocol import Step
    from energon_infer.scheduling.kv_groups import KVGroups
    from energon_infer.scheduling.requests import Request, StepPlan

__all__ = ["SpeculativeConfig", "Proposer", "NgramProposer", "Speculator", "NoSpeculation", "ngram_propose", "METHODS"]

METHODS = ("ngram", "draft")


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    Args:
        method: ``"ngram"`` (prompt lookup, no extra model) or ``"draft"`` (a small model, ``draft_model``).
        num_speculative_tokens: the most tokens a request proposes in one step (``k``).
        prompt_lookup_min: ``"ngram"``: the shortest suffix of the sequence matched.
        prompt_lookup_max: ``"ngram"``: the longest suffix matched (tried first).
        draft_model: ``"draft"``: the draft model's directory (same tokenizer as the served model).
        adaptive: choose each request's ``k`` per step from measured costs and acceptance (``False``: always
            ``num_speculative_tokens`` where a proposal exists).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise OptionError(f"speculative method={self.method!r} is not one of {list(METHODS)}; use 'ngram' "
                              "(prompt lookup) or 'draft' with draft_model=DIR")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise OptionError(f"num_speculative_tokens={k!r} must be an integer >= 1 (tokens proposed per step); "
                              "turn speculation off with speculative=None instead")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise OptionError(f"prompt_lookup_min={lo!r}, prompt_lookup_max={hi!r}: need 1 <= min <= max")
        if (self.method == "draft") != (self.draft_model is not None):
            raise OptionError(f"method={self.method!r} with draft_model={self.draft_model!r}: a draft model goes with "
                              "method='draft' (and only there); give both, or method='ngram' without it")


def ngram_propose(tokens: Sequence[int], *, k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: for the longest ``n`` in ``[min_n, max_n]`` whose last ``n`` tokens occurred before, the up
    to ``k`` tokens that followed their latest earlier occurrence (``[]``: no match)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = list(tokens[size - n:])
        for start in range(size - n - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start:start + n]) == tail:
                return list(tokens[start + n:start + n + k])
    return []


class Proposer(Protocol):
    """Where proposed tokens come from."""

    def propose(self, batch: Sequence[tuple[int, Sequence[int], int]]) -> dict[int, list[int]]:
        """``(seq_id, tokens so far, most tokens)`` per request -> up to that many proposed tokens each."""
        ...

    def release(self, seq_ids: Sequence[int]) -> None:
        """These sequences are gone (finished, or preempted and to be recomputed)."""
        ...


class NgramProposer:
    """:func:`ngram_propose` for each request, from an index of its n-grams kept as it grows: each new token adds
    its ``max_n - min_n + 1`` n-grams (the latest end of each), so a proposal is a few lookups, not a scan."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, tuple[int, dict[tuple[int, ...], int]]] = {}  # seq_id -> (ends indexed, n-gram -> end)

    def propose(self, batch: Sequence[tuple[int, Sequence[int], int]]) -> dict[int, list[int]]:
        out = {}
        for seq_id, tokens, k in batch:
            if found := self._lookup(seq_id, tokens, k):
                out[seq_id] = found
        return out

    def _lookup(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]:
        size = len(tokens)
        done, index = self._index.get(seq_id, (0, {}))
        if done > size - 1:  # shorter than what was indexed: not the sequence it was
            done, index = 0, {}
        for end in range(done, size - 1):  # n-grams ending before the last token: the tail's earlier occurrences
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index[tuple(tokens[end - n + 1:end + 1])] = end
        self._index[seq_id] = (max(done, size - 1), index)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            last = index.get(tuple(tokens[size - n:]))
            if last is not None:
                return list(tokens[last + 1:last + 1 + k])
        return []

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._index.pop(seq_id, None)


class Speculator:
    """The scheduler's speculation (see the module docstring): proposals into a planned step, and what came back.

    Args:
        config: the settings.
        proposer: where proposals come from.
        prior: the acceptance rate a request starts with.
        cost: the step cost model (default: fitted online, starting memory-bound).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, prior: float = 0.6,
                 cost: CostFit | None = None):
        self.config, self.proposer, self.prior = config, proposer, prior
        self.cost = cost or CostFit()
        self.acceptance: dict[int, float] = {}  # seq_id -> its proposals' acceptance rate (online)
        self.proposed = self.accepted = self.steps = 0  # totals: proposed / accepted tokens, verifying steps
        self.verifying: set[int] = set()  # sequences whose step in flight verifies their proposals
        self.bubble_s = 0.0  # a drained pipeline's gap: a step's result back to the next step planned (measured)
        self._back: dict[int, tuple[float, set[int]]] = {}  # group -> when its latest step came back, its sequences
        self._shape: dict[int, tuple[int, int]] = {}  # group -> its latest step's (tokens, sampled requests)

    def _eligible(self, req: Request, sampled: bool, fed: int, new: bool) -> bool:
        # A request still below min_tokens bans its stop tokens per position, which the workers do, but gains
        # little. Penalties are exact: the workers count the proposals before each row (worker.speculative).
        return (sampled and fed == 1 and not new and not req.fed_unknown and bool(req.generated)
                and len(req.generated) >= req.params.min_tokens)

    def waits(self, req: Request) -> bool:
        """With steps planned ahead (depth > 1): should ``req``, whose latest token a step in flight samples, sit out
        the step being planned (and propose in the one after, once its tokens are known) rather than run in it as a
        placeholder? A proposal's position is only known once the step before it has come back. Yes while its
        proposals are being verified; otherwise where the planner would have it propose in a step like its group's
        latest one, the overlap it gives up priced (:func:`~energon_infer.scheduling.spec_plan.plan_proposals` with
        ``ahead``). A request that does not wait drifts back towards the prior, so it is tried again later."""
        if req.seq_id in self.verifying:  # its next position is known once its accepted count is
            return True
        p = req.params
        if p.structured is not None or len(req.generated) + 1 < p.min_tokens:
            return False
        most = min(self.config.num_speculative_tokens, p.max_tokens - len(req.generated) - 2)
        if most < 1:
            return False
        if not self.config.adaptive:
            return True
        rate = self.acceptance.get(req.seq_id, self.prior)
        tokens, emitted = self._shape.get(req.group, (1, 1))
        # Sitting out costs a whole step wherever other requests keep the steps running, so it must also beat the two
        # tokens it would have had from running in both steps.
        if not (wait := expected_tokens(rate, most) > 2.0 and plan_proposals(
                [rate], [most], self.cost.cost(), step_tokens=max(tokens, 1), emitted=max(min(emitted, tokens), 1),
                ahead=True, bubble_s=self.bubble_s)[0] > 0):
            self.acceptance[req.seq_id] = 0.95 * rate + 0.05 * self.prior
        return wait

    def extend(self, plan: StepPlan, blocks: KVGroups, *, budget: int, max_context: int, ahead: bool = False) -> int:
        """Add proposals to ``plan``'s decodes (blocks grown for them); returns the proposed tokens. ``ahead``: steps
        are planned ahead, so a request that proposes sits out the next one (:meth:`waits`)."""
        step = plan.step
        if step.frees:
            self.proposer.release(step.frees)
            for seq_id in step.frees:
                self.acceptance.pop(seq_id, None)
        self._shape[step.group] = (plan.n_tokens, sum(plan.samples))
        if any(r.params.structured is not None for r in plan.requests):
            return 0  # a grammar masks one row per sequence: a step holding a structured request verifies nothing
        cands = []
        for i, (req, sampled) in enumerate(zip(plan.requests, plan.samples)):
            if self._eligible(req, sampled, len(step.items[i][1]), req.seq_id in step.starts):
                most = min(self.config.num_speculative_tokens, req.params.max_tokens - len(req.generated) - 1,
                           max_context - req.computed - 1)
                if most > 0:
                    cands.append((i, req, most))
        if not cands or budget < 1:
            return 0
        limits = [most for _, _, most in cands]
        if self.config.adaptive:
            rates = [self.acceptance.get(r.seq_id, self.prior) for _, r, _ in cands]
            # Ahead, a request that proposes sits out the next step: the planner prices the overlap it gives up.
            limits = plan_proposals(rates, limits, self.cost.cost(), step_tokens=plan.n_tokens,
                                    emitted=sum(plan.samples), budget=budget, ahead=ahead, bubble_s=self.bubble_s)
            if ahead:  # sitting out the next step must also beat the two tokens of running in both (see waits)
                limits = [k if k and expected_tokens(a, k) > 2.0 else 0 for a, k in zip(rates, limits)]
            for (_, r, _), rate, k in zip(cands, rates, limits):  # not proposing: drift back, to be tried again
                if k == 0:
                    self.acceptance[r.seq_id] = 0.95 * rate + 0.05 * self.prior
        asked = [(r.seq_id, [*r.prompt, *r.generated], k) for (_, r, _), k in zip(cands, limits) if k > 0]
        found = self.proposer.propose(asked) if asked else {}
        total = 0
        for (i, req, _), k in zip(cands, limits):
            proposal = found.get(req.seq_id, [])[:min(k, budget - total)]
            if k > 0 and req.seq_id not in found and self.config.adaptive:  # nothing found: one failed trial
                self.acceptance[req.seq_id] = update_acceptance(self.acceptance.get(req.seq_id, self.prior), 1, 0)
            if not proposal or blocks.grow_cost(req.seq_id, req.computed + len(proposal)) > blocks.num_free:
                continue
            if new := blocks.grow(req.seq_id, req.computed + len(proposal)):
                step.blocks[req.seq_id] = [*step.blocks.get(req.seq_id, []), *new]
            step.items[i] = (req.seq_id, [*step.items[i][1], *proposal])
            step.proposals[req.seq_id] = len(proposal)
            self.verifying.add(req.seq_id)
            req.computed += len(proposal)
            total += len(proposal)
        return total

    def settle(self, req: Request, proposed: int, accepted: int) -> None:
        """A verified step of ``req``: ``accepted`` of its ``proposed`` tokens were kept (counted in its totals)."""
        self.proposed, self.accepted, self.steps = self.proposed + proposed, self.accepted + accepted, self.steps + 1
        req.proposed, req.accepted = req.proposed + proposed, req.accepted + accepted
        if not req.spec_histogram:  # dense: one entry per accepted count a step can have
            req.spec_histogram.extend([0] * (self.config.num_speculative_tokens + 1))
        req.spec_histogram[accepted] += 1
        self.acceptance[req.seq_id] = update_acceptance(self.acceptance.get(req.seq_id, self.prior), proposed, accepted)

    def observe_step(self, step: Step, tokens: int, *, started: float, ended: float) -> None:
        """``step`` (``tokens`` tokens, planned at ``started``) came back at ``ended``: the cost model's data. A step
        planned ahead ran from when the one before it came back."""
        self.verifying.difference_update(step.proposals)
        back, before = self._back.get(step.group, (started, set()))
        ids = {seq_id for seq_id, _ in step.items}
        # Planned ahead, yet only after the step before it came back, with a request of that step in it: the pipeline
        # drained under a running request (one that verified, or sat out to propose), not on an idle engine.
        if step.send_back and started > back and not ids.isdisjoint(before):
            gap = started - back
            self.bubble_s = 0.8 * self.bubble_s + 0.2 * gap if self.bubble_s else gap
        began = max(started, back)
        self._back[step.group] = (ended, ids)
        self.cost.add(tokens, ended - began)

    def stats(self) -> dict[str, int]:
        """Totals: tokens proposed and accepted, and the steps that verified proposals."""
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted, "spec_steps": self.steps}


class NoSpeculation:
    """The scheduler's speculator when speculation is off: proposes nothing."""

    def waits(self, req: Request) -> bool:
        return False

    def extend(self, plan: StepPlan, blocks: KVGroups, *, budget: int, max_context: int, ahead: bool = False) -> int:
        return 0

    def settle(self, req: Request, proposed: int, accepted: int) -> None:
        raise RuntimeError(f"sequence {req.seq_id} came back with {proposed} proposals, but speculation is off")

    def observe_step(self, step: Step, tokens: int, *, started: float, ended: float) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}
