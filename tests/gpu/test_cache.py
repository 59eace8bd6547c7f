"""The embedding cache's core on CUDA, without TorchRec: 1.5% of the rows in device slots, the full table
in pinned host memory, rows prefetched a batch ahead, against the same cache on the CPU.

``FusedCache`` + ``prepare_batch`` / ``cached_pooled_lookup`` + the fused row optimizer are the part of
``torchrec_cache`` that does not import TorchRec (the GPU image has none); the TorchRec drop-in
(``CachedEmbeddingBagCollection``, the sharder) is a stated skip there. Same Zipf batches, same Adam
arithmetic: the pooled outputs of every batch and the final table (after ``flush``) must agree, and the GPU
side really copies out of pinned memory.
"""

from __future__ import annotations

import torch

from tests.gpu.common import cuda, require
from tests.helpers.runif import RunIf

pytestmark = RunIf(cuda=True)
ROWS, DIM, BATCH, STEPS = 20_000, 16, 512, 12


def _zipf_batches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(STEPS, BATCH, generator=g, dtype=torch.float64)
    a = 1.05
    rank = (((ROWS ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))).long().clamp_(1, ROWS) - 1
    return list((rank * 2654435761) % ROWS)


def run_cache(device: torch.device, *, pinned: bool, prefetch: bool) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    from torchrec_cache.cache import FusedCache, TableSpec
    from torchrec_cache.config import RowOptimizer
    from torchrec_cache.lookup import cached_pooled_lookup, prepare_batch

    torch.manual_seed(0)
    cache = FusedCache([TableSpec(name="t", rows=ROWS, dim=DIM, capacity=int(ROWS * 0.015))], policy="lfu",
                       optimizer=RowOptimizer(kind="adam", lr=1e-2, eps=1e-8), device=device)
    (group,) = cache.groups
    group.host.copy_(torch.randn(ROWS, DIM) * 0.1)
    if pinned:
        assert cache.pin_host_memory()
        assert group.host.is_pinned() and group.host_state.is_pinned()
    cache.finish_setup()
    batches = [b.to(device) for b in _zipf_batches()]
    lengths = torch.ones(BATCH, dtype=torch.int64, device=device)
    feature_table = torch.zeros(1, dtype=torch.int64, device=device)
    anchor = torch.zeros((), device=device, requires_grad=True)
    outs = []
    for i, ids in enumerate(batches):
        b = prepare_batch(cache, ids, lengths, feature_table, train=True)
        out = cached_pooled_lookup(cache, b, lengths, batch_size=BATCH, group_features=[(0, 1)], anchor=anchor)[0]
        if prefetch and i + 1 < STEPS:  # next batch's rows, pinned until it has run (what `prefetching` does)
            cache.prefetch(batches[i + 1], lengths, feature_table, until=cache.step + 1)
        out.square().mean().backward()
        outs.append(out.detach().cpu())
    cache.flush()
    return outs, group.host[:ROWS].detach().cpu().clone(), cache.stats_total()


def test_cache_on_cuda_with_pinned_staging_and_prefetch_equals_the_cpu_reference():
    got_outs, got_table, stats = run_cache(cuda(), pinned=True, prefetch=True)
    ref_outs, ref_table, ref_stats = run_cache(torch.device("cpu"), pinned=False, prefetch=False)
    for step, (a, b) in enumerate(zip(got_outs, ref_outs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, s=step: f"batch {s}: {m}")
    torch.testing.assert_close(got_table, ref_table, atol=1e-5, rtol=1e-5)
    assert stats["rows_loaded"] > 0 and stats["hits"] > 0 and stats["lookups"] == ref_stats["lookups"], stats


def test_torchrec_drop_in_on_cuda():
    """The TorchRec collection drop-in needs TorchRec (and FBGEMM's CUDA build), absent from the GPU image."""
    require("torchrec", "fbgemm_gpu")
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from torchrec_cache import CachedEmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0"])]
    ebc = CachedEmbeddingBagCollection(tables=tables, device=cuda())
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([1, 2, 999], device=cuda()),
                                              lengths=torch.tensor([2, 1], device=cuda()))
    out = ebc(kjt)
    assert out["f0"].shape == (2, 8) and out["f0"].is_cuda


def test_cuda_step_makes_no_implicit_synchronisation():
    """A training step syncs with the host exactly where the cache says it does (``SYNCS``: the two reads of the
    miss count, forward and backward) and nowhere else: CUDA's sync debug mode warns on every implicit sync.
    (This lived in tests/torchrec_cache/test_fast_path.py, which needs TorchRec and so never ran on the GPU
    image; here it drives the TorchRec-free core of the cache.)"""
    import warnings

    from torchrec_cache.cache import FusedCache, TableSpec
    from torchrec_cache.config import RowOptimizer
    from torchrec_cache.lookup import cached_pooled_lookup, prepare_batch
    from torchrec_cache.sync import SYNCS

    device = cuda()
    cache = FusedCache([TableSpec(name="t", rows=ROWS, dim=DIM, capacity=int(ROWS * 0.015))], policy="lfu",
                       optimizer=RowOptimizer(kind="adam", lr=1e-2, eps=1e-8), device=device)
    assert cache.pin_host_memory()
    cache.finish_setup()
    batches = [b.to(device) for b in _zipf_batches(seed=3)[:5]]
    lengths = torch.ones(BATCH, dtype=torch.int64, device=device)
    feature_table = torch.zeros(1, dtype=torch.int64, device=device)
    anchor = torch.zeros((), device=device, requires_grad=True)

    def step(ids: torch.Tensor) -> None:
        b = prepare_batch(cache, ids, lengths, feature_table, train=True)
        out = cached_pooled_lookup(cache, b, lengths, batch_size=BATCH, group_features=[(0, 1)], anchor=anchor)[0]
        out.square().mean().backward()

    step(batches[0])  # warm-up: allocations, staging buffers
    torch.cuda.synchronize()
    for ids in batches[1:]:
        SYNCS.reset()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                step(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in record if "synchroniz" in str(w.message)]
        assert len(syncs) <= SYNCS.count, (SYNCS.count, syncs)
        assert SYNCS.count <= 2, SYNCS.count
