"""Cache-backed drop-ins for TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection``.

The full tables stay in host memory as the collection's parameters (same names as TorchRec's, so
state dicts move both ways); a :class:`~torchrec_cache.cache.TableCache` per table keeps the hot
rows on the device. A lookup gathers the batch's unique rows into a small (U x dim) block and pools
over it with ``F.embedding_bag``; the backward pass sums each unique row's gradient and either
applies the fused :class:`~torchrec_cache.config.RowOptimizer` to it where the row lives (slot or
host), or hands a sparse gradient to the host table for a standard optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from tightfit.planner.cache import CacheTableSpec, plan_cache
from tightfit.units import parse_bytes
from torchrec_cache.cache import STAT_KEYS, TableCache
from torchrec_cache.config import CacheConfig
from torchrec_cache.frequency import FrequencyStats
from torchrec_cache.lookup import _CachedLookup, _offsets
from torchrec_cache.optim import state_names

__all__ = ["CachedEmbeddingBagCollection", "CachedEmbeddingCollection"]


class _HostTable(nn.Module):
    """One full table in host memory. ``.to(device)`` leaves it where it is: only the cache moves."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, requires_grad: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype), requires_grad=requires_grad)

    def _apply(self, fn: Any, recurse: bool = True) -> _HostTable:  # type: ignore[override]
        return self

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, host memory"


