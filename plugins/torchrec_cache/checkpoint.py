"""A cached collection's checkpoints: state dicts and fused optimizer state, always in id order.

The host tables may store their rows in frequency order (``CacheConfig(reorder=True)``) and the
newest rows may sit in device slots; a checkpoint sees neither: the hooks write the slots back before
a state dict is taken, turn position order into id order on the way out and back on the way in, and
make the slots re-read what was loaded. The functions take the collection
(:class:`~torchrec_cache.modules.CachedCollection`) and use only its public face.

With a disk tier (``CacheConfig(disk_dir=...)``) the tables are on disk: ``state_dict()`` streams each table
chunk by chunk into a file beside the tier and returns it mapped (``torch.from_file``, copy-on-write, the file
unlinked), so its pages are clean file pages the kernel reclaims under a memory limit and ``torch.save`` writes
from them; the fused optimizer's state comes the same way. ``load_state_dict`` (and loading the optimizer
state) writes the given tensors to disk chunk by chunk: load a saved file with ``torch.load(..., mmap=True)``
to keep it out of memory too. :func:`save_tables` / :func:`load_tables` stream rows and optimizer state between
the live tables and a checkpoint directory (a :class:`tightfit.storage.TensorStore`) one chunk at a time.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tightfit.storage import DiskFullError
from torchrec_cache.cache import FusedCache
from torchrec_cache.optim import state_names

if TYPE_CHECKING:
    from torchrec_cache.modules import CachedCollection

__all__ = ["flush_before_state_dict", "ids_order_state_dict", "positions_order_on_load", "reload_after_load",
           "id_to_pos", "pos_to_id", "fused_optimizer_state", "load_fused_optimizer_state", "save_tables",
           "load_tables", "CHUNK_ROWS"]

# Rows per chunk when a table streams to or from disk (64K rows of dim 128 fp32 with Adam: 96 MiB).
CHUNK_ROWS = 65536


def _table_tensor(cache: FusedCache, name: str, part: int) -> torch.Tensor:
    """Table ``name``'s weights (``part`` 0) or optimizer state (1), in position order, gathered chunk by chunk;
    with a disk tier streamed into a file beside the tier and mapped (:func:`_file_backed`), so the table is
    never in anonymous memory."""
    spec = cache.specs[cache.index[name]]
    chunks = ((w if part == 0 else st) for _, w, st in cache.store.table_chunks(name, CHUNK_ROWS))
    if cache.store.tier is not None:
        return _file_backed(chunks, cache.store.tier.path.parent, f"{name}.{'weight' if part == 0 else 'state'}",
                            spec.dtype if part == 0 else torch.float32, spec.dim if part == 0 else None)
    kept = [c.clone() for c in chunks]
    if not kept:
        return torch.empty(0, spec.dim, dtype=spec.dtype)
    return torch.cat(kept)


def _file_backed(chunks: Iterator[torch.Tensor], directory: Path, what: str, dtype: torch.dtype,
                 width: int | None) -> torch.Tensor:
    """The rows of ``chunks`` written one after the other to a new file in ``directory`` (each chunk synced and
    dropped from the page cache as it goes), then mapped copy-on-write (``torch.from_file``) and unlinked: the
    tensor's pages are clean file pages the kernel can reclaim under a memory limit and read back on use, and the
    file's space is freed with the tensor."""
    fd, path = tempfile.mkstemp(prefix=f"torchrec_cache-{what}-", suffix=".rows", dir=directory)
    rows = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for c in chunks:
                c = c.detach().contiguous()
                width = c.shape[1]
                if c.numel():
                    f.write(c.view(torch.uint8).numpy().data)
                    os.fdatasync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                rows += c.shape[0]
        width = width or 0
        if rows * width == 0:
            return torch.empty(rows, width, dtype=dtype)
        return torch.from_file(path, shared=False, size=rows * width, dtype=dtype).view(rows, width)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise DiskFullError(f"state_dict: {directory} has no room for a copy of {what!r} (the state dict of a "
                                f"disk-backed table is a file there until it is freed); free space there or use "
                                f"checkpoint.save_tables") from err
        raise
    finally:
        os.unlink(path)


def flush_before_state_dict(module: Any, prefix: str, keep_vars: bool) -> None:
    """State-dict pre-hook: write the cached rows back so the host tables are current."""
    module.flush_cache()


