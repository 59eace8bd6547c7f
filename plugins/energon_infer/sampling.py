"""Per-request sampling settings, the sampler, and stop conditions.

Greedy is ``temperature=0``. Otherwise logits are divided by the temperature, filtered by top-k
then top-p (the smallest set of most likely tokens whose probability reaches ``top_p``; the most
likely token is always kept), and a token is drawn with the request's own ``torch.Generator``, so a
request with a ``seed`` gives the same tokens whatever else is in the batch.

Example:
    >>> import torch
    >>> sampler = Sampler()
    >>> logits = torch.tensor([[0.0, 3.0, 1.0]])
    >>> sampler.sample(logits, [1], [SamplingParams(temperature=0)])
    [1]
    >>> SamplingParams(top_p=1.5)
    Traceback (most recent call last):
    ...
    ValueError: top_p=1.5 must be in (0, 1]; 1 keeps every token
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tightfit.checks import check_number

__all__ = ["SamplingParams", "Sampler", "stop_reason"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one request picks tokens and when it stops.

    Args:
        temperature: 0 is greedy; > 0 scales the logits before sampling.
        top_k: keep only the ``k`` most likely tokens (0 keeps all).
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1 keeps all).
        seed: seeds this request's generator (``None``: a seed drawn from the runner's generator).
        max_tokens: generated tokens at most (not counting the prompt).
        stop_token_ids: tokens that end the request (kept in the output); the model's EOS tokens are
            added unless ``ignore_eos``.
        stop: strings that end the request; the text is cut before the first one.
        ignore_eos: do not stop at the model's EOS tokens.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Type and finiteness first (a NaN temperature or top_k=2.5 would pass the range checks below).
        for name in ("temperature", "top_p"):
            check_number(getattr(self, name), name, where="SamplingParams", fix="give a finite number")
        for name in ("top_k", "max_tokens"):
            check_number(getattr(self, name), name, where="SamplingParams", integer=True, fix="give a whole number")
        if self.seed is not None:
            check_number(self.seed, "seed", where="SamplingParams", integer=True, low=0, high=2**63 - 1,
                         fix="give a whole number in [0, 2**63), or None for a seed from the runner")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0; use 0 for greedy decoding")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0; 0 keeps every token")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; 1 keeps every token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a list of token ids")
        for t in self.stop_token_ids:
            check_number(t, "stop_token_ids entry", where="SamplingParams", integer=True, low=0,
                         fix="token ids are whole numbers >= 0")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a string or a list of strings")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} contains an empty string, which would stop at once; remove it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Draws one token per row of a logits batch, each row with its request's generator.

    Args:
        seed: seeds the generator that draws seeds for requests that give none.
    """

    def __init__(self, seed: int = 0):
        self._seeds = torch.Generator().manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, seq_id: int, params: SamplingParams, device: torch.device) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,),
                                                                                 generator=self._seeds))
            gen = torch.Generator(device=device).manual_seed(seed)
            self._generators[seq_id] = gen
        return gen

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]) -> list[int]:
        """One token per row; rows with greedy params take the argmax (no generator used)."""
        if logits.shape[0] != len(seq_ids) or len(seq_ids) != len(params):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seq_ids)} sequences and {len(params)} params")
        out = logits.argmax(dim=-1).tolist()
        for row, (seq_id, p) in enumerate(zip(seq_ids, params)):
            if p.greedy:
                continue
            probs = _filtered_probs(logits[row].float(), p)
            gen = self.generator(seq_id, p, logits.device)
            out[row] = int(torch.multinomial(probs, 1, generator=gen))
        return out


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of strictly more likely tokens
        drop = before >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def stop_reason(generated: Sequence[int], params: SamplingParams, eos_token_ids: Sequence[int],
                decode: Callable[[Sequence[int]], str] | None = None, *,
                text: str | None = None) -> tuple[str | None, str | None]:
    """``(finish_reason, text)`` after the latest token: ``"stop"``, ``"length"`` or ``None`` (go on).

    Stop strings are looked for in ``text`` (the output's text so far) or, without it, in
    ``decode(generated)``. The returned text is the output cut before a stop string when one
    matched, else ``None``.
    """
    last = generated[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
        return "stop", None
    if params.stop and (text is not None or decode is not None):
        if text is None:
            assert decode is not None
            text = decode(generated)
        hits = [text.find(s) for s in params.stop if s in text]
        if hits:
            return "stop", text[: min(hits)]
    if len(generated) >= params.max_tokens:
        return "length", None
    return None, None
