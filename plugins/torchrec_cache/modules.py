"""Cache-backed drop-ins for TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection``.

The full tables stay in host memory as the collection's parameters (same names as TorchRec's, so
state dicts move both ways; each is a view of one flat host tensor per embedding dim); one
:class:`~torchrec_cache.cache.FusedCache` per collection keeps the hot rows of every table on the
device. A lookup resolves the whole batch at once, gathers its unique rows into a (U x dim) block and
pools every bag with one ``F.embedding_bag``; the backward pass sums each unique row's gradient and
either applies the fused :class:`~torchrec_cache.config.RowOptimizer` to it where the row lives (slot
or host), or hands a sparse gradient to the host tables for a standard optimizer.
"""

# No ``from __future__ import annotations``: torch.fx and TorchScript read ``forward``'s and the leaves' types.

import weakref
from typing import Any, cast

import torch
from torch import nn
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

import torchrec_cache.checkpoint as checkpoint
from torchrec_cache.cache import FusedCache
from torchrec_cache.config import CacheConfig
from torchrec_cache.frequency import FrequencyStats
from torchrec_cache.keyed import CachedFusedOptimizer
from torchrec_cache.layout import check_table_names, column_order, group_feature_spans
from torchrec_cache.lookup import cached_pooled_lookup, cached_unpooled_lookup, prepare_batch
from torchrec_cache.meta import meta_pooled, meta_sequence
from torchrec_cache.planning import fused_cache_for
from torchrec_cache.window import Window

__all__ = ["CachedEmbeddingBagCollection", "CachedEmbeddingCollection", "CachedCollection", "HostTable",
           "cached_collection_forward", "cached_sequence_forward"]

_LIVE: "weakref.WeakValueDictionary[int, CachedCollection]" = weakref.WeakValueDictionary()


@torch.fx.wrap
@torch.jit.ignore
def cached_collection_forward(features: KeyedJaggedTensor, handle: int) -> KeyedTensor:
    """A :class:`CachedEmbeddingBagCollection`'s whole lookup as one call, the leaf ``torch.fx`` records.

    The cache's decisions are data-dependent and its state (index, policy, host store) is Python-side, so
    tracing stops here (TorchRec's train pipelines look for the call); ``torch.jit.script`` of a traced
    graph keeps it as a Python call (``torch.jit.ignore``): it runs in this process, it cannot be saved.
    ``handle``: :meth:`CachedCollection.handle` of the calling collection."""
    return _LIVE[handle].lookup(features)


@torch.fx.wrap
@torch.jit.ignore
def cached_sequence_forward(features: KeyedJaggedTensor, handle: int) -> dict[str, JaggedTensor]:
    """:func:`cached_collection_forward` for a :class:`CachedEmbeddingCollection` (unpooled lookups)."""
    return _LIVE[handle].lookup(features)


class HostTable(nn.Module):
    """One full table in host memory. ``.to(device)`` leaves it where it is: only the cache moves."""

    def __init__(self, weight: torch.Tensor, requires_grad: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)

    def _apply(self, fn: Any, recurse: bool = True) -> "HostTable":  # type: ignore[override]
        return self

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, host memory"


