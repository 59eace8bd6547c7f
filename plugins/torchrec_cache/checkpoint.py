"""A cached collection's checkpoints: state dicts and fused optimizer state, always in id order.

The host tables may store their rows in frequency order (``CacheConfig(reorder=True)``) and the
newest rows may sit in device slots; a checkpoint sees neither: the hooks write the slots back before
a state dict is taken, turn position order into id order on the way out and back on the way in, and
make the slots re-read what was loaded. The functions take the collection
(:class:`~torchrec_cache.modules.CachedCollection`) and use only its public face.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchrec_cache.cache import FusedCache
from torchrec_cache.optim import state_names

if TYPE_CHECKING:
    from torchrec_cache.modules import CachedCollection

__all__ = ["flush_before_state_dict", "ids_order_state_dict", "positions_order_on_load", "reload_after_load",
           "id_to_pos", "pos_to_id", "fused_optimizer_state", "load_fused_optimizer_state"]


def flush_before_state_dict(module: Any, prefix: str, keep_vars: bool) -> None:
    """State-dict pre-hook: write the cached rows back so the host tables are current."""
    module.flush_cache()


def ids_order_state_dict(module: CachedCollection, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    """State-dict hook: tables stored in frequency order are written in id order."""
    for name in module.fused_cache.names:
        key = f"{prefix}{module.tables_attr}.{name}.weight"
        if module.is_reordered(name) and key in state_dict:
            state_dict[key] = state_dict[key].detach().index_select(0, id_to_pos(module.fused_cache, name))


def positions_order_on_load(module: CachedCollection, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: id-ordered checkpoints go to the host tables in their position order."""
    for name in module.fused_cache.names:
        key = f"{prefix}{module.tables_attr}.{name}.weight"
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
        state = cache.store.host_state_view(name)
        if cache.store.is_reordered(name):
            state = state.index_select(0, id_to_pos(cache, name))
        dim = cache.specs[cache.index[name]].dim
        entry: dict[str, Any] = {"step": cache.groups[cache.group_of(name)].opt_step}
        if cols:
            parts = state.split(dim, dim=1) if len(cols) == 2 else (state,)
            entry.update({k: v.clone() for k, v in zip(cols, parts)})
        out[name] = entry
    return out


def load_fused_optimizer_state(cache: FusedCache, state: dict[str, dict[str, Any]]) -> None:
    """Inverse of :func:`fused_optimizer_state`."""
    cache.flush()
    for name, entry in state.items():
        cols = state_names(cache.optimizer)
        host = cache.store.host_state_view(name)
        if cols:
            full = torch.cat([entry[k].float().reshape(host.shape[0], -1) for k in cols], dim=1)
            if full.shape != host.shape:
                raise ValueError(f"table {name!r}: optimizer state of shape {tuple(full.shape)} does not fit "
                                 f"{tuple(host.shape)}; was it saved with another optimizer kind?")
            host.copy_(full if not cache.store.is_reordered(name) else full.index_select(0, pos_to_id(cache, name)))
        cache.groups[cache.group_of(name)].opt_step = int(entry.get("step", 0))
    cache.reload()
