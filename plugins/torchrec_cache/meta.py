"""Lookups of a collection built on the meta device: shape propagation, as TorchRec's collections do it.

TorchRec's planner and ``torch.export`` run a model's forward on the meta device to learn its output
shapes. A cached collection on the meta device has no cache yet (nothing is allocated until
``to_empty``), so its forward skips the cache: every feature is looked up in its table's meta
weight with the plain op (``F.embedding_bag`` / ``F.embedding``), which gives TorchRec's output
shapes, keys and dtypes, all on the meta device, without reading a value.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

__all__ = ["meta_pooled", "meta_sequence"]

_META = torch.device("meta")


def _feature(jts: dict[str, JaggedTensor], name: str) -> JaggedTensor:
    if name not in jts:
        raise KeyError(f"the batch has no feature {name!r}; this collection reads it (add it to the batch)")
    return jts[name]


def _weight(tables: nn.ModuleDict, name: str) -> torch.Tensor:
    return cast(torch.Tensor, tables[name].weight)


def meta_pooled(features: KeyedJaggedTensor, tables: nn.ModuleDict, configs: list[EmbeddingBagConfig],
                is_weighted: bool) -> torch.Tensor:
    """The pooled values (batch x sum of the features' dims, float32, on the meta device) that
    ``EmbeddingBagCollection`` returns for ``features``: tables in order, each table's features in order."""
    jts = features.to_dict()
    pooled = []
    for cfg in configs:
        weight = _weight(tables, cfg.name)
        mode = "mean" if cfg.pooling == PoolingType.MEAN else "sum"
        for name in cfg.feature_names:
            jt = _feature(jts, name)
            per_id = jt.weights().to(_META) if is_weighted else None
            pooled.append(F.embedding_bag(jt.values().to(_META), weight, jt.offsets().to(_META), mode=mode,
                                          per_sample_weights=per_id, include_last_offset=True).float())
    if not pooled:
        return torch.empty(features.stride(), 0, device=_META)
    return torch.cat(pooled, dim=1)


def meta_sequence(features: KeyedJaggedTensor, tables: nn.ModuleDict, configs: list[EmbeddingConfig],
                  embedding_names_by_table: list[list[str]], need_indices: bool) -> dict[str, Any]:
    """The ``JaggedTensor`` per embedding name that ``EmbeddingCollection`` returns, on the meta device."""
    jts = features.to_dict()
    out: dict[str, JaggedTensor] = {}
    for cfg, emb_names in zip(configs, embedding_names_by_table):
        weight = _weight(tables, cfg.name)
        for name, emb_name in zip(cfg.feature_names, emb_names):
            jt = _feature(jts, name)
            ids = jt.values().to(_META)
            out[emb_name] = JaggedTensor(values=F.embedding(ids, weight), lengths=jt.lengths().to(_META),
                                         weights=ids if need_indices else None)
    return out
