"""KV groups: where windowed and global layers alternate, each kind keeps its keys and values in tables of its own.

In Gemma 2 / 3, gpt-oss or Qwen2 with ``max_window_layers``, some layers attend within a sliding window and the
others read the whole context. With one block table per sequence, the global layers' reads keep every block alive
and the window saves nothing. Here the layers are split into *KV groups* (:func:`kv_layout`) of at most ``slots``
layers, each group holding only one kind of layer; every group has its own block table per sequence, and all of
them draw from one pool of *pages* (one page: one block of tokens for ``slots`` layers, so a page serves any group).
A windowed group's table releases its pages as the window passes them (:meth:`BlockManager.trim`), the global
groups' tables keep the whole context: a long sequence holds about ``window / block_size + 2`` pages in each
windowed group and ``context / block_size`` in each global one, from one budget of bytes.

:class:`KVGroups` is the scheduler's view: one :class:`BlockManager` per group, all sharing the pool's free list,
references and prefix-cache names (each group's chain of names has a root of its own), behind the one-group API the
scheduler already used. Every group's table of a sequence has the same length (one entry per block of tokens); the
workers get them *interleaved*: entry ``i`` of group ``g`` is element ``i * groups + g`` of the flat list
(:meth:`KVGroups.table`, :meth:`KVGroups.grow`; one group: the table itself).

Example:
    >>> layout = kv_layout((6, 0, 6, 0))                 # Gemma 2: windowed and global layers in turn
    >>> layout.windows, layout.slots, layout.group_of, layout.slot_of
    ((6, 0), 2, (0, 1, 0, 1), (0, 0, 1, 1))
    >>> kv = KVGroups(32, 4, layout.windows)
    >>> kv.grow(1, 9)               # 3 blocks of tokens: pages 0-2 in the windowed group, 3-5 in the global one
    [0, 3, 1, 4, 2, 5]
    >>> kv.trim(1, 9), kv.table(1)  # a query at 9 reads keys from 4 on: the windowed group's block 0 is released
    (1, [-1, 3, 1, 4, 2, 5])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from energon_infer.scheduling.blocks import HOLE, BlockManager, PrefixHit

__all__ = ["KVGroups", "KVLayout", "allocator", "kv_layout"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Which KV group each layer's keys and values live in.

    Args:
        windows: each group's window (0: its layers read the whole context).
        slots: layers per page (the most any group holds).
        group_of: per model layer, its group.
        slot_of: per model layer, its place among its group's layers (the page's slot it uses).
    """

    windows: tuple[int, ...]
    slots: int
    group_of: tuple[int, ...]
    slot_of: tuple[int, ...]

    @property
    def hybrid(self) -> bool:
        """Whether the layers are split into several groups (windowed and global layers mixed)."""
        return len(self.windows) > 1


def kv_layout(windows: Sequence[int], n_layers: int | None = None) -> KVLayout:
    """The groups of a model whose layer ``l`` attends within ``windows[l]`` tokens (0: the whole context).

    No windowed layer, or every layer windowed: one group of every layer (its window the largest, as before).
    Mixed: the windowed and the global layers are each cut, in order, into groups of ``slots`` layers, ``slots``
    being the smaller kind's count, so no group mixes the two and a page wastes at most the tail of each kind.
    ``n_layers``: the model's layers where ``windows`` is empty (no windowed layer).
    """
    n = len(windows) if windows else (n_layers or 0)
    if any(w < 0 for w in windows):
        raise ValueError(f"windows={tuple(windows)} must all be >= 0 (0: the layer reads the whole context)")
    windowed = [i for i, w in enumerate(windows) if w]
    full = [i for i, w in enumerate(windows) if not w]
    if not windowed or not full:
        return KVLayout((max(windows, default=0),), max(n, 1), (0,) * n, tuple(range(n)))
    slots = min(len(windowed), len(full))
    window = max(windows)
    group_of, slot_of, kinds = [0] * n, [0] * n, list[int]()
    for layers, w in ((windowed, window), (full, 0)):
        for start in range(0, len(layers), slots):
            for slot, layer in enumerate(layers[start:start + slots]):
                group_of[layer], slot_of[layer] = len(kinds), slot
            kinds.append(w)
    return KVLayout(tuple(kinds), slots, tuple(group_of), tuple(slot_of))