class _CachedCollection(nn.Module):
    """What both collections share: host tables, caches, state-dict hooks, stats, optimizer state."""

    _tables_attr = "embedding_bags"

    def _setup(self, tables: list[Any], device: torch.device | str | None, cache: CacheConfig,
               frequencies: FrequencyStats | None) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "meta":
            raise ValueError("a cached collection keeps its full tables in host memory and cannot be built on the "
                             "meta device; build it with device='cpu' or 'cuda' (the cache's device)")
        if cache.needs_frequencies() and frequencies is None:
            raise ValueError(f"CacheConfig(policy={cache.policy!r}, reorder={cache.reorder}) needs frequency "
                             "statistics: pass frequencies=collect_frequencies(loader, tables)")
        if frequencies is not None:
            frequencies.check(tables)
        names = set()
        for cfg in tables:
            if cfg.name in names:
                raise ValueError(f"Duplicate table name {cfg.name}")
            names.add(cfg.name)
            if not cfg.feature_names:
                cfg.feature_names = [cfg.name]
        self._cache_config = cache
        self._frequencies = frequencies
        self._device = device
        self._anchor = torch.zeros((), device=device, requires_grad=True)  # ties fused lookups into autograd
        slots = self._capacities(tables, cache, frequencies)
        host = nn.ModuleDict()
        caches = nn.ModuleDict()
        for cfg in tables:
            dtype = torch.float32 if cfg.data_type == DataType.FP32 else torch.float16
            table = _HostTable(cfg.num_embeddings, cfg.embedding_dim, dtype, requires_grad=cache.optimizer is None)
            if cfg.init_fn is not None:
                with torch.no_grad():
                    cfg.init_fn(table.weight)
            host[cfg.name] = table
            counts = frequencies.counts[cfg.name] if frequencies is not None else None
            remap = order = None
            if cache.reorder and counts is not None:
                order = frequencies.order(cfg.name)  # type: ignore[union-attr]
                remap = torch.empty_like(order)
                remap[order] = torch.arange(order.numel())
                with torch.no_grad():
                    table.weight.copy_(table.weight.index_select(0, order))
                counts = counts.index_select(0, order)
            caches[cfg.name] = TableCache(
                name=cfg.name, host_table=table, capacity=slots[cfg.name], policy=cache.policy,
                optimizer=cache.optimizer, device=device, static_freq=counts,
                prior_counts=counts if cache.policy == "lfu" else None, remap=remap)
            caches[cfg.name].order = order
        setattr(self, self._tables_attr, host)
        self._caches = caches
        if frequencies is not None and cache.warmup:
            for cfg in tables:
                hot = frequencies.hottest(cfg.name, caches[cfg.name].capacity)
                c = caches[cfg.name]
                c.warm(c.remap.index_select(0, hot.to(device)) if c.remap is not None else hot)
        if cache.pin_memory or (cache.pin_memory is None and device.type == "cuda"):
            for c in caches.values():
                c.pin_host_memory()
        self.register_state_dict_pre_hook(_flush_before_state_dict)
        self._register_state_dict_hook(_ids_order_state_dict)
        self._register_load_state_dict_pre_hook(_positions_order_on_load, with_module=True)
        self.register_load_state_dict_post_hook(_reload_after_load)

    @staticmethod
    def _capacities(tables: list[Any], cache: CacheConfig, frequencies: FrequencyStats | None) -> dict[str, int]:
        kind = cache.capacity_kind()
        if kind == "ratio":
            return {c.name: max(1, int(round(c.num_embeddings * float(cache.capacity)))) for c in tables}
        if kind == "rows":
            return {c.name: min(int(cache.capacity), c.num_embeddings) for c in tables}
        specs = [CacheTableSpec(name=c.name, rows=c.num_embeddings, dim=c.embedding_dim,
                                weight_bytes=4 if c.data_type == DataType.FP32 else 2,
                                state_columns=cache.optimizer.state_columns(c.embedding_dim) if cache.optimizer else 0)
                 for c in tables]
        plan = plan_cache(specs, budget_bytes=parse_bytes(cache.capacity),
                          frequencies=frequencies.counts if frequencies is not None else None)
        return plan.slots

    def _apply(self, fn: Any, recurse: bool = True) -> _CachedCollection:  # type: ignore[override]
        super()._apply(fn, recurse)
        self._anchor = fn(self._anchor.detach()).requires_grad_(True)
        self._device = self._anchor.device
        if self._device.type == "cuda" and self._cache_config.pin_memory is not False:
            for c in self._caches.values():
                c.pin_host_memory()
        return self

    # ------------------------------------------------------------------ lookups
    def _lookup(self, name: str, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                mode: str) -> torch.Tensor:
        cache: TableCache = self._caches[name]
        batch = cache.prepare(values)
        anchor = self._anchor if cache.fused else cache.host_weight
        dev = cache.device
        w = weights.to(dev) if weights is not None else None
        return _CachedLookup.apply(anchor, cache, batch, offsets.to(dev), w, mode)

    def prefetch(self, features: KeyedJaggedTensor, ahead: int = 1) -> None:
        """Load the rows of a batch that runs ``ahead`` forwards from now, and pin them until then."""
        jts = features.to_dict()
        for cfg in self._configs():
            values = [jts[f].values() for f in cfg.feature_names if f in jts]
            if values:
                c = self._caches[cfg.name]
                c.prepare(torch.cat(values), pin_until=c.step + ahead, count=False)

    # ------------------------------------------------------------------ stats and optimizer state
    def resident_rows(self, table: str) -> torch.Tensor:
        """Ids of ``table`` now on the device (sorted)."""
        c: TableCache = self._caches[table]
        rows = c.resident_rows().cpu()
        return torch.sort(c.order.index_select(0, rows) if c.order is not None else rows).values

    def cache_stats(self, per_table: bool = False) -> dict[str, Any]:
        """Totals since construction (or :meth:`reset_cache_stats`): hit rate, misses, rows and bytes moved.

        Keys: ``hit_rate``, ``last_hit_rate`` (the last step), the counters of
        :data:`torchrec_cache.cache.STAT_KEYS`, ``last_*`` for the last step, and ``tables`` (per table)
        when ``per_table``.
        """
        total = dict.fromkeys(STAT_KEYS, 0)
        last = dict.fromkeys(STAT_KEYS, 0)
        for c in self._caches.values():
            for k in STAT_KEYS:
                total[k] += c.stats[k]
                last[k] += c.last_step[k]
        total["steps"] = max((c.stats["steps"] for c in self._caches.values()), default=0)
        out: dict[str, Any] = {"hit_rate": total["hits"] / total["lookups"] if total["lookups"] else 0.0,
                               "last_hit_rate": last["hits"] / last["lookups"] if last["lookups"] else 0.0}
        out.update(total)
        out.update({f"last_{k}": v for k, v in last.items() if k != "steps"})
        if per_table:
            out["tables"] = {n: dict(c.stats) for n, c in self._caches.items()}
        return out

    def reset_cache_stats(self) -> None:
        for c in self._caches.values():
            c.stats = dict.fromkeys(STAT_KEYS, 0)

    def flush_cache(self) -> None:
        """Write every cached row (weights, optimizer state, counts) back to host memory."""
        for c in self._caches.values():
            c.flush()

    def fused_optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Per table: the fused optimizer's state tensors in id order (names as in the PyTorch optimizer's
        state: ``sum`` for Adagrad, ``exp_avg``/``exp_avg_sq`` for Adam) and ``step``."""
        self.flush_cache()
        out: dict[str, dict[str, Any]] = {}
        for name, c in self._caches.items():
            cols = state_names(c.optimizer)
            state = c.host_state if c.order is None else c.host_state.index_select(0, c.remap.cpu())
            entry: dict[str, Any] = {"step": c.opt_step}
            if cols:
                parts = state.split(c.dim, dim=1) if len(cols) == 2 else (state,)
                entry.update({k: v.clone() for k, v in zip(cols, parts)})
            out[name] = entry
        return out

    def load_fused_optimizer_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Inverse of :meth:`fused_optimizer_state`."""
        for name, entry in state.items():
            c = self._caches[name]
            cols = state_names(c.optimizer)
            if cols:
                full = torch.cat([entry[k].float() for k in cols], dim=1)
                if full.shape != c.host_state.shape:
                    raise ValueError(f"table {name!r}: optimizer state of shape {tuple(full.shape)} does not fit "
                                     f"{tuple(c.host_state.shape)}; was it saved with another optimizer kind?")
                c.host_state.copy_(full if c.order is None else full.index_select(0, c.order))
            c.opt_step = int(entry.get("step", 0))
            c.reload()

    @property
    def device(self) -> torch.device:
        return self._device

    def cache_config(self) -> CacheConfig:
        return self._cache_config

    def _configs(self) -> list[Any]:  # pragma: no cover - overridden
        raise NotImplementedError


