"""Per-request sampling settings, the sampler, and stop conditions.

Greedy is ``temperature=0``. Otherwise logits are divided by the temperature, filtered by top-k
then top-p (the smallest set of most likely tokens whose probability reaches ``top_p``; the most
likely token is always kept), and a token is drawn for the whole batch at once (Gumbel-max with
counter-based noise of the request's seed and the token's position), so a request with a ``seed``
gives the same tokens whatever else is in the batch, and after a preemption or a chunked prefill.

Penalties act on the logits first, in vLLM's order: ``repetition_penalty`` (Hugging Face's: a
positive logit of a token seen in the prompt or the output is divided by it, a negative one
multiplied), then ``frequency_penalty`` (times the token's count in the output) and
``presence_penalty`` (once per token present in the output) are subtracted. ``logprobs=k`` returns
the log-probability of the sampled token under the model (the raw logits, before penalties and
temperature, as OpenAI reports them) and the ``k`` most likely tokens.

Penalties, logprobs and the draw are tensor ops over the batch (no loop over rows). One row that cannot be sampled (its probabilities are not finite, e.g. a half-precision overflow)
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from energon_infer.structured import StructuredOutput
from tightfit.checks import check_number
from tightfit.kernels.gumbel import counter_uniform, first_max, gumbel_argmax

__all__ = ["SamplingParams", "Sampler", "SampleOutput", "filter_logits", "allowed_from_bitmask", "stop_reason", "uniform_noise", "MIN_TEMPERATURE", "MAX_TEMPERATURE",
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
        min_tokens: generated tokens at least (vLLM's): until then the EOS and ``stop_token_ids`` cannot be
            drawn and stop strings are not looked for (0: off; at most ``max_tokens``).
        presence_penalty: subtracted once from the logit of every token already in the output ([-2, 2]).
        frequency_penalty: subtracted from a token's logit once per time it is in the output ([-2, 2]).
        repetition_penalty: > 1 discourages tokens of the prompt and the output (Hugging Face's; 1: off).
        logprobs: ``None``: none; ``k``: the sampled token's log-probability and the ``k`` most likely tokens'
            (at most ``MAX_LOGPROBS``).
        structured: the output must match this constraint (a JSON schema, a regex, a choice, a grammar:
            :class:`~energon_infer.structured.StructuredOutput`), enforced by grammar-constrained decoding.
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
    min_tokens: int = 0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
        for name in ("top_k", "max_tokens", "min_tokens"):
            check_number(getattr(self, name), name, where="SamplingParams", integer=True, fix="give a whole number")
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
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]; lower it or "
                             "raise max_tokens")
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
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured={self.structured!r} must be a StructuredOutput (or None)")
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


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


#: ``(B, vocab)`` uniforms, a pure function of each row's ``(seed, position)`` and the token index: the noise of
#: every draw (:func:`tightfit.kernels.gumbel.counter_uniform`).
uniform_noise = counter_uniform


class Sampler:
    """Draws one token per row of a logits batch: every row at once (no loop over rows, one host sync).

    A sampled row's draw is Gumbel-max over its penalised, filtered logits (exactly a draw from the
    softmax) with noise from :func:`uniform_noise` of the request's seed and the token's position, so
    a seeded request gives the same tokens whatever else is in the batch, and after a preemption.

    Args:
        seed: requests without a ``seed`` get one derived from this and their sequence id.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._seeds: dict[int, int] = {}
        self._history: dict[int, tuple[list[int], list[int]]] = {}  # seq_id -> (prompt, output) for penalties

    def seed_of(self, seq_id: int, params: SamplingParams) -> int:
        if params.seed is not None:
            return _splitmix64(int(params.seed) % (1 << 64)) >> 2  # hashed: nearby seeds draw unrelated noise
        s = self._seeds.get(seq_id)
        if s is None:
            s = self._seeds[seq_id] = _splitmix64(_splitmix64(self.seed) ^ (seq_id & 0xFFFFFFFFFFFFFFFF)) >> 2
        return s

    def generator(self, seq_id: int, params: SamplingParams, device: torch.device) -> torch.Generator:
        """A ``torch.Generator`` seeded like this request's draws (for callers that draw their own)."""
        return torch.Generator(device=device).manual_seed(self.seed_of(seq_id, params))

    def forget(self, seq_id: int) -> None:
        self._seeds.pop(seq_id, None)
        self._history.pop(seq_id, None)

    def observe(self, seq_id: int, tokens: Sequence[int], *, prompt: bool) -> None:
        """Record tokens fed to a sequence (its prompt, or the tokens it generated) for the penalties."""
        hist = self._history.setdefault(seq_id, ([], []))
        hist[0 if prompt else 1].extend(int(t) for t in tokens)

    def sample(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams],
               positions: Sequence[int] | None = None) -> list[int]:
        """One token per row; greedy rows take the argmax. ``positions``: each row's context length (default 0)."""
        out = self.sample_rows(logits, seq_ids, params, positions)
        if out.errors:
            row, why = next(iter(out.errors.items()))
            raise ValueError(f"sequence {seq_ids[row]}: {why}")
        return out.tokens

    def sample_rows(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams],
                    positions: Sequence[int] | None = None, banned: Mapping[int, Sequence[int]] | None = None,
                    grammar: tuple[Sequence[int], torch.Tensor] | None = None,
                    extra_output: Mapping[int, Sequence[int]] | None = None) -> SampleOutput:
        """Like :meth:`sample`, with the logprobs each row asked for and per-row errors instead of raising.

        ``banned``: by row, tokens that cannot be drawn (a request below its ``min_tokens``: its stop tokens);
        ``grammar``: rows under a structured-output grammar and their ``(len(rows), ceil(vocab / 32))`` int32
        bitmask of the tokens they may take (bit ``t % 32`` of word ``t // 32``; see
        :class:`~energon_infer.worker.grammar.GrammarMasks`): the others are set to ``-inf`` after the penalties, for
        greedy and sampled rows alike; ``extra_output``: by row, output the penalties count after what was recorded
        (a speculative row: the proposals before it). The logprobs stay those of the raw logits."""
        if logits.shape[0] != len(seq_ids) or len(seq_ids) != len(params):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seq_ids)} sequences and {len(params)} params")
        dev, vocab = logits.device, logits.shape[-1]
        out = first_max(logits)
        banned = banned or {}
        masked = dict(zip(grammar[0], range(len(grammar[0])))) if grammar is not None else {}
        rows = [i for i, p in enumerate(params)
                if not p.greedy or p.penalised or p.logprobs is not None or i in banned or i in masked]
        if not rows:
            return SampleOutput(out.tolist())
        sub = [params[i] for i in rows]
        index = torch.tensor(rows, dtype=torch.long, device=dev)
        raw = (logits if len(rows) == len(params) else logits.index_select(0, index)).float()  # no copy for all rows
        scores = self.apply_penalties_batch(raw, [seq_ids[i] for i in rows], sub,
                                            [extra_output.get(i, ()) for i in rows] if extra_output else None)
        # Under a grammar the EOS is where the grammar may end: a row's mask overrides its min_tokens ban.
        ban = [(j, t) for j, i in enumerate(rows) if i not in masked for t in banned.get(i, ()) if 0 <= t < vocab]
        if ban:
            scores = scores.clone() if scores is raw else scores
            scores[torch.tensor([j for j, _ in ban], device=dev), torch.tensor([t for _, t in ban], device=dev)] = \
                float("-inf")
        if masked:
            assert grammar is not None
            scores = _mask_rows(scores.clone() if scores is raw else scores, rows, masked, grammar[1])
        greedy_rows = [p.greedy for p in sub]
        if not all(greedy_rows):
            pos = positions if positions is not None else [0] * len(seq_ids)
            seeds = torch.tensor([self.seed_of(seq_ids[i], params[i]) for i in rows], dtype=torch.long, device=dev)
            where = torch.tensor([pos[i] for i in rows], dtype=torch.long, device=dev)
            filtered = filter_logits(scores, sub)
            drawn = gumbel_argmax(filtered, seeds, where)
            # The drawn token's score says whether the row could be sampled: it is NaN or +inf where the row has
            # one (logits / a tiny temperature overflowed: softmax would be NaN), -inf where it has no finite one.
            usable = torch.isfinite(filtered.gather(1, drawn[:, None])[:, 0])
            choice = drawn
            if any(greedy_rows):
                greedy = torch.tensor(greedy_rows, device=dev)
                choice, usable = torch.where(greedy, first_max(scores), drawn), greedy | usable
        else:
            usable = torch.ones(len(rows), dtype=torch.bool, device=dev)
            choice = first_max(scores)
        # A row has a finite logit where its largest is finite; only a NaN or +inf largest needs the whole row.
        largest = raw.gather(1, out.index_select(0, index)[:, None])[:, 0]
        finite = torch.isfinite(largest)
        odd = torch.isnan(largest) | torch.isposinf(largest)
        if bool(odd.any()):
            finite = finite | (odd & torch.isfinite(raw).any(dim=-1))
        ok = finite & usable
        out = out.index_copy(0, index, torch.where(ok, choice, torch.zeros_like(choice)))
        result = SampleOutput(out.tolist())
        for j in (~ok).nonzero().flatten().tolist():  # rows that fail alone (empty in a healthy batch)
            bad = not bool(torch.isfinite(raw[j]).any())
            result.errors[rows[j]] = ("sampling failed: the model produced no finite logit (numerical overflow)"
                                      if bad else "sampling failed: the sampling probabilities are not finite "
                                      f"(temperature={sub[j].temperature:g})")
        want = [j for j, p in enumerate(sub) if p.logprobs is not None and rows[j] not in result.errors]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            toks = torch.tensor([result.tokens[rows[j]] for j in want], dtype=torch.long, device=dev)
            chosen = lp.gather(1, toks[:, None])[:, 0].tolist()
            kmax = max(sub[j].logprobs or 0 for j in want)
            top = torch.topk(lp, min(kmax, vocab), dim=-1) if kmax else None
            ids = top.indices.tolist() if top is not None else []
            vals = top.values.tolist() if top is not None else []
            for n, j in enumerate(want):
                k = sub[j].logprobs or 0
                result.logprobs[rows[j]] = (chosen[n], list(zip(ids[n][:k], vals[n][:k])) if k else [])
        return result

    def apply_penalties(self, logits: torch.Tensor, seq_id: int, p: SamplingParams) -> torch.Tensor:
        """``logits`` (one row) with ``p``'s penalties for what :meth:`observe` recorded of ``seq_id`` (a copy)."""
        return self.apply_penalties_batch(logits[None], [seq_id], [p])[0]

    def apply_penalties_batch(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams],
                              extra_output: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """``(B, V)`` logits with each row's penalties (rows without any are returned as they are); ``extra_output``:
        by row, output tokens counted after the recorded ones."""
        pen = [j for j, p in enumerate(params) if p.penalised]
        if not pen:
            return logits
        dev, vocab = logits.device, logits.shape[-1]
        logits = logits.clone()
        hist = [self._history.get(seq_ids[j], ([], [])) for j in pen]
        if extra_output is not None:
            hist = [(pr, [*ou, *extra_output[j]]) if extra_output[j] else (pr, ou) for j, (pr, ou) in zip(pen, hist)]
        # Every row's seen tokens (prompt + output) and output tokens as (row, token) index pairs, one tensor each.
        seen_r = [r for r, (pr, ou) in enumerate(hist) for _ in range(len(pr) + len(ou))]
        seen_t = [t for pr, ou in hist for t in (*pr, *ou)]
        out_r = [r for r, (_, ou) in enumerate(hist) for _ in ou]
        out_t = [t for _, ou in hist for t in ou]
        rows = torch.tensor(pen, dtype=torch.long, device=dev)
        sub = logits.index_select(0, rows)
        rep = torch.tensor([params[j].repetition_penalty for j in pen], dtype=logits.dtype, device=dev)
        if seen_t:
            seen = torch.zeros_like(sub, dtype=torch.bool)
            t = torch.tensor(seen_t, dtype=torch.long, device=dev)
            keep = t < vocab
            seen[torch.tensor(seen_r, dtype=torch.long, device=dev)[keep], t[keep]] = True
            scaled = torch.where(sub > 0, sub / rep[:, None], sub * rep[:, None])
            sub = torch.where(seen & (rep[:, None] != 1), scaled, sub)
        if out_t:
            counts = torch.zeros_like(sub)
            t = torch.tensor(out_t, dtype=torch.long, device=dev)
            keep = t < vocab
            counts.index_put_((torch.tensor(out_r, dtype=torch.long, device=dev)[keep], t[keep]),
                              torch.ones(int(keep.sum()), dtype=sub.dtype, device=dev), accumulate=True)
            freq = torch.tensor([params[j].frequency_penalty for j in pen], dtype=sub.dtype, device=dev)
            pres = torch.tensor([params[j].presence_penalty for j in pen], dtype=sub.dtype, device=dev)
            sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(sub.dtype)
        return logits.index_copy(0, rows, sub)