class CachedCollection(FusedOptimizerModule, nn.Module):
    """What both collections share: host tables, the fused cache, state-dict hooks, stats, optimizer state."""

    _tables_attr = "embedding_bags"

    def _setup(self, tables: list[Any], device: torch.device | str | None, cache: CacheConfig,
               frequencies: FrequencyStats | None) -> None:
        # No device: the default one, as TorchRec's collections take it (``with torch.device("meta"):``).
        # The host-side state is then built on the CPU whatever the default device is.
        resolved = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("cpu"):
            self._build(tables, resolved, cache, frequencies)

    def _build(self, tables: list[Any], device: torch.device, cache: CacheConfig,
               frequencies: FrequencyStats | None) -> None:
        if cache.needs_frequencies() and frequencies is None:
            raise ValueError(f"CacheConfig(policy={cache.policy!r}, reorder={cache.reorder}) needs frequency "
                             "statistics: pass frequencies=collect_frequencies(loader, tables)")
        if frequencies is not None:
            frequencies.check(tables)
        check_table_names(tables)
        self._cache_config = cache
        self._frequencies = frequencies
        self._device = device
        self._anchor = torch.zeros((), device=device, requires_grad=True)  # ties fused lookups into autograd
        self._cache = fused_cache_for(tables, cache, frequencies, device)
        host = nn.ModuleDict()
        for cfg in tables:
            host[cfg.name] = HostTable(self._cache.store.host_view(cfg.name), requires_grad=cache.optimizer is None)
        setattr(self, self._tables_attr, host)
        # Features in key order: the tables of one slot tensor are contiguous, so are their features.
        order = [tables[i] for i in self._cache.layout]
        self._fused_features = [f for c in order for f in c.feature_names]
        self._feature_table_host = torch.tensor([self._cache.index[c.name] for c in order for _ in c.feature_names],
                                                dtype=torch.int64)
        self._mean_host = torch.tensor([getattr(c, "pooling", PoolingType.SUM) == PoolingType.MEAN
                                        for c in order for _ in c.feature_names], dtype=torch.bool)
        self._feature_table = self._feature_table_host.to(device)
        self._mean = self._mean_host.to(device)
        self._group_features = group_feature_spans(self._cache.groups, tables)
        self._materialized = device.type != "meta"
        if self._materialized:
            self._initialise_host(tables)
        self.register_state_dict_pre_hook(checkpoint.flush_before_state_dict)
        self._register_state_dict_hook(checkpoint.ids_order_state_dict)
        self._register_load_state_dict_pre_hook(checkpoint.positions_order_on_load, with_module=True)
        self.register_load_state_dict_post_hook(checkpoint.reload_after_load)

    def _initialise_host(self, tables: list[Any]) -> None:
        """Run the tables' init functions, store rows in frequency order, seed the policy, warm the cache."""
        cache, freq, cfg = self._cache, self._frequencies, self._cache_config
        with torch.no_grad():
            if cache.store.tier is not None:  # rows on disk: each table's init_fn runs chunk by chunk
                cache.store.init_tier({t.name: t.init_fn for t in tables})
            for t in tables:
                if t.init_fn is not None and cache.store.tier is None:
                    t.init_fn(self._host_tables()[t.name].weight)
        if cfg.reorder and freq is not None:
            for t in tables:
                cache.store.set_reorder(t.name, freq.order(t.name))
        if freq is not None and cfg.policy != "lru":
            cache.seed_frequencies(freq.counts)
        hottest = ({t.name: freq.hottest(t.name, cache.capacity[t.name]) for t in tables}
                   if freq is not None and cfg.warmup else None)
        cache.finish_setup(hottest)
        if cfg.pin_memory or (cfg.pin_memory is None and self._device.type == "cuda"):
            self._pin()

    def _pin(self) -> None:
        if self._cache.pin_host_memory():
            for name, table in self._host_tables().items():
                table.weight.data = self._cache.store.host_view(name)
            self._cache.store.mark_host_changed()

    def _host_tables(self) -> nn.ModuleDict:
        return getattr(self, self._tables_attr)

    def lookup(self, features: KeyedJaggedTensor) -> Any:
        """The cached lookup (each collection type defines it)."""
        raise NotImplementedError

    def handle(self) -> int:
        """This collection's key for :func:`cached_collection_forward` (registered at every call, so a
        deep copy, e.g. inside ``DistributedModelParallel``, looks itself up, not its original). A traced
        graph keeps the key of the collection it was traced from: keep that model alive beside it."""
        key = id(self)
        _LIVE[key] = self
        return key

    def host_tables(self) -> nn.ModuleDict:
        """Table name -> :class:`HostTable` (the full tables in host memory)."""
        return self._host_tables()

    @property
    def tables_attr(self) -> str:
        """The attribute holding the host tables (``embedding_bags`` or ``embeddings``, as in TorchRec)."""
        return self._tables_attr

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The fused optimizer's state as a TorchRec ``KeyedOptimizer`` (empty without a fused optimizer)."""
        if self._cache_config.optimizer is None:
            return EmptyFusedOptimizer()
        return CachedFusedOptimizer(self)

    def init_parameters(self) -> None:
        """(Re)initialise the tables with their ``init_fn`` and empty the cache (after ``to_empty``)."""
        self._initialise_host(self._configs())

    reset_parameters = init_parameters

    def _apply(self, fn: Any, recurse: bool = True) -> "CachedCollection":  # type: ignore[override]
        # A materialised cache's slots and index survive an ``fn`` that drops values (``to_empty``); one that keeps
        # them (``.to``, ``.cpu()``, ``.double()``) is applied without a copy. A probe tells the two apart.
        probe = torch.tensor([0.375, -2.25])
        out = fn(probe)
        drops = out.is_meta or not torch.equal(out.detach().cpu().float(), probe)
        kept = [b.detach().clone() for b in self._cache.buffers()] if self._materialized and drops else []
        super()._apply(fn, recurse)
        with torch.no_grad():
            for b, old in zip(self._cache.buffers(), kept):
                b.copy_(old)
        self._anchor = fn(self._anchor.detach()).requires_grad_(True)
        self._device = self._anchor.device
        self._feature_table = self._feature_table_host.to(self._device)
        self._mean = self._mean_host.to(self._device)
        if not self._materialized and self._device.type != "meta":
            # ``to_empty`` (or ``.to``) off the meta device: the host tables materialise, uninitialised,
            # and the cache starts empty; ``init_parameters()`` or ``load_state_dict`` fills them.
            self._cache.materialize_host()
            for name, table in self._host_tables().items():
                table.weight = nn.Parameter(self._cache.store.host_view(name),
                                            requires_grad=bool(table.weight.requires_grad))
            self._cache.finish_setup()
            self._materialized = True
        elif self._device.type == "cuda" and self._cache_config.pin_memory is not False:
            self._pin()
        return self

    # ------------------------------------------------------------------ lookups
    def _check_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if not self._materialized:
            raise RuntimeError("the cached collection was built on the meta device; materialise it first with "
                               "module.to_empty(device=...) and init_parameters() or load_state_dict(...)")
        if features.variable_stride_per_key():
            raise NotImplementedError("variable batch size per feature (VBE) is not supported by the cached "
                                      "collection; give every feature the same stride")
        values = features.values()
        if values.is_floating_point() or values.dtype == torch.bool:
            raise TypeError(f"KeyedJaggedTensor values must be integer ids, got dtype {values.dtype}; a float id "
                            "such as 1.7 is not a row: cast the feature to int64 before the lookup")
        keys = features.keys()
        if keys != self._fused_features:
            missing = [f for f in self._fused_features if f not in keys]
            if missing:
                raise KeyError(f"the batch has no feature(s) {missing}; this collection reads {self._fused_features}")
            features = features.permute([keys.index(f) for f in self._fused_features])
        return features

    def _prepare(self, kjt: KeyedJaggedTensor) -> Any:
        return prepare_batch(self._cache, kjt.values(), kjt.lengths(), self._feature_table,
                             value_bounds=self._bounds(kjt))

    def _host_params(self) -> list[list[torch.Tensor]] | None:
        if self._cache.fused:
            return None
        tables = self._host_tables()
        return [[cast(torch.Tensor, tables[self._cache.names[i]].weight) for i in g.tables] for g in self._cache.groups]

    def prefetch(self, features: KeyedJaggedTensor, ahead: int = 1, *, until: int | None = None,
                 window: list[tuple[int, KeyedJaggedTensor]] | None = None) -> None:
        """Load the rows of a batch that runs ``ahead`` forwards from now (or at forward number ``until``),
        and pin them until then. ``window``: ``(forward number, batch)`` of the batches that run after it; a
        missing row they need again takes the slot of a row needed later (Belady inside the window)."""
        kjt = self._check_features(features)
        at = until if until is not None else self._cache.step + ahead
        later = None
        if window:
            later = Window.of([(s, self._cache.key_index.sorted_keys(k.values(), k.lengths(), self._feature_table))
                               for s, k in ((s, self._check_features(x)) for s, x in window)])
        with torch.no_grad():
            self._cache.prefetch(kjt.values(), kjt.lengths(), self._feature_table, until=at,
                                 value_bounds=self._bounds(kjt), window=later)

    def enter_window(self, features: KeyedJaggedTensor, step: int) -> None:
        """A batch enters the prefetch window, to run at forward number ``step``: its cached rows learn that
        step as their next use (the earliest one they know is kept), so inside the window the row used last
        leaves first. Nothing is loaded."""
        kjt = self._check_features(features)
        with torch.no_grad():
            self._cache.enter_window(kjt.values(), kjt.lengths(), self._feature_table, step=step,
                                     value_bounds=self._bounds(kjt))

    def _bounds(self, kjt: KeyedJaggedTensor) -> list[int]:
        values = kjt.values()
        if len(self._group_features) == 1:
            return [0, values.numel()]
        per_feature = kjt.length_per_key()  # KJT-side sizes (cached by from_lengths_sync)
        bounds = [0]
        for a, b in self._group_features:
            bounds.append(bounds[-1] + sum(per_feature[a:b]))
        return bounds

    # ------------------------------------------------------------------ stats and optimizer state
    @property
    def fused_cache(self) -> FusedCache:
        """The collection's :class:`~torchrec_cache.cache.FusedCache` (one for all tables)."""
        return self._cache

    def resident_rows(self, table: str) -> torch.Tensor:
        """Ids of ``table`` now on the device."""
        return self._cache.resident_rows(table)

    def cache_capacity(self) -> dict[str, int]:
        """Device slots of each table (the planner's split)."""
        return dict(self._cache.capacity)

    def is_reordered(self, table: str) -> bool:
        """Whether ``table``'s rows are stored in frequency order in host memory."""
        return self._cache.store.is_reordered(table)

    def cache_stats(self, per_table: bool = False) -> dict[str, Any]:
        """Totals since construction (or :meth:`reset_cache_stats`): hit rate, misses, rows and bytes moved.

        Keys: ``hit_rate``, ``last_hit_rate`` (the last step), the counters of
        :data:`torchrec_cache.cache.STAT_KEYS`, ``last_*`` for the last step, and ``tables`` (per table)
        when ``per_table``.
        """
        total = self._cache.stats_total()
        last = self._cache.counters.last()
        out: dict[str, Any] = {"hit_rate": total["hits"] / total["lookups"] if total["lookups"] else 0.0,
                               "last_hit_rate": last["hits"] / last["lookups"] if last["lookups"] else 0.0}
        out.update(total)
        out.update({f"last_{k}": v for k, v in last.items() if k != "steps"})
        if per_table:
            out["tables"] = {n: self._cache.counters.table(i) for i, n in enumerate(self._cache.names)}
        return out

    def reset_cache_stats(self) -> None:
        self._cache.counters.reset()

    def flush_cache(self) -> None:
        """Write every cached row (weights and optimizer state) back to host memory."""
        self._cache.flush()

    def disk_stats(self) -> dict[str, int]:
        """With a ``disk_dir``: the host level's hits, misses, rows and bytes read and written, requests, rows held."""
        tier = self._cache.store.tier
        return tier.stats() if tier is not None else {}

    def persist(self) -> None:
        """With a ``disk_dir``: write every changed row to disk and make it durable (a no-op without one)."""
        self._cache.flush()
        if self._cache.store.tier is not None:
            self._cache.store.tier.persist()

    def fused_optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Per table: the fused optimizer's state tensors in id order (names as in the PyTorch optimizer's
        state: ``sum`` for Adagrad, ``exp_avg``/``exp_avg_sq`` for Adam) and ``step``."""
        return checkpoint.fused_optimizer_state(self._cache)

    def load_fused_optimizer_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Inverse of :meth:`fused_optimizer_state`."""
        checkpoint.load_fused_optimizer_state(self._cache, state)

    @property
    def device(self) -> torch.device:
        return self._device

    def frequencies(self) -> FrequencyStats | None:
        """The frequency statistics the collection was built with."""
        return self._frequencies

    def cache_config(self) -> CacheConfig:
        return self._cache_config

    def _configs(self) -> list[Any]:  # pragma: no cover - overridden
        raise NotImplementedError


