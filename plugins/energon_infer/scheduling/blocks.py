"""The scheduler's KV block allocator: on-demand blocks, reference counts and content-addressed prefix caching.

The scheduler owns every decision about blocks; the workers only write where they are told
(:meth:`energon_infer.worker.kv_cache.KVCache.assign`). A sequence's table grows one block at a time as
its tokens are computed (:meth:`BlockManager.grow`), so a request holds the blocks it has filled,
not the worst case of its ``max_tokens``.

Prefix caching: a *full* block is named by its content, the hash of its tokens and of the name of
the block before it (so a name stands for the whole prefix up to that block). A new sequence takes
references on the longest run of named blocks that matches its tokens and computes only the rest.
A block that was only partly matched (the first divergent block, or the last block of a fully
cached prompt, since at least one token must run to give logits) is copied into a fresh block
(copy-on-write): the sequence keeps the matched tokens' keys/values and writes its own after them,
and the shared original is never written. Blocks nobody references stay named and cached until the
free list runs dry; then the least recently released one is evicted (its name forgotten).

Sliding windows: with ``window`` set (every layer of the model attends to at most its last ``window`` tokens),
a block whose tokens every later query is past is released while the sequence runs (:meth:`BlockManager.trim`):
its table entry becomes :data:`HOLE` and the block goes back to the pool (a named one stays cached for another
sequence's prefix, until evicted). Holes are only ever the leading entries of a table. A prefix hit still needs
its whole chain of named blocks, but holds only the ones its window reaches (the rest are holes from the start).

Names are Python's tuple hash (64 bit, deterministic for ints); a match also compares the block's
tokens, so only two different prefixes with one 64-bit name could ever be confused. A chain of names starts
from a ``root`` key (0 unless told): sequences whose blocks hold other values for the same tokens (a longrope
model's past its switch, :mod:`energon_infer.scheduling.rope_switch`) name and find theirs in a chain of their own.

Example:
    >>> m = BlockManager(num_blocks=8, block_size=4)
    >>> m.start(1, [1, 2, 3, 4, 5, 6]).start       # nothing cached yet: compute from token 0
    0
    >>> m.grow(1, 6); m.commit(1, [1, 2, 3, 4, 5, 6]); m.free(1)
    [...]
    >>> hit = m.start(2, [1, 2, 3, 4, 9])            # the first block [1, 2, 3, 4] is shared
    >>> hit.start, hit.table
    (4, [...])
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["HOLE", "BlockManager", "PrefixHit"]

#: A table entry whose block was released (:meth:`BlockManager.trim`): no query reads it any more.
HOLE = -1


@dataclass(slots=True)
class PrefixHit:
    """What :meth:`BlockManager.start` found: reuse ``table``, start computing at ``start``, do ``copies`` first."""

    start: int
    table: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Named:
    key: int
    parent: int
    tokens: tuple[int, ...]


class BlockManager:
    """Blocks ``0 .. num_blocks - 1`` (or ``blocks``) shared by every sequence (see the module docstring).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        prefix_caching: name full blocks and share them between sequences.
        blocks: the block ids to manage (default ``range(num_blocks)``).
        window: tokens back from a query that every layer reads at most (0: some layer reads the whole
            context); blocks before every running query's window are released (:meth:`trim`).
        share: another manager whose blocks, references and prefix-cache names this one shares: one KV group's
            tables beside another's over one pool (:class:`~energon_infer.scheduling.kv_groups.KVGroups`).
        salt: this group's number, which gives its chains of names a root of their own (0: the first group's).
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True,
                 blocks: Iterable[int] | None = None, window: int = 0, share: BlockManager | None = None,
                 salt: int = 0):
        if window < 0:
            raise ValueError(f"window={window} must be >= 0 (0: no sliding window)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.window, self.salt = window, salt
        self._free: deque[int]
        self._ref: dict[int, int]
        self._cached: OrderedDict[int, None]  # named, unreferenced: evictable, LRU first
        self._by_key: dict[int, int]
        self._name: dict[int, _Named]
        self._children: dict[int, set[int]]
        if share is not None:  # another KV group's tables over the same blocks (energon_infer.scheduling.kv_groups)
            self._free, self._ref, self._cached = share._free, share._ref, share._cached
            self._by_key, self._name, self._children = share._by_key, share._name, share._children
        else:
            self._free = deque(range(num_blocks) if blocks is None else blocks)
            self._ref = {}
            self._cached = OrderedDict()
            self._by_key = {}
            self._name = {}
            self._children = {}
        self.tables: dict[int, list[int]] = {}
        self._named_upto: dict[int, tuple[int, int]] = {}  # seq -> (full blocks named, key of the last)
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evictions = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take (free plus cached-but-unreferenced)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return len(self._ref)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow_cost(self, seq_id: int, length: int) -> int:
        """New blocks ``seq_id``'s table needs to hold ``length`` tokens."""
        return max(0, self.blocks_for(length) - len(self.tables.get(seq_id, ())))

    def peak(self, tokens: int, step: int) -> int:
        """The most blocks a sequence of ``tokens`` tokens holds at once when no step runs more than ``step``
        of them: all of them, or with a window the step's tokens, the window before them and one block more."""
        whole = self.blocks_for(tokens)
        return min(whole, self.blocks_for(step + self.window - 1) + 1) if self.window else whole

    def unneeded(self, start: int) -> int:
        """Leading blocks no query at position ``start`` or later reads: those wholly before its window."""
        return max(0, start - self.window + 1) // self.block_size if self.window else 0

    def holes(self, seq_id: int) -> int:
        """Leading entries of ``seq_id``'s table that were released (:data:`HOLE`)."""
        n = 0
        for block in self.tables.get(seq_id, ()):
            if block != HOLE:
                break
            n += 1
        return n

    def held(self, seq_id: int) -> list[int]:
        """The blocks ``seq_id`` holds, in table order (its table without the holes)."""
        return [b for b in self.tables.get(seq_id, ()) if b != HOLE]

    # ------------------------------------------------------------------ allocation

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)  # the least recently released named block
            self._forget(block)
            self.evictions += 1
        self._ref[block] = 1
        return block

    def _forget(self, block: int) -> None:
        named = self._name.pop(block, None)
        if named is not None:
            self._by_key.pop(named.key, None)
            kids = self._children.get(named.parent)
            if kids is not None:
                kids.discard(block)
                if not kids:
                    del self._children[named.parent]

    def _hold(self, block: int) -> None:
        if block in self._ref:
            self._ref[block] += 1
        else:
            self._cached.pop(block, None)
            self._ref[block] = 1

    def _release(self, block: int) -> None:
        n = self._ref[block] - 1
        if n:
            self._ref[block] = n
            return
        del self._ref[block]
        if block in self._name:
            self._cached[block] = None
        else:
            self._free.append(block)

    def grow(self, seq_id: int, length: int) -> list[int]:
        """Append blocks so ``seq_id`` holds ``length`` tokens; returns the new blocks (caller checked the room)."""
        table = self.tables.setdefault(seq_id, [])
        need = self.grow_cost(seq_id, length)
        if need > self.num_free:
            raise RuntimeError(f"sequence {seq_id} needs {need} blocks but {self.num_free} are free; check "
                               "grow_cost first (this is a scheduler bug)")
        new = [self._take() for _ in range(need)]
        table.extend(new)
        return new

    def trim(self, seq_id: int, start: int) -> int:
        """Release the blocks of ``seq_id`` that no query from position ``start`` on reads (:meth:`unneeded`);
        returns how many leading entries of its table are holes now (unchanged without a window)."""
        table = self.tables.get(seq_id)
        if table is None:
            return 0
        drop = min(self.unneeded(start), len(table))
        for i in range(drop):
            if table[i] != HOLE:
                self._release(table[i])
                table[i] = HOLE
        return self.holes(seq_id)

    def resume(self, seq_id: int, length: int, held: int, root: int = 0) -> list[int]:
        """A table for a swapped-out sequence of ``length`` tokens whose last ``held`` blocks come back (the
        ones before are holes, as are those :meth:`unneeded` now), named in the chain from ``root``; returns the
        blocks taken, in table order."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks; free it first")
        total = self.blocks_for(length)
        back = min(held, total - self.unneeded(length))
        if back > self.num_free:
            raise RuntimeError(f"sequence {seq_id} needs {back} blocks but {self.num_free} are free; check "
                               "resume_cost first (this is a scheduler bug)")
        new = [self._take() for _ in range(back)]
        self.tables[seq_id] = [HOLE] * (total - back) + new
        self._named_upto[seq_id] = (0, self.root_key(root))
        return new

    def resume_cost(self, length: int, grown: int, held: int) -> int:
        """Blocks :meth:`resume` (``length`` tokens, ``held`` blocks back) and growing to ``grown`` tokens take."""
        total = self.blocks_for(length)
        return min(held, total - self.unneeded(length)) + self.blocks_for(grown) - total

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``'s blocks; named ones stay cached (the deepest evicted first)."""
        table = self.tables.pop(seq_id, None)
        self._named_upto.pop(seq_id, None)
        for block in reversed(table or ()):
            if block != HOLE:
                self._release(block)

    def reset(self) -> None:
        """Forget everything (the workers restarted with empty caches)."""
        if self.salt:
            raise RuntimeError("a KV group sharing another's blocks is reset with all of them (KVGroups.reset)")
        self.__init__(self.num_blocks, self.block_size, prefix_caching=self.prefix_caching,  # type: ignore[misc]
                      window=self.window)

    # ------------------------------------------------------------------ prefix caching

    def _key(self, parent: int, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def root_key(self, root: int) -> int:
        """The key this manager's chains start from for ``root``: ``root`` itself, or one of its own for another
        KV group sharing the blocks (``salt``), so two groups never name their blocks alike."""
        return hash((root, self.salt)) if self.salt else root

    def chain(self, tokens: Sequence[int], root: int = 0) -> tuple[list[int], list[int]]:
        """``(key of each full block of tokens, the block named so or HOLE)``: read only, never stopping at a gap
        (a windowed group needs only the named blocks its window reaches)."""
        bs, parent = self.block_size, self.root_key(root)
        keys: list[int] = []
        blocks: list[int] = []
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = self._key(parent, chunk)
            block = self._by_key.get(key)
            ok = block is not None and self._name[block].tokens == chunk and self._name[block].parent == parent
            keys.append(key)
            blocks.append(block if ok and block is not None else HOLE)
            parent = key
        return keys, blocks

    def lookup(self, tokens: Sequence[int], root: int = 0) -> tuple[list[int], int, tuple[int, int] | None]:
        """``(shared full blocks, their key chain's last key, (block to copy, tokens of it to keep) or None)``.

        Read only. At least one token is always left to compute. ``root``: the key the chain starts from.
        """
        bs, parent = self.block_size, self.root_key(root)
        shared: list[int] = []
        if not self.prefix_caching:
            return shared, parent, None
        n_full = len(tokens) // bs
        for i in range(n_full):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            block = self._by_key.get(self._key(parent, chunk))
            if block is None or self._name[block].tokens != chunk or self._name[block].parent != parent:
                break
            shared.append(block)
            parent = self._name[block].key
        cow: tuple[int, int] | None = None
        if len(shared) * bs >= len(tokens):  # all cached: recompute the last token into a copy of its block
            last = shared.pop()
            parent = self._name[last].parent
            cow = (last, bs - 1)
        else:  # the first divergent block: copy the cached sibling sharing the longest run of tokens
            rest = tokens[len(shared) * bs:(len(shared) + 1) * bs]
            best = 0
            for kid in self._children.get(parent, ()):
                common = 0
                for a, b in zip(self._name[kid].tokens, rest):
                    if a != b:
                        break
                    common += 1
                common = min(common, len(tokens) - len(shared) * bs - 1)
                if common > best:
                    best, cow = common, (kid, common)
        return shared, parent, cow

    def start_cost(self, shared: Sequence[int], cow: tuple[int, int] | None, length: int) -> int:
        """Blocks a new sequence takes from :attr:`num_free` to hold ``length`` tokens, given its :meth:`lookup`."""
        cached = len(shared) * self.block_size + (cow[1] if cow else 0)
        drop = self.unneeded(cached)  # shared blocks before the window: holes, never held
        revived = sum(1 for b in shared[drop:] if b not in self._ref)  # cached blocks leave the evictable set
        if cow is not None and cow[0] not in self._ref:
            revived += 1  # held while its copy is taken, so it cannot be the block evicted for it
        return max(0, self.blocks_for(max(length, cached + 1)) - len(shared)) + revived

    def start(self, seq_id: int, tokens: Sequence[int], *, share: bool = True, root: int = 0,
              found: tuple[list[int], int, tuple[int, int] | None] | None = None) -> PrefixHit:
        """Begin ``seq_id``: share the cached prefix of ``tokens`` (see :meth:`lookup`, or ``found`` where the
        caller chose it; nothing with ``share`` off), its blocks named in the chain from ``root``; grow it
        afterwards. ``found`` may hold :data:`HOLE` before the window of its end."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks; free it first")
        if found is None:
            found = self.lookup(tokens, root) if share else ([], self.root_key(root), None)
        shared, parent, cow = found
        drop = self.unneeded(len(shared) * self.block_size + (cow[1] if cow else 0))
        for block in shared[drop:]:
            self._hold(block)
        table = [HOLE] * drop + list(shared[drop:])
        self.tables[seq_id] = table
        self._named_upto[seq_id] = (len(shared), parent)
        hit = PrefixHit(len(shared) * self.block_size, table)
        if cow is not None:
            src, keep = cow
            self._hold(src)  # not evicted by the _take below
            dst = self._take()
            self._release(src)
            table.append(dst)
            hit.copies.append((src, dst))
            hit.start += keep
        self.query_tokens += len(tokens)
        self.hit_tokens += hit.start
        return hit

    def commit(self, seq_id: int, tokens: Sequence[int], computed: int | None = None) -> None:
        """Name ``seq_id``'s blocks that ``computed`` tokens (default all of ``tokens``) have filled."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        table = self.tables[seq_id]
        done, parent = self._named_upto.get(seq_id, (0, self.root_key(0)))
        full = min(len(tokens) if computed is None else computed, len(table) * bs) // bs
        for i in range(done, full):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = self._key(parent, chunk)
            block = table[i]  # a hole (released before it was named) is skipped, its key still chains
            if block != HOLE and key not in self._by_key and block not in self._name:
                self._by_key[key] = block
                self._name[block] = _Named(key, parent, chunk)
                self._children.setdefault(parent, set()).add(block)
            parent = key
        self._named_upto[seq_id] = (max(done, full), parent)
