"""``swap_in`` of a model built on the meta device with a ``disk_dir``: the rows go straight to disk, as TorchRec
would initialise them, chunk by chunk (never a whole table in memory, checked under a hard memory limit)."""

from __future__ import annotations

import functools
import os
import sys
import textwrap

import pytest
import torch

from benchmarks.memlimit import last_json_line, limit_unavailable, run_limited
from tests.helpers.runif import RunIf
from tests.torchrec_cache.common import TOL, make_kjt, reference_optimizer, tables
from torchrec_cache import CacheConfig, CachedEmbeddingBagCollection, RowOptimizer, swap_in

pytestmark = RunIf(torchrec=True)


def _tables():
    """The common tables plus two spanning several init chunks (65536 rows): one with TorchRec's default init,
    one with ``normal_`` whose last chunk would hold fewer than 16 elements (merged into the one before)."""
    from torchrec import EmbeddingBagConfig

    return tables() + [
        EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=140_001, feature_names=["f4"]),
        EmbeddingBagConfig(name="normal", embedding_dim=4, num_embeddings=2 * 65536 + 3, feature_names=["f5"],
                           init_fn=functools.partial(torch.nn.init.normal_, std=0.02)),
    ]


def _torchrec_reference(seed: int):
    """A plain collection whose rows TorchRec's ``reset_parameters`` set from the same RNG state (each table's
    init_fn on its whole weight, in the configs' order)."""
    from torchrec import EmbeddingBagCollection

    ref = EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
    torch.manual_seed(seed)
    ref.reset_parameters()
    return ref


def test_swap_in_of_a_meta_collection_writes_torchrecs_rows_to_disk_and_trains_like_it(tmp_path):
    from torchrec import EmbeddingBagCollection

    opt = RowOptimizer(kind="adagrad", lr=0.05, eps=1e-8)
    meta = EmbeddingBagCollection(tables=_tables(), device=torch.device("meta"))
    torch.manual_seed(11)
    cached = swap_in(meta, cache=CacheConfig(capacity=0.05, optimizer=opt, disk_dir=str(tmp_path),
                                             host_budget=4096))
    assert isinstance(cached, CachedEmbeddingBagCollection) and cached.device.type == "cpu"
    assert cached.fused_cache.store.tier is not None
    ref = _torchrec_reference(11)
    got = cached.state_dict()
    for key, want in ref.state_dict().items():
        assert torch.equal(got[key], want), key  # bit-exact: the same RNG stream in the same order
    ref_opt = reference_optimizer(ref, opt)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        kjt = make_kjt(_tables(), 32, gen)
        ref_opt.zero_grad()
        want = ref(kjt).values()
        (want ** 2).sum().backward()
        ref_opt.step()
        out = cached(kjt).values()
        torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
        (out ** 2).sum().backward()
    got = cached.state_dict()
    for key, want in ref.state_dict().items():
        torch.testing.assert_close(got[key], want, atol=TOL, rtol=TOL)
    assert cached.disk_stats()["rows_read"] > 0


def test_a_meta_dlrm_swapped_in_then_materialised_keeps_its_cached_rows(tmp_path):
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM

    cfgs = tables()
    for c in cfgs:
        c.embedding_dim = 8
    with torch.device("meta"):
        model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=cfgs), dense_in_features=5,
                     dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    torch.manual_seed(3)
    model = swap_in(model, cache=CacheConfig(capacity=0.2, optimizer=RowOptimizer(kind="sgd", lr=0.1),
                                             disk_dir=str(tmp_path)))
    ebc = model.sparse_arch.embedding_bag_collection
    gen = torch.Generator().manual_seed(0)
    kjt = make_kjt(cfgs, 16, gen)
    before = ebc(kjt).values()  # rows now sit in the device slots
    model.to_empty(device="cpu")  # the dense layers materialise; the cache keeps its slots and index
    _fix_interaction(model)
    torch.testing.assert_close(ebc(kjt).values(), before, atol=0, rtol=0)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    assert model(torch.randn(16, 5, generator=gen), kjt).shape == (16, 1)
    ref = EmbeddingBagCollection(tables=cfgs)
    torch.manual_seed(3)
    ref.reset_parameters()
    torch.testing.assert_close(ebc(kjt).values(), ref(kjt).values(), atol=TOL, rtol=TOL)


