"""Table-wise and row-wise sharding of the cached collection inside TorchRec's ``DistributedModelParallel``.

Table-wise: each rank owns whole tables and caches them itself. The data path is TorchRec's own
table-wise one: ``TwSparseFeaturesDist`` (a ``KJTAllToAll``) sends every feature's ids from all ranks to
the rank that owns its table, the owner runs its local :class:`CachedEmbeddingBagCollection` on the
gathered batch (forward, and the fused optimizer in backward), and ``TwPooledEmbeddingDist`` (a
``PooledEmbeddingsAllToAll``, differentiable) returns each rank its own samples' pooled embeddings.

Row-wise: each rank owns a block of ``ceil(rows / world)`` rows of every table (TorchRec's layout) and
caches it; ``RwSparseFeaturesDist`` sends each id to its block's rank (as a local row id), the ranks pool
partial bags, and ``RwPooledEmbeddingDist`` (a reduce-scatter) sums them into each rank's samples. For
tables too big for one rank's host memory, or too hot for one rank's cache. Sum pooling only.

    plan = cached_sharding_plan(model, world_size=2)          # or sharding="row_wise", or place tables
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=device,
                                   plan=plan, sharders=[CachedEmbeddingBagCollectionSharder()])

Tracing: :class:`ShardedCachedEmbeddingBagCollection` is a TorchRec ``ShardedModule`` with the
``input_dist`` / ``compute`` / ``output_dist`` split that TorchRec's train pipelines drive, and
``torchrec.fx.Tracer`` keeps sharded modules as leaves. Its ``compute`` itself is not symbolically
traceable (cache misses are data-dependent control flow), so ``torch.fx.symbolic_trace`` of an
unsharded cached collection fails; trace the model with TorchRec's tracer instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist, RwSparseFeaturesDist
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist, TwSparseFeaturesDist
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ModuleSharder,
    NullShardedModuleContext,
    ShardedModule,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_cache.checkpoint import flush_before_state_dict
from torchrec_cache.frequency import FrequencyStats
from torchrec_cache.modules import CachedEmbeddingBagCollection

__all__ = ["CachedEmbeddingBagCollectionSharder", "ShardedCachedEmbeddingBagCollection", "cached_sharding_plan"]


class _KeyedTensorAwaitable(LazyAwaitable[KeyedTensor]):
    """Waits for the pooled all-to-all, then puts the columns back in the unsharded key order."""

    def __init__(self, pending: Awaitable[torch.Tensor], keys: list[str], dims: list[int], order: list[int]) -> None:
        super().__init__()
        self._pending, self._keys, self._dims, self._order = pending, keys, dims, order

    def _wait_impl(self) -> KeyedTensor:
        values = self._pending.wait()
        parts = values.split(self._dims, dim=1)  # in rank order
        ordered = [parts[i] for i in self._order]
        return KeyedTensor(keys=self._keys, values=torch.cat(ordered, dim=1),
                           length_per_key=[self._dims[i] for i in self._order])


class ShardedCachedEmbeddingBagCollection(ShardedModule[KeyedJaggedTensor, torch.Tensor, KeyedTensor, Any],
                                          FusedOptimizerModule):
    """The rank-local part of a table-wise or row-wise sharded :class:`CachedEmbeddingBagCollection`.

    Its state dict holds the local tables (row-wise: the local block of rows, from :meth:`row_offset`)
    under the unsharded names (``embedding_bags.<table>.weight``).
    """

    _tables_attr = "embedding_bags"

    def __init__(self, module: CachedEmbeddingBagCollection, plan: EmbeddingModuleShardingPlan, env: ShardingEnv,
                 device: torch.device | None) -> None:
        super().__init__()
        cfgs = module.embedding_bag_configs()
        kinds = {plan[c.name].sharding_type if c.name in plan else None for c in cfgs}
        self._row_wise = kinds == {ShardingType.ROW_WISE.value}
        self._world = env.world_size
        self._out_keys = module.embedding_names()
        self._cache_device = device if device is not None else module.device
        if self._row_wise:
            self._setup_row_wise(module, env)
        else:
            self._setup_table_wise(module, plan, env)
        self.register_state_dict_pre_hook(flush_before_state_dict)
        self._register_state_dict_hook(_rename_local_keys)
        self._register_load_state_dict_pre_hook(_prefix_local_keys, with_module=True)
        self.register_load_state_dict_post_hook(_ignore_dist_buffers)

    def _setup_table_wise(self, module: CachedEmbeddingBagCollection, plan: EmbeddingModuleShardingPlan,
                          env: ShardingEnv) -> None:
        world = env.world_size
        rank_of = {}
        for cfg in module.embedding_bag_configs():
            sharding = plan.get(cfg.name)
            if sharding is None or sharding.sharding_type != ShardingType.TABLE_WISE.value or not sharding.ranks:
                raise ValueError(f"table {cfg.name!r} needs a table-wise placement in the plan (one rank), or every "
                                 f"table row-wise; got {sharding}. Build the plan with cached_sharding_plan(model, "
                                 "world_size) or cached_sharding_plan(model, world_size, sharding='row_wise')")
            rank_of[cfg.name] = sharding.ranks[0]
        per_rank: list[list[Any]] = [[c for c in module.embedding_bag_configs() if rank_of[c.name] == r]
                                     for r in range(world)]
        if any(not tables for tables in per_rank):
            empty = [r for r, t in enumerate(per_rank) if not t]
            raise ValueError(f"ranks {empty} own no table; table-wise sharding of the cached collection needs at least "
                             f"one table per rank ({len(module.embedding_bag_configs())} tables, world size {world}); "
                             "shard row-wise instead: cached_sharding_plan(model, world_size, sharding='row_wise')")
        local_cfgs = per_rank[env.rank]
        freq: FrequencyStats | None = module.frequencies()
        local_freq = None if freq is None else FrequencyStats(
            counts={c.name: freq.counts[c.name] for c in local_cfgs}, batches=freq.batches)
        self._local = CachedEmbeddingBagCollection(tables=local_cfgs, is_weighted=module.is_weighted(),
                                                   device=self._cache_device, cache=module.cache_config(),
                                                   frequencies=local_freq)
        self._local.load_state_dict({f"embedding_bags.{c.name}.weight": module.state_dict()[
            f"embedding_bags.{c.name}.weight"] for c in local_cfgs})
        # The KJT arrives in the unsharded feature order; permute it so each rank's features are contiguous.
        all_features = [f for c in module.embedding_bag_configs() for f in c.feature_names]
        rank_features = [f for tables in per_rank for c in tables for f in c.feature_names]
        self._feature_perm = [all_features.index(f) for f in rank_features]
        self._input_dist = TwSparseFeaturesDist(env.process_group,
                                                [sum(len(c.feature_names) for c in t) for t in per_rank])
        dims_per_rank = [[c.embedding_dim for c in t for _ in c.feature_names] for t in per_rank]
        self._output_dist = TwPooledEmbeddingDist(env.process_group, [sum(d) for d in dims_per_rank], dims_per_rank,
                                                  device=self._cache_device)
        rank_keys = [n for t in per_rank for c in t for n in (c.feature_names if len(c.feature_names) else [c.name])]
        self._out_dims = [d for dims in dims_per_rank for d in dims]
        self._out_order = [rank_keys.index(k) for k in self._out_keys]

    def _setup_row_wise(self, module: CachedEmbeddingBagCollection, env: ShardingEnv) -> None:
        """Every rank holds a block of rows of every table (TorchRec's row-wise layout: blocks of
        ``ceil(rows / world)``) and caches it; ids go to the rank of their block, pooled partial sums come
        back summed by a reduce-scatter."""
        world, rank = env.world_size, env.rank
        freq: FrequencyStats | None = module.frequencies()
        local_cfgs, counts, state = [], {}, module.state_dict()
        self._row_offsets: dict[str, int] = {}
        for cfg in module.embedding_bag_configs():
            if cfg.pooling != PoolingType.SUM:
                raise ValueError(f"table {cfg.name!r} pools by {cfg.pooling}; row-wise sharding sums partial bags "
                                 "across ranks, so it needs PoolingType.SUM (or shard it table-wise)")
            block = -(-cfg.num_embeddings // world)
            first = rank * block
            rows = min(cfg.num_embeddings, first + block) - first
            if rows < 1:
                raise ValueError(f"table {cfg.name!r} has {cfg.num_embeddings} rows, too few to give each of {world} "
                                 f"ranks a block of {block}; shard it table-wise or use fewer ranks")
            local_cfgs.append(dataclasses.replace(cfg, num_embeddings=rows))
            self._row_offsets[cfg.name] = first
            if freq is not None:
                counts[cfg.name] = freq.counts[cfg.name][first:first + rows]
        self._local = CachedEmbeddingBagCollection(
            tables=local_cfgs, is_weighted=module.is_weighted(), device=self._cache_device,
            cache=module.cache_config(),
            frequencies=None if freq is None else FrequencyStats(counts=counts, batches=freq.batches))
        self._local.load_state_dict({
            f"embedding_bags.{c.name}.weight": state[f"embedding_bags.{c.name}.weight"][
                self._row_offsets[c.name]:self._row_offsets[c.name] + c.num_embeddings] for c in local_cfgs})
        features = [(f, c.num_embeddings) for c in module.embedding_bag_configs() for f in c.feature_names]
        all_features = [f for f, _ in features]
        self._feature_perm = list(range(len(all_features)))
        self._features = all_features
        self._input_dist = RwSparseFeaturesDist(env.process_group, len(features), [n for _, n in features],
                                                device=self._cache_device,
                                                has_feature_processor=False)
        dims = [c.embedding_dim for c in module.embedding_bag_configs() for _ in c.feature_names]
        self._output_dist = RwPooledEmbeddingDist(env.process_group, dims)
        self._out_dims = dims
        self._out_order = list(range(len(dims)))

    def row_offset(self, table: str) -> int:
        """First row of ``table`` held here (0 for table-wise sharding)."""
        return getattr(self, "_row_offsets", {}).get(table, 0)

    def flush_cache(self) -> None:
        self._local.flush_cache()

    def cache_stats(self, per_table: bool = False) -> dict[str, Any]:
        return self._local.cache_stats(per_table)

    def local_tables(self) -> list[str]:
        return [c.name for c in self._local.embedding_bag_configs()]

    def fused_optimizer_state(self) -> dict[str, dict[str, Any]]:
        return self._local.fused_optimizer_state()

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The local tables' fused optimizer state (keys as in this module's state dict); DMP collects it."""
        return self._local.fused_optimizer

    # ------------------------------------------------------------------ ShardedModule
    @property
    def unsharded_module_type(self) -> type[CachedEmbeddingBagCollection]:
        return CachedEmbeddingBagCollection

    def create_context(self) -> NullShardedModuleContext:
        return NullShardedModuleContext()

    def input_dist(self, ctx: Any, features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if features.variable_stride_per_key():
            raise NotImplementedError("variable batch size per feature (VBE) is not supported by the cached collection")
        if self._row_wise and features.keys() != self._features:
            features = features.permute([features.keys().index(f) for f in self._features])
        elif self._feature_perm != list(range(len(self._feature_perm))):
            features = features.permute(self._feature_perm)
        return self._input_dist(features)

    def compute(self, ctx: Any, dist_input: KeyedJaggedTensor) -> torch.Tensor:
        return self._local(dist_input).values()

    def output_dist(self, ctx: Any, output: torch.Tensor) -> LazyAwaitable[KeyedTensor]:
        return _KeyedTensorAwaitable(self._output_dist(output), self._out_keys, self._out_dims, self._out_order)


def _rename_local_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # Only the tables are state; the dist modules' buffers (split sizes) are rebuilt from the plan.
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "_local.")]:
        del state_dict[key]
    for key in [k for k in state_dict if k.startswith(prefix + "_local.")]:
        state_dict[prefix + key[len(prefix) + len("_local."):]] = state_dict.pop(key)


