"""A paged key/value cache: one pool of fixed-size blocks shared by every running sequence.

Only keys and values are kept (``2 x layers x kv_heads x head_dim`` numbers per token per rank);
a sequence has a list of blocks (its block table) that grows one block at a time, so sequences of
any length share one pool and the only waste is the unfilled tail of each sequence's last block
(``< block_size`` tokens per sequence).

The cache holds block tables only: it never chooses a block. Whoever allocates uses
:class:`~energon_infer.scheduling.blocks.BlockManager` (the engine's scheduler, or the runner's own for its
step-level API) and hands the cache the tables (:meth:`KVCache.assign`); a step then writes where
the tables say. Every rank holds the pool of its own stage's layers and its own key/value heads and
is given the same tables, so the ranks agree without talking to each other.

KV groups: in a model whose windowed and global layers alternate (``layer_windows``), the layers' keys and values
live in KV groups of their own (:func:`~energon_infer.scheduling.kv_groups.kv_layout`), each with its own table
per sequence, over one pool of *pages*: a page is one block of tokens for ``slots`` layers (``k[slot, page]``), and
the cache sized for ``num_blocks`` blocks of every layer holds ``num_blocks * layers / slots`` of them. The tables
travel interleaved (:meth:`assign`); each layer reads its own group's (:meth:`layer`, :attr:`StepMetadata.groups`),
and a sliding window releases only the windowed groups' entries (:meth:`trim`).

Example:
    >>> import torch
    >>> cache = KVCache(n_layers=1, num_blocks=8, block_size=4, n_kv_heads=1, head_dim=2, dtype=torch.float32)
    >>> cache.assign(7, [3, 5])                          # sequence 7's table, chosen by a BlockManager
    >>> meta = cache.prepare([(7, 6)], device="cpu")     # 6 new tokens
    >>> cache.length(7), cache.block_table(7), cache.free_blocks
    (6, [3, 5], 6)
    >>> cache.free(7); cache.free_blocks
    8
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from energon_infer.errors import EnergonError
from energon_infer.scheduling.blocks import HOLE
from energon_infer.scheduling.kv_groups import kv_layout

__all__ = ["KVCache", "KVCacheFullError", "StepMetadata", "UnknownSequenceError"]


class KVCacheFullError(EnergonError, RuntimeError):
    """Not enough free blocks for a step; carries how many it needed and how many were free."""

    def __init__(self, needed: int, free: int, block_size: int, total: int):
        self.needed, self.free = needed, free
        super().__init__(
            f"the KV cache needs {needed} more blocks of {block_size} tokens but only {free} of {total} are free; "
            "free finished sequences (runner.free(seq_id)), run fewer sequences per step, or load with a larger "
            "kv_cache_tokens"
        )


class UnknownSequenceError(EnergonError, KeyError):
    """A step or free names a sequence the cache does not hold."""


@dataclass(slots=True)
class _Seq:
    tables: list[list[int]]  # one per KV group, all of the same length
    length: int = 0


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Everything attention needs for one packed step (tensors on the model's device).

    Args:
        positions: ``(T,)`` absolute position of every new token.
        slot_mapping: ``(T,)`` cache slot (``block * block_size + offset``) each new token's key/value goes to.
        block_tables: ``(B, max_blocks)`` int32, rows padded with block 0 (never read past ``kv_lens``).
        cu_seqlens: ``(B + 1,)`` int32 offsets of each sequence's new tokens in the packed batch.
        kv_lens: ``(B,)`` int32 tokens of context per sequence after this step.
        last_index: ``(B,)`` row of each sequence's last new token (where next-token logits come from).
        max_q_len: the most new tokens of any sequence (host int).
        n_tokens: ``T`` (host int).
        rope_lens: ``(B,)`` the length a length-dependent rope takes per sequence where a step runs a chunk of a
            longer prefill (:attr:`~energon_infer.protocol.Step.prefill_lengths`: that prefill's); ``None``: ``kv_lens``.
        groups: with several KV groups, each one's metadata (its own ``slot_mapping`` and ``block_tables``; the
            first is this one's); ``()``: one group.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens: torch.Tensor
    kv_lens: torch.Tensor
    last_index: torch.Tensor
    max_q_len: int
    n_tokens: int
    rope_lens: torch.Tensor | None = None
    groups: tuple[StepMetadata, ...] = ()


class KVCache:
    """Block pools for ``n_layers`` layers and each sequence's block table (assigned, never chosen here).

    Args:
        n_layers: layers on this rank (its pipeline stage).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        n_kv_heads: key/value heads on this rank (its tensor-parallel share).
        head_dim: width of one head.
        dtype / device: of the pools.
        host_blocks: blocks of host swap space (``swap_out`` / ``swap_in``; 0: none).
        scratch: one more block after the ``num_blocks`` (:attr:`scratch_block`) that no sequence is ever
            given: the padding rows of a CUDA-graph decode step write there (:mod:`energon_infer.worker.cuda_graphs`).
        layer_windows: every layer of the model's window (0: whole context). Where windowed and global layers mix
            and this stage holds every layer (``pp = 1``): KV groups (see the module docstring), ``num_blocks`` and
            ``host_blocks`` count blocks of every layer and the cache holds as many bytes in pages
            (:attr:`num_blocks` is then the pages). At ``pp > 1`` a stage's pages would sit unused wherever a
            group's layers are all on another stage, so there the layers stay in one group (no block is released).
    """

    def __init__(self, *, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", host_blocks: int = 0, scratch: bool = False,
                 layer_windows: Sequence[int] = ()):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        layout = kv_layout(layer_windows, n_layers)
        hybrid = layout.hybrid and n_layers == len(layer_windows)
        #: each KV group's window (one entry: every layer in one group, windowed only if every layer is)
        self.group_windows = layout.windows if hybrid else (min(layer_windows, default=0) and max(layer_windows),)
        if hybrid:  # pages of layout.slots layers: as many bytes as num_blocks blocks of every layer
            num_blocks, host_blocks = num_blocks * n_layers // layout.slots, host_blocks * n_layers // layout.slots
            self._group, self._slot, slots = layout.group_of, layout.slot_of, layout.slots
        else:
            self._group, self._slot, slots = (0,) * n_layers, tuple(range(n_layers)), n_layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block: int | None = num_blocks if scratch else None  # outside range(num_blocks): never allocated
        shape = (slots, num_blocks + int(scratch), block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._seqs: dict[int, _Seq] = {}
        self._pinned: torch.Tensor | None = None
        self._copied: Any = None
        # Swap space: host blocks a preempted sequence's keys/values wait in (pinned, so copies to and
        # from a GPU run at full bandwidth); see swap_out / swap_in.
        host = (slots, host_blocks, block_size, n_kv_heads, head_dim)
        pin = torch.device(device).type == "cuda"
        self.host_k = torch.zeros(host, dtype=dtype, pin_memory=pin)
        self.host_v = torch.zeros(host, dtype=dtype, pin_memory=pin)

    # ------------------------------------------------------------------ bookkeeping

    @property
    def groups(self) -> int:
        """KV groups (each with its own table per sequence)."""
        return len(self.group_windows)

    def _held(self) -> set[int]:
        return {b for seq in self._seqs.values() for table in seq.tables for b in table if b != HOLE}

    @property
    def free_blocks(self) -> int:
        """Blocks (pages) in no sequence's table."""
        return self.num_blocks - len(self._held())

    def layer(self, i: int, meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """Keys, values and step metadata of this stage's layer ``i`` (its KV group's tables and slots)."""
        slot, group = self._slot[i], self._group[i]
        if len(self.group_windows) > 1:
            if len(meta.groups) != len(self.group_windows):
                raise ValueError(f"the step's metadata has {len(meta.groups)} KV groups' tables but the cache has "
                                 f"{len(self.group_windows)}; build it with this cache's prepare()")
            meta = meta.groups[group]
        return self.k[slot], self.v[slot], meta

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def free_block_ids(self) -> list[int]:
        """The blocks in no sequence's table (what an allocator may hand out), lowest first."""
        held = self._held()
        return [b for b in range(self.num_blocks) if b not in held]

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def length(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` whose keys/values are cached (0 for a sequence not yet seen)."""
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else seq.length

    def block_table(self, seq_id: int) -> list[int]:
        """``seq_id``'s tables, interleaved as :meth:`assign` takes them (one group: its table)."""
        tables = self._get(seq_id).tables
        return [t[i] for i in range(len(tables[0])) for t in tables]

    def _get(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(
                f"sequence {seq_id!r} is not in the KV cache (running: {sorted(self._seqs)[:10]}); prefill it "
                "first, and do not use it after free()"
            ) from None

    def free(self, seq_id: int) -> None:
        """Forget ``seq_id``'s table (its allocator takes the blocks back)."""
        if self._seqs.pop(seq_id, None) is None:
            raise UnknownSequenceError(f"cannot free sequence {seq_id!r}: it is not in the KV cache")

    def assign(self, seq_id: int, blocks: Sequence[int], start: int | None = None) -> None:
        """Append allocator-chosen ``blocks`` to ``seq_id``'s table; a new sequence begins with ``start``
        tokens already cached (a shared prefix, see :mod:`energon_infer.scheduling.blocks`). With several KV
        groups ``blocks`` are interleaved: entry ``i`` of group ``g``'s table is ``blocks[i * groups + g]``."""
        g = len(self.group_windows)
        if len(blocks) % g:
            raise ValueError(f"{len(blocks)} blocks for sequence {seq_id} do not split over the cache's {g} KV "
                             "groups; give one block per group for each block of tokens (interleaved)")
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Seq([[] for _ in range(g)], length=start or 0)
        new = not seq.tables[0]
        bad = [b for b in blocks if not 0 <= b < self.num_blocks and not (b == HOLE and new)]
        if bad:
            raise ValueError(f"blocks {bad[:5]} are outside the cache's {self.num_blocks} blocks (a new table may "
                             f"start with holes, {HOLE})")
        for i, table in enumerate(seq.tables):
            table.extend(blocks[i::g])

    def trim(self, trims: Mapping[int, int]) -> None:
        """``{seq_id: holes}``: the first ``holes`` entries of each windowed group's table were released (a sliding
        window passed them) and become :data:`~energon_infer.scheduling.blocks.HOLE`, so a read of one fails
        instead of reading a block another sequence now writes."""
        for seq_id, holes in trims.items():
            seq = self._get(seq_id)
            if not 0 <= holes <= len(seq.tables[0]):
                raise ValueError(f"cannot release {holes} blocks of sequence {seq_id}: its table has "
                                 f"{len(seq.tables[0])}")
            for table, window in zip(seq.tables, self.group_windows):
                if window or len(self.group_windows) == 1:
                    table[:holes] = [HOLE] * holes

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep only ``seq_id``'s first ``length`` tokens (speculation's rejected proposals): its table stays, and the
        slots after ``length`` are written over by the next tokens fed."""
        seq = self._get(seq_id)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id} to {length} tokens: it holds {seq.length}")
        seq.length = length

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of a shared prefix block)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``(device block, host block)`` to the swap space, every layer (a preemption by swap)."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.k.device)
            dst = torch.tensor([d for _, d in pairs])
            self.host_k[:, dst] = self.k[:, src].to("cpu")
            self.host_v[:, dst] = self.v[:, src].to("cpu")

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``(host block, device block)`` back from the swap space, every layer."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs])
            dst = torch.tensor([d for _, d in pairs], device=self.k.device)
            self.k[:, dst] = self.host_k[:, src].to(self.k.device, non_blocking=True)
            self.v[:, dst] = self.host_v[:, src].to(self.k.device, non_blocking=True)

    def reset(self) -> None:
        self._seqs.clear()

    # ------------------------------------------------------------------ one step

    def prepare(self, items: Sequence[tuple[int, int]], device: torch.device | str,
                prefill_lengths: Mapping[int, int] | None = None) -> StepMetadata:
        """Append ``(seq_id, new_tokens)`` items to their sequences and describe the step (``prefill_lengths``:
        of the sequences running a chunk of a longer prefill, its length, :attr:`StepMetadata.rope_lens`).

        Every sequence's table must already hold its new tokens (:meth:`assign`); the whole step is checked
        before anything changes.
        """
        if len({s for s, _ in items}) != len(items):
            raise ValueError(f"a step lists a sequence twice: {[s for s, _ in items]}; give each sequence once")
        bs, seqs = self.block_size, []
        for seq_id, n in items:
            if n < 1:
                raise ValueError(f"sequence {seq_id!r} has {n} new tokens in this step; give at least one")
            seq = self._get(seq_id)
            if len(seq.tables[0]) * bs < seq.length + n:
                raise RuntimeError(f"sequence {seq_id} was assigned {len(seq.tables[0])} blocks, too few for "
                                   f"{seq.length + n} tokens; assign its blocks before the step")
            seqs.append(seq)
        starts, ns = [], []
        for seq, (_, n) in zip(seqs, items):
            starts.append(seq.length)
            ns.append(n)
            seq.length += n
        metas = [self._metadata(starts, ns, [seq.tables[g] for seq in seqs], device)
                 for g in range(len(self.group_windows))]
        meta = metas[0] if len(metas) == 1 else dataclasses.replace(metas[0], groups=tuple(metas))
        if prefill_lengths and any(s in prefill_lengths for s, _ in items):
            lens = [max(seq.length, prefill_lengths.get(s, 0)) for seq, (s, _) in zip(seqs, items)]
            meta = dataclasses.replace(meta, rope_lens=torch.tensor(lens, dtype=torch.int32).to(meta.kv_lens.device))
        return meta

    def _metadata(self, starts: list[int], ns: list[int], tables: list[list[int]],
                  device: torch.device | str) -> StepMetadata:
        b, total = len(ns), sum(ns)
        widths = [len(t) for t in tables]
        width = max(widths)
        if total == b:
            packed = self._decode_metadata(starts, tables, width)
        else:
            packed = self._packed_metadata(starts, ns, tables, widths, width, total)
        dev = torch.device(device)
        if dev.type == "cuda":  # pinned staging: the copy runs asynchronously
            packed = self._staged_copy(packed, dev)
        else:
            packed = packed.to(dev)
        o = [0, total, 2 * total, 2 * total + b + 1, 2 * total + 2 * b + 1, 2 * total + 3 * b + 1]
        return StepMetadata(
            positions=packed[o[0]:o[1]],
            slot_mapping=packed[o[1]:o[2]],
            block_tables=packed[o[5]:].view(b, width).to(torch.int32),
            cu_seqlens=packed[o[2]:o[3]].to(torch.int32),
            kv_lens=packed[o[3]:o[4]].to(torch.int32),
            last_index=packed[o[4]:o[5]],
            max_q_len=max(ns),
            n_tokens=total,
        )

    def _decode_metadata(self, starts: list[int], tables: list[list[int]], width: int) -> torch.Tensor:
        """:meth:`_packed_metadata` of a step where every sequence has one new token, from host lists.

        Here tokens are sequences, so a pass over the sequences builds the whole layout; that beats the ~25
        small tensor ops of the general path several times over at a few sequences.
        """
        bs, b = self.block_size, len(starts)
        slots = [t[p // bs] * bs + p % bs for p, t in zip(starts, tables)]
        flat = list(itertools.chain.from_iterable(t + [0] * (width - len(t)) for t in tables))
        return torch.tensor([*starts, *slots, *range(b + 1), *(p + 1 for p in starts), *range(b), *flat],
                            dtype=torch.long)

    def _packed_metadata(self, starts: list[int], ns: list[int], tables: list[list[int]], widths: list[int],
                         width: int, total: int) -> torch.Tensor:
        """``[positions, slots, cu_seqlens, kv_lens, last_index, block table]`` of a step in one tensor.

        Tensor ops over the flattened step (no Python loop per token): one host buffer, one copy to the device.
        """
        b, bs = len(ns), self.block_size
        host = torch.tensor(starts + ns + widths + list(itertools.chain.from_iterable(tables)), dtype=torch.long)
        start_t, n_t, w_t, flat = host[:b], host[b:2 * b], host[2 * b:3 * b], host[3 * b:]
        cu = torch.zeros(b + 1, dtype=torch.long)
        torch.cumsum(n_t, 0, out=cu[1:])
        row = torch.repeat_interleave(torch.arange(b), n_t)
        positions = torch.arange(total) - cu[:-1][row] + start_t[row]
        table = torch.zeros((b, width), dtype=torch.long)
        t_off = torch.zeros(b, dtype=torch.long)
        torch.cumsum(w_t[:-1], 0, out=t_off[1:])
        t_row = torch.repeat_interleave(torch.arange(b), w_t)
        table[t_row, torch.arange(flat.numel()) - t_off[t_row]] = flat
        slots = table[row, positions // bs] * bs + positions % bs
        return torch.cat([positions, slots, cu, start_t + n_t, cu[1:] - 1, table.flatten()])

    def _staged_copy(self, packed: torch.Tensor, dev: torch.device) -> torch.Tensor:
        """Copy ``packed`` to ``dev`` through a reused pinned buffer (grown when too small); the buffer is
        rewritten only after the previous copy out of it has finished."""
        if self._pinned is None or self._pinned.numel() < packed.numel():
            self._pinned = torch.empty(max(packed.numel(), 4096), dtype=torch.long, pin_memory=True)
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()
        buf = self._pinned[: packed.numel()]
        buf.copy_(packed)
        out = buf.to(dev, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out
