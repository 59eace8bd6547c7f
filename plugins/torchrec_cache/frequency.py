"""Frequency statistics: how often each row of each table is used by a dataset.

    stats = collect_frequencies(loader, ebc.embedding_bag_configs())   # one pass over the data
    stats.save("freq.safetensors"); stats = FrequencyStats.load("freq.safetensors")

The cache warms with each table's hottest rows, the ``static`` policy ranks rows by these counts,
the byte-budget planner sizes each table's cache from them, and ``reorder`` stores the rows in host
memory by descending count. The file is safetensors (plain tensors, nothing unpickled).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["FrequencyStats", "collect_frequencies", "find_kjt"]

log = logging.getLogger("torchrec_cache")


@dataclass
class FrequencyStats:
    """Per-table id counts (int64, one entry per row).

    Args:
        counts: table name -> (num_embeddings,) int64 counts.
        batches: how many batches were counted.

    Example:
        >>> s = FrequencyStats({"t": torch.tensor([0, 5, 2])})
        >>> s.hottest("t", 2).tolist()
        [1, 2]
    """

    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    batches: int = 0

    def hottest(self, table: str, k: int) -> torch.Tensor:
        """The ``k`` most used rows of ``table`` (ids), hottest first; unused rows never come back."""
        c = self._table(table)
        k = min(int(k), int((c > 0).sum()))
        return torch.topk(c, k, sorted=True).indices if k > 0 else torch.empty(0, dtype=torch.int64)

    def order(self, table: str) -> torch.Tensor:
        """All row ids of ``table`` by descending count (ties by id): the host order of ``reorder``."""
        return torch.sort(self._table(table), descending=True, stable=True).indices

    def _table(self, table: str) -> torch.Tensor:
        try:
            return self.counts[table]
        except KeyError:
            raise KeyError(f"no frequency statistics for table {table!r}; the statistics cover "
                           f"{sorted(self.counts)}. Collect them with the same table configs") from None

    def check(self, tables: Sequence[Any]) -> None:
        """Raise unless every table in ``tables`` has counts of the right length."""
        for cfg in tables:
            c = self._table(cfg.name)
            if c.numel() != cfg.num_embeddings:
                raise ValueError(f"frequency statistics for table {cfg.name!r} have {c.numel()} rows but the table "
                                 f"has num_embeddings={cfg.num_embeddings}; collect them again for this table")

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {f"counts.{k}": v.contiguous() for k, v in self.counts.items()}
        save_file(tensors, str(path), metadata={"batches": str(self.batches), "format": "tightfit-frequencies-1"})
        return path

    @classmethod
    def load(cls, path: str | Path) -> FrequencyStats:
        from safetensors import safe_open

        counts: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "tightfit-frequencies-1":
                raise ValueError(f"{path} is not a tightfit frequency file (format={meta.get('format')!r}); "
                                 "write one with FrequencyStats.save")
            for key in f.keys():
                counts[key.removeprefix("counts.")] = f.get_tensor(key)
        return cls(counts=counts, batches=int(meta.get("batches", 0)))


def find_kjt(batch: Any) -> KeyedJaggedTensor:
    """The ``KeyedJaggedTensor`` inside a batch: the batch itself, ``batch.sparse_features`` (TorchRec's
    ``Batch``), or the first one in a tuple, list or dict."""
    if isinstance(batch, KeyedJaggedTensor):
        return batch
    sparse = getattr(batch, "sparse_features", None)
    if isinstance(sparse, KeyedJaggedTensor):
        return sparse
    items: Iterable[Any] = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        if isinstance(item, KeyedJaggedTensor):
            return item
    raise TypeError(f"cannot find a KeyedJaggedTensor in a batch of type {type(batch).__name__}; yield KJTs, "
                    "TorchRec Batch objects, or tuples/dicts holding one")


def _table_configs(tables: Any) -> list[Any]:
    if hasattr(tables, "embedding_bag_configs"):
        return list(tables.embedding_bag_configs())
    if hasattr(tables, "embedding_configs"):
        return list(tables.embedding_configs())
    return list(tables)


def collect_frequencies(data: Iterable[Any], tables: Any, *, max_batches: int | None = None,
                        progress: bool = True) -> FrequencyStats:
    """Count how often each row of each table occurs in ``data``.

    Args:
        data: an iterable of ``KeyedJaggedTensor`` (or of batches holding one, see :func:`find_kjt`),
            e.g. a DataLoader.
        tables: the ``EmbeddingBagConfig`` / ``EmbeddingConfig`` list, or a collection module.
        max_batches: stop after this many batches.
        progress: log a progress line (INFO, logger ``torchrec_cache``) every 10 s.
    """
    configs = _table_configs(tables)
    counts = {cfg.name: torch.zeros(cfg.num_embeddings, dtype=torch.int64) for cfg in configs}
    start = last = time.monotonic()
    n = 0
    for batch in data:
        if max_batches is not None and n >= max_batches:
            break
        kjt = find_kjt(batch)
        jts = kjt.to_dict()
        for cfg in configs:
            for feature in cfg.feature_names or [cfg.name]:
                if feature not in jts:
                    continue
                ids = jts[feature].values().long().cpu()
                if ids.numel() == 0:
                    continue
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= cfg.num_embeddings:
                    bad = lo if lo < 0 else hi
                    raise IndexError(f"table {cfg.name!r} (feature {feature!r}): id {bad} is outside its range "
                                     f"[0, {cfg.num_embeddings}); hash or clip the feature first")
                counts[cfg.name] += torch.bincount(ids, minlength=cfg.num_embeddings)
        n += 1
        if progress and time.monotonic() - last > 10:
            last = time.monotonic()
            log.info("collect_frequencies: %d batches in %.0f s", n, last - start)
    return FrequencyStats(counts=counts, batches=n)
