"""Parameters on disk between uses: a plan's tier-3 units (``Tier.DISK_PARAMS``) keep their fp32 master weights
in the store, read one unit ahead of the forward and of the backward and dropped after each.

FSDP2's sharded parameters *are* the master weights (it all-gathers, and casts under mixed precision, from them),
so one copy lives on disk: ``<store>/u<i>.master``, each parameter's local shard at the same aligned offset as its
optimizer state (:func:`lightning_elixir.disk_state.flat_layout`), and the streamed optimizer step reads and writes
it with the moments (:class:`~lightning_elixir.disk_state.DiskOptimizerState`). Between uses a unit's shards have
no memory: their storages are resized to zero bytes (the parameter objects, their shapes and the views FSDP2
holds stay; FSDP2 frees its unsharded parameters the same way) and resized back when read.

Hooks, per unit, on its FSDP2 parameter group (the order FSDP2 itself runs, prefetches included):
    * ``unshard`` (pre-forward, pre-backward, FSDP2's own prefetches): waits for the unit's shards, reading them
      first if nobody asked yet, then reads the next tier-3 unit's shards ahead - the next one in forward, the
      previous one in backward - and runs FSDP2's unshard;
    * ``wait_for_unshard``: once FSDP2 has copied the shards into its gathered parameters, drop them: the gathered
      copy is what forward and backward compute with, and the step reads the master weights from the store;
    * ``post_forward`` and ``post_backward``: drop the unit's shards if still held (the first drop writes them to
      the store: until the first step they are the model's initial weights).
Before each optimizer step, :meth:`DiskParameters.settle` drops what is still held, so the step reads the newest
weights from the store and nothing in RAM can go stale.

Host memory: the shards of at most two units at a time (the one being gathered or read ahead, and the one read
ahead of that by FSDP2's prefetch), as the planner counts them (``UnitTerms.fetch``); no buffer of the whole model.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_elixir._torch_adapter import (
    fsdp_param_group,
    gather_started,
    gathers_in_backward,
    group_pass,
    local_tensor,
    storage_key,
    wrap_group_method,
)
from lightning_elixir.disk_layout import wait_all
from tightfit.storage import TensorStore

__all__ = ["MASTER_KEY", "DiskParameters", "fsdp_group"]

MASTER_KEY = "master"  # the store name's key of a tier-3 unit's master weights: u<i>.master


_local = local_tensor  # the local shard FSDP2 holds itself (lightning_elixir._torch_adapter)


def _leaves(tree: Any) -> Iterator[Any]:
    """The leaves of nested tuples, lists and dicts (a torch function's arguments)."""
    if isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _leaves(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _leaves(x)
    else:
        yield tree


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a buffer for the store. Not through ``t.numpy()``: numpy's view
    marks the storage as not resizable for good, and a tier-3 shard's storage is resized to zero between uses."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


@dataclass
class _Unit:
    index: int
    group: Any  # FSDP2's parameter group (None: no hooks, e.g. a unit FSDP2 does not manage)
    pieces: list[tuple[nn.Parameter, int, int]]  # (parameter, first element in the flat buffer, local numel)
    nbytes: dict[int, int] = field(default_factory=dict)  # storage bytes per parameter id, to resize back to
    stored: bool = False  # the store holds this unit's current weights
    blank: bool = False  # allocated never: its first fetch gives memory without reading (initialisation follows)
    resident: bool = True  # its shards have memory (their values valid once ``pending`` is done)
    pending: list[Future[Any]] = field(default_factory=list)


class DiskParameters:
    """Tier-3 units' parameters: in the store between uses, read ahead of each use.

    Args:
        units: ``(plan unit index, FSDP2 parameter group, [(parameter, flat offset, local numel), ...])`` in plan
            order (the forward's order; the backward runs it backwards).
        store: this rank's store (the optimizer state's).

    ``bytes_read`` / ``bytes_written`` count what moved; ``peak_resident`` is the most units held at once.
    """

    def __init__(self, units: Sequence[tuple[int, Any, Sequence[tuple[nn.Parameter, int, int]]]],
                 store: TensorStore) -> None:
        self.store = store
        self.units = [_Unit(i, g, list(pieces)) for i, g, pieces in units]
        self.by_index = {u.index: u for u in self.units}
        self.order = [u.index for u in self.units]
        self.bytes_read = self.bytes_written = 0
        self.fetches = 0
        self.peak_resident = 0
        self._owners: dict[int, tuple[_Unit, nn.Parameter, int]] = {}  # storage id -> (unit, parameter, offset)
        seen: set[int] = set()
        for u in self.units:
            for p, _, _ in u.pieces:
                key = storage_key(p)
                if key in seen:
                    raise ValueError(f"unit {u.index}: two parameters share one storage (tied weights?); a unit "
                                     "whose parameters wait on disk needs its own storage per parameter: keep "
                                     "tied weights in a unit on the host (plan it with allow_disk_params=False)")
                seen.add(key)
        self._undo: list[Callable[[], None]] = []
        for u in self.units:
            if u.group is not None:
                self._wrap(u)

    def name(self, unit: int) -> str:
        """The store name of unit ``unit``'s master weights (a flat buffer)."""
        return f"u{unit}.{MASTER_KEY}"

    @property
    def resident_units(self) -> tuple[int, ...]:
        return tuple(u.index for u in self.units if u.resident)

    # ---- moving one unit ----------------------------------------------------------------------------
    def _write_unit(self, u: _Unit) -> None:
        futures = []
        for p, start, n in u.pieces:
            local = _local(p)
            if n:
                futures.append(self.store.write(self.name(u.index), _raw(local), start * local.element_size()))
                self.bytes_written += n * local.element_size()
        wait_all(futures)  # a DiskFullError surfaces here, before the unit's only copy is dropped
        u.stored = True

    def release(self, index: int) -> None:
        """Drop unit ``index``'s shards (written to the store first if it does not hold them yet)."""
        u = self.by_index[index]
        if not u.resident:
            return
        self._wait(u)
        if not u.stored:
            self._write_unit(u)
        self._free(u)

    def drop_blank(self, index: int) -> None:
        """Drop unit ``index``'s freshly allocated, not yet initialised shards without writing them: its next fetch
        gives them memory again without reading (:meth:`paging`, while the model is initialised unit by unit)."""
        u = self.by_index[index]
        self._wait(u)
        self._free(u)
        u.stored, u.blank = False, True

    def _free(self, u: _Unit) -> None:
        for p, start, _ in u.pieces:
            # Looked up at each drop: loading a checkpoint may have given FSDP2 a new local tensor.
            storage = _local(p).untyped_storage()
            u.nbytes[id(p)] = storage.nbytes()
            self._owners[storage_key(p)] = (u, p, start)
            storage.resize_(0)
        u.resident = False

    @contextmanager
    def paging(self, window: int = 1) -> Iterator[None]:
        """Within: any torch operation on a dropped unit's parameter first brings that unit back (read, or only
        allocated if :meth:`drop_blank` dropped it), and at most ``window`` units are held this way (the least
        recently used one is written and dropped first); on exit the held ones are written and dropped. What runs
        inside sees the whole model, so an initialisation (``reset_parameters``, ``init_weights``) gives the values
        it gives in RAM, with the same random draws in the same order, while host memory holds ``window`` units."""
        if window < 1:
            raise ValueError(f"paging(window={window}): hold at least one unit")
        mode = _PageOnTouch(self, window)
        try:
            with mode:
                yield
        finally:
            for u in mode.held:
                self.release(u.index)

    def fetch(self, index: int) -> None:
        """Start reading unit ``index``'s shards back (nothing to do if they are held or on their way)."""
        u = self.by_index[index]
        if u.resident:
            return
        for p, start, n in u.pieces:
            local = _local(p)
            storage = local.untyped_storage()
            storage.resize_(u.nbytes[id(p)])
            if storage.nbytes() > local.numel() * local.element_size():
                # FSDP2's padding past the local shard (uneven shards): all-gathered, never used; zeroed anyway.
                flat = torch.empty(0, dtype=local.dtype).set_(storage, 0, (storage.nbytes() // local.element_size(),), (1,))
                flat[local.storage_offset() + local.numel():].zero_()
            if n and not u.blank:
                u.pending.append(self.store.read_into(self.name(u.index), _raw(local), start * local.element_size()))
                self.bytes_read += n * local.element_size()
        u.resident, u.blank = True, False
        self.fetches += 1
        self.peak_resident = max(self.peak_resident, len(self.resident_units))

    def _wait(self, u: _Unit) -> None:
        pending, u.pending = u.pending, []
        wait_all(pending)  # a ChecksumError names the file and offset

    def ensure(self, index: int) -> None:
        """Unit ``index``'s shards held and valid (read now if nobody read them ahead)."""
        self.fetch(index)
        self._wait(self.by_index[index])

    def settle(self) -> None:
        """Before an optimizer step: every unit's weights in the store and none held (the step updates the store)."""
        for u in self.units:
            self.release(u.index)

    def mark_stale(self) -> None:
        """After the optimizer step wrote new weights: the store holds them (every unit was released before it)."""
        for u in self.units:
            u.stored = True

    def materialize(self) -> None:
        """Read every unit back and keep it (tests and exports: this holds the whole model)."""
        for u in self.units:
            self.ensure(u.index)

    # ---- reading a parameter whatever its state (checkpoints, digests) -----------------------------------
    def owner(self, t: torch.Tensor) -> tuple[nn.Parameter, int] | None:
        """(parameter, flat offset) of a tier-3 shard ``t`` (a parameter, a DTensor, or a view of its storage)."""
        hit = self._owners.get(storage_key(t))
        return None if hit is None else (hit[1], hit[2])

    def is_released(self, t: torch.Tensor) -> bool:
        hit = self._owners.get(storage_key(t))
        return hit is not None and not hit[0].resident

    def read_parameter(self, t: torch.Tensor) -> torch.Tensor:
        """The values of a released tier-3 shard ``t``, read from the store into a new tensor of its local shape."""
        u, _, start = self._owners[storage_key(t)]
        local = _local(t)
        out = torch.empty(local.shape, dtype=local.dtype)
        if local.numel():
            self.store.read_into(self.name(u.index), out.reshape(-1), start * local.element_size()).result()
            self.bytes_read += out.nbytes
        return out

    def write_parameter(self, t: torch.Tensor, values: torch.Tensor, element: int = 0) -> None:
        """Write ``values`` over a released tier-3 shard ``t`` in the store, from its local ``element`` on."""
        u, _, start = self._owners[storage_key(t)]
        if values.numel():
            self.store.write(self.name(u.index), values.contiguous().reshape(-1),
                             (start + element) * values.element_size()).result()
            self.bytes_written += values.nbytes

    # ---- hooks on FSDP2's parameter groups ------------------------------------------------------------
    def _neighbour(self, index: int, backward: bool) -> int | None:
        k = self.order.index(index) + (-1 if backward else 1)
        return self.order[k] if 0 <= k < len(self.order) else None

    def _gathers(self, index: int, state: str) -> bool:
        """Whether unit ``index``'s group will gather in this pass (a tied lookup does not in backward after its head,
        :mod:`lightning_elixir.tied`): only then are its shards worth reading ahead."""
        group = self.by_index[index].group
        return state != "PRE_BACKWARD" or group is None or gathers_in_backward(group)

    def _wrap(self, u: _Unit) -> None:
        group = u.group

        def wrap(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
            self._undo.append(wrap_group_method(group, name, make))

        def unshard(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                state = group_pass(group)
                skipped = state == "PRE_BACKWARD" and not gathers_in_backward(group)
                if not group.is_unsharded and not gather_started(group) and not skipped:
                    self.ensure(u.index)
                    ahead = self._neighbour(u.index, backward=state == "PRE_BACKWARD")
                    if ahead is not None and state in ("FORWARD", "PRE_BACKWARD") and self._gathers(ahead, state):
                        self.fetch(ahead)  # read while this unit computes
                return original(*args, **kwargs)
            return run

        def then_release(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                self.release(u.index)
                return out
            return run

        def copied(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                if group.is_unsharded:  # the gathered copy is made: the shards wait in the store until the next use
                    self.release(u.index)
                return out
            return run

        wrap("unshard", unshard)
        wrap("wait_for_unshard", copied)
        wrap("post_forward", then_release)
        wrap("post_backward", then_release)

    def held_bytes(self) -> int:
        """Host bytes every unit's shards take when held (what :meth:`close` reads back)."""
        return sum(sum(_local(p).numel() * _local(p).element_size() for p, _, _ in u.pieces) for u in self.units)

    def close(self, read_back: bool = True) -> None:
        """After training: remove the hooks and, with ``read_back``, hold every unit again, so the module is usable
        as it was; each unit's gradients are dropped before its weights come back, so this needs no more memory
        than a step did beside the weights. Without it the weights stay in the store only and the shards hold
        memory that was never read (untouched pages: no host memory), not the weights (the store is the caller's
        to close)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if not read_back:
            self.settle()
            for u in self.units:
                for p, _, _ in u.pieces:
                    p.grad = None
                    # Memory behind every view FSDP2 holds again (a zero-byte storage under a shaped tensor is read
                    # out of bounds), but never read: pages nobody touches take no host memory. The values are not
                    # the weights; the strategy stops the module's forward and checkpoints from using them.
                    _local(p).untyped_storage().resize_(u.nbytes[id(p)])
                u.resident = True
            return
        for u in self.units:
            for p, _, _ in u.pieces:
                p.grad = None
            self.ensure(u.index)


class _PageOnTouch(TorchFunctionMode):
    """:meth:`DiskParameters.paging`'s mode: brings a dropped unit back when an operation touches its shards."""

    def __init__(self, disk: DiskParameters, window: int) -> None:
        super().__init__()
        self.disk, self.window = disk, window
        self.held: list[_Unit] = []  # units this mode brought back, least recently touched first

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in _leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                try:
                    hit = self.disk._owners.get(storage_key(t))
                except (RuntimeError, NotImplementedError):  # a tensor without a storage (sparse, nested)
                    continue
                if hit is not None:
                    self._touch(hit[0])
        return func(*args, **kwargs)

    def _touch(self, u: _Unit) -> None:
        if u in self.held:
            self.held.remove(u)
            self.held.append(u)
            return
        if u.resident:
            return  # held by its hooks or by the caller: not this mode's to drop
        while len(self.held) >= self.window:
            self.disk.release(self.held.pop(0).index)
        self.disk.ensure(u.index)
        u.stored = False  # what runs next may change it: written back when dropped
        self.held.append(u)


def fsdp_group(module: nn.Module, units: Sequence[Any], index: int) -> Any:
    """FSDP2's parameter group of applied unit ``index`` (its first module's, or the root's), or ``None``."""
    unit = units[index]
    owner = unit.modules[0] if unit.modules else module if unit.on_root else None
    if owner is None:
        return None
    return fsdp_param_group(owner)