def _ignore_dist_buffers(module: nn.Module, incompatible_keys: Any) -> None:
    kept = [k for k in incompatible_keys.missing_keys if "._input_dist." not in k and "._output_dist." not in k
            and not k.startswith(("_input_dist.", "_output_dist."))]
    incompatible_keys.missing_keys[:] = kept


def _prefix_local_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "embedding_bags.")]:
        state_dict[prefix + "_local." + key[len(prefix):]] = state_dict.pop(key)


class CachedEmbeddingBagCollectionSharder(ModuleSharder[CachedEmbeddingBagCollection]):
    """Shards :class:`CachedEmbeddingBagCollection` table-wise (each rank owns and caches whole tables) or
    row-wise (each rank owns and caches a block of rows of every table)."""

    def shard(self, module: CachedEmbeddingBagCollection, params: EmbeddingModuleShardingPlan, env: ShardingEnv,
              device: torch.device | None = None, module_fqn: str | None = None) -> ShardedCachedEmbeddingBagCollection:
        return ShardedCachedEmbeddingBagCollection(module, params, env, device)

    @property
    def module_type(self) -> type[CachedEmbeddingBagCollection]:
        return CachedEmbeddingBagCollection

    def shardable_parameters(self, module: CachedEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        tables = cast(nn.ModuleDict, module.embedding_bags)
        return {name: cast(nn.Parameter, table.weight) for name, table in tables.items()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]


def cached_sharding_plan(model: nn.Module, world_size: int, *, placement: dict[str, int] | None = None,
                         device_type: str = "cpu", sharding: str = "table_wise") -> ShardingPlan:
    """A table-wise (or row-wise) plan for every cached collection in ``model``.

    Args:
        model: the (unsharded) model.
        world_size: number of ranks.
        placement: table name -> rank (table-wise); tables not listed are placed largest first on the
            rank with the fewest bytes so far.
        device_type: ``"cpu"`` or ``"cuda"``.
        sharding: ``"table_wise"`` (each rank owns whole tables) or ``"row_wise"`` (each rank owns a
            block of rows of every table; sum pooling only).
    """
    if sharding not in ("table_wise", "row_wise"):
        raise ValueError(f"sharding={sharding!r} is unknown; choose 'table_wise' or 'row_wise'")
    sharder = CachedEmbeddingBagCollectionSharder()
    plan: dict[str, EmbeddingModuleShardingPlan] = {}
    load = [0] * world_size
    for fqn, module in model.named_modules():
        if not isinstance(module, CachedEmbeddingBagCollection):
            continue
        chosen: dict[str, int] = {}
        cfgs = sorted(module.embedding_bag_configs(), key=lambda c: -c.num_embeddings * c.embedding_dim)
        for cfg in cfgs:
            if placement and cfg.name in placement:
                rank = placement[cfg.name]
                if not 0 <= rank < world_size:
                    raise ValueError(f"placement puts table {cfg.name!r} on rank {rank}, outside [0, {world_size})")
            else:
                rank = min(range(world_size), key=lambda r: load[r])
            load[rank] += cfg.num_embeddings * cfg.embedding_dim
            chosen[cfg.name] = rank
        kernel = (EmbeddingComputeKernel.FUSED.value if module.cache_config().optimizer is not None
                  else EmbeddingComputeKernel.DENSE.value)
        if sharding == "row_wise":
            plan[fqn] = construct_module_sharding_plan(
                module, {c.name: row_wise(compute_kernel=kernel) for c in module.embedding_bag_configs()},
                sharder=sharder, local_size=world_size, world_size=world_size, device_type=device_type)
            continue
        plan[fqn] = construct_module_sharding_plan(
            module, {c.name: table_wise(rank=chosen[c.name], compute_kernel=kernel)
                     for c in module.embedding_bag_configs()},
            sharder=sharder, local_size=world_size, world_size=world_size, device_type=device_type)
    if not plan:
        raise ValueError("cached_sharding_plan found no CachedEmbeddingBagCollection in the model; swap_in first")
    return ShardingPlan(plan=plan)
