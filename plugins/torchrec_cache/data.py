"""Synthetic Criteo-like click data: 13 dense features, 26 sparse ones with Criteo Kaggle's cardinalities.

Nothing is downloaded. Ids follow a Zipf-like power law (a few rows get most of the traffic, as in
the real logs), hot ids are scattered over the table by a multiplicative hash, and the label is
learnable: it is drawn from a logistic model of the dense features and a hidden per-id effect.

Example:
    >>> tables = criteo_like_tables(scale=0.001, dim=8)
    >>> len(tables), tables[2].num_embeddings
    (26, 10132)
    >>> dense, kjt, labels = next(iter(SyntheticCriteo(tables, batch_size=4, seed=0)))
    >>> dense.shape, len(kjt.keys()), labels.shape
    (torch.Size([4, 13]), 26, torch.Size([4]))
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "criteo_like_tables", "zipf_ids", "SyntheticCriteo"]

# Rows per sparse feature of the Criteo Kaggle (Display Advertising Challenge) dataset: 33,762,577 in all.
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
    10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
_HASH = 2654435761  # Knuth's multiplicative hash constant: scatters hot ranks over the table


def criteo_like_tables(scale: float = 1.0, dim: int = 16) -> list[EmbeddingBagConfig]:
    """26 ``EmbeddingBagConfig`` named ``t_cat_i`` (feature ``cat_i``), rows = cardinality * scale (>= 4)."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale={scale} must be in (0, 1]: the fraction of Criteo Kaggle's table sizes")
    return [EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=dim, feature_names=[f"cat_{i}"],
                               num_embeddings=max(4, int(math.ceil(card * scale))))
            for i, card in enumerate(CRITEO_KAGGLE_CARDINALITIES)]


def zipf_ids(n: int, rows: int, *, a: float = 1.05, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` ids in ``[0, rows)`` whose ranks follow a power law with exponent ``a`` (inverse-CDF sampling)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    if abs(a - 1.0) < 1e-9:
        rank = torch.exp(u * math.log(rows))
    else:
        rank = ((rows ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))
    rank = rank.long().clamp_(1, rows) - 1
    return (rank * _HASH) % rows


def _hidden_effect(ids: torch.Tensor, salt: int) -> torch.Tensor:
    # A deterministic per-id effect in [-1, 1) without storing a table the size of the embedding one.
    return (((ids * 40503 + salt * 7919) % 2003).float() / 1001.5) - 1.0


class SyntheticCriteo:
    """An endless (or ``batches``-long) stream of ``(dense, kjt, labels)`` batches.

    Args:
        tables: the sparse tables (one feature each), e.g. :func:`criteo_like_tables`.
        batch_size: samples per batch.
        batches: stop after this many (``None``: endless).
        ids_per_feature: ids per sample and feature (Criteo has one).
        a: the Zipf exponent of the ids.
        seed: makes the stream reproducible.
    """

    def __init__(self, tables: list[EmbeddingBagConfig], *, batch_size: int = 512, batches: int | None = None,
                 ids_per_feature: int = 1, a: float = 1.05, seed: int = 0) -> None:
        self.tables, self.batch_size, self.batches = tables, batch_size, batches
        self.ids_per_feature, self.a, self.seed = ids_per_feature, a, seed
        self.dense_weights = torch.linspace(-1, 1, 13)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        i = 0
        while self.batches is None or i < self.batches:
            i += 1
            b, k = self.batch_size, self.ids_per_feature
            dense = torch.randn(b, 13, generator=gen)
            values, logit = [], dense @ self.dense_weights * 0.5
            for t, cfg in enumerate(self.tables):
                ids = zipf_ids(b * k, cfg.num_embeddings, a=self.a, generator=gen)
                values.append(ids)
                logit = logit + _hidden_effect(ids, t).view(b, k).mean(1) * 0.6
            labels = (torch.rand(b, generator=gen) < torch.sigmoid(logit)).float()
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=[c.feature_names[0] for c in self.tables], values=torch.cat(values),
                lengths=torch.full((len(self.tables) * b,), k, dtype=torch.int64))
            yield dense, kjt, labels