class CachedEmbeddingBagCollection(CachedCollection, EmbeddingBagCollectionInterface):
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
        self._any_mean = any(c.pooling == PoolingType.MEAN for c in tables)
        self._column_order = column_order(tables, self._cache.layout)
        for cfg in tables:
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {cfg.name!r}: pooling {cfg.pooling} is not supported by a bag collection; "
                                 "use PoolingType.SUM or MEAN (or CachedEmbeddingCollection for unpooled lookups)")

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return cached_collection_forward(features, self.handle())

    def lookup(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The pooled lookup of every feature through the fused cache (what :meth:`forward` calls); on the
        meta device, the output's shape only (:func:`~torchrec_cache.meta.meta_pooled`)."""
        if not self._materialized:
            values = meta_pooled(features, self._host_tables(), self._embedding_bag_configs, self._is_weighted)
            return KeyedTensor(keys=self._embedding_names, values=values, length_per_key=self._lengths_per_embedding)
        kjt = self._check_features(features)
        batch = self._prepare(kjt)
        weights = kjt.weights() if self._is_weighted else None
        parts = cached_pooled_lookup(self._cache, batch, kjt.lengths(), batch_size=kjt.stride(),
                                     group_features=self._group_features, weights=weights,
                                     mean=self._mean if self._any_mean else None, anchor=self._anchor,
                                     host_params=self._host_params())
        values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self._column_order is not None:
            values = values.index_select(1, self._column_order.to(values.device))
        return KeyedTensor(keys=self._embedding_names, values=values, length_per_key=self._lengths_per_embedding)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_names(self) -> list[str]:
        """The output keys, in order (one per feature)."""
        return list(self._embedding_names)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def _configs(self) -> list[Any]:
        return self._embedding_bag_configs


class CachedEmbeddingCollection(CachedCollection):
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
        return cached_sequence_forward(features, self.handle())

    def lookup(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """The unpooled lookup of every feature through the fused cache (what :meth:`forward` calls); on
        the meta device, the outputs' shapes only (:func:`~torchrec_cache.meta.meta_sequence`)."""
        if not self._materialized:
            return meta_sequence(features, self._host_tables(), self._embedding_configs, self._embedding_names_by_table,
                                 self._need_indices)
        kjt = self._check_features(features)
        batch = self._prepare(kjt)
        rows = cached_unpooled_lookup(self._cache, batch, anchor=self._anchor, host_params=self._host_params())
        looked = rows[0] if len(rows) == 1 else torch.cat(rows)
        jts = kjt.to_dict()
        out: dict[str, JaggedTensor] = {}
        per_feature = dict(zip(self._fused_features, looked.split(kjt.length_per_key())))
        for names, emb_names in zip(self._feature_names, self._embedding_names_by_table):
            for f, emb_name in zip(names, emb_names):
                out[emb_name] = JaggedTensor(values=per_feature[f], lengths=jts[f].lengths(),
                                             weights=jts[f].values() if self._need_indices else None)
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