def _mask_rows(scores: torch.Tensor, rows: Sequence[int], masked: Mapping[int, int], bitmask: torch.Tensor
               ) -> torch.Tensor:
    """``scores`` (rows ``rows`` of the batch) with the tokens a grammar row may not take at ``-inf`` (in place where
    some rows are not constrained);
    ``masked``: batch row -> its row of ``bitmask``."""
    js = [j for j, i in enumerate(rows) if i in masked]
    allowed = allowed_from_bitmask(bitmask.to(scores.device)[[masked[rows[j]] for j in js]], scores.shape[-1])
    if len(js) == scores.shape[0]:  # every row constrained: one select, no gather and scatter (half the time)
        return torch.where(allowed, scores, float("-inf"))
    index = torch.tensor(js, dtype=torch.long, device=scores.device)
    return scores.index_copy_(0, index, scores.index_select(0, index).masked_fill(~allowed, float("-inf")))


def allowed_from_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, width)`` booleans from ``(B, words)`` int32 bitmasks (bit ``t % 32`` of word ``t // 32``: token t)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    flat = bits.reshape(bitmask.shape[0], -1)
    if flat.shape[1] < width:
        flat = torch.nn.functional.pad(flat, (0, width - flat.shape[1]))
    return flat[:, :width].bool()


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``(B, V)`` logits divided by each row's temperature, with tokens outside its top-k / top-p set to ``-inf``."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = [p.temperature or 1.0 for p in params]  # 0: greedy rows
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, dtype=logits.dtype, device=dev)[:, None]
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
    if len(generated) < params.min_tokens:
        return None, None  # the stop tokens could not be drawn (see Sampler.sample_rows' banned)
    last = generated[-1]
    # Under a grammar the EOS is drawable only where the grammar may end: it ends the request even with ignore_eos.
    if last in params.stop_token_ids or ((not params.ignore_eos or params.structured is not None)
                                         and last in eos_token_ids):
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
