"""Put the cache into an existing model and take it out again.

    model = swap_in(DLRM(embedding_bag_collection=ebc, ...), cache=CacheConfig(capacity=0.015))
    ...train...
    model = swap_out(model)          # plain TorchRec collections holding the trained weights

``swap_in`` replaces every ``EmbeddingBagCollection`` and ``EmbeddingCollection`` (at any depth,
TorchRec's ``DLRM`` included) by its cached version built from the same table configs and loaded
with the same weights, so the model's outputs do not change. ``prefetching`` wraps a data loader
so each batch's rows are loaded on a background thread up to ``k`` batches before the batch runs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from torchrec_cache.config import CacheConfig
from torchrec_cache.frequency import FrequencyStats, find_kjt
from torchrec_cache.modules import CachedCollection, CachedEmbeddingBagCollection, CachedEmbeddingCollection

__all__ = ["swap_in", "swap_out", "cached_collections", "prefetching"]


def _subset(frequencies: FrequencyStats | None, names: list[str]) -> FrequencyStats | None:
    if frequencies is None:
        return None
    missing = [n for n in names if n not in frequencies.counts]
    if missing:
        raise KeyError(f"the frequency statistics have no counts for tables {missing}; collect them over every "
                       f"table of the model (they cover {sorted(frequencies.counts)})")
    return FrequencyStats(counts={n: frequencies.counts[n] for n in names}, batches=frequencies.batches)


def _cached(module: nn.Module, cache: CacheConfig, frequencies: FrequencyStats | None,
            device: torch.device | str | None) -> nn.Module | None:
    if isinstance(module, CachedCollection):
        return None
    # A collection on the meta device (TorchRec's way to describe tables larger than memory) has no rows to
    # carry over: with a disk tier the cached collection is built off the meta device, its rows written straight
    # to disk chunk by chunk by each table's init_fn, as TorchRec's init_parameters would fill them.
    from_meta = (isinstance(module, (EmbeddingBagCollection, EmbeddingCollection))
                 and torch.device(module.device).type == "meta" and cache.disk_dir is not None)
    if from_meta and device is None:
        device = "cpu"
    if isinstance(module, EmbeddingBagCollection):
        tables = module.embedding_bag_configs()
        new: nn.Module = CachedEmbeddingBagCollection(
            tables=tables, is_weighted=module.is_weighted(), device=device or module.device, cache=cache,
            frequencies=_subset(frequencies, [t.name for t in tables]))
    elif isinstance(module, EmbeddingCollection):
        tables = module.embedding_configs()
        new = CachedEmbeddingCollection(
            tables=tables, device=device or module.device, need_indices=module.need_indices(), cache=cache,
            frequencies=_subset(frequencies, [t.name for t in tables]))
    else:
        return None
    if not from_meta:
        new.load_state_dict(module.state_dict())
    return new


def _replace(model: nn.Module, make: Any) -> tuple[nn.Module, int]:
    top = make(model)
    if top is not None:
        return top, 1
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = make(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return model, count


def swap_in(model: nn.Module, cache: CacheConfig | None = None, frequencies: FrequencyStats | None = None, *,
            device: torch.device | str | None = None) -> nn.Module:
    """Replace every TorchRec embedding collection in ``model`` by its cached version (weights carried over).

    Args:
        model: a model holding ``EmbeddingBagCollection`` / ``EmbeddingCollection`` modules, or one of them.
        cache: the :class:`CacheConfig` for every collection (a byte budget applies to each collection).
        frequencies: statistics over the model's tables (warm-up, ``static`` policy, byte-budget split).
        device: where the caches live (default: each collection's own device; ``"cpu"`` for a collection on
            the meta device whose cache has a ``disk_dir``).

    A collection built on the meta device with a ``disk_dir`` in ``cache`` is materialised straight into the
    disk tier: each table's ``init_fn`` runs chunk by chunk in the configs' order (the rows TorchRec's
    ``init_parameters`` would give under the same RNG state), never the whole table in memory. The rest of
    the model stays where it is (``model.to_empty(device=...)`` then materialises it; the cached collections
    keep their rows through it).

    Returns the model (modified in place), or the new module when ``model`` itself was a collection.
    """
    cache = cache or CacheConfig()
    model, n = _replace(model, lambda m: _cached(m, cache, frequencies, device))
    if n == 0 and not any(isinstance(m, CachedCollection) for m in model.modules()):
        raise ValueError(f"swap_in found no EmbeddingBagCollection or EmbeddingCollection in {type(model).__name__}; "
                         "build the model with torchrec.EmbeddingBagCollection (or pass that module itself)")
    return model


def _plain(module: nn.Module, device: torch.device | str) -> nn.Module | None:
    if isinstance(module, CachedEmbeddingBagCollection):
        new: nn.Module = EmbeddingBagCollection(tables=module.embedding_bag_configs(),
                                                is_weighted=module.is_weighted(), device=torch.device(device))
    elif isinstance(module, CachedEmbeddingCollection):
        new = EmbeddingCollection(tables=module.embedding_configs(), device=torch.device(device),
                                  need_indices=module.need_indices())
    else:
        return None
    new.load_state_dict(module.state_dict())
    return new


def swap_out(model: nn.Module, *, device: torch.device | str = "cpu") -> nn.Module:
    """Replace every cached collection by a plain TorchRec one holding the trained weights, on ``device``.

    The fused optimizer's state does not travel (plain collections have none): save
    ``collection.fused_optimizer_state()`` first if training continues elsewhere.
    """
    model, _ = _replace(model, lambda m: _plain(m, device))
    return model


def cached_collections(model: nn.Module) -> list[CachedCollection]:
    """The cached collections inside ``model`` (in module order)."""
    return [m for m in model.modules() if isinstance(m, CachedCollection)]


def _prefetch_job(collections: list[CachedCollection], start: list[int], entering: list[tuple[int, Any]],
                  target: tuple[int, Any] | None, window: list[tuple[int, Any]], stream: Any,
                  resumed: threading.Event) -> Any:
    """One prefetch step (on the worker thread), once the current batch's lookup has read its rows (or the loop
    moved on without one): note when the batches entering the window need the rows already cached, then
    load the next batch's rows knowing which of them the rest of the window needs again."""

    def run() -> None:
        for c, s0 in zip(collections, start):
            if target is not None:
                # Loading before the current lookup has read its rows could not evict them: the same loads
                # then cost more misses, and the hit rate would depend on the threads' timing.
                c.fused_cache.clock.wait(s0 + target[0], resumed)
            for j, kjt in entering:
                c.enter_window(kjt, step=s0 + j + 1)  # batch j is the (j + 1)-th forward
            if target is not None:
                c.prefetch(target[1], until=s0 + target[0] + 1, window=[(s0 + j + 1, k) for j, k in window])

    if stream is None:
        run()
        return None
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.default_stream(stream.device))  # slots the step wrote before
        run()
        event = torch.cuda.Event()
        event.record(stream)
    return event


