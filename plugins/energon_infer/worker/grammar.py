"""Structured outputs on the rank that samples: each constrained sequence's grammar matcher and a step's bitmask.

The rank compiles a request's grammar (once per constraint: the last :data:`GRAMMARS` kept by key) on its grammar
thread, when the engine asks (:class:`~energon_infer.protocol.CompileGrammars`, :meth:`GrammarMasks.compile_async`)
before the request may run: the step path never waits for a compile, and the engine holds the request until the
rank answers :class:`~energon_infer.protocol.GrammarReady`. The engine only checked that its grammar builds
(:data:`~energon_infer.structured.ON_RANK`; compiling here costs less than carrying a compiled grammar here would:
xgrammar's JSON of one serialises and deserialises several times slower than the grammar compiles). A sequence
whose grammar the rank does not hold when the step admits it (a runner driven in-process, or a grammar dropped
from the cache since) has it compiled on the mask thread, beside that step's forward. One that cannot compile
fails its request alone with a :data:`~energon_infer.structured.REFUSED` error (a 400). A grammar the request
carries compiled (xgrammar's JSON) is read back instead.
:class:`GrammarSampler` is the runner's sampler with them: :meth:`GrammarSampler.start_masks` (before the
forward) hands new constrained sequences' admission (grammar and matcher) and the step's bitmask to the mask
thread; the draw applies it and advances each matcher with its sampled token; forgetting a sequence frees its
matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from energon_infer.sampling import SampleOutput, Sampler, SamplingParams
from energon_infer.structured import (
    ON_RANK,
    REFUSED,
    StructuredOutput,
    StructuredOutputError,
    compile_grammar,
    import_xgrammar,
    tokenizer_info,
)

__all__ = ["GRAMMARS", "GrammarMasks", "SequenceGrammars", "GrammarSampler", "failure"]

GRAMMARS = 64  #: compiled grammars a rank keeps, by constraint (the least recently used dropped)
#: Called with a constraint's key and ``None`` once its grammar is compiled, or the error text of its failure.
Done = Callable[[tuple[str, str], "str | None"], None]


def failure(exc: BaseException) -> str:
    """A request's error text for a grammar that could not be set up (:data:`REFUSED` first where it cannot compile:
    the server's 400)."""
    text = " ".join(str(exc).split())
    return REFUSED + text if isinstance(exc, StructuredOutputError) else f"structured output: {text}"


