"""Optimizer state on disk: the optimizer step of a plan's disk units streams their state through the host.

A disk unit (``UnitPlan.tier == Tier.DISK``, state tier 2) is offloaded like a host unit (FSDP2
``CPUOffloadPolicy``: fp32 master parameters and gradients on the host) but its optimizer state - the tensors
the optimizer keeps per parameter element, ``exp_avg`` / ``exp_avg_sq`` of AdamW - waits between steps in a
:class:`tightfit.storage.TensorStore` (``<disk_dir>/rank<r>``). The plan keeps master weights on the host
for tier-2 units; a tier-3 unit (``Tier.DISK_PARAMS``) keeps its fp32 master weights in the same store
(:mod:`lightning_elixir.disk_params`: parameters between uses), and its chunks stream them with the state.

The step. The user's optimizer is used unchanged: :class:`lightning_elixir.step.ElixirOptimizer` (what
``ElixirStrategy.optimizer_step`` steps) leaves the disk parameters out of the user's step (host and device
parameters step as usual), then calls :meth:`DiskOptimizerState.step`, which steps the disk parameters
chunk by chunk in the plan's unit order. A chunk is a range of one unit's flattened local shards
(:data:`CHUNK_ELEMENTS` elements at most); its state is read into one of two fixed staging sets while the
chunk before it updates, and written back behind it (the store's asynchronous ``read_into`` / ``write``).
An optimizer of the user's class and hyperparameters (its twin: its own groups and state, none of the user's
optimizer's hooks) steps each chunk on surrogate parameters: leaf views of the local shards and gradients, with
the staging views as their state, so every element sees the same kernel with the same operands as in a run
all in RAM (AdamW, Adam, SGD, Adagrad are elementwise). Inside a tensor, chunk boundaries fall on multiples
of :data:`ALIGN_ELEMENTS`: torch's fused CPU Adam kernel rounds the scalar tail of a range differently from
its vector body (measured: a 1,000,003-element AdamW step split at 33,333 elements differed in
``exp_avg_sq``; split at multiples of 4,096 it is bit-equal, as foreach and the for-loop are at any split).

Host memory: two staging sets of ``CHUNK_ELEMENTS`` elements per state tensor (fp32 AdamW: 2 x 2 x 32 MiB
= 128 MiB, the planner's ``DISK_STAGING_BYTES``), smaller when the largest unit is smaller; with tier-3 units
each set holds the chunk's master weights too, and :func:`~lightning_elixir.disk_attach.attach_disk_state` shrinks the chunk by a third so
the area stays 128 MiB; plus, on the first step only, the chunk's freshly initialised state (one chunk, freed
once written).

Tier-3 chunks: the surrogate parameters are views of the staging set's master weights (read with the state,
written back behind it), not of the local shards, which hold no memory between uses.

Tier-4 chunks (:mod:`lightning_elixir.disk_grads`): the gradients were written
to the store behind the backward; each chunk reads them into the staging set with the state (not written back),
the clipping recorded for them is replayed on the chunk, and the surrogates' gradients view it. Each staging
set then holds four tensors, so :func:`~lightning_elixir.disk_attach.attach_disk_state` halves the chunk.

Layout on disk: per unit ``i`` and state key ``k`` one flat buffer ``u<i>.<k>``; each parameter's local shard
starts at a multiple of ``ALIGN_ELEMENTS`` (the gaps read as zeros and are never stepped).

Example:
    >>> state = DiskOptimizerState(optimizer, [(3, params_of_unit_3), (4, params_of_unit_4)], store)  # doctest: +SKIP
    >>> ElixirOptimizer(optimizer, disk=state).step()                                     # doctest: +SKIP
    >>> state.bytes_written, state.bytes_read                                               # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_elixir.disk_grads import DiskGradients
from lightning_elixir.disk_layout import (
    ALIGN_ELEMENTS,
    CHUNK_ELEMENTS,
    Chunk,
    Piece,
    Staging,
    StepIO,
    align,
    chunks_of,
    flat_layout,
    local_of,
    wait_all,
)
from lightning_elixir.disk_params import DiskParameters
from lightning_elixir.optim import host_group
from tightfit.storage import ReadAhead, TensorStore, aligned_empty

__all__ = ["DiskOptimizerState", "StepIO", "flat_layout", "CHUNK_ELEMENTS", "ALIGN_ELEMENTS", "local_of"]

def _twin(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and defaults with no groups, no state and none of its hooks, made the way
    unpickling makes one (``__setstate__``; its public attributes copied): the disk tier's chunks step on it."""
    twin = type(optimizer).__new__(type(optimizer))
    own = {k: v for k, v in vars(optimizer).items() if not k.startswith("_") and k not in ("state", "param_groups")}
    twin.__setstate__({**own, "defaults": dict(optimizer.defaults), "state": defaultdict(dict), "param_groups": []})
    return twin