def prefetching(data: Iterable[Any], model: nn.Module, ahead: int | None = None) -> Iterator[Any]:
    """Yield ``data``'s batches unchanged while a background thread prepares the next ones (lookahead eviction).

    While batch ``i`` computes, a worker thread (and, on CUDA, a side stream whose event the step waits
    for) loads the rows of batch ``i + 1`` and pins the cached rows of every batch up to ``i + ahead``
    until their forward. So a row needed inside the window is never evicted; a missing row that the
    window needs again is admitted even over a more frequent one (Belady inside the window); among the
    other rows the cache's policy decides (frequency for ``lfu``). One forward per yielded batch is
    assumed (the pins count forwards). ``ahead`` defaults to the largest ``CacheConfig.prefetch`` of the
    model's cached collections.
    """
    collections = cached_collections(model)
    if ahead is None:
        ahead = max((c.cache_config().prefetch for c in collections), default=0)
    if ahead <= 0 or not collections:
        yield from data
        return
    start = [c.fused_cache.step for c in collections]
    cuda = [c for c in collections if c.device.type == "cuda"]
    stream = torch.cuda.Stream(cuda[0].device) if cuda else None
    pool = ThreadPoolExecutor(1, thread_name_prefix="torchrec_cache-prefetch")
    it = iter(data)
    buf: deque[tuple[int, Any, Any]] = deque()  # (index, batch, its KeyedJaggedTensor)

    pulled = 0  # batches taken from ``data``: a batch's index, its forward number after ``start``

    def pull() -> tuple[int, Any] | None:
        nonlocal pulled
        batch = next(it, _END)
        if batch is _END:
            return None
        # Numbered by the stream, not by the buffer: with ahead=1 the buffer is empty here, and a batch
        # numbered 0 again neither waited for the current lookup nor stayed pinned until its own forward.
        j, pulled = pulled, pulled + 1
        buf.append((j, batch, find_kjt(batch)))
        return j, buf[-1][2]

    resumed = threading.Event()  # set when the loop asks for the next batch: a job stops waiting for a lookup

    def submit(entering: list[tuple[int, Any]]) -> Future[Any]:
        nonlocal resumed
        resumed = threading.Event()
        target = (buf[0][0], buf[0][2]) if buf else None
        window = [(j, k) for j, _, k in list(buf)[1:]]
        return pool.submit(_prefetch_job, collections, start, entering, target, window, stream, resumed)

    def resume() -> None:
        resumed.set()
        for c in collections:
            c.fused_cache.clock.wake()

    try:
        for _ in range(ahead + 1):
            if pull() is None:
                break
        if not buf:
            return
        _, first, _ = buf.popleft()  # the first batch runs at once: its own forward loads its rows
        pending = submit([(j, k) for j, _, k in buf])
        yield first
        while buf:
            resume()
            event = pending.result()  # the next batch's rows are in (on CUDA: queued before this event)
            if event is not None:
                torch.cuda.current_stream(stream.device).wait_event(event)  # type: ignore[union-attr]
            _, batch, _ = buf.popleft()
            new = pull()
            pending = submit([new] if new is not None else [])
            yield batch
        resume()
        pending.result()
    finally:
        resume()
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()
