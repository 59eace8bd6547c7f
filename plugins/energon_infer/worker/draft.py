"""A draft model that proposes tokens for speculative decoding (:mod:`energon_infer.scheduling.speculation`).

:class:`DraftProposer` holds a second, small :class:`~energon_infer.worker.runtime.ModelRunner` (its own paged KV
cache, its own block allocator) in the process that schedules, and keeps every speculating sequence in step with
the served model: before it proposes it forgets what it holds past the tokens the sequence really has (its
rejected proposals, :meth:`~energon_infer.worker.kv_cache.KVCache.truncate`), feeds the tokens it has not seen,
and then decodes greedily up to ``k`` tokens, one step for the whole batch at a time. Greedy proposals are a point
mass, which the served model's check accepts exactly (see :mod:`energon_infer.worker.speculative`).

:func:`check_draft` refuses, in one line, a draft whose tokenizer (or vocabulary size, without tokenizers) is not
the served model's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from energon_infer.errors import OptionError
from energon_infer.sampling import SamplingParams
from energon_infer.worker.kv_cache import KVCacheFullError
from energon_infer.worker.runtime import ModelRunner, RuntimeConfig

__all__ = ["DraftProposer", "check_draft"]

_GREEDY = SamplingParams(temperature=0)


def _vocab(path: Path) -> dict[str, int] | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    vocab = json.loads(file.read_text()).get("model", {}).get("vocab")
    return dict(vocab) if isinstance(vocab, dict) else {str(i): i for i in range(len(vocab or []))}


def check_draft(model_dir: str | Path, draft_dir: str | Path) -> None:
    """Raise :class:`~energon_infer.errors.OptionError` unless ``draft_dir`` can propose tokens for ``model_dir``."""
    model_dir, draft_dir = Path(model_dir), Path(draft_dir)
    if not (draft_dir / "config.json").is_file():
        raise OptionError(f"draft_model={str(draft_dir)!r} is not a model directory (no config.json); give a small "
                          "model saved with save_pretrained that uses the served model's tokenizer")
    mine, theirs = _vocab(model_dir), _vocab(draft_dir)
    if mine is not None and theirs is not None and mine != theirs:
        raise OptionError(f"draft_model={str(draft_dir)!r} has another tokenizer ({len(theirs)} tokens, the served "
                          f"model {len(mine)}, or the same ids spelt differently); a draft must share the served "
                          "model's tokenizer: pick one of its family")
    sizes = [json.loads((d / "config.json").read_text()).get("vocab_size") for d in (model_dir, draft_dir)]
    # Without both tokenizers the sizes must agree; with them, a draft's (padded) vocabulary may be smaller, never
    # larger: every id it can propose must be one the served model scores.
    if (sizes[1] != sizes[0]) if mine is None or theirs is None else not sizes[1] <= sizes[0]:
        raise OptionError(f"draft_model={str(draft_dir)!r} has vocab_size={sizes[1]} but the served model "
                          f"{sizes[0]}; a draft must share the served model's tokenizer (and propose no id beyond "
                          "its vocabulary): pick one of its family")


class DraftProposer:
    """Greedy proposals from a draft :class:`ModelRunner`, kept in step with each sequence (see the module).

    Args:
        runner: the draft model (one rank: ``tp = pp = 1``).
    """

    def __init__(self, runner: ModelRunner):
        if runner.grid.world != 1:
            raise OptionError(f"a draft model runs on one rank; it was loaded on {runner.grid.world}")
        self.runner = runner
        self._held: dict[int, list[int]] = {}  # seq_id -> the tokens whose keys/values the draft's cache holds

    @classmethod
    def from_pretrained(cls, path: str | Path, **runtime: Any) -> DraftProposer:
        """Load the draft from a directory; ``runtime``: :class:`RuntimeConfig` fields (``device``, ``dtype``)."""
        rt = RuntimeConfig(**{"progress": False, "kv_cache_tokens": 16384, **runtime})
        return cls(ModelRunner.from_pretrained(path, rt))

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._held.pop(seq_id, None)
            if seq_id in self.runner.cache:
                self.runner.free(seq_id)

    def _catch_up(self, batch: Sequence[tuple[int, Sequence[int], int]]) -> list[int]:
        """Feed each sequence what the draft has not seen; returns each one's first proposal."""
        items = []
        for seq_id, tokens, _ in batch:
            held, common = self._held.get(seq_id, []), 0
            limit = min(len(held), len(tokens) - 1)  # at least the last token is fed: its logits propose
            while common < limit and held[common] == tokens[common]:
                common += 1
            if seq_id in self.runner.cache:
                self.runner.cache.truncate(seq_id, common)
                self._held[seq_id] = list(tokens[:common])
            items.append((seq_id, list(tokens[common:])))
        return self.runner.step(items, _GREEDY).tokens

    def propose(self, batch: Sequence[tuple[int, Sequence[int], int]]) -> dict[int, list[int]]:
        """Up to ``k`` greedy draft tokens per ``(seq_id, tokens, k)``."""
        batch = [b for b in batch if len(b[1]) + b[2] < self.runner.max_context]
        if not batch:
            return {}
        try:
            first = self._catch_up(batch)
        except KVCacheFullError:  # what it holds of sequences not asked about goes first, then half of the batch
            others = [s for s in self._held if s not in {b[0] for b in batch}]
            if others or len(batch) > 1:
                self.release(others or [b[0] for b in batch[len(batch) // 2:]])
                return self.propose(batch if others else batch[:len(batch) // 2])
            self.release([batch[0][0]])
            return {}
        out = {seq_id: [tok] for (seq_id, _, _), tok in zip(batch, first)}
        want = {seq_id: k for seq_id, _, k in batch}
        try:
            while live := [s for s, toks in out.items() if len(toks) < want[s]]:
                for s, tok in zip(live, self.runner.step([(s, [out[s][-1]]) for s in live]).tokens):
                    out[s].append(tok)
        except KVCacheFullError:  # no room for the draft's own tokens: no proposals this step
            self.release([b[0] for b in batch])
            return {}
        for seq_id, tokens, _ in batch:  # it holds the tokens and every proposal but the last (never fed)
            self._held[seq_id] = [*tokens, *out[seq_id][:-1]]
        return out