class KVGroups:
    """One :class:`BlockManager` per KV group over one shared pool of pages (see the module docstring).

    Args:
        num_blocks: pages in the pool.
        block_size: tokens per block.
        windows: each group's window (0: whole context); one entry: the plain one-table case.
        prefix_caching: name full blocks and share them between sequences (every group's, together).
        blocks: the page ids to manage (default ``range(num_blocks)``).
    """

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int] = (0,), *,
                 prefix_caching: bool = True, blocks: Iterable[int] | None = None):
        if not windows:
            raise ValueError("windows=() must give at least one group's window (0: the whole context)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.windows = tuple(windows)
        first = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching, blocks=blocks,
                             window=self.windows[0])
        self.groups = [first] + [BlockManager(num_blocks, block_size, prefix_caching=prefix_caching, window=w,
                                              share=first, salt=g) for g, w in enumerate(self.windows[1:], 1)]
        #: the largest window (0: no group is windowed): the scheduler trims and caps its steps by it
        self.window = max(self.windows)

    # ------------------------------------------------------------------ counts (pages, all groups together)

    @property
    def num_free(self) -> int:
        return self.groups[0].num_free

    @property
    def used(self) -> int:
        return self.groups[0].used

    @property
    def tables(self) -> dict[int, list[int]]:
        """The first group's tables (every group holds a table for the same sequences, of the same length)."""
        return self.groups[0].tables

    @property
    def hit_tokens(self) -> int:
        return self.groups[0].hit_tokens

    @property
    def query_tokens(self) -> int:
        return self.groups[0].query_tokens

    @property
    def evictions(self) -> int:
        return sum(g.evictions for g in self.groups)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak(self, tokens: int, step: int) -> int:
        """Pages a sequence holds at most (:meth:`BlockManager.peak`, every group's)."""
        return sum(g.peak(tokens, step) for g in self.groups)

    def grow_cost(self, seq_id: int, length: int) -> int:
        return sum(g.grow_cost(seq_id, length) for g in self.groups)

    def unneeded(self, start: int) -> int:
        """Leading blocks no query from ``start`` on reads in the windowed groups."""
        return max(g.unneeded(start) for g in self.groups)

    def holes(self, seq_id: int) -> int:
        """Leading entries released in the windowed groups' tables of ``seq_id`` (each has the same)."""
        return max(g.holes(seq_id) for g in self.groups)

    def held(self, seq_id: int) -> list[int]:
        """Every page ``seq_id`` holds, group after group."""
        return [b for g in self.groups for b in g.held(seq_id)]

    def held_groups(self, seq_id: int) -> list[list[int]]:
        """The pages ``seq_id`` holds in each group, in table order."""
        return [g.held(seq_id) for g in self.groups]

    def group_table(self, seq_id: int, group: int) -> list[int]:
        return list(self.groups[group].tables.get(seq_id, ()))

    def table(self, seq_id: int) -> list[int]:
        """``seq_id``'s tables interleaved (entry ``i`` of group ``g`` at ``i * groups + g``)."""
        return _interleave([g.tables.get(seq_id, []) for g in self.groups])

    # ------------------------------------------------------------------ changes

    def grow(self, seq_id: int, length: int) -> list[int]:
        """Grow every group's table to ``length`` tokens; the new pages, interleaved."""
        if self.grow_cost(seq_id, length) > self.num_free:
            raise RuntimeError(f"sequence {seq_id} needs {self.grow_cost(seq_id, length)} pages but {self.num_free} "
                               "are free; check grow_cost first (this is a scheduler bug)")
        return _interleave([g.grow(seq_id, length) for g in self.groups])

    def trim(self, seq_id: int, start: int) -> int:
        """Release the windowed groups' blocks no query from ``start`` on reads; returns their holes."""
        return max(g.trim(seq_id, start) for g in self.groups)

    def commit(self, seq_id: int, tokens: Sequence[int], computed: int | None = None) -> None:
        for g in self.groups:
            g.commit(seq_id, tokens, computed)

    def free(self, seq_id: int) -> None:
        for g in self.groups:
            g.free(seq_id)

    def reset(self) -> None:
        """Forget everything (the workers restarted with empty caches)."""
        self.__init__(self.num_blocks, self.block_size, self.windows,  # type: ignore[misc]
                      prefix_caching=self.prefix_caching)

    def resume_cost(self, length: int, grown: int, counts: Sequence[int]) -> int:
        """Pages :meth:`resume` and growing to ``grown`` tokens take (``counts``: pages swapped out per group)."""
        return sum(g.resume_cost(length, grown, n) for g, n in zip(self.groups, counts))

    def resume(self, seq_id: int, length: int, swapped: Sequence[int], counts: Sequence[int],
               root: int = 0) -> list[tuple[int, int]]:
        """Tables for a swapped-out sequence of ``length`` tokens (``swapped``: its host blocks, group after group,
        ``counts`` of them per group); returns the ``(host, device)`` copies that bring back what each group's
        window still reaches."""
        pairs: list[tuple[int, int]] = []
        at = 0
        for g, n in zip(self.groups, counts):
            mine = swapped[at:at + n]
            at += n
            back = g.resume(seq_id, length, n, root)
            pairs.extend(zip(mine[len(mine) - len(back):], back))
        return pairs

    # ------------------------------------------------------------------ prefix caching

    def lookup(self, tokens: Sequence[int], root: int = 0
               ) -> tuple[list[int] | list[tuple[int, ...]], int, tuple[int, int] | None]:
        """What :meth:`start` would share: one group's :meth:`BlockManager.lookup`; several: per shared block of
        tokens, each group's page (a windowed group's :data:`HOLE` where its window does not reach), no copy.

        Several groups share the longest run of whole blocks that every group can serve: a global group needs
        every page of it named, a windowed one only those its window reaches from the run's end.
        """
        if len(self.groups) == 1:
            return self.groups[0].lookup(tokens, root)
        if not self.prefix_caching:
            return [], root, None
        chains = [g.chain(tokens, root)[1] for g in self.groups]
        for n in range((len(tokens) - 1) // self.block_size, 0, -1):  # at least one token left to compute
            if all(HOLE not in blocks[g.unneeded(n * self.block_size):n] for g, blocks in zip(self.groups, chains)):
                return [tuple(blocks[i] for blocks in chains) for i in range(n)], root, None
        return [], root, None

    def start_cost(self, shared: Sequence, cow: tuple[int, int] | None, length: int) -> int:
        """Pages a new sequence takes to hold ``length`` tokens, given its :meth:`lookup`."""
        if len(self.groups) == 1:
            return self.groups[0].start_cost(shared, cow, length)
        return sum(g.start_cost([s[i] for s in shared], None, length) for i, g in enumerate(self.groups))

    def start(self, seq_id: int, tokens: Sequence[int], *, share: bool = True, root: int = 0) -> PrefixHit:
        """Begin ``seq_id`` in every group, sharing what :meth:`lookup` finds (nothing with ``share`` off)."""
        if len(self.groups) == 1:
            return self.groups[0].start(seq_id, tokens, share=share, root=root)
        shared = self.lookup(tokens, root)[0] if share else []
        n = len(shared)
        hits = []
        for i, g in enumerate(self.groups):
            keys = g.chain(tokens[:n * self.block_size], root)[0]
            mine = [s[i] for s in shared if isinstance(s, tuple)]
            hits.append(g.start(seq_id, tokens, share=share, root=root,
                                found=(mine, keys[-1] if keys else g.root_key(root), None)))
        return PrefixHit(hits[0].start, self.table(seq_id))


def allocator(num_blocks: int, block_size: int, windows: Sequence[int], *,
              prefix_caching: bool = True) -> BlockManager | KVGroups:
    """Blocks for a cache whose KV groups have ``windows``: one group's :class:`BlockManager`, else :class:`KVGroups`
    (the same calls; a runner's own step-level API allocates with it)."""
    if len(windows) == 1:
        return BlockManager(num_blocks, block_size, prefix_caching=prefix_caching, window=windows[0])
    return KVGroups(num_blocks, block_size, windows, prefix_caching=prefix_caching)


def _interleave(tables: list[list[int]]) -> list[int]:
    if len(tables) == 1:
        return list(tables[0])
    return [t[i] for i in range(len(tables[0])) for t in tables]