class DiskOptimizerState:
    """Keep the optimizer state of ``units``' parameters in ``store``, streamed through the host in each step.

    Args:
        optimizer: the user's optimizer (any whose per-parameter state is elementwise: AdamW, Adam, SGD with
            momentum, Adagrad ...); nothing about it changes (:class:`~lightning_elixir.step.ElixirOptimizer`
            steps it without the disk parameters, then calls :meth:`step`).
        units: ``(plan unit index, parameters)`` of the disk units, in the plan's order (the step's order).
        store: this rank's store (:meth:`TensorStore.for_rank`).
        chunk_elements: the largest chunk (a multiple of :data:`ALIGN_ELEMENTS`; default :data:`CHUNK_ELEMENTS`).
        master: the tier-3 units' parameters (:class:`~lightning_elixir.disk_params.DiskParameters`): their chunks
            read and write the master weights from the store with the state.
        grads: the tier-4 units' gradients (:class:`~lightning_elixir.disk_grads.DiskGradients`): their chunks
            read the gradients from the store with the state (clipping replayed on them), and write nothing back.
        fused_on_host: Adam/AdamW chunks step with torch's fused CPU kernel where the user chose neither ``foreach``
            nor ``fused`` (the choice :func:`lightning_elixir.optim.mesh_step` makes for the host buckets).

    ``bytes_read`` / ``bytes_written`` count what moved; ``staging_bytes`` is the host staging area.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, units: Sequence[tuple[int, Sequence[nn.Parameter]]],
                 store: TensorStore, *, chunk_elements: int = CHUNK_ELEMENTS,
                 master: DiskParameters | None = None, grads: DiskGradients | None = None,
                 fused_on_host: bool = False) -> None:
        if chunk_elements <= 0 or chunk_elements % ALIGN_ELEMENTS:
            raise ValueError(f"DiskOptimizerState(chunk_elements={chunk_elements}): use a positive multiple of "
                             f"{ALIGN_ELEMENTS}")
        self.optimizer, self.store, self.master, self.fused_on_host = optimizer, store, master, fused_on_host
        self.twin = _twin(optimizer)
        self.master_units = frozenset(master.order) if master is not None else frozenset()
        self.grads = grads
        self.grad_units = frozenset(u.index for u in grads.units) if grads is not None else frozenset()
        self.params = {id(p): p for _, ps in units for p in ps}
        dtypes = {p.dtype for p in self.params.values()}
        if len(dtypes) > 1:
            raise ValueError(f"disk units hold parameters of several dtypes {sorted(map(str, dtypes))}; the disk "
                             "tier streams one dtype (fp32 master weights): keep such units on the host")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.where: dict[int, tuple[int, int]] = {}
        self.chunks, self.lengths = chunks_of(units, chunk_elements, self.where)
        # optimizer.state keeps, for each streamed key of a disk parameter, a placeholder of the state's shape
        # backed by one element (so state dicts and checkpoints see every key); storage address -> (param, key).
        self.placeholders: dict[int, tuple[nn.Parameter, str]] = {}
        self.chunk_elements = min(chunk_elements, align(max((c.hi - c.lo for c in self.chunks), default=0)))
        self.keys: tuple[str, ...] | None = None  # streamed state keys, known after the first step
        self.bytes_read = 0
        self.bytes_written = 0
        self.steps = 0
        self.last_step: StepIO | None = None  # what the latest streamed step moved, and how long it took
        self._waited = 0.0
        self._staging: list[Staging] = []
        self._freed_staging = 0
        self._undo_zero_grad = grads.wrap_zero_grad(optimizer) if grads is not None else None

    # ---- names and sizes ---------------------------------------------------------------------------
    def name(self, unit: int, key: str) -> str:
        """The store name of unit ``unit``'s state tensor ``key`` (a flat buffer)."""
        return f"u{unit}.{key}"

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging sets (0 before the first step allocates them; after :meth:`close`, which frees
        them, what they were)."""
        if not self._staging:
            return self._freed_staging
        return sum(b.nbytes for s in self._staging for b in (*s.buffers.values(), *(t for t in (s.master, s.grad)
                                                                                    if t is not None)))

    def disk_bytes(self) -> int:
        """Bytes this rank keeps on disk: every disk unit's optimizer state, and the master weights (tier 3) and
        gradients (tier 4) of the units that keep them there (one flat buffer per unit and key)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return (sum(n * size for n in self.lengths.values()) * len(self.keys or ())
                + sum(n * size for u, n in self.lengths.items() if u in self.master_units)
                + sum(n * size for u, n in self.lengths.items() if u in self.grad_units))

    def close(self, read_back: bool = True) -> None:
        """Free the staging sets and remove tier 3's and tier 4's hooks (with ``read_back`` tier-3 units hold their
        weights again, else they stay in the store only: :meth:`DiskParameters.close`; the store is the caller's to
        close)."""
        self._freed_staging = self.staging_bytes
        self._staging = []  # freed before tier 3 reads the weights back
        try:
            if self.grads is not None:
                try:
                    self.grads.close()  # its hooks wrap tier 3's: removed first (a failed write raised after)
                finally:
                    if self._undo_zero_grad is not None:
                        self._undo_zero_grad()
        finally:
            if self.master is not None:
                self.master.close(read_back)  # the units hold their weights again even when a gradient write failed

    # ---- the streamed step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Step every disk parameter that has a gradient, chunk by chunk in plan order, with the hyperparameters of
        its group in the user's optimizer (:class:`~lightning_elixir.step.ElixirOptimizer` calls it after the user's
        step of the parameters in RAM)."""
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"] if id(p) in self.params}
        before = {pid: {k: v.clone() if torch.is_tensor(v) else v for k, v in self.optimizer.state[p].items()
                        if k not in (self.keys or ()) and not self.is_placeholder(v)}
                  for pid, p in self.params.items() if p in self.optimizer.state}
        first = self.keys is None
        t0, read0, written0, self._waited = time.perf_counter(), self.bytes_read, self.bytes_written, 0.0
        if self.grads is not None:
            self.grads.drain()  # every gradient written before the chunks read them
        if self.master is not None:
            self.master.settle()  # every tier-3 unit's newest weights in the store, none held: the step updates those
        self._allocate()
        # Chunk i+1's state (none before the first step), master weights and gradients come in while chunk i
        # updates, into the other staging set.
        ahead = ReadAhead(range(len(self.chunks)), partial(self._read, state=not first), depth=1)
        unwritten: list[int] = []  # first step: chunks whose parameters had no gradient, so no state yet
        try:
            for i, chunk in enumerate(self.chunks):
                t = time.perf_counter()
                s = ahead.take(i)
                self._waited += time.perf_counter() - t
                if not first:
                    self._chunk_step(chunk, groups, before, s)
                    self._write(chunk, s)  # written back behind it
                elif not self._first_chunk(chunk, groups, s):
                    unwritten.append(i)
            if unwritten and self.keys is not None:
                self._write_zero_state(unwritten)
        finally:
            ahead.close()
            for s in self._staging:
                self._wait(s.writes)
            # Freed until the next step: forward and backward run without them, as the planner prices the step.
            self._freed_staging, self._staging = self.staging_bytes, []
        # A durability point each step: the store writes to fresh slots and reuses the replaced ones only after
        # a sync, so without it the state's footprint on disk would grow by a copy every step.
        if self.grads is not None:
            self.grads.consumed()
        t1 = time.perf_counter()
        self.store.sync()
        if self.master is not None:
            self.master.mark_stale()
        now = time.perf_counter()
        self.steps += 1
        self.last_step = StepIO(seconds=now - t0, bytes_read=self.bytes_read - read0,
                                bytes_written=self.bytes_written - written0, wait_seconds=self._waited,
                                sync_seconds=now - t1, chunks=len(self.chunks))

    def _allocate(self) -> None:
        """The two staging sets' buffers: the state's once its keys are known, the master weights' (tier 3) and
        the gradients' (tier 4)."""
        if not self._staging:
            self._staging = [Staging() for _ in range(2)]
        nbytes = self.chunk_elements * self.dtype.itemsize
        for s in self._staging:
            s.buffers.update({k: aligned_empty(nbytes, self.dtype) for k in self.keys or () if k not in s.buffers})
            if self.master_units and s.master is None:
                s.master = aligned_empty(nbytes, self.dtype)
            if self.grad_units and s.grad is None:
                s.grad = aligned_empty(nbytes, self.dtype)

    def _read_grad(self, chunk: Chunk, s: Staging) -> list[Future[Any]]:
        """Read the chunk's gradients from disk where any of its parameters has one there."""
        grads = self.grads
        if chunk.unit not in self.grad_units or grads is None or not any(grads.holds(pc.param) for pc in chunk.pieces):
            return []
        assert s.grad is not None
        # To the end of the last piece with a gradient there: a parameter without one (frozen, unused) wrote
        # nothing, and where it ends the unit the buffer on disk ends before the chunk does.
        hi = max(pc.offset + pc.stop - pc.start for pc in chunk.pieces if grads.holds(pc.param))
        n, size = hi - chunk.lo, self.dtype.itemsize
        self.bytes_read += n * size
        return [self.store.read_into(grads.name(chunk.unit), s.grad[:n], chunk.lo * size)]

    def _read_master(self, chunk: Chunk, s: Staging) -> list[Future[Any]]:
        if chunk.unit not in self.master_units:
            return []
        assert self.master is not None and s.master is not None
        n, size = chunk.hi - chunk.lo, self.dtype.itemsize
        self.bytes_read += n * size
        return [self.store.read_into(self.master.name(chunk.unit), s.master[:n], chunk.lo * size)]

    def _read(self, i: int, slot: int, *, state: bool) -> Staging:
        """Chunk ``i``'s state (with ``state``: none exists before the first step) and master weights, gradients
        read into staging set ``slot`` (on the read-ahead thread: the step waits for it only when it takes the
        chunk)."""
        chunk, s = self.chunks[i], self._staging[slot]
        writes, s.writes = s.writes, []
        wait_all(writes)  # its buffers still hold chunk i-2 on its way out (a failed write raises at the take)
        n, size = chunk.hi - chunk.lo, self.dtype.itemsize
        keys = self.keys if state and self.keys is not None else ()
        wait_all([self.store.read_into(self.name(chunk.unit, k), s.buffers[k][:n], chunk.lo * size)
                  for k in keys] + self._read_master(chunk, s) + self._read_grad(chunk, s))
        self.bytes_read += n * size * len(keys)
        return s

    def _write(self, chunk: Chunk, s: Staging) -> None:
        n, size = chunk.hi - chunk.lo, self.dtype.itemsize
        assert self.keys is not None
        s.writes = [self.store.write(self.name(chunk.unit, k), s.buffers[k][:n], chunk.lo * size)
                    for k in self.keys]
        self.bytes_written += n * size * len(self.keys)
        if chunk.unit in self.master_units:
            assert self.master is not None and s.master is not None
            s.writes.append(self.store.write(self.master.name(chunk.unit), s.master[:n], chunk.lo * size))
            self.bytes_written += n * size

    def _wait(self, futures: list[Future[Any]]) -> None:
        pending, futures[:] = list(futures), []
        t0 = time.perf_counter()
        try:
            wait_all(pending)  # a DiskFullError or ChecksumError surfaces here, out of optimizer.step()
        finally:
            self._waited += time.perf_counter() - t0

    def _surrogates(self, chunk: Chunk, groups: dict[int, dict[str, Any]], master: torch.Tensor | None = None,
                    grad_buf: torch.Tensor | None = None) -> list[tuple[Piece, nn.Parameter]]:
        out = []
        for piece in chunk.pieces:
            p = piece.param
            lo, n = piece.offset - chunk.lo, piece.stop - piece.start
            on_disk = self.grads is not None and grad_buf is not None and self.grads.holds(p)
            if (p.grad is None and not on_disk) or id(p) not in groups:
                continue
            if on_disk:  # tier 4: read with the chunk; clipping replayed on it here
                assert self.grads is not None and grad_buf is not None
                g = grad_buf[lo:lo + n]
                self.grads.apply_ops(g)
            else:
                g = local_of(p.grad).view(-1)[piece.start:piece.stop]  # type: ignore[arg-type]
            if master is not None:  # tier 3: the master weights read into the staging set, not the (empty) shard
                q = nn.Parameter(master[lo:lo + n])
            else:
                data = local_of(p).detach().view(-1)
                q = nn.Parameter(data[piece.start:piece.stop])  # a leaf aliasing the shard: the update lands in it
            q.grad = g
            out.append((piece, q))
        return out

    def _run(self, pairs: list[tuple[Piece, nn.Parameter]], groups: dict[int, dict[str, Any]],
             state: dict[nn.Parameter, dict[str, Any]]) -> None:
        """One step of the twin over the surrogates, with the user's groups' hyperparameters (read now)."""
        twin = self.twin
        by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
        index = {id(g): g for g in groups.values()}
        for piece, q in pairs:
            by_group[id(groups[id(piece.param)])].append(q)
        twin.param_groups = [host_group(self.optimizer, index[g], qs, fused_on_host=self.fused_on_host)
                             for g, qs in by_group.items()]
        twin.state = defaultdict(dict, state.items())
        try:
            with torch.no_grad():
                twin.step()
            state.update((q, v) for q, v in twin.state.items() if isinstance(q, nn.Parameter))
        finally:
            twin.param_groups, twin.state = [], defaultdict(dict)

    def _first_chunk(self, chunk: Chunk, groups: dict[int, dict[str, Any]], s: Staging) -> bool:
        """The first step: the optimizer initialises the chunk's state itself; it is gathered into staging set
        ``s`` (gaps zeroed) and written back like any later step's. False where no parameter of the chunk stepped
        (none had a gradient), so nothing of its state was written."""
        master = s.master if chunk.unit in self.master_units else None
        pairs = self._surrogates(chunk, groups, master, s.grad)
        state: dict[nn.Parameter, dict[str, Any]] = {}
        self._run(pairs, groups, state)
        if not pairs:
            if master is not None:  # nothing stepped: its weights go back unchanged
                n = chunk.hi - chunk.lo
                s.writes.append(self.store.write(self.master.name(chunk.unit), master[:n],  # type: ignore[union-attr]
                                                 chunk.lo * self.dtype.itemsize))
            return False
        if self.keys is None:
            q0 = pairs[0][1]
            self.keys = tuple(k for k, v in state[q0].items() if torch.is_tensor(v) and v.shape == q0.shape
                              and v.ndim > 0)
            self._allocate()
        n = chunk.hi - chunk.lo
        for k in self.keys:
            s.buffers[k][:n].zero_()
        for piece, q in pairs:
            for k in self.keys:
                s.buffers[k][piece.offset - chunk.lo:piece.offset - chunk.lo + q.numel()].copy_(state[q][k])
            self._keep_scalars(piece.param, state[q])
        self._write(chunk, s)
        return True

    def _write_zero_state(self, indices: list[int]) -> None:
        """Zeros for the state of chunks no parameter of which stepped in the first step, so every later step
        reads whole chunks (their parameters still have no gradient there, and the zeros go back unchanged)."""
        assert self.keys is not None
        s, size = self._staging[0], self.dtype.itemsize
        self._wait(s.writes)
        zeros = s.buffers[self.keys[0]].zero_()  # one buffer of zeros, written to every key of every such chunk
        for chunk in (self.chunks[i] for i in indices):
            n = chunk.hi - chunk.lo
            s.writes += [self.store.write(self.name(chunk.unit, k), zeros[:n], chunk.lo * size) for k in self.keys]
            self.bytes_written += n * size * len(self.keys)

    def _chunk_step(self, chunk: Chunk, groups: dict[int, dict[str, Any]], before: dict[int, dict[str, Any]],
                    s: Staging) -> None:
        buffers = s.buffers
        pairs = self._surrogates(chunk, groups, s.master if chunk.unit in self.master_units else None, s.grad)
        assert self.keys is not None
        state: dict[nn.Parameter, dict[str, Any]] = {}
        for piece, q in pairs:
            views = {k: buffers[k][piece.offset - chunk.lo:piece.offset - chunk.lo + q.numel()] for k in self.keys}
            small = before.get(id(piece.param), {})
            state[q] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in small.items()}, **views}
        self._run(pairs, groups, state)
        for piece, q in pairs:
            for k in self.keys:
                view, new = buffers[k][piece.offset - chunk.lo:piece.offset - chunk.lo + q.numel()], state[q][k]
                if new.data_ptr() != view.data_ptr():
                    view.copy_(new)  # an optimizer that replaced the tensor instead of updating it in place
            self._keep_scalars(piece.param, state[q])

    def _keep_scalars(self, p: nn.Parameter, new: dict[str, Any]) -> None:
        """The small per-parameter state (AdamW's ``step``) stays in ``optimizer.state`` (checkpoints see it),
        beside a placeholder per streamed key."""
        assert self.keys is not None
        slot = self.optimizer.state[p]
        for k, v in new.items():
            if k not in self.keys:
                slot[k] = v
            elif not self.is_placeholder(slot.get(k)):
                slot[k] = self._placeholder(p, k)

    # ---- placeholders and whole-tensor access (checkpoints: lightning_elixir.disk_checkpoint) ----------
    def _placeholder(self, p: nn.Parameter, key: str) -> torch.Tensor:
        local = local_of(p)
        stub = torch.zeros((), dtype=self.dtype).expand(local.shape)  # one element of memory
        self.placeholders[stub.untyped_storage().data_ptr()] = (p, key)
        if local is p:
            return stub
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(stub, p.device_mesh, p.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=p.shape, stride=p.stride())

    def adopt_placeholders(self) -> None:
        """After ``optimizer.load_state_dict``: every streamed key of a disk parameter is a registered placeholder
        again (loading may have copied them), and the keys are those the state dict brought."""
        for p in self.params.values():
            slot = self.optimizer.state.get(p, {})
            keys = self.keys or tuple(k for k, v in slot.items() if torch.is_tensor(v) and v.ndim > 0
                                      and v.shape == p.shape)
            if keys and self.keys is None:
                self.keys = keys
            for k in keys:
                if k in slot and not self.is_placeholder(slot[k]):
                    slot[k] = self._placeholder(p, k)

    def is_placeholder(self, t: Any) -> bool:
        return torch.is_tensor(t) and local_of(t).untyped_storage().data_ptr() in self.placeholders

    def owner(self, t: torch.Tensor) -> tuple[nn.Parameter, str]:
        """(parameter, key) of a placeholder (a DTensor's, or its local shard's)."""
        return self.placeholders[local_of(t).untyped_storage().data_ptr()]

    def read_state(self, t: torch.Tensor) -> torch.Tensor:
        """The state a placeholder stands for, read from the store into a new tensor of its local shape."""
        p, key = self.owner(t)
        unit, start = self.where[id(p)]
        local = local_of(p)
        out = aligned_empty(local.numel() * self.dtype.itemsize, self.dtype, tuple(local.shape))
        if local.numel():
            self.store.read_into(self.name(unit, key), out, start * self.dtype.itemsize).result()
            self.bytes_read += out.nbytes
        return out

    def write_state(self, t: torch.Tensor, values: torch.Tensor, element: int = 0) -> None:
        """Write ``values`` (contiguous) over the state a placeholder stands for, from its local ``element``."""
        p, key = self.owner(t)
        unit, start = self.where[id(p)]
        if values.numel():
            self.store.write(self.name(unit, key), values.contiguous(), (start + element) * self.dtype.itemsize
                             ).result()
            self.bytes_written += values.nbytes
