"""The disk tier of the cache: tables on disk, a host cache level, write-back; against plain TorchRec collections."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.runif import RunIf
from tests.torchrec_cache.common import TOL, make_kjt, reference_optimizer, reference_state, tables
from torchrec_cache import CacheConfig, CachedEmbeddingBagCollection, CachedEmbeddingCollection, RowOptimizer

pytestmark = RunIf(torchrec=True)

# Every fused optimizer.
KINDS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]
WIDTH = sum(t.embedding_dim * len(t.feature_names) for t in tables())


def _disk_pair(tmp_path, kind: str, *, prefetch: int = 0, host_budget: int = 1500):
    from torchrec import EmbeddingBagCollection

    opt = RowOptimizer(kind=kind, lr=0.05, eps=1e-8)
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables())
    # Tiny budgets: ~10% of the rows on the device, ~1500 bytes of host level: every table lives on disk.
    cached = CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(
        capacity=0.1, optimizer=opt, disk_dir=str(tmp_path), host_budget=host_budget, prefetch=prefetch))
    cached.load_state_dict(ref.state_dict())
    return ref, cached, reference_optimizer(ref, opt)


def _batches(n: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return [(make_kjt(tables(), 24, gen), torch.randn(24, WIDTH, generator=gen)) for _ in range(n)]


def _check_equal(ref, cached, ref_opt) -> None:
    got = cached.state_dict()
    for key, want in ref.state_dict().items():
        torch.testing.assert_close(got[key], want, atol=TOL, rtol=TOL)
    state, want_state = cached.fused_optimizer_state(), reference_state(ref_opt, ref)
    for name, entries in want_state.items():
        for k, v in entries.items():
            torch.testing.assert_close(state[name][k].reshape(v.shape), v, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_tables_on_disk_train_like_ebc(tmp_path, kind):
    ref, cached, ref_opt = _disk_pair(tmp_path, kind)
    assert cached.fused_cache.store.tier is not None
    for kjt, target in _batches(30):
        ref_opt.zero_grad()
        want = ref(kjt).values()
        ((want - target) ** 2).sum().backward()
        ref_opt.step()
        got = cached(kjt).values()
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        ((got - target) ** 2).sum().backward()
    _check_equal(ref, cached, ref_opt)
    disk = cached.disk_stats()
    rec = {"sgd": 0, "adagrad": 8, "rowwise_adagrad": 1, "adam": 16}[kind]  # t0's state columns: record size
    assert disk["rows_read"] > 500 and disk["rows_written"] > 500, disk  # rows went through the disk both ways
    assert disk["bytes_read"] >= disk["rows_read"] * 4 * (4 + rec // 2) // 2 and disk["bytes_written"] > 0
    assert 0 < disk["host_rows"] <= disk["host_capacity"] and disk["host_hits"] > 0


def test_lookahead_reads_the_window_from_disk(tmp_path):
    from torchrec_cache import prefetching

    ref, cached, ref_opt = _disk_pair(tmp_path, "adagrad", prefetch=3)
    data = _batches(20, seed=5)
    for kjt, target in data:
        ref_opt.zero_grad()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        ref_opt.step()
    for kjt, target in prefetching(data, cached):
        ((cached(kjt).values() - target) ** 2).sum().backward()
    _check_equal(ref, cached, ref_opt)
    disk = cached.disk_stats()
    assert disk["rows_staged"] > 0 and disk["staged_hits"] > 0, disk  # the window's rows were read ahead and used


def test_embedding_collection_on_disk_trains_like_ec(tmp_path):
    from torchrec import EmbeddingCollection, EmbeddingConfig

    def cfgs():
        return [EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=300, feature_names=["fa"]),
                EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=120, feature_names=["fb"])]

    opt = RowOptimizer(kind="adam", lr=0.05, eps=1e-8)
    torch.manual_seed(0)
    ref = EmbeddingCollection(tables=cfgs())
    cached = CachedEmbeddingCollection(tables=cfgs(), cache=CacheConfig(capacity=0.1, optimizer=opt,
                                                                          disk_dir=str(tmp_path), host_budget=800))
    cached.load_state_dict(ref.state_dict())
    for e in ref.embeddings.values():
        e.sparse = True
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05, eps=1e-8)
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        kjt = make_kjt(cfgs(), 16, gen)  # type: ignore[arg-type]
        ref_opt.zero_grad()
        want, got = ref(kjt), cached(kjt)
        loss = sum((want[f].values() ** 2).sum() for f in ("fa", "fb"))
        loss.backward()  # type: ignore[union-attr]
        ref_opt.step()
        for f in ("fa", "fb"):
            torch.testing.assert_close(got[f].values(), want[f].values(), atol=TOL, rtol=TOL)
        sum((got[f].values() ** 2).sum() for f in ("fa", "fb")).backward()  # type: ignore[union-attr]
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[key], value, atol=TOL, rtol=TOL)
    assert cached.disk_stats()["rows_written"] > 0


def test_save_and_load_tables_stream_chunks(tmp_path):
    from torchrec_cache.checkpoint import load_tables, save_tables

    (tmp_path / "a").mkdir()
    ref, cached, ref_opt = _disk_pair(tmp_path / "a", "adam")
    data = _batches(12, seed=6)
    for kjt, target in data[:6]:
        for model, opt in ((ref, ref_opt), (cached, None)):
            if opt is not None:
                opt.zero_grad()
            ((model(kjt).values() - target) ** 2).sum().backward()
            if opt is not None:
                opt.step()
    (tmp_path / "ckpt").mkdir()
    chunks = []
    store = cached.fused_cache.store
    original = store.table_chunks
    store.table_chunks = lambda name, rows: (chunks.append(c[1].shape[0]) or c for c in original(name, rows))
    save_tables(cached, str(tmp_path / "ckpt"), chunk_rows=32)
    store.table_chunks = original
    assert max(chunks) == 32 and sum(chunks) == sum(t.num_embeddings for t in tables())  # 32 rows at a time
    (tmp_path / "b").mkdir()
    fresh = CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(
        capacity=0.1, optimizer=cached.cache_config().optimizer, disk_dir=str(tmp_path / "b"), host_budget=1500))
    load_tables(fresh, str(tmp_path / "ckpt"), chunk_rows=32)
    for kjt, target in data[6:]:  # training continues from the checkpoint exactly
        for model, opt in ((ref, ref_opt), (fresh, None)):
            if opt is not None:
                opt.zero_grad()
            ((model(kjt).values() - target) ** 2).sum().backward()
            if opt is not None:
                opt.step()
    _check_equal(ref, fresh, ref_opt)


# ---------------------------------------------------------------------------------------------- bad input
def test_load_tables_refuses_a_checkpoint_of_other_tables(tmp_path):
    from torchrec import EmbeddingBagConfig

    from torchrec_cache.checkpoint import load_tables, save_tables

    for d in ("a", "b", "ckpt"):
        (tmp_path / d).mkdir()
    opt = RowOptimizer(kind="adagrad", lr=0.05)
    small = CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(capacity=0.1, optimizer=opt))
    save_tables(small, str(tmp_path / "ckpt"))
    other = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=300, feature_names=["f0"])]
    wrong = CachedEmbeddingBagCollection(tables=other, cache=CacheConfig(capacity=0.1, optimizer=opt,
                                                                           disk_dir=str(tmp_path / "b")))
    with pytest.raises(ValueError, match=r"table 't0'.*300 rows of dim 8.*same tables and optimizer"):
        load_tables(wrong, str(tmp_path / "ckpt"))


def test_disk_dir_that_cannot_hold_the_tables_is_refused(tmp_path):
    from tightfit.storage import StorageError

    with pytest.raises(StorageError, match="does not exist.*mkdir -p"):
        CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(
            optimizer=RowOptimizer(kind="sgd"), disk_dir=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="disk_dir needs a fused optimizer"):
        CacheConfig(disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="host_budget=.* needs disk_dir"):
        CacheConfig(host_budget="1GiB")


@pytest.mark.filterwarnings("ignore:disk directory")
def test_tables_larger_than_the_disk_are_refused_at_construction(mount_tmpfs):
    from torchrec import EmbeddingBagConfig

    from tightfit.storage import DiskFullError

    d = mount_tmpfs("2m")  # tests/conftest.py: a real small disk, unmounted after the test
    big = [EmbeddingBagConfig(name="big", embedding_dim=64, num_embeddings=20_000, feature_names=["f"])]
    with pytest.raises(DiskFullError, match=r"has .* free, .* are needed: free space there"):
        CachedEmbeddingBagCollection(tables=big, cache=CacheConfig(optimizer=RowOptimizer(kind="sgd"),
                                                                     disk_dir=str(d)))


@pytest.mark.filterwarnings("ignore:disk directory")
def test_disk_full_on_write_back_raises_and_loses_no_row(mount_tmpfs):
    from tightfit.storage import DiskFullError

    d = mount_tmpfs("2m")
    ref, cached, ref_opt = _disk_pair(d, "adagrad", host_budget=0)
    filler = d / f"filler-{uuid.uuid4().hex}"
    free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
    with open(filler, "wb") as f:  # the disk is full from here: write-backs have nowhere to go
        f.write(b"\0" * max(0, free - 4096))
    data, raised = _batches(30, seed=7), None
    done = 0
    for kjt, target in data:
        try:
            got = cached(kjt).values()
        except DiskFullError as err:
            raised = err
            break
        ((got - target) ** 2).sum().backward()
        ref_opt.zero_grad()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        ref_opt.step()
        done += 1
    assert raised is not None and "free space" in str(raised), "the full disk went unnoticed"
    filler.unlink()  # space again: the next step retries the write-back; nothing was lost meanwhile
    for kjt, target in data[done:done + 3]:
        ((cached(kjt).values() - target) ** 2).sum().backward()
        ref_opt.zero_grad()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        ref_opt.step()
    _check_equal(ref, cached, ref_opt)
    cached.fused_cache.store.tier.close()


def test_corrupted_row_file_raises_naming_table_and_rows(tmp_path):
    from torchrec import KeyedJaggedTensor

    from torchrec_cache.disk import RowFileError

    _, cached, _ = _disk_pair(tmp_path, "sgd", host_budget=0)
    tier = cached.fused_cache.store.tier
    data = tier.path / "data.bin"
    with open(data, "r+b") as f:  # flip every bit of the row file (the test opens it; the plugin never does)
        block = f.read()
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in block))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], torch.arange(0, 211, dtype=torch.int64),
                                              torch.tensor([211, 0, 0, 0]))
    with pytest.raises(RowFileError, match=r"table 't0' rows \[\d+, \d+\).*corrupted"):
        for _ in range(3):
            cached(kjt)


# ---------------------------------------------------------------------------------------------- the host level
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "take", "peek", "issue", "persist", "range"]),
                              st.lists(st.integers(0, 299), min_size=1, max_size=40, unique=True)),
                    min_size=1, max_size=25),
       slots=st.integers(0, 40))
def test_host_level_always_returns_the_latest_row(tmp_path_factory, ops, slots):
    """Any order of puts, device loads, reads, write-backs and checkpoints: every read is the last write."""
    from tightfit.storage import TensorStore
    from torchrec_cache.disk import DiskRows
    from torchrec_cache.hostlevel import HostLevel

    store = TensorStore(tmp_path_factory.mktemp("level"), extent_bytes=4096)
    disk = DiskRows(store, "g", rows=300, record_bytes=12, tables=[("t", 0, 300)])
    model = torch.zeros(300, 12, dtype=torch.uint8)
    disk.fill(0, model)
    level = HostLevel(disk, slots, key_lo=0, sketch=None)
    version = 0
    try:
        for op, ids in ops:
            pos = torch.tensor(ids, dtype=torch.int64)
            if op == "put":
                version += 1
                recs = (pos.unsqueeze(1) * 7 + version + torch.arange(12)).remainder(256).to(torch.uint8)
                level.put(pos, recs)
                model[pos] = recs
            elif op in ("take", "peek"):
                assert torch.equal(level.fetch(pos, take=op == "take"), model[pos])
                if op == "take":  # the device holds them now and writes them back when it evicts them
                    level.put(pos, model[pos])
            elif op == "issue":
                level.issue()
            elif op == "persist":
                level.persist()
            else:
                lo = int(pos.min())
                assert torch.equal(level.read_range(lo, 300 - lo), model[lo:])
        level.persist()
        assert torch.equal(disk.read_range(0, 300), model)
    finally:
        level.close()
        store.close()


@settings(max_examples=60, deadline=None)
@given(budget=st.one_of(st.integers(-10, 2**40), st.booleans(), st.floats(allow_nan=True), st.none(),
                        st.text(max_size=8), st.sampled_from(["2GiB", "64 KiB", "-1MiB", "1.5GB", "0"])),
       disk_dir=st.one_of(st.none(), st.just(""), st.just("/tmp"), st.integers(0, 3)))
def test_disk_settings_are_accepted_or_refused_in_one_line(budget, disk_dir):
    """Whatever a user passes as host_budget / disk_dir: a valid config, or one ValueError line naming the value."""
    try:
        cfg = CacheConfig(optimizer=RowOptimizer(kind="sgd"), host_budget=budget, disk_dir=disk_dir)
    except ValueError as err:
        msg = str(err)
        assert "\n" not in msg and ("host_budget" in msg or "disk_dir" in msg or "memory size" in msg), msg
        return
    assert cfg.host_budget_bytes() >= 0
    assert budget is None or cfg.disk_dir is not None


def test_state_dict_streams_to_mapped_files_and_loads_back(tmp_path):
    """A disk-backed collection's state dict is mapped files beside the tier (nothing left in disk_dir);
    torch.save / torch.load(mmap=True) / load_state_dict of it, and of the fused optimizer state, continue
    training exactly."""
    (tmp_path / "a").mkdir()
    ref, cached, ref_opt = _disk_pair(tmp_path / "a", "adam")
    data = _batches(8, seed=9)
    for kjt, target in data[:4]:
        ref_opt.zero_grad()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        ref_opt.step()
        ((cached(kjt).values() - target) ** 2).sum().backward()
    before = set(os.listdir(tmp_path / "a"))
    sd, opt_state = cached.state_dict(), cached.fused_optimizer_state()
    assert set(os.listdir(tmp_path / "a")) == before  # the files are unlinked once mapped
    maps = open("/proc/self/maps").read()
    assert "torchrec_cache-t0.weight-" in maps and "torchrec_cache-t0.state-" in maps
    torch.save({"sd": sd, "opt": opt_state}, tmp_path / "ckpt.pt")
    del sd, opt_state
    (tmp_path / "b").mkdir()
    fresh = CachedEmbeddingBagCollection(tables=tables(), cache=CacheConfig(
        capacity=0.1, optimizer=cached.cache_config().optimizer, disk_dir=str(tmp_path / "b"), host_budget=1500))
    saved = torch.load(tmp_path / "ckpt.pt", mmap=True, weights_only=True)
    fresh.load_state_dict(saved["sd"])
    fresh.load_fused_optimizer_state(saved["opt"])
    for kjt, target in data[4:]:
        ref_opt.zero_grad()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        ref_opt.step()
        ((fresh(kjt).values() - target) ** 2).sum().backward()
    _check_equal(ref, fresh, ref_opt)
