"""The model runner: load a checkpoint onto a ``tp x pp`` grid, then run packed steps over a paged KV cache.

This is the API the engine's controller drives. Every rank of the grid holds one :class:`ModelRunner` and calls
the same methods with the same arguments in the same order (SPMD; a controller broadcasts each step's arguments to
its workers); results come back on every rank.

    runner = ModelRunner.from_pretrained("path/to/hf-dir", tp=2, pp=2)    # in each of 4 processes
    first = runner.prefill({0: prompt_a, 1: prompt_b}, SamplingParams(temperature=0))   # {seq_id: token}
    nxt = runner.decode([0, 1])            # one token for each running sequence (feeds the last token)
    res = runner.step([(2, prompt_c), (0, [nxt[0]])], {2: params})   # mix both: res.tokens, one per item
    runner.free(1)                         # its KV blocks go back to the pool
    outs = runner.generate(["Hello", "Hi there"], SamplingParams(max_tokens=8))   # the whole loop

A step packs the new tokens of all its sequences back to back (a prompt for a new sequence, one token for a running
one, or any chunk) and runs them with no padding; with ``pp > 1`` the sequences are split into micro-batches that
flow through the stages concurrently (stage ``s`` works on micro-batch ``m`` while stage ``s+1`` works on ``m-1``),
and only packed hidden states travel between stages. A step of the engine (:class:`~energon_infer.protocol.Step`) is
applied by :meth:`ModelRunner.run_step`, which returns a :class:`StepResult`.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from energon_infer.errors import ContextLengthError
from energon_infer.loading.config import ModelConfig, UnsupportedModelError, load_config
from energon_infer.loading.hf_files import auto_dtype
from energon_infer.loading.quantization import (
    QuantSpec,
    check_quantization,
    load_quantized,
    quantized_bytes_per_weight,
)
from energon_infer.loading.torchao_checkpoint import TorchaoWeights, checkpoint_quantization
from energon_infer.loading.weights import CheckpointReader, check_stage_fits, hf_parts, load_stage_weights
from energon_infer.parallel import Grid, local_rank_device, microbatches, split_layers
from energon_infer.protocol import Step
from energon_infer.sampling import SamplingParams
from energon_infer.scheduling.kv_groups import allocator
from energon_infer.scheduling.scheduler_config import KVAdmission, Preemption
from energon_infer.worker.attention import every_layer_window
from energon_infer.worker.building import build_stage as _build_stage
from energon_infer.worker.building import extra_eos as _extra_eos
from energon_infer.worker.building import load_tokenizer as _load_tokenizer
from energon_infer.worker.building import pack_loaded as _pack_loaded
from energon_infer.worker.cuda_graphs import decode_graphs_for
from energon_infer.worker.grammar import GrammarSampler
from energon_infer.worker.kv_cache import KVCache, KVCacheFullError
from energon_infer.worker.model import check_tp
from energon_infer.worker.offline import Generation, run_offline
from energon_infer.worker.runtime_config import DTYPES, RuntimeConfig
from energon_infer.worker.speculative import SpeculativeVerify

__all__ = ["RuntimeConfig", "ModelRunner", "Generation", "StepResult", "ContextLengthError", "DTYPES"]

@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step sampled: a token per item (``[]`` off the result rank when not broadcast) and, on the
    result rank, by seq_id, the logprobs asked for and the rows that failed alone (their token is a placeholder);
    ``accepted``: a speculating sequence's tokens with their logprobs (:class:`~energon_infer.protocol.Tokens`)."""

    tokens: list[int]
    logprobs: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    accepted: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)