class GrammarMasks:
    """Each constrained request's matcher on the rank that samples, and the token bitmask of a step.

    A matcher has accepted the request's output tokens up to :attr:`next_pos` (a position in the sequence);
    a step's sampled token for a request is accepted when it is the next output (a non-final chunk of a prefill
    samples a token nobody keeps). The bitmask of a step depends only on accepted tokens, so :meth:`fill_async`
    computes it on a thread while the step's forward runs, after admitting the step's new sequences there
    (:meth:`admit`: the grammar :meth:`compile_async` compiled on the grammar thread, waited for if that compile is
    still running, or compiled there if the rank was never asked). The caller marks a sequence admitted
    (:attr:`next_pos`) before handing its admission over; :meth:`settle` waits for the thread's work, and
    :attr:`failed` has the sequences whose admission failed.

    Args:
        info: the :func:`tokenizer_info` of the model's tokenizer (the same vocabulary the grammar was compiled for).
        width: the logits' width (the model's vocab size).
    """

    def __init__(self, info: Any, width: int):
        self.info, self.width = info, width
        self._compilers: dict[str, Any] = {}  # one per thread that compiles (the mask and the grammar thread)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # deserialised, by key
        self._compiling: dict[tuple[str, str], Future[Any]] = {}  # on the grammar thread, by key
        self._lock = threading.Lock()  # _compiled, _compiling and compiles: both threads use them
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="energon-grammar")
        self.matchers: dict[int, Any] = {}
        self.next_pos: dict[int, int] = {}
        self.failed: dict[int, str] = {}  # admissions that failed on the mask thread, by seq_id
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="energon-mask")
        self._last: Future[Any] | None = None  # the mask thread's latest task (it runs them in order)
        self._words = -(-width // 32)
        self.compiles = 0  # grammars this rank compiled (a constraint kept by key compiles once)

    def _grammar(self, structured: StructuredOutput) -> Any:
        """The compiled grammar of ``structured``: kept, being compiled on the grammar thread (waited for), or
        compiled here (raises StructuredOutputError)."""
        key = structured.key
        with self._lock:
            got, running = self._compiled.get(key), self._compiling.get(key)
            if got is not None:
                self._compiled.move_to_end(key)
        if got is None:
            got = running.result() if running is not None else self._compile(structured, "mask")
        return got

    def _compile(self, structured: StructuredOutput, thread: str) -> Any:
        """Compile (or read back) ``structured``'s grammar with ``thread``'s compiler and keep it by key."""
        xgr = import_xgrammar()
        key = structured.key
        try:
            if structured.compiled not in (None, ON_RANK):
                got = xgr.CompiledGrammar.deserialize_json(structured.compiled, self.info)
            else:
                compiler = self._compilers.get(thread)
                if compiler is None:
                    compiler = self._compilers[thread] = xgr.GrammarCompiler(self.info, max_threads=1,
                                                                             cache_enabled=False)
                with self._lock:
                    self.compiles += 1
                got = compile_grammar(compiler, structured)
            with self._lock:
                self._compiled[key] = got
                while len(self._compiled) > GRAMMARS:
                    self._compiled.popitem(last=False)
            return got
        finally:
            if thread == "grammar":  # its future leaves once the grammar is kept (or failed)
                with self._lock:
                    self._compiling.pop(key, None)

    def compile_async(self, structured: StructuredOutput, done: Done) -> None:
        """Compile ``structured``'s grammar on the grammar thread (at once if kept or already compiling), then call
        ``done(key, None)``, or ``done(key, error text)`` if it cannot compile (:func:`failure`)."""
        key = structured.key
        with self._lock:
            kept = key in self._compiled
            if kept:
                self._compiled.move_to_end(key)
                running = None
            elif (running := self._compiling.get(key)) is None:
                running = self._compiling[key] = self._grammar_pool.submit(self._compile, structured, "grammar")
        if running is None:
            done(key, None)
            return

        def report(fut: Future[Any]) -> None:
            exc = fut.exception()
            done(key, None if exc is None else failure(exc))

        running.add_done_callback(report)

    def admit(self, seq_id: int, structured: StructuredOutput, output_start: int, generated: Sequence[int]) -> None:
        """A new sequence whose outputs start at position ``output_start``, with ``generated`` already sampled."""
        m = import_xgrammar().GrammarMatcher(self._grammar(structured))
        for t in generated:
            if not m.accept_token(int(t)):
                raise ValueError(f"sequence {seq_id}: its earlier output token {t} breaks its grammar")
        self.matchers[seq_id] = m
        self.next_pos[seq_id] = output_start + len(generated)

    def free(self, seq_id: int) -> None:
        self.settle()  # an admission still on the mask thread would bring the matcher back
        self.matchers.pop(seq_id, None)
        self.next_pos.pop(seq_id, None)
        self.failed.pop(seq_id, None)

    def settle(self) -> None:
        """Wait for the mask thread's work handed over so far (admissions and fills)."""
        if self._last is not None:
            self._last.exception()  # waits; an error is the caller's of that future to see

    def admit_async(self, admits: Sequence[tuple[int, StructuredOutput, int, Sequence[int]]]) -> Future[None]:
        """Admit ``(seq_id, structured, output_start, generated)`` sequences on the mask thread (:meth:`admit`);
        one that fails is in :attr:`failed`."""
        self._last = self._pool.submit(self._admit_all, admits)
        return self._last

    def fill_async(self, rows: Sequence[tuple[int, int]],
                   admits: Sequence[tuple[int, StructuredOutput, int, Sequence[int]]] = ()) -> Future[torch.Tensor]:
        """The ``(len(rows), words)`` int32 bitmask for ``(row, seq_id)`` rows, computed on the mask thread after
        admitting ``admits`` there (as :meth:`admit_async`). A row whose sequence failed its admission allows
        every token (it fails after the draw)."""
        self._last = fut = self._pool.submit(self._admit_and_fill, admits, [s for _, s in rows])
        return fut

    def _admit_all(self, admits: Sequence[tuple[int, StructuredOutput, int, Sequence[int]]]) -> None:
        for seq_id, structured, output_start, generated in admits:
            try:
                self.admit(seq_id, structured, output_start, generated)
            except Exception as exc:  # this request fails alone (a 400 where its grammar cannot compile)
                self.failed[seq_id] = failure(exc)

    def _admit_and_fill(self, admits: Sequence[tuple[int, StructuredOutput, int, Sequence[int]]],
                        seq_ids: Sequence[int]) -> torch.Tensor:
        self._admit_all(admits)
        return self._fill(seq_ids)

    def _fill(self, seq_ids: Sequence[int]) -> torch.Tensor:
        mask = torch.zeros((len(seq_ids), self._words), dtype=torch.int32)
        n = self.info.vocab_size
        for i, s in enumerate(seq_ids):
            m = self.matchers.get(s)
            if m is None:  # its admission failed
                mask[i] = -1
                continue
            if m.is_terminated():
                words = mask[i]  # nothing more: only the stop tokens
                for t in self.info.stop_token_ids:
                    words[t // 32] |= _bit(t % 32)
                continue
            m.fill_next_token_bitmask(mask, i)
        if n < self.width:  # ids the tokenizer does not have (a padded vocab): never allowed
            tail = n % 32
            if tail:
                mask[:, n // 32] &= (1 << tail) - 1
            mask[:, -(-n // 32):] = 0
        return mask

    def accept(self, seq_id: int, token: int, position: int) -> str | None:
        """Advance ``seq_id``'s matcher with the token sampled for ``position``; an error text if it refuses."""
        if self.next_pos.get(seq_id) != position:
            return None
        self.next_pos[seq_id] = position + 1
        m = self.matchers[seq_id]
        if m.is_terminated():
            return None  # a stop token after the end (ignore_eos): the request stops on it
        if not m.accept_token(int(token)):
            return f"structured output: token {token} does not fit the grammar"
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)


def _bit(i: int) -> int:
    return -(1 << 31) if i == 31 else 1 << i  # int32 words: bit 31 is the sign


class SequenceGrammars:
    """A runner's constrained sequences: admission (with the outputs a preempted one had), the step's bitmask,
    the matchers' advance, and the sequences whose grammar could not be set up (they fail alone).

    Args:
        make_info: builds the tokenizer info on the first constrained sequence (raises if there is no tokenizer).
        width: the logits' width.
    """

    def __init__(self, make_info: Callable[[], Any], width: int):
        self._make_info, self.width = make_info, width
        self.masks: GrammarMasks | None = None
        self.errors: dict[int, str] = {}

    def start(self, items: Sequence[tuple[int, Sequence[int]]], starts: Mapping[int, int],
              params: Mapping[int, SamplingParams], history: Mapping[int, tuple[list[int], list[int]]]
              ) -> tuple[list[int], Future[torch.Tensor]] | None:
        """Hand new constrained sequences' admission to the mask thread; start filling the bitmask of the rows
        whose sampled token is their next output (a non-final prefill chunk's is not) there after it.
        ``(rows, future of the bitmask)``, or None."""
        self._collect()
        rows: list[tuple[int, int]] = []
        admits: list[tuple[int, StructuredOutput, int, Sequence[int]]] = []
        for row, (seq_id, fed) in enumerate(items):
            p = params[seq_id]
            if p.structured is None or seq_id in self.errors:
                continue
            if self.masks is None:
                try:
                    self.masks = GrammarMasks(self._make_info(), self.width)
                except Exception as exc:  # no tokenizer: this request fails alone
                    self.errors[seq_id] = failure(exc)
                    continue
            if seq_id not in self.masks.next_pos:
                # A sequence admitted with a history (a preempted one) has outputs its grammar took already; one
                # first seen here takes its first feed as its prompt.
                h = history.get(seq_id)
                plen, generated = (len(h[0]), list(h[1])) if h is not None else (starts[seq_id] + len(fed), [])
                self.masks.next_pos[seq_id] = plen + len(generated)
                admits.append((seq_id, p.structured, plen, generated))
            if starts[seq_id] + len(fed) == self.masks.next_pos[seq_id]:
                rows.append((row, seq_id))
        if self.masks is None or not (rows or admits):
            return None
        if not rows:
            self.masks.admit_async(admits)
            return None
        return [r for r, _ in rows], self.masks.fill_async(rows, admits)

    @property
    def compiles(self) -> int:
        """Grammars compiled for this rank's vocabulary since it started (:attr:`GrammarMasks.compiles`)."""
        return self.masks.compiles if self.masks is not None else 0

    def compile(self, constraints: Sequence[StructuredOutput], done: Done) -> None:
        """Compile each constraint's grammar on the grammar thread (:meth:`GrammarMasks.compile_async`, ``done``
        called as each is ready); without a tokenizer each is answered at once with the error."""
        if self.masks is None:
            try:
                self.masks = GrammarMasks(self._make_info(), self.width)
            except Exception as exc:
                for so in constraints:
                    done(so.key, failure(exc))
                return
        for so in constraints:
            self.masks.compile_async(so, done)

    def _collect(self) -> None:
        """The mask thread's work done; the admissions that failed there become errors (their sequences fail)."""
        if self.masks is not None:
            self.masks.settle()
            self.errors.update(self.masks.failed)

    def finish(self, ids: Sequence[int], positions: Sequence[int], tokens: Sequence[int],
               failed: Mapping[int, str]) -> dict[int, str]:
        """Advance each constrained row's matcher with its sampled token; by seq_id, the rows that fail."""
        self._collect()
        out = {s: why for s in ids if (why := self.errors.get(s)) is not None}
        if self.masks is None:
            return out
        for seq_id, pos, tok in zip(ids, positions, tokens):
            if seq_id in self.masks.matchers and seq_id not in failed and seq_id not in out:
                if (why := self.masks.accept(seq_id, tok, pos)) is not None:
                    out[seq_id] = why
        return out

    def free(self, seq_id: int) -> None:
        self.errors.pop(seq_id, None)
        if self.masks is not None:
            self.masks.free(seq_id)


class GrammarSampler(Sampler):
    """The runner's :class:`~energon_infer.sampling.Sampler` with structured outputs' matchers (on the rank that
    samples; xgrammar is loaded for the first constrained sequence).

    Args:
        seed: as :class:`~energon_infer.sampling.Sampler`'s.
        runner: the :class:`~energon_infer.worker.runtime.ModelRunner` (its grid, tokenizer, vocabulary, EOS tokens).
    """

    def __init__(self, seed: int, runner: Any):
        super().__init__(seed)
        self._runner = runner
        self.grammars = SequenceGrammars(self._info, runner.config.vocab_size)
        self._pending: tuple[list[int], Future[torch.Tensor]] | None = None

    def _info(self) -> Any:
        r = self._runner
        if r.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (tokenizer.json in the model directory)")
        return tokenizer_info(r.tokenizer, r.config.vocab_size, r.eos_token_ids)

    def start_masks(self, items: Sequence[tuple[int, Sequence[int]]], starts: dict[int, int],
                    params: Mapping[int, SamplingParams]) -> dict[int, int]:
        """Before a step's forward: start filling its grammar bitmask (``starts``: each sequence's tokens cached
        before the step, returned as given)."""
        grid = self._runner.grid
        if grid.rank == grid.result_rank and any(params[s].structured is not None for s, _ in items):
            self._pending = self.grammars.start(items, starts, params, self._history)
        return starts

    def sample_rows(self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams],
                    positions: Sequence[int] | None = None, banned: Mapping[int, Sequence[int]] | None = None,
                    grammar: tuple[Sequence[int], torch.Tensor] | None = None,
                    extra_output: Mapping[int, Sequence[int]] | None = None) -> SampleOutput:
        pending, self._pending = self._pending, None
        if grammar is None and pending is not None:
            grammar = (pending[0], pending[1].result())
        out = super().sample_rows(logits, seq_ids, params, positions, banned, grammar, extra_output)
        if positions is not None and (self.grammars.masks is not None or self.grammars.errors):
            failed = {seq_ids[r] for r in out.errors}
            why = self.grammars.finish(seq_ids, positions, out.tokens, dict.fromkeys(failed, ""))
            out.errors.update({row: why[s] for row, s in enumerate(seq_ids) if s in why})
        return out

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        self.grammars.free(seq_id)
