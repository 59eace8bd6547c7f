"""Per-request sampling settings, the sampler, and stop conditions.

Greedy is ``temperature=0``. Otherwise logits are divided by the temperature, filtered by top-k
then top-p (the smallest set of most likely tokens whose probability reaches ``top_p``; the most
likely token is always kept), and a token is drawn for the whole batch at once (Gumbel-max with
counter-based noise of the request's seed and the token's position), so a request with a ``seed``
gives the same tokens whatever else is in the batch.

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

__all__ = ["SamplingParams", "Sampler", "filter_logits", "stop_reason", "uniform_noise"]


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
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} contains an empty string, which would stop at once; remove it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


_M31 = 0x7FFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 31-bit values (int64 tensors; products stay below 2**58, so nothing overflows)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(B, vocab)`` uniforms in (0, 1), a pure function of each row's ``(seed, position)`` and the token index.

    Counter-based, so a request's draw for the token at ``position`` is the same whatever ran before it
    (batch mates, a preemption and recompute, a prefill split into chunks), with no generator state to keep.
    """
    dev = seeds.device
    key = _mix((seeds ^ (seeds >> 31)) & _M31)
    key = _mix(key ^ _mix((positions * 0x2545F491) & _M31))
    cols = (torch.arange(vocab, device=dev, dtype=torch.long) * 0x9E3779B1) & _M31
    x = _mix(_mix((key[:, None] ^ cols[None, :]) & _M31) ^ key[:, None])
    return (x.to(torch.float64) + 0.5).div_(2.0 ** 31).float()


class Sampler:
    """Draws one token per row of a logits batch: every sampled row at once (no loop over rows, one host sync).

    A row's draw is Gumbel-max over its filtered logits (exactly a draw from the softmax) with noise
    from :func:`uniform_noise` of the request's seed and the token's position, so a seeded request
    gives the same tokens whatever else is in the batch, and after being preempted and recomputed.

    Args:
        seed: requests without a ``seed`` get one derived from this and their sequence id.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._seeds: dict[int, int] = {}

    def seed_of(self, seq_id: int, params: SamplingParams) -> int:
        if params.seed is not None:
            return int(params.seed) & ((1 << 62) - 1)
        s = self._seeds.get(seq_id)
        if s is None:
            s = self._seeds[seq_id] = _splitmix64(_splitmix64(self.seed) ^ (seq_id & 0xFFFFFFFFFFFFFFFF)) >> 2
        return s

    def generator(self, seq_id: int, params: SamplingParams, device: torch.device) -> torch.Generator:
        """A ``torch.Generator`` seeded like this request's draws (for callers that draw their own)."""
        return torch.Generator(device=device).manual_seed(self.seed_of(seq_id, params))

    def forget(self, seq_id: int) -> None:
        self._seeds.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams],
               positions: Sequence[int] | None = None) -> list[int]:
        """One token per row; greedy rows take the argmax. ``positions``: each row's context length (default 0)."""
        if logits.shape[0] != len(seq_ids) or len(seq_ids) != len(params):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seq_ids)} sequences and {len(params)} params")
        out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            pos = positions if positions is not None else [0] * len(seq_ids)
            sub = [params[i] for i in rows]
            dev = logits.device
            seeds = torch.tensor([self.seed_of(seq_ids[i], params[i]) for i in rows], dtype=torch.long, device=dev)
            where = torch.tensor([pos[i] for i in rows], dtype=torch.long, device=dev)
            index = torch.tensor(rows, dtype=torch.long, device=dev)
            filtered = filter_logits(logits.index_select(0, index).float(), sub)
            gumbel = -torch.log(-torch.log(uniform_noise(seeds, where, logits.shape[-1])))
            out = out.index_copy(0, index, (filtered + gumbel).argmax(dim=-1))
        return out.tolist()


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``(B, V)`` logits divided by each row's temperature, with tokens outside its top-k / top-p set to ``-inf``."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    logits = logits / temps[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        kmax = max(ks)
        top = torch.topk(logits, kmax, dim=-1).values
        k_t = torch.tensor([(k or kmax) - 1 for k in ks], dtype=torch.long, device=dev)
        kth = top.gather(1, k_t[:, None])
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # one sort for the whole batch
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop = before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


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