class ModelRunner(SpeculativeVerify):
    """A model stage on this rank, its KV cache, and the sampler (see the module docstring).

    Args:
        config: the model.
        source: checkpoint tensors: a :class:`~energon_infer.loading.weights.CheckpointReader` or a ``{name: tensor}`` map.
        runtime: layout and cache settings.
        tokenizer: a ``tokenizers.Tokenizer`` (for string prompts, stop strings and output text), or ``None``.
        parts_fn (Callable): ``parts_fn(config, name, keys)``: the checkpoint tensors runtime parameter ``name`` is
            built from (default: :func:`~energon_infer.loading.weights.hf_parts`, Hugging Face names).
        offload: blocks (positions within this rank's stage) and tables (``"embed"``, ``"lm_head"``) not loaded: on
            meta for a memory pool to stream in (:mod:`~energon_infer.worker.disk_pool`, ``worker.disk_vocab``).
    """

    def __init__(self, config: ModelConfig, source: Any, runtime: RuntimeConfig | None = None, *,
                 tokenizer: Any = None, parts_fn=hf_parts, offload: Sequence[int | str] = ()):
        rt = runtime or RuntimeConfig()
        device = torch.device(rt.device) if rt.device else local_rank_device()
        if rt.dtype == "auto":
            rt = dataclasses.replace(rt, dtype=auto_dtype(getattr(source, "path", source), str(device))[0])
        self.config, self.runtime, self.tokenizer = config, rt, tokenizer
        self.device = device
        self.dtype = DTYPES[rt.dtype]
        check_tp(config, rt.tp)
        layers = split_layers(config.n_layers, rt.pp)
        self.grid = Grid.create(rt.tp, rt.pp, self.device)
        self._say(f"energon: {config.model_type} {config.n_params / 1e6:.1f}M params, {config.n_layers} layers "
                  f"on tp={rt.tp} x pp={rt.pp} ({self.device}, {rt.dtype})")
        num_blocks = -(-rt.kv_cache_tokens // rt.block_size)
        tables: list[Any] = [i for i in offload if isinstance(i, str)]
        blocks = sorted({i for i in offload if isinstance(i, int)})
        self.quant = QuantSpec.create(rt.quantization, rt.group_size)
        check_quantization(config, self.quant, tp=rt.tp, dtype=self.dtype)
        check_stage_fits(config, len(layers[self.grid.stage]) - len(blocks), tp=rt.tp, itemsize=self.dtype.itemsize,
                         kv_tokens=(num_blocks + 1) * rt.block_size, device=self.device,  # + the scratch block
                         weight_itemsize=quantized_bytes_per_weight(self.quant, self.dtype.itemsize))
        self.stage = _build_stage(config, self.grid, layers[self.grid.stage], self.dtype, self.device, blocks + tables,
                                  quantized=self.quant is not None)
        load_stage_weights(self.stage, config, self.grid, source, parts_fn=parts_fn, progress=self._say,
                           nonfinite=rt.nonfinite_weights)
        if self.quant is not None:
            # Offloaded blocks and experts get quantized shapes on meta: quantized_pool / expert_pool stream them.
            held = load_quantized(self.stage, config, self.grid, source, self.quant, parts_fn=parts_fn,
                                  nonfinite=rt.nonfinite_weights, skip=blocks, saved=TorchaoWeights.of(source),
                                  modules=[t for t in tables if t.startswith("layers.")])
            self._say(f"energon: block projections quantized to {self.quant.method}"
                      f"{f' (group {self.quant.group_size})' if self.quant.group_size else ''}: "
                      f"{held / 2**20:.1f} MiB")
        if rt.packed_weights and (packed := _pack_loaded(self.stage)):
            self._say(f"energon: projection weights packed for oneDNN (+{packed / 2**20:.1f} MiB)")
        self.cache = KVCache(n_layers=len(layers[self.grid.stage]), num_blocks=num_blocks, block_size=rt.block_size,
                             n_kv_heads=config.n_kv_heads // rt.tp, head_dim=config.head_dim, dtype=self.dtype,
                             device=self.device, host_blocks=-(-rt.swap_space_tokens // rt.block_size), scratch=True,
                             layer_windows=config.windows)  # windowed and global layers mixed: KV groups (pp = 1)
        # Blocks of the step-level API's sequences (no assign_blocks); the engine's scheduler assigns its own.
        self.allocator = allocator(self.cache.num_blocks, rt.block_size, self.cache.group_windows, prefix_caching=False)
        self.kv_window = every_layer_window(config)  # the scheduler releases blocks before it (0: none)
        # None: every step runs on self.stage eagerly (always with offloaded blocks: their weights move).
        self.decode_graphs = None if offload else decode_graphs_for(self)
        self.sampler = GrammarSampler(rt.seed, self)  # with structured outputs' matchers, on the rank that samples
        self._params: dict[int, SamplingParams] = {}
        self._last: dict[int, int] = {}
        self._seen: dict[int, tuple[int, int]] = {}  # penalised / min_tokens seq -> (prompt length, tokens recorded)
        self._ids = itertools.count(-1, -1)  # internal sequence ids (negative: never a caller's)
        self.eos_token_ids: tuple[int, ...] = config.eos_token_ids

    @classmethod
    def from_pretrained(cls, path: str | Path, runtime: RuntimeConfig | None = None, *, offload: Sequence[Any] = (),
                        **kwargs: Any) -> ModelRunner:
        """Load a Hugging Face directory (``config.json``, ``*.safetensors``, optional ``tokenizer.json``).

        ``kwargs`` are :class:`RuntimeConfig` fields (``tp=2, pp=2, dtype="bfloat16"``); ``offload``: blocks
        left unloaded (see the class). A checkpoint no native family reads (or ``model_impl="transformers"``) is
        refused in one line pointing to :class:`~energon_infer.worker.hf_runner.TransformersRunner`, the runner of
        the path the engine takes for it (this module cannot load it: that runner is built on this one).
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist; give a directory saved with "
                                    "save_pretrained (config.json + *.safetensors)")
        rt = runtime if runtime is not None else RuntimeConfig(**kwargs)
        if cls is ModelRunner:  # a subclass (TransformersRunner) has chosen its path already
            from energon_infer.loading.backend import choose_backend

            backend, why = choose_backend(path, rt.model_impl)
            if backend == "transformers":
                raise UnsupportedModelError(
                    f"{path}: {why}; ModelRunner runs the native families only: load it with "
                    "TransformersRunner.from_pretrained(path, ...) (from energon_infer import TransformersRunner), "
                    "or serve it with Engine.from_pretrained, which picks the path itself")
        if (method := checkpoint_quantization(path, rt.quantization)) != rt.quantization:  # saved quantized by torchao
            rt = dataclasses.replace(rt, quantization=method)
        config = load_config(path)
        if rt.dtype == "auto":  # once config.json has been read and checked
            dtype, why = auto_dtype(path, rt.device)
            rt = dataclasses.replace(rt, dtype=dtype)
            if rt.progress:
                print(f"energon: dtype {dtype}: {why}", file=sys.stderr, flush=True)
        reader = CheckpointReader(path)
        try:
            runner = cls(config, reader, rt, tokenizer=_load_tokenizer(path), offload=offload)
        finally:
            reader.close()
        runner.eos_token_ids = tuple(dict.fromkeys(config.eos_token_ids + _extra_eos(path)))
        return runner

    # ------------------------------------------------------------------ properties

    @property
    def weights_format(self) -> str:
        """How the block projections are held: the dtype, or the quantization (``"int4 (group 128)"``)."""
        q = self.quant
        return self.runtime.dtype if q is None else q.method + (f" (group {q.group_size})" if q.group_size else "")

    def layer_bytes(self) -> tuple[int, ...]:
        """Bytes each block of this stage holds (its quantized weights where quantized); on meta: what it would."""
        return tuple(sum(p.numel() * p.element_size() for p in block.parameters())
                     for block in self.stage.layers.values())

    @property
    def max_context(self) -> int:
        return self.config.max_positions

    @property
    def is_last_stage(self) -> bool:
        return self.grid.last

    def _say(self, msg: str) -> None:
        if self.runtime.progress and self.grid.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the packed step

    def _validate(self, items: Sequence[tuple[int, Sequence[int]]]) -> None:
        vocab = self.config.vocab_size
        for seq_id, tokens in items:
            if len(tokens) == 0:
                raise ValueError(f"sequence {seq_id}: no tokens to run; a prompt needs at least one token")
            total = self.cache.length(seq_id) + len(tokens)
            if total > self.max_context:
                raise ContextLengthError(
                    f"sequence {seq_id} would reach {total} tokens but this {self.config.model_type} model's context "
                    f"is {self.max_context} (max_position_embeddings); shorten the prompt or lower max_tokens"
                )
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"sequence {seq_id}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _allocate(self, items: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Grow the tables of this runner's own sequences from :attr:`allocator` (a sequence whose blocks were
        assigned is the scheduler's to grow); a step that does not fit raises before anything changes."""
        cache, own = self.cache, self.allocator
        grow = []
        for seq_id, tokens in items:
            mine = seq_id in own.tables
            if seq_id in cache:
                if not mine:
                    continue  # assigned (assign_blocks): the engine's scheduler grows it
            elif mine:
                own.free(seq_id)  # the cache forgot it (cache.free): so does the allocator
            length = cache.length(seq_id) + len(tokens)
            if own.grow_cost(seq_id, length):
                grow.append((seq_id, length))
        if not grow:
            return
        need = sum(own.grow_cost(s, n) for s, n in grow)
        if need > own.num_free:
            raise KVCacheFullError(need, own.num_free, own.block_size, own.num_blocks)
        for seq_id, length in grow:
            cache.assign(seq_id, own.grow(seq_id, length))

    def forward(self, items: Sequence[tuple[int, Sequence[int]]], *, all_logits: bool = False,
                broadcast: bool = False, prefill_lengths: Mapping[int, int] | None = None) -> torch.Tensor | None:
        """Run one packed step; append the tokens to each sequence's cache; return logits.

        ``items`` are ``(seq_id, new_tokens)``: an unknown ``seq_id`` starts a sequence. Returns the
        next-token logits ``(len(items), vocab)`` (every token's with ``all_logits``: ``(total, vocab)``)
        on the last stage's ranks, ``None`` on the others unless ``broadcast``. ``prefill_lengths``: the sequences
        whose items are a chunk of a longer prefill, and its length (:class:`~energon_infer.protocol.Step`).
        """
        items = [(s, list(t)) for s, t in items]
        self._validate(items)
        self._allocate(items)
        grid, stage = self.grid, self.stage
        outputs, sends = [], []
        for chunk in microbatches(items, min(len(items), self.runtime.microbatches or self.runtime.pp)):
            meta = self.cache.prepare([(s, len(t)) for s, t in chunk], self.device, prefill_lengths)
            if grid.first:
                x = torch.tensor([tok for _, t in chunk for tok in t], dtype=torch.long, device=self.device)
            else:
                x = torch.empty((meta.n_tokens, self.config.hidden_size), dtype=self.dtype, device=self.device)
                dist.recv(x, src=grid.prev_rank)
            y = (self.decode_graphs or stage)(x, meta, self.cache, all_logits=all_logits)
            if grid.last:
                outputs.append(y)
            else:
                sends.append((dist.isend(y, dst=grid.next_rank), y))
        for work, _ in sends:
            if work is not None:  # isend gives None only to ranks outside the group, never ours
                work.wait()
        if grid.last:
            logits = (torch.cat(outputs) if len(outputs) > 1 else outputs[0]).contiguous()
        elif broadcast:
            rows = sum(len(t) for _, t in items) if all_logits else len(items)
            logits = torch.empty((rows, self.config.vocab_size), dtype=self.dtype, device=self.device)
        else:
            return None
        if broadcast and grid.pp > 1:
            grid.broadcast_result(logits)
        return logits

    def step(self, items: Sequence[tuple[int, Sequence[int]]],
             params: SamplingParams | Mapping[int, SamplingParams] | None = None, *, broadcast: bool = True,
             prefill_lengths: Mapping[int, int] | None = None, proposals: Mapping[int, int] | None = None) -> StepResult:
        """Run a step and sample one next token per item (on every rank, identical): ``.tokens``.

        New sequences need sampling ``params`` (one for all, or per ``seq_id``); running ones keep theirs.
        With ``broadcast=False`` the tokens stay on :attr:`Grid.result_rank` (the others get ``[]``), so
        earlier stages can start the next step at once: the engine's non-blocking pipeline feeds them
        back itself. ``proposals``: seq_id -> proposed tokens ending its item (:mod:`~energon_infer.worker.speculative`).
        """
        for seq_id, _ in items:
            if seq_id not in self._params:
                p = params.get(seq_id) if isinstance(params, Mapping) else params
                if p is None and seq_id in self.cache:
                    raise ValueError(f"sequence {seq_id} is in the KV cache but has no sampling params")
                if p is None:
                    raise ValueError(f"sequence {seq_id} is new: give its SamplingParams (params={{seq_id: ...}})")
                self._params[seq_id] = p
        starts = self.sampler.start_masks(items, {s: self.cache.length(s) for s, _ in items}, self._params)
        logits = self.forward(items, prefill_lengths=prefill_lengths, all_logits=bool(proposals))
        if proposals:  # never with a grammar: a step holding a structured request has no proposals
            return StepResult(*self.verify(items, starts, logits, proposals))
        ids = [s for s, _ in items]
        tokens = torch.empty(len(items), dtype=torch.long, device=self.device)
        logprobs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        if self.grid.rank == self.grid.result_rank:
            assert logits is not None
            self._observe(items, starts)
            positions = [self.cache.length(s) for s in ids]  # the context each token is drawn after
            params_ = [self._params[s] for s in ids]
            sampled = self.sampler.sample_rows(logits, ids, params_, positions, self._banned(ids, params_, positions))
            # By seq_id, for the engine's workers: logprobs asked for, and rows that failed alone.
            logprobs = {ids[r]: v for r, v in sampled.logprobs.items()}
            errors = {ids[r]: v for r, v in sampled.errors.items()}
            tokens = torch.tensor(sampled.tokens, dtype=torch.long, device=self.device)
        if not broadcast and self.grid.world > 1:
            return StepResult(tokens.tolist() if self.grid.rank == self.grid.result_rank else [], logprobs, errors)
        out = self.grid.broadcast_result(tokens).tolist()
        self._last.update(zip(ids, out))
        return StepResult(out, logprobs, errors)

    def run_step(self, step: Step, items: Sequence[tuple[int, Sequence[int]]] | None = None, *,
                 broadcast: bool = True) -> StepResult:
        """Apply one :class:`~energon_infer.protocol.Step` in its order: swap-outs, trims (blocks a window passed),
        frees, the block decisions, then run ``items`` (default the step's own; placeholders filled first), sample.

        The one way a step is applied: the engine's worker loop and :meth:`generate` both call it.
        """
        self.cache.swap_out(step.swap_out)
        self.cache.trim(step.trims)
        for seq_id in step.frees:
            self.free(seq_id)
        self.assign_blocks(step.blocks, step.starts, step.copies, step.history, step.swap_in)
        run = step.items if items is None else items  # the default call keeps step's two-argument shape for wrappers
        kw: dict[str, Any] = {name: v for name in ("prefill_lengths", "proposals") if (v := getattr(step, name))}
        return self.step(run, step.new_params, **(kw if broadcast else {**kw, "broadcast": False}))

    def assign_blocks(self, blocks: Mapping[int, Sequence[int]], starts: Mapping[int, int] | None = None,
                      copies: Sequence[tuple[int, int]] = (),
                      history: Mapping[int, tuple[Sequence[int], Sequence[int]]] | None = None,
                      swap_in: Sequence[tuple[int, int]] = ()) -> None:
        """Take a scheduler's block decisions for the next step (:class:`~energon_infer.scheduling.scheduler.StepPlan`):
        copy-on-write copies first, then each sequence's new blocks (a new one starts ``starts[seq]`` tokens in).
        ``history``: a new penalised sequence's ``(prompt, generated so far)`` (its penalties count them even
        when a shared prefix, a chunk or a preemption means they are not all fed in this step); ``swap_in``:
        ``(host, device)`` blocks of swapped-in sequences, copied back last."""
        self.cache.copy_blocks(copies)
        starts = starts or {}
        for seq_id, new in blocks.items():
            self.cache.assign(seq_id, new, starts.get(seq_id))
        self.cache.swap_in(swap_in)
        for seq_id, (prompt, generated) in (history or {}).items():
            self.sampler.observe(seq_id, prompt, prompt=True)
            self.sampler.observe(seq_id, generated, prompt=False)
            self._seen[seq_id] = (len(prompt), len(prompt) + len(generated))

    def _banned(self, ids: Sequence[int], params: Sequence[SamplingParams], positions: Sequence[int]
                ) -> dict[int, tuple[int, ...]]:
        """By row, the stop tokens of requests that have generated fewer than their ``min_tokens``."""
        out: dict[int, tuple[int, ...]] = {}
        for row, (seq_id, p) in enumerate(zip(ids, params)):
            if p.min_tokens and positions[row] - self._seen.get(seq_id, (positions[row], 0))[0] < p.min_tokens:
                out[row] = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
        return out

    def _observe(self, items: Sequence[tuple[int, Sequence[int]]], starts: Mapping[int, int]) -> None:
        """Record fed tokens for the penalties: positions below the prompt length are prompt, the rest output
        (and, for ``min_tokens``, the prompt's length). A sequence first seen here (no ``history``) takes its
        first feed as its prompt."""
        for seq_id, fed in items:
            p = self._params[seq_id]
            if not (p.penalised or p.min_tokens):
                continue
            start = starts[seq_id]
            plen, seen = self._seen.get(seq_id, (start + len(fed), start))
            if not p.penalised:
                self._seen[seq_id] = (plen, max(seen, start + len(fed)))
                continue
            new = [(start + i, t) for i, t in enumerate(fed) if start + i >= seen]
            self.sampler.observe(seq_id, [t for pos, t in new if pos < plen], prompt=True)
            self.sampler.observe(seq_id, [t for pos, t in new if pos >= plen], prompt=False)
            self._seen[seq_id] = (plen, max(seen, start + len(fed)))

    def prefill(self, prompts: Mapping[int, Sequence[int]], params: SamplingParams | Mapping[int, SamplingParams]
                ) -> dict[int, int]:
        """Start new sequences; returns each one's first generated token."""
        for seq_id in prompts:
            if seq_id in self.cache:
                raise ValueError(f"sequence {seq_id} is already running; free it or use another id")
        return dict(zip(prompts, self.step(list(prompts.items()), params).tokens))

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int] | None = None) -> dict[int, int]:
        """One decode step for running sequences, fed their last sampled token (or ``tokens``)."""
        for s in seq_ids:
            if s not in self.cache:
                raise ValueError(f"sequence {s} is not running; prefill it first")
        feed = list(tokens) if tokens is not None else [self._last[s] for s in seq_ids]
        return dict(zip(seq_ids, self.step([(s, [t]) for s, t in zip(seq_ids, feed)]).tokens))

    def free(self, seq_id: int) -> None:
        """Drop a sequence: its KV blocks return to the pool, its sampling state is forgotten."""
        self.cache.free(seq_id)
        self.allocator.free(seq_id)
        for state in (self._seen, self._params, self._last):
            state.pop(seq_id, None)
        self.sampler.forget(seq_id)

    # ------------------------------------------------------------------ conveniences

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: put tokenizer.json in the model directory or "
                                 "pass token ids")
            return list(self.tokenizer.encode(prompt).ids)
        return [int(t) for t in prompt]

    def decode_text(self, token_ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self._decode_str(token_ids)

    def _decode_str(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                 kv_admission: KVAdmission = "reserve", prefix_caching: bool = False, chunked_prefill: bool = False,
                 preemption: Preemption = "recompute", stats: dict[str, int] | None = None) -> list[Generation]:
        """Generate for every prompt with continuous batching; results in prompt order.

        By default new prompts join the running batch as soon as the KV cache can hold their prompt
        plus ``max_tokens`` (so no running sequence is ever evicted) and the step stays under
        ``max_batch_tokens``; finished sequences leave at once and free their blocks. The engine's
        other scheduling modes are here too: ``kv_admission="on_demand"`` (grow, preempt and
        recompute; ``preemption="swap"``/``"auto"`` swap victims to host memory, see :mod:`energon_infer.scheduling.swap`),
        ``prefix_caching`` and ``chunked_prefill`` (see :class:`SchedulerConfig`).
        ``stats`` (a dict) receives the scheduler's counters (preemptions, prefix-cache hits, steps).
        """
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        encoded = [self.encode(p) for p in prompts]
        peak, most = allocator(1, self.cache.block_size, self.cache.group_windows).peak, self.runtime.max_batch_tokens
        reserve = [peak(min(len(e) + p.max_tokens, self.max_context), min(len(e), most if chunked_prefill else len(e)))
                   for e, p in zip(encoded, plist)]
        for i, e in enumerate(encoded):
            if not e or len(e) > self.max_context:
                raise ContextLengthError(
                    f"prompt {i} has {len(e)} tokens; prompts need 1 to {self.max_context} tokens (the model's "
                    "context); shorten it"
                )
            if reserve[i] > self.cache.num_blocks:
                raise ValueError(
                    f"prompt {i} ({len(e)} tokens + max_tokens={plist[i].max_tokens}) needs {reserve[i]} KV blocks; the "
                    f"cache has {self.cache.num_blocks}; load with a larger kv_cache_tokens"
                )
        if not prompts:
            return []
        return run_offline(self, encoded, plist, seq_ids=self._ids, decode=self._decode_str if self.tokenizer else None,
                           kv_admission=kv_admission, prefix_caching=prefix_caching, chunked_prefill=chunked_prefill,
                           preemption=preemption, stats=stats)

    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ``(B, L, vocab)`` for a padded batch (left, right or mixed padding); zeros at pad positions.

        The pads are removed first (:func:`tightfit.kernels.packing.pack`), the packed tokens run as new
        sequences (cached, then freed), and the logits are put back in the padded layout
        (:func:`tightfit.kernels.packing.unpack`). Returned on every rank.
        """
        from tightfit.kernels.packing import pack, unpack

        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.to(torch.bool).cpu()
        lengths = mask.sum(1)
        starts = mask.int().argmax(1)
        rows = torch.arange(mask.shape[1])[None, :]
        if not torch.equal(mask, (rows >= starts[:, None]) & (rows < (starts + lengths)[:, None])):
            raise ValueError("attention_mask must mark one contiguous run of tokens per row (left or right padding)")
        if int(lengths.min()) == 0:
            raise ValueError("every row of attention_mask needs at least one token")
        packed, cu = pack(input_ids.cpu(), starts, lengths)
        ids = [next(self._ids) for _ in range(input_ids.shape[0])]
        cu_l = cu.tolist()
        items = [(s, packed[cu_l[b]:cu_l[b + 1]].tolist()) for b, s in enumerate(ids)]
        try:
            logits = self.forward(items, all_logits=True, broadcast=True)
        finally:
            for s in ids:
                if s in self.cache:
                    self.free(s)
        assert logits is not None
        return unpack(logits, starts.to(logits.device), lengths.to(logits.device), input_ids.shape[1])