def _flush_before_state_dict(module: _CachedCollection, prefix: str, keep_vars: bool) -> None:
    module.flush_cache()


def _ids_order_state_dict(module: _CachedCollection, state_dict: dict[str, Any], prefix: str,
                          local_metadata: Any) -> None:
    for name, c in module._caches.items():
        key = f"{prefix}{module._tables_attr}.{name}.weight"
        if c.remap is not None and key in state_dict:
            state_dict[key] = state_dict[key].detach().index_select(0, c.remap.cpu())


def _positions_order_on_load(module: _CachedCollection, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for name, c in module._caches.items():
        key = f"{prefix}{module._tables_attr}.{name}.weight"
        if c.order is not None and key in state_dict:
            state_dict[key] = state_dict[key].index_select(0, c.order.to(state_dict[key].device))


def _reload_after_load(module: _CachedCollection, incompatible_keys: Any) -> None:
    for c in module._caches.values():
        c.reload()


class CachedEmbeddingBagCollection(_CachedCollection, EmbeddingBagCollectionInterface):
    """``torchrec.EmbeddingBagCollection`` with the full tables in host memory and the hot rows cached on the device.

    Args:
        tables: the ``EmbeddingBagConfig`` list, as for ``EmbeddingBagCollection``.
        is_weighted: whether the input ``KeyedJaggedTensor`` carries per-id weights.
        device: where the cache (and the output) lives; the full tables always stay in host memory.
        cache: the :class:`~torchrec_cache.config.CacheConfig` (capacity, policy, optimizer...).
        frequencies: :class:`~torchrec_cache.frequency.FrequencyStats` to warm the cache and rank rows.

    Example:
        >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        >>> ebc = CachedEmbeddingBagCollection(
        ...     tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])],
        ...     cache=CacheConfig(capacity=0.1))
        >>> kt = ebc(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3]), torch.tensor([1, 2])))
        >>> kt.values().shape
        torch.Size([2, 4])
    """

    _tables_attr = "embedding_bags"

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool = False,
                 device: torch.device | str | None = None, *, cache: CacheConfig | None = None,
                 frequencies: FrequencyStats | None = None) -> None:
        super().__init__()
        self._is_weighted = is_weighted
        self._embedding_bag_configs = tables
        self._setup(tables, device, cache or CacheConfig(), frequencies)
        self._lengths_per_embedding = [c.embedding_dim for c in tables for _ in c.feature_names]
        self._embedding_names = [n for names in get_embedding_names_by_table(tables) for n in names]
        self._feature_names = [list(c.feature_names) for c in tables]
        for cfg in tables:
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {cfg.name!r}: pooling {cfg.pooling} is not supported by a bag collection; "
                                 "use PoolingType.SUM or MEAN (or CachedEmbeddingCollection for unpooled lookups)")

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if features.variable_stride_per_key():
            raise NotImplementedError("variable batch size per feature (VBE) is not supported by the cached "
                                      "collection; give every feature the same stride")
        jts = features.to_dict()
        batch_size = features.stride()
        pooled: list[torch.Tensor] = []
        for cfg, names in zip(self._embedding_bag_configs, self._feature_names):
            parts = [jts[f] for f in names]
            values = torch.cat([p.values() for p in parts])
            offsets = _offsets(torch.cat([p.lengths() for p in parts]))
            weights = torch.cat([p.weights() for p in parts]) if self._is_weighted else None
            mode = "mean" if cfg.pooling == PoolingType.MEAN else "sum"
            out = self._lookup(cfg.name, values, offsets, weights, mode)
            pooled.extend(out.split(batch_size))
        return KeyedTensor(keys=self._embedding_names, values=torch.cat(pooled, dim=1),
                           length_per_key=self._lengths_per_embedding)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def _configs(self) -> list[Any]:
        return self._embedding_bag_configs