def ids_order_state_dict(module: CachedCollection, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    """State-dict hook: tables stored in frequency order are written in id order."""
    cache = module.fused_cache
    for name in cache.names:
        key = f"{prefix}{module.tables_attr}.{name}.weight"
        if cache.store.tier is not None and key in state_dict:
            state_dict[key] = _table_tensor(cache, name, 0)
        if module.is_reordered(name) and key in state_dict:
            state_dict[key] = state_dict[key].detach().index_select(0, id_to_pos(module.fused_cache, name))


def positions_order_on_load(module: CachedCollection, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: id-ordered checkpoints go to the host tables in their position order."""
    cache = module.fused_cache
    if cache.store.tier is not None:
        cache.store.mover.apply_pending()
    for name in cache.names:
        key = f"{prefix}{module.tables_attr}.{name}.weight"
        if cache.store.tier is not None and key in state_dict:
            w = state_dict[key]
            spec = cache.specs[cache.index[name]]
            if isinstance(w, torch.Tensor) and w.device.type != "meta" and tuple(w.shape) == (spec.rows, spec.dim):
                for lo in range(0, spec.rows, CHUNK_ROWS):
                    cache.store.write_table_chunk(name, lo, w[lo:lo + CHUNK_ROWS].detach().cpu(), None)
                state_dict[key] = torch.empty(w.shape, dtype=w.dtype, device="meta")  # loaded: the meta weight
            continue
        if module.is_reordered(name) and key in state_dict:
            state_dict[key] = state_dict[key].index_select(0, pos_to_id(module.fused_cache, name).to(
                state_dict[key].device))


def reload_after_load(module: CachedCollection, incompatible_keys: Any) -> None:
    """Load post-hook: the slots re-read the rows that were just loaded."""
    module.fused_cache.reload()


def id_to_pos(cache: FusedCache, name: str) -> torch.Tensor:
    """Host position of each id of table ``name`` of a :class:`~torchrec_cache.cache.FusedCache` (identity
    unless reordered)."""
    return _table_permutation(cache, name, "remap")


def pos_to_id(cache: FusedCache, name: str) -> torch.Tensor:
    """Id held at each host position of table ``name`` (the inverse of :func:`id_to_pos`)."""
    return _table_permutation(cache, name, "order")


def _table_permutation(cache: FusedCache, name: str, which: str) -> torch.Tensor:
    """``name``'s slice of its group's ``remap`` or ``order`` permutation, in table-local numbers."""
    g = cache.groups[cache.group_of(name)]
    first = cache.key_start(name) - g.key_lo
    n = cache.specs[cache.index[name]].rows
    perm = getattr(g, which)
    assert perm is not None
    return perm[first:first + n] - first


def fused_optimizer_state(cache: FusedCache) -> dict[str, dict[str, Any]]:
    """Per table: the fused optimizer's state tensors in id order (names as in the PyTorch optimizer's
    state: ``sum`` for Adagrad, ``exp_avg``/``exp_avg_sq`` for Adam) and ``step``."""
    cache.flush()
    out: dict[str, dict[str, Any]] = {}
    for name in cache.names:
        cols = state_names(cache.optimizer)
        state = cache.store.host_state_view(name) if cache.store.tier is None else _table_tensor(cache, name, 1)
        if cache.store.is_reordered(name):
            state = state.index_select(0, id_to_pos(cache, name))
        dim = cache.specs[cache.index[name]].dim
        entry: dict[str, Any] = {"step": cache.groups[cache.group_of(name)].opt_step}
        if cols:
            parts = state.split(dim, dim=1) if len(cols) == 2 else (state,)
            fresh = cache.store.tier is not None  # streamed to a file of its own: views of it, not copies
            entry.update({k: v if fresh else v.clone() for k, v in zip(cols, parts)})
        out[name] = entry
    return out


def load_fused_optimizer_state(cache: FusedCache, state: dict[str, dict[str, Any]]) -> None:
    """Inverse of :func:`fused_optimizer_state`."""
    cache.flush()
    for name, entry in state.items():
        cols = state_names(cache.optimizer)
        if cache.store.tier is not None:
            _load_state_tier(cache, name, entry, cols)
            cache.groups[cache.group_of(name)].opt_step = int(entry.get("step", 0))
            continue
        host = cache.store.host_state_view(name)
        if cols:
            full = torch.cat([entry[k].float().reshape(host.shape[0], -1) for k in cols], dim=1)
            if full.shape != host.shape:
                raise ValueError(f"table {name!r}: optimizer state of shape {tuple(full.shape)} does not fit "
                                 f"{tuple(host.shape)}; was it saved with another optimizer kind?")
            host.copy_(full if not cache.store.is_reordered(name) else full.index_select(0, pos_to_id(cache, name)))
        cache.groups[cache.group_of(name)].opt_step = int(entry.get("step", 0))
    cache.reload()


def _load_state_tier(cache: FusedCache, name: str, entry: dict[str, Any], cols: tuple[str, ...]) -> None:
    spec = cache.specs[cache.index[name]]
    if not cols:
        return
    given = [entry[k].reshape(spec.rows, -1) for k in cols]  # streamed: a chunk of rows at a time in memory
    width = sum(g.shape[1] for g in given)
    for lo, w, st in cache.store.table_chunks(name, CHUNK_ROWS):  # each chunk read before it is rewritten
        if width != st.shape[1]:
            raise ValueError(f"table {name!r}: optimizer state of shape {(spec.rows, width)} does not fit "
                             f"({spec.rows}, {st.shape[1]}); was it saved with another optimizer kind?")
        cache.store.write_table_chunk(name, lo, w, torch.cat([g[lo:lo + w.shape[0]].float() for g in given], dim=1))


def save_tables(module: CachedCollection, path: str, *, chunk_rows: int = CHUNK_ROWS) -> None:
    """Write every table's rows and optimizer state (id order) and each group's step to a new checkpoint
    directory ``path`` (a :class:`tightfit.storage.TensorStore`), one chunk of rows at a time: with a disk
    tier no table is ever wholly in memory. Durable when it returns."""
    from tightfit.storage import TensorStore

    cache = module.fused_cache
    cache.flush()
    with TensorStore(path) as store:
        for name in cache.names:
            if cache.store.is_reordered(name):
                raise ValueError(f"save_tables: table {name!r} is stored in frequency order (reorder=True); use "
                                 "state_dict() for reordered tables")
            futures = []
            for lo, w, st in cache.store.table_chunks(name, chunk_rows):
                w, st = w.contiguous().clone(), st.contiguous().clone()
                futures.append(store.write(f"{name}.weight", w, offset=lo * w[:1].nbytes))
                if st.shape[1]:
                    futures.append(store.write(f"{name}.state", st, offset=lo * st[:1].nbytes))
                for f in futures:
                    f.result()
                futures.clear()
            store.put(f"{name}.step", torch.tensor([cache.groups[cache.group_of(name)].opt_step]))


def load_tables(module: CachedCollection, path: str, *, chunk_rows: int = CHUNK_ROWS) -> None:
    """Inverse of :func:`save_tables`: rows and state stream from ``path`` into the live tables chunk by chunk;
    a checkpoint whose sizes do not match the collection is refused naming the table."""
    from tightfit.storage import TensorStore, aligned_empty

    cache = module.fused_cache
    cache.store.mover.apply_pending()
    with TensorStore(path) as store:
        for name in cache.names:
            spec = cache.specs[cache.index[name]]
            cols = cache.optimizer.state_columns(spec.dim) if cache.optimizer is not None else 0
            wb = spec.dim * torch.empty((), dtype=spec.dtype).element_size()
            have = store.nbytes(f"{name}.weight") if f"{name}.weight" in store else -1
            if have != spec.rows * wb or (cols and store.nbytes(f"{name}.state") != spec.rows * cols * 4):
                raise ValueError(f"load_tables: checkpoint {path} holds {have} bytes of table {name!r}, which needs "
                                 f"{spec.rows * wb} ({spec.rows} rows of dim {spec.dim}) with {cols} state columns; "
                                 "load a checkpoint saved from the same tables and optimizer")
            for lo in range(0, spec.rows, chunk_rows):
                k = min(chunk_rows, spec.rows - lo)
                w = aligned_empty(k * wb, spec.dtype, (k, spec.dim))
                store.read_into(f"{name}.weight", w, offset=lo * wb).result()
                st = None
                if cols:
                    st = aligned_empty(k * cols * 4, torch.float32, (k, cols))
                    store.read_into(f"{name}.state", st, offset=lo * cols * 4).result()
                cache.store.write_table_chunk(name, lo, w, st if st is not None else torch.zeros(k, 0))
            cache.groups[cache.group_of(name)].opt_step = int(store.get(f"{name}.step")[0])
    cache.reload()