def _fix_interaction(model) -> None:
    """DLRM's interaction keeps index pairs in a buffer that ``to_empty`` leaves uninitialised (TorchRec's own
    module, not the cache): set it again as its constructor does."""
    f = model.inter_arch.F
    model.inter_arch.triu_indices = torch.triu_indices(f + 1, f + 1, offset=1)


def test_an_init_fn_that_depends_on_the_shape_is_refused_naming_the_table(tmp_path):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    cfg = EmbeddingBagConfig(name="wide", embedding_dim=8, num_embeddings=70_000, feature_names=["f"],
                             init_fn=torch.nn.init.xavier_uniform_)
    meta = EmbeddingBagCollection(tables=[cfg], device=torch.device("meta"))
    with pytest.raises(ValueError, match="table 'wide': its init_fn .* depend on the tensor's shape .* elementwise"):
        swap_in(meta, cache=CacheConfig(optimizer=RowOptimizer(kind="sgd"), disk_dir=str(tmp_path)))


MiB = 1 << 20
ROWS, DIM = 2_700_000, 32  # 330 MiB of weights + 330 MiB of Adagrad state on disk
LIMIT = 512 * MiB

# The child: TorchRec's DLRM on the meta device, swapped in with a disk tier, trained a few steps. The first
# init chunk is compared with what TorchRec's init_fn gives the table's first rows (one RNG stream: they come first).
META_CHILD = textwrap.dedent("""
    import json, sys, torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM
    from torchrec_cache import CacheConfig, RowOptimizer, swap_in
    rows, dim, base = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cfg = EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])
    with torch.device("meta"):
        model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=[cfg]), dense_in_features=4,
                     dense_arch_layer_sizes=[16, dim], over_arch_layer_sizes=[8, 1])
    torch.manual_seed(7)
    model = swap_in(model, cache=CacheConfig(capacity=0.001, optimizer=RowOptimizer(kind="adagrad", lr=0.1),
                                             disk_dir=base, host_budget=8 << 20))
    model.to_empty(device="cpu")
    f = model.inter_arch.F  # DLRM's index pairs, a buffer to_empty leaves uninitialised
    model.inter_arch.triu_indices = torch.triu_indices(f + 1, f + 1, offset=1)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    ebc = model.sparse_arch.embedding_bag_collection
    torch.manual_seed(7)
    first = torch.empty(65536, dim)
    cfg.init_fn(first)
    _, w, _ = next(ebc.fused_cache.store.table_chunks("t", 65536))
    same = bool(torch.equal(w, first))
    del first, w
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, rows, (4096,), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(4096, dtype=torch.int64))
        model(torch.randn(4096, 4, generator=gen), kjt).sum().backward()
    print(json.dumps({"same": same, "written": ebc.disk_stats()["bytes_written"] >= rows * dim * 8}))
""")


@pytest.mark.skipif(limit_unavailable() is not None, reason=str(limit_unavailable()))
def test_a_meta_dlrm_larger_than_the_limit_is_materialised_on_disk_under_it(tmp_path):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # as test_disk_memory: chunk buffers go back to the OS
    run = run_limited([sys.executable, "-c", META_CHILD, str(ROWS), str(DIM), str(tmp_path)], LIMIT,
                      name="test-meta-disk", timeout=600, env=env)
    assert ROWS * DIM * 4 * 2 > LIMIT * 1.2
    assert run.enforced and not run.oom_killed, (run.returncode, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]
    assert last_json_line(run.stdout) == {"same": True, "written": True}
    assert run.peak_bytes <= LIMIT
