"""Decode steps replayed from CUDA graphs: one captured graph per batch-size bucket.

A decode step (one new token per sequence) launches the same few kernels per layer every time, and
at small batches the host time to launch them, not the GPU's work, sets the step time. A CUDA graph
records one step's launches once and replays them with a single call. A graph replays fixed shapes
at fixed addresses, so :class:`DecodeGraphs` keeps every input of a step in static buffers sized for
its largest bucket, and runs a step of ``b`` sequences in the smallest bucket ``B >= b``:

* rows ``0..b-1`` are copied from the step's :class:`~energon_infer.worker.kv_cache.StepMetadata` (token
  ids, or hidden states on a later pipeline stage; positions, slots, block tables, context lengths);
* rows ``b..B-1`` are padding: position 0, one token of context, and their slot and block table in
  the KV cache's *scratch block* (``KVCache(scratch=True)``: a block outside ``range(num_blocks)``,
  so no sequence ever owns it). Padding writes its keys there and attends to them alone, and its
  output rows are dropped;
* block tables are padded to ``ceil(max_context / block_size)`` columns; entries past a row's
  context are never read.

What runs eagerly: steps with prefill or chunked tokens (``max_q_len > 1``), steps of more
sequences than the largest bucket, ``all_logits`` steps, and every step when graphs are off.

The bucketing and buffers are separate from the capture: with ``capture=False`` the same padded
buffers run through :class:`~energon_infer.worker.model.DecoderStage` eagerly. That is how the CPU tests check
the padding (same logits and tokens as the unpadded step, no other sequence's KV touched); only the
capture itself needs a GPU. Graphs are captured lazily, the first time a bucket is used (one eager
warm-up run, then the capture; both write only the scratch block), into one shared memory pool; the
engine's workers capture every bucket at load instead (:meth:`DecodeGraphs.capture_all`).

Tensor parallelism: ``tp > 1`` is not captured. Each block all-reduces twice across the tensor-parallel
ranks, and a collective inside a graph needs NCCL's graph-safe mode on every rank (registered buffers,
the same capture order everywhere); that is not done here, so graphs need ``tp == 1`` (any ``pp``: stages
exchange hidden states outside the stage's forward). Layers pooled in host memory
(:mod:`energon_infer.worker.memory_pool`) move between steps, so pooling turns graphs off.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from energon_infer.worker.kv_cache import KVCache, StepMetadata
from energon_infer.worker.model import DecoderStage

__all__ = ["DecodeGraphs", "DEFAULT_MAX_GRAPH_BATCH", "default_buckets", "check_cuda_graphs", "decode_graphs_for"]

# Decode batches beyond this are wide enough that launch overhead is a small part of a step.
DEFAULT_MAX_GRAPH_BATCH = 256


def default_buckets(limit: int = DEFAULT_MAX_GRAPH_BATCH) -> tuple[int, ...]:
    """1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, ... up to ``limit`` (past 8, a step pads at most 1.5x).

    Example:
        >>> default_buckets(64)
        (1, 2, 4, 8, 16, 24, 32, 48, 64)
    """
    out, p = [1, 2, 4, 8], 16
    while p <= limit:
        out += [p, p * 3 // 2]
        p *= 2
    return tuple(b for b in out if b <= limit)


def check_cuda_graphs(value: Any, *, device: str | None, tp: int) -> bool | tuple[int, ...] | None:
    """Validate :attr:`RuntimeConfig.cuda_graphs <energon_infer.worker.runtime.RuntimeConfig>`; returns it normalised
    (a bucket list as a sorted tuple of distinct ints)."""
    if value is None or value is False:
        return value
    if value is not True:
        buckets = value if isinstance(value, Sequence) and not isinstance(value, str) else None
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(
                f"cuda_graphs={value!r} must be None (on where the device is CUDA), True, False, or a list of "
                "decode batch sizes >= 1 to capture (e.g. cuda_graphs=[1, 2, 4, 8])"
            )
        value = tuple(sorted(set(buckets)))
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError(
            f"cuda_graphs={value!r} asks for CUDA graphs but device={device!r}; graphs capture CUDA kernels only, "
            "so use a CUDA device or leave cuda_graphs=None (on where the device is CUDA, off elsewhere)"
        )
    if tp > 1:
        raise ValueError(
            f"cuda_graphs={value!r} with tp={tp}: decode graphs are captured only at tp=1 (the all-reduces "
            "between tensor-parallel ranks are not captured); leave cuda_graphs=None or use tp=1"
        )
    return value


def decode_graphs_for(runner: Any) -> DecodeGraphs | None:
    """The :class:`DecodeGraphs` a :class:`~energon_infer.worker.runtime.ModelRunner` asks for, or ``None``."""
    rt, device = runner.runtime, runner.device
    wanted = rt.cuda_graphs
    if runner.config.n_sparse and wanted not in (None, False):
        # which experts a step runs depends on its tokens (energon_infer.worker.moe), and a graph replays one set
        raise ValueError(f"cuda_graphs={wanted!r}: this {runner.config.model_type} model's Mixture-of-Experts layers "
                         "run the experts its tokens choose, which a captured graph cannot follow; leave "
                         "cuda_graphs=None (off for MoE models)")
    if wanted is False or (wanted is None and (device.type != "cuda" or rt.tp > 1 or runner.config.n_sparse)):
        return None
    if device.type != "cuda":  # device=None resolved to a CPU only now (__post_init__ could not tell)
        check_cuda_graphs(wanted, device=str(device), tp=rt.tp)
    limit = min(DEFAULT_MAX_GRAPH_BATCH, rt.max_batch_tokens)
    buckets = wanted if isinstance(wanted, tuple) else default_buckets(limit)
    return DecodeGraphs(runner.stage, runner.cache, buckets=buckets, max_context=runner.max_context)


class DecodeGraphs(nn.Module):
    """Run a stage's decode steps padded to batch-size buckets, replayed from CUDA graphs.

    Called like the stage (``graphs(x, meta, cache, all_logits=False)``): a step that fits a bucket
    runs padded (replayed, or eagerly with ``capture=False``); any other runs on the stage unchanged.
    Being a module, its forward hooks see every step, replayed or not (the workers' stage timer).

    Args:
        stage: the :class:`~energon_infer.worker.model.DecoderStage` to run.
        cache: its KV cache, built with ``scratch=True``.
        buckets: decode batch sizes to pad to (each captured once, when first used).
        max_context: the model's context; block tables are padded to ``ceil(max_context / block_size)``.
        capture: ``False`` runs the padded buffers eagerly (no graph): the CPU-testable path.

    Example:
        >>> graphs = DecodeGraphs(stage, cache, buckets=(1, 2, 4), max_context=128)    # doctest: +SKIP
        >>> logits = graphs(ids, cache.prepare([(0, 1), (1, 1), (2, 1)], "cuda"), cache)  # bucket 4 # doctest: +SKIP
    """

    def __init__(self, stage: DecoderStage, cache: KVCache, *, buckets: Sequence[int], max_context: int,
                 capture: bool = True):
        super().__init__()
        if cache.scratch_block is None:
            raise ValueError("DecodeGraphs needs a KV cache with a scratch block for its padding rows; build it "
                             "with KVCache(..., scratch=True)")
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets={buckets!r} must list decode batch sizes >= 1")
        self.stage, self.cache, self.capture = stage, cache, capture
        self.max_blocks = -(-max_context // cache.block_size)
        n, dev = self.buckets[-1], cache.k.device
        self._pad_slot, self._pad_block = cache.scratch_block * cache.block_size, cache.scratch_block
        # The static buffers: every bucket's graph reads views of their first B rows.
        if stage.first:
            self._x = torch.zeros(n, dtype=torch.long, device=dev)
        else:
            self._x = torch.zeros((n, stage.cfg.hidden_size), dtype=cache.k.dtype, device=dev)
        self._positions = torch.zeros(n, dtype=torch.long, device=dev)
        self._slots = torch.full((n,), self._pad_slot, dtype=torch.long, device=dev)
        self._tables = torch.full((n, self.max_blocks), self._pad_block, dtype=torch.int32, device=dev)
        # Each KV group's own slots and tables (energon_infer.worker.kv_cache; the first group's are the two above).
        self._groups = [(self._slots, self._tables)] + [(self._slots.clone(), self._tables.clone())
                                                         for _ in range(cache.groups - 1)]
        self._kv_lens = torch.ones(n, dtype=torch.int32, device=dev)
        cu = torch.arange(n + 1, dtype=torch.int32, device=dev)  # decode: one token per row, row i is token i
        last = torch.arange(n, dtype=torch.long, device=dev)
        self._meta = {b: StepMetadata(positions=self._positions[:b], slot_mapping=self._slots[:b],
                                      block_tables=self._tables[:b], cu_seqlens=cu[:b + 1], kv_lens=self._kv_lens[:b],
                                      last_index=last[:b], max_q_len=1, n_tokens=b) for b in self.buckets}
        if cache.groups > 1:
            self._meta = {b: replace(m, groups=tuple(replace(m, slot_mapping=s[:b], block_tables=t[:b])
                                                     for s, t in self._groups)) for b, m in self._meta.items()}
        self._real = 0  # rows 0.._real-1 of the buffers hold a step's rows; the rest are padding
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: Any = None
        self.failed: str | None = None  # why capture failed (then every step runs eagerly)
        self.padded_steps: dict[int, int] = dict.fromkeys(self.buckets, 0)  # steps run per bucket
        self.eager_steps = 0  # steps that did not fit a bucket

    def bucket(self, meta: StepMetadata) -> int | None:
        """The bucket a step runs in, or ``None`` when it runs eagerly (not decode-only, too wide, or a chunk of a
        longer prefill, whose rope lengths the captured step does not hold)."""
        b = meta.n_tokens
        if meta.max_q_len != 1 or b != meta.kv_lens.shape[0] or b > self.buckets[-1] \
                or meta.block_tables.shape[1] > self.max_blocks or meta.rope_lens is not None:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, b)]

    def forward(self, x: torch.Tensor, meta: StepMetadata, cache: KVCache, *, all_logits: bool = False
                ) -> torch.Tensor:
        size = None if all_logits or self.failed or cache is not self.cache else self.bucket(meta)
        if size is None:
            self.eager_steps += 1
            return self.stage(x, meta, cache, all_logits=all_logits)
        if self.capture and size not in self._graphs:
            self._pad_from(0)  # all rows padding: warm-up and capture touch only the scratch block
            if not self._capture(size):
                self.eager_steps += 1
                return self.stage(x, meta, cache)
        b = meta.n_tokens
        self._fill(b, x, meta)
        self.padded_steps[size] += 1
        if self.capture:
            self._graphs[size].replay()
            out = self._outputs[size]
        else:
            out = self.stage(self._x[:size], self._meta[size], cache)
        # A copy: the next replay rewrites the graph's output while this one may still be read (a send
        # to the next stage in flight, or the sampler).
        return out[:b].clone()

    def _fill(self, b: int, x: torch.Tensor, meta: StepMetadata) -> None:
        """Rows ``0..b-1`` from the step, the rows after them padding. Block-table columns past the step's
        width keep earlier (valid) block ids: they lie past the row's context, so attention masks them out
        as it does the zero columns of an eager step's table."""
        w = meta.block_tables.shape[1]
        self._x[:b].copy_(x)
        self._positions[:b].copy_(meta.positions)
        for (slots, tables), part in zip(self._groups, meta.groups or (meta,)):
            slots[:b].copy_(part.slot_mapping)
            tables[:b, :w].copy_(part.block_tables)
        self._kv_lens[:b].copy_(meta.kv_lens)
        self._pad_from(b)

    def _pad_from(self, b: int) -> None:
        """Rows from ``b`` on that held an earlier step's sequences back to padding."""
        if self._real > b:
            rows = slice(b, self._real)
            self._x[rows].zero_()
            self._positions[rows].zero_()
            for slots, tables in self._groups:
                slots[rows].fill_(self._pad_slot)
                tables[rows].fill_(self._pad_block)
            self._kv_lens[rows].fill_(1)
        self._real = b

    def _capture(self, size: int) -> bool:
        """Warm up (kernel compilation and the dispatcher's first-use checks, which sync the host and
        so cannot happen inside a capture) on a side stream, then capture; ``False`` if that failed."""
        x, meta, stage, cache = self._x[:size], self._meta[size], self.stage, self.cache
        try:
            with torch.cuda.device(cache.k.device):  # the graph's own capture stream is on the current device
                current = torch.cuda.current_stream()
                side = torch.cuda.Stream()
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    for _ in range(2):
                        stage(x, meta, cache)
                current.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = stage(x, meta, cache)
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves decode eager, said once
            self.failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"CUDA graph capture of the decode step at batch {size} failed ({self.failed}); decode "
                          "steps run eagerly from now on. Set RuntimeConfig(cuda_graphs=False) to skip the attempt",
                          RuntimeWarning, stacklevel=3)
            return False
        if self._pool is None:
            self._pool = graph.pool()  # later buckets share the first one's memory pool
        self._graphs[size], self._outputs[size] = graph, out
        return True

    def capture_all(self) -> tuple[int, ...]:
        """Capture every bucket now (the engine's workers do, at load, so no request waits for a capture);
        largest first, so the smaller graphs reuse its memory. Returns the captured buckets."""
        if self.capture:
            for size in reversed(self.buckets):
                if self.failed:
                    break
                if size not in self._graphs:
                    self._pad_from(0)
                    self._capture(size)
        return self.captured

    @property
    def captured(self) -> tuple[int, ...]:
        """Buckets with a captured graph."""
        return tuple(sorted(self._graphs))