class CachedEmbeddingCollection(_CachedCollection):
    """``torchrec.EmbeddingCollection`` (unpooled lookups) backed by the same cache.

    Args:
        tables: the ``EmbeddingConfig`` list (one embedding dim for all, as TorchRec requires).
        device: where the cache (and the output) lives.
        need_indices: put the ids in the output ``JaggedTensor``'s weights, as TorchRec does.
        cache: the :class:`~torchrec_cache.config.CacheConfig`.
        frequencies: optional :class:`~torchrec_cache.frequency.FrequencyStats`.
    """

    _tables_attr = "embeddings"

    def __init__(self, tables: list[EmbeddingConfig], device: torch.device | str | None = None,
                 need_indices: bool = False, *, cache: CacheConfig | None = None,
                 frequencies: FrequencyStats | None = None) -> None:
        super().__init__()
        dims = {c.embedding_dim for c in tables}
        if len(dims) > 1:
            raise ValueError(f"All tables in a EmbeddingCollection are required to have same embedding dimension; "
                             f"got {sorted(dims)}")
        self._embedding_configs = tables
        self._need_indices = need_indices
        self._embedding_dim = dims.pop() if dims else -1
        self._setup(tables, device, cache or CacheConfig(), frequencies)
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._feature_names = [list(c.feature_names) for c in tables]

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        jts = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for cfg, names, emb_names in zip(self._embedding_configs, self._feature_names,
                                         self._embedding_names_by_table):
            parts = [jts[f] for f in names]
            values = torch.cat([p.values() for p in parts])
            # One bag per id: an unpooled lookup is a pooled one over bags of length 1.
            offsets = torch.arange(values.numel() + 1, device=values.device)
            looked = self._lookup(cfg.name, values, offsets, None, "sum")
            for part, emb_name, chunk in zip(parts, emb_names, looked.split([p.values().numel() for p in parts])):
                out[emb_name] = JaggedTensor(values=chunk, lengths=part.lengths(),
                                             weights=part.values() if self._need_indices else None)
        return out

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table

    def _configs(self) -> list[Any]:
        return self._embedding_configs


_ = BaseEmbeddingConfig  # re-exported type for annotations in swap.py
