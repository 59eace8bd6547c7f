"""A Lightning callback that logs the cache's hit rate and traffic (Lightning is imported here only)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from torchrec_cache.stats import model_cache_stats

__all__ = ["CacheStatsCallback"]


class CacheStatsCallback(pl.Callback):
    """Logs ``cache/<key>`` from :func:`~torchrec_cache.stats.model_cache_stats` after every training batch.

    Args:
        keys: which entries to log.
        prog_bar: show the hit rate in the progress bar.

    Example:
        >>> trainer = pl.Trainer(callbacks=[CacheStatsCallback()])  # doctest: +SKIP
    """

    def __init__(self, keys: tuple[str, ...] = ("hit_rate", "last_hit_rate", "last_misses", "last_rows_loaded",
                                                "last_bytes_to_device"), prog_bar: bool = True) -> None:
        super().__init__()
        self.keys, self.prog_bar = keys, prog_bar

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = model_cache_stats(pl_module)
        for key in self.keys:
            pl_module.log(f"cache/{key}", stats[key], prog_bar=self.prog_bar and key == "hit_rate", on_step=True,
                          on_epoch=False, batch_size=1)
