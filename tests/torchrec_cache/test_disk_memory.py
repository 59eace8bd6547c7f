"""Checkpoints of tables larger than memory stream under a hard memory limit.

Two paths, each under a real cgroup v1 limit (``benchmarks/memlimit.py``), never killed: ``checkpoint.save_tables``
/ ``load_tables`` stream rows and optimizer state chunk by chunk (tables with Adagrad state 1.25x the limit,
built on disk, trained, saved, loaded into a fresh collection and compared); ``state_dict()`` hands TorchRec a
tensor per table backed by a file it streamed (clean pages the kernel reclaims), so a state dict whose weights
alone are 1.3x the limit is taken, ``torch.save``-d, loaded back with ``torch.load(mmap=True)`` and compared.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from benchmarks.memlimit import last_json_line, limit_unavailable, run_limited
from tests.helpers.runif import RunIf

pytestmark = [RunIf(torchrec=True),
              pytest.mark.skipif(limit_unavailable() is not None, reason=str(limit_unavailable()))]

MiB = 1 << 20
ROWS, DIM = 2_700_000, 32  # 330 MiB of weights + 330 MiB of Adagrad state
LIMIT = 512 * MiB  # python, torch and torchrec alone: ~270 MiB

# Both children: build a disk-backed collection (optimizer kind from argv) and train it on random ids.
PRELUDE = textwrap.dedent("""
    import json, sys, torch
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec_cache import CacheConfig, CachedEmbeddingBagCollection, RowOptimizer
    rows, dim, base, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    def make(sub):
        t = [EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"],
                                init_fn=lambda w: w.data.fill_(0.01))]
        return CachedEmbeddingBagCollection(tables=t, cache=CacheConfig(
            capacity=0.001, optimizer=RowOptimizer(kind=kind, lr=0.1), disk_dir=f"{base}/{sub}",
            host_budget=8 << 20))
    gen = torch.Generator().manual_seed(0)
    def kjt():
        ids = torch.randint(0, rows, (4096,), generator=gen)
        return KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(4096, dtype=torch.int64))
    a = make("a")
    for _ in range(3):
        a(kjt()).values().sum().backward()
""")

CHILD = PRELUDE + textwrap.dedent("""
    from torchrec_cache.checkpoint import load_tables, save_tables
    save_tables(a, f"{base}/ckpt", chunk_rows=65536)
    b = make("b")
    load_tables(b, f"{base}/ckpt", chunk_rows=65536)
    probe = kjt()
    same = bool(torch.equal(a(probe).values(), b(probe).values()))
    changed = bool((a(probe).values() != 0.01 * dim).any())
    print(json.dumps({"same": same, "trained": changed}))
""")


def test_tables_larger_than_the_limit_save_and_load_under_it(tmp_path):
    for sub in ("a", "b", "ckpt"):
        (tmp_path / sub).mkdir()
    # glibc raises its mmap threshold after the first chunk buffer is freed, so later 16 MiB chunks come from
    # its heap and stay there once freed: measured +244 MiB anonymous memory after building 610 MiB of tables
    # (RssAnon), +39 MiB with a fixed threshold. The streaming paths allocate a chunk at a time and do not
    # reuse buffers yet, so the child runs with a fixed threshold (docs/embedding-cache.md, "Limits").
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = run_limited([sys.executable, "-c", CHILD, str(ROWS), str(DIM), str(tmp_path), "adagrad"], LIMIT,
                      name="test-save-tables", timeout=600, env=env)
    table_bytes = ROWS * DIM * 4 * 2
    assert table_bytes > LIMIT * 1.2
    assert run.enforced and not run.oom_killed, (run.returncode, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]
    assert last_json_line(run.stdout) == {"same": True, "trained": True}
    assert run.peak_bytes <= LIMIT


STATE_DICT_CHILD = PRELUDE + textwrap.dedent("""
    sd = a.state_dict()
    shape = list(sd["embedding_bags.t.weight"].shape)
    torch.save(sd, f"{base}/ckpt/sd.pt")
    del sd
    b = make("b")
    b.load_state_dict(torch.load(f"{base}/ckpt/sd.pt", mmap=True, weights_only=True))
    probe = kjt()
    same = bool(torch.equal(a(probe).values(), b(probe).values()))
    changed = bool((a(probe).values() != 0.01 * dim).any())
    print(json.dumps({"same": same, "trained": changed, "shape": shape}))
""")


def test_a_state_dict_of_tables_larger_than_the_limit_is_taken_saved_and_loaded_under_it(tmp_path):
    for sub in ("a", "b", "ckpt"):
        (tmp_path / sub).mkdir()
    rows, dim = ROWS, 2 * DIM  # 660 MiB of weights (SGD: no state)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # as above
    run = run_limited([sys.executable, "-c", STATE_DICT_CHILD, str(rows), str(dim), str(tmp_path), "sgd"], LIMIT,
                      name="test-state-dict", timeout=600, env=env)
    assert rows * dim * 4 > LIMIT * 1.25
    assert run.enforced and not run.oom_killed, (run.returncode, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]
    assert last_json_line(run.stdout) == {"same": True, "trained": True, "shape": [rows, dim]}
    assert run.peak_bytes <= LIMIT
