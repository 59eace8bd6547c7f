"""Per-request sampling settings, the sampler, and stop conditions.

Greedy is ``temperature=0``. Otherwise logits are divided by the temperature, filtered by top-k
then top-p (the smallest set of most likely tokens whose probability reaches ``top_p``; the most
likely token is always kept), and a token is drawn with the request's own ``torch.Generator``, so a
request with a ``seed`` gives the same tokens whatever else is in the batch.

Penalties act on the logits first, in vLLM's order: ``repetition_penalty`` (Hugging Face's: a
positive logit of a token seen in the prompt or the output is divided by it, a negative one
multiplied), then ``frequency_penalty`` (times the token's count in the output) and
``presence_penalty`` (once per token present in the output) are subtracted. ``logprobs=k`` returns
the log-probability of the sampled token under the model (the raw logits, before penalties and
temperature, as OpenAI reports them) and the ``k`` most likely tokens.

One row that cannot be sampled (its probabilities are not finite, e.g. a half-precision overflow)
fails alone: :meth:`Sampler.sample_rows` reports it in ``errors`` and the others are unaffected.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "Sampler", "SampleOutput", "stop_reason", "MIN_TEMPERATURE", "MAX_TEMPERATURE",
           "MAX_LOGPROBS", "SEED_MIN", "SEED_MAX"]

# Below 1e-2, logits / temperature overflow float32 for ordinary logit gaps (a gap of 10 at 1e-40 is 1e41 >
# 3.4e38) and softmax turns into NaN; 0 (greedy) is what such a request means. vLLM uses the same floor.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
# torch.Generator.manual_seed takes 64 bits; a negative seed is taken modulo 2**64.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


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
        presence_penalty: subtracted once from the logit of every token already in the output ([-2, 2]).
        frequency_penalty: subtracted from a token's logit once per time it is in the output ([-2, 2]).
        repetition_penalty: > 1 discourages tokens of the prompt and the output (Hugging Face's; 1: off).
        logprobs: ``None``: none; ``k``: the sampled token's log-probability and the ``k`` most likely tokens'
            (at most ``MAX_LOGPROBS``).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0; use 0 for greedy decoding")
        if 0 < self.temperature < MIN_TEMPERATURE or self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature:g} must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                             f"{MAX_TEMPERATURE:g}]; smaller positive values overflow the logits to NaN")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed={self.seed!r} must be an integer that fits in 64 bits [-2^63, 2^64)")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"presence_penalty={self.presence_penalty} and frequency_penalty="
                             f"{self.frequency_penalty} must be in [-2, 2] (OpenAI's range)")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be in (0, 10]; 1 turns it off")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}] (None: no logprobs)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0; 0 keeps every token")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; 1 keeps every token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} contains an empty string, which would stop at once; remove it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(slots=True)
class SampleOutput:
    """What :meth:`Sampler.sample_rows` drew: a token per row, and by row the logprobs asked for and the errors.

    ``logprobs[row]`` is ``(logprob of the token, [(token, logprob), ...] most likely first)``; a row in
    ``errors`` got token 0 as a placeholder and must be failed by the caller.
    """

    tokens: list[int]
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Draws one token per row of a logits batch, each row with its request's generator.

    Args:
        seed: seeds the generator that draws seeds for requests that give none.
    """

    def __init__(self, seed: int = 0):
        self._seeds = torch.Generator().manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}
        self._history: dict[int, tuple[list[int], list[int]]] = {}  # seq_id -> (prompt, output) for penalties

    def generator(self, seq_id: int, params: SamplingParams, device: torch.device) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            seed = params.seed % (1 << 64) if params.seed is not None else int(torch.randint(0, 2**62, (1,),
                                                                                             generator=self._seeds))
            gen = torch.Generator(device=device).manual_seed(seed)
            self._generators[seq_id] = gen
        return gen

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self._history.pop(seq_id, None)

    def observe(self, seq_id: int, tokens: Sequence[int], *, prompt: bool) -> None:
        """Record tokens fed to a sequence (its prompt, or the tokens it generated) for the penalties."""
        hist = self._history.setdefault(seq_id, ([], []))
        hist[0 if prompt else 1].extend(int(t) for t in tokens)

    def sample(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]) -> list[int]:
        """One token per row; rows with greedy params take the argmax (no generator used)."""
        out = self.sample_rows(logits, seq_ids, params)
        if out.errors:
            row, why = next(iter(out.errors.items()))
            raise ValueError(f"sequence {seq_ids[row]}: {why}")
        return out.tokens

    def sample_rows(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]
                    ) -> SampleOutput:
        """Like :meth:`sample`, with the logprobs each row asked for and per-row errors instead of raising."""
        if logits.shape[0] != len(seq_ids) or len(seq_ids) != len(params):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seq_ids)} sequences and {len(params)} params")
        out = SampleOutput(logits.argmax(dim=-1).tolist())
        for row, (seq_id, p) in enumerate(zip(seq_ids, params)):
            if p.greedy and not p.penalised and p.logprobs is None:
                continue  # the batched argmax above (NaN logits are caught by the finite check of others)
            try:
                raw = logits[row].float()
                if not bool(torch.isfinite(raw).any()):
                    raise ValueError("the model produced no finite logit (numerical overflow)")
                scores = self.apply_penalties(raw, seq_id, p) if p.penalised else raw
                if p.greedy:
                    tok = int(scores.argmax())
                else:
                    probs = _filtered_probs(scores, p)
                    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
                        raise ValueError(f"the sampling probabilities are not finite (temperature={p.temperature:g})")
                    tok = int(torch.multinomial(probs, 1, generator=self.generator(seq_id, p, logits.device)))
                out.tokens[row] = tok
                if p.logprobs is not None:
                    lp = torch.log_softmax(raw, dim=-1)
                    top = torch.topk(lp, min(p.logprobs, lp.shape[-1])) if p.logprobs else None
                    out.logprobs[row] = (float(lp[tok]), [] if top is None else
                                         list(zip(top.indices.tolist(), top.values.tolist())))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the batch
                out.tokens[row] = 0
                out.errors[row] = f"sampling failed: {exc}"
        return out

    def apply_penalties(self, logits: torch.Tensor, seq_id: int, p: SamplingParams) -> torch.Tensor:
        """``logits`` (one row) with ``p``'s penalties for what :meth:`observe` recorded of ``seq_id`` (a copy)."""
        prompt, output = self._history.get(seq_id, ([], []))
        vocab = logits.shape[-1]
        logits = logits.clone()
        if p.repetition_penalty != 1 and (prompt or output):
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=vocab)[:vocab]
            logits -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits


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
