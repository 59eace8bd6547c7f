"""tightfit.storage: round trips, offsets, overwrites, backpressure, checksums, locking, crashes, bad
directories and a real ENOSPC (small files throughout: the whole file runs in a few seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tightfit.storage import (
    ChecksumError,
    DiskFullError,
    IOEngine,
    StorageError,
    StoreLockedError,
    TensorStore,
    aligned_empty,
    check_disk_dir,
)

E = 8192  # a small extent: several extents per test tensor, unaligned tails everywhere
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _extent_offset(store_dir: Path, name: str, k: int = 0) -> tuple[int, int]:
    index = json.loads((store_dir / "index.json").read_text())
    slot, length, _ = index["entries"][name]["extents"][k]
    return slot * index["extent_bytes"], length


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_dtypes_and_odd_sizes(tmp_path, direct):
    with TensorStore(tmp_path, extent_bytes=E, direct=direct) as store:
        tensors = {f"{dt}-{n}": _rand((n, 3), dt, seed=n) for dt in DTYPES for n in (1, 7, 1001, 5461)}
        tensors["scalar"] = torch.tensor(3.5)
        tensors["empty"] = torch.empty(0, 4)
        for name, t in tensors.items():
            store.put(name, t)
        for name, t in tensors.items():
            got = store.get(name)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    with TensorStore(tmp_path) as store:  # reopened: the index carried shapes and dtypes
        assert sorted(store.names()) == sorted(tensors)
        for name, t in tensors.items():
            assert torch.equal(store.get(name), t), name


def test_unaligned_caller_buffers_and_offsets(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 5 * E + 123, dtype=np.uint8)
    with TensorStore(tmp_path, extent_bytes=E) as store:
        raw = torch.empty(data.size + 3, dtype=torch.uint8)
        src = raw[3:]  # an address that is not 4 KiB-aligned
        src.copy_(torch.from_numpy(data))
        assert store.write("blob", src).result() == data.size
        for offset, n in [(0, data.size), (1, 10), (E - 5, 10), (2 * E, E), (3 * E + 7, 2 * E + 100), (data.size - 1, 1)]:
            out = torch.empty(n + 1, dtype=torch.uint8)[1:]  # unaligned destination
            store.read_into("blob", out, offset=offset).result()
            assert out.numpy().tobytes() == data[offset:offset + n].tobytes(), (offset, n)
        aligned = aligned_empty(data.size)
        store.read_into("blob", aligned).result()
        assert aligned.numpy().tobytes() == data.tobytes()
        with pytest.raises(StorageError, match="past its end"):
            store.read_into("blob", bytearray(10), offset=data.size - 5)
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            store.read_into("nope", bytearray(1))


def test_byte_range_writes_merge_and_grow(tmp_path):
    with TensorStore(tmp_path, extent_bytes=E) as store:
        model = bytearray(b"a" * (2 * E + 10))
        store.write("b", bytes(model)).result()
        futs = []
        for off, chunk in [(5, b"XY" * 10), (E - 3, b"Z" * 8), (2 * E + 5, b"tail" * 4), (4 * E + 1, b"far")]:
            futs.append(store.write("b", chunk, offset=off))
            model.extend(bytes(max(0, off + len(chunk) - len(model))))
            model[off:off + len(chunk)] = chunk
        for f in futs:
            f.result()
        assert store.nbytes("b") == len(model)
        assert bytes(store.get("b").numpy()) == bytes(model)  # the gap reads as zeros


def test_overwrite_keeps_latest_and_reuses_space_after_sync(tmp_path):
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("w", _rand((4000,), torch.float32, 1))
        store.sync()
        size = os.path.getsize(tmp_path / "data.bin")
        for seed in range(2, 6):
            new = _rand((4000 - seed,), torch.float32, seed)
            store.put("w", new)
            store.sync()
            assert torch.equal(store.get("w"), new)
        # each overwrite went to fresh slots; the old ones were reused after each sync, so the file did not grow 4x
        assert os.path.getsize(tmp_path / "data.bin") <= 2 * size + E
        store.delete("w")
        assert "w" not in store and store.names() == []


def test_many_requests_in_flight(tmp_path):
    with TensorStore(tmp_path, extent_bytes=E, workers=3, max_inflight=4) as store:
        ts = [_rand((3 * E // 4 + i,), torch.float32, i) for i in range(40)]
        futs = [store.write(f"t{i}", t) for i, t in enumerate(ts)]
        assert [f.result() for f in futs] == [t.numel() * 4 for t in ts]
        outs = [torch.empty_like(t) for t in ts]
        reads = [store.read_into(f"t{i}", o) for i, o in enumerate(outs)]
        for r, o, t in zip(reads, outs, ts):
            assert r.result() is o and torch.equal(o, t)


def test_backpressure_blocks_the_caller_at_the_bound():
    engine = IOEngine(workers=1, max_inflight=2)
    gate = threading.Event()
    engine.submit(gate.wait)
    engine.submit(gate.wait)
    third_in = threading.Event()

    def third() -> None:
        engine.submit(lambda: None)
        third_in.set()

    t = threading.Thread(target=third)
    t.start()
    assert not third_in.wait(0.3), "a third request was accepted with two in flight and max_inflight=2"
    gate.set()
    assert third_in.wait(5)
    t.join()
    engine.drain()
    engine.close()


def test_engine_threads_carry_its_name_and_run_the_initializer_first():
    """energon runs its disk reads on an IOEngine whose threads each keep one intra-op thread: the initializer
    runs on every worker before its first request."""
    engine = IOEngine(workers=2, max_inflight=4, name="energon-test", initializer=lambda: torch.set_num_threads(1))
    gate = threading.Barrier(2)  # both workers busy at once: each ran the initializer

    def seen() -> tuple[str, int]:
        gate.wait(5)
        return threading.current_thread().name, torch.get_num_threads()

    got = [f.result() for f in [engine.submit(seen), engine.submit(seen)]]
    engine.close()
    assert len({name for name, _ in got}) == 2 and all(name.startswith("energon-test") for name, _ in got)
    assert [n for _, n in got] == [1, 1]


def test_flipped_bit_raises_naming_file_and_offset(tmp_path):
    t = _rand((3 * E // 4,), torch.float32, 3)  # 3 extents
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("w", t)
    offset, _ = _extent_offset(tmp_path, "w", 1)
    with open(tmp_path / "data.bin", "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)[0]
        f.seek(offset + 100)
        f.write(bytes([byte ^ 0x10]))
    with TensorStore(tmp_path) as store:
        with pytest.raises(ChecksumError, match=rf"data\.bin: checksum mismatch .* byte offset {offset} .*'w'") as err:
            store.get("w")
        assert err.value.offset == offset and err.value.path.endswith("data.bin")
        out = torch.empty(10)
        store.read_into("w", out).result()  # extent 0 is intact
        assert torch.equal(out, t[:10])


def test_truncated_file_raises_naming_file_and_offset(tmp_path):
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("w", _rand((E,), torch.float32, 4))  # 4 extents
    offset, _ = _extent_offset(tmp_path, "w", 3)
    os.truncate(tmp_path / "data.bin", offset + 10)
    with TensorStore(tmp_path) as store:
        with pytest.raises(ChecksumError, match=rf"data\.bin is truncated: .* byte offset {offset}"):
            store.get("w")


def test_damaged_index_is_refused_naming_it(tmp_path):
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("w", torch.ones(10))
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(StorageError, match=r"index\.json: cannot read the store index"):
        TensorStore(tmp_path)


HOLDER = textwrap.dedent("""
    import sys, time, torch
    from tightfit.storage import TensorStore
    store = TensorStore(sys.argv[1], extent_bytes=8192)
    store.put("a", torch.full((5000,), 1.0))
    store.sync()
    store.put("a", torch.full((5000,), 2.0))   # overwritten, never synced
    store.put("b", torch.full((100,), 3.0))    # new, never synced
    print("ready", flush=True)
    time.sleep(60)
""")


def _holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_second_process_is_refused_and_a_killed_writer_reopens_at_last_sync(tmp_path):
    proc = _holder(tmp_path)  # one real subprocess for both (starting Python with torch takes seconds here)
    try:
        with pytest.raises(StoreLockedError, match=rf"in use by process {proc.pid}") as err:
            TensorStore(tmp_path)
        assert err.value.pid == proc.pid
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # before it ever syncs its second state
        proc.wait()
    with TensorStore(tmp_path) as store:  # the lock died with its holder; the store is at its last sync()
        assert store.names() == ["a"]
        assert torch.equal(store.get("a"), torch.full((5000,), 1.0))
        with pytest.raises(StoreLockedError, match=rf"in use by process {os.getpid()}"):
            TensorStore(tmp_path)  # a second store in the same process is refused too


def test_for_rank_gives_each_rank_its_directory(tmp_path):
    with TensorStore.for_rank(tmp_path, 0) as r0, TensorStore.for_rank(tmp_path, 1) as r1:
        r0.put("x", torch.zeros(3))
        r1.put("x", torch.ones(3))
        assert r0.path == tmp_path / "rank0" and torch.equal(r1.get("x"), torch.ones(3))


def test_bad_directories_are_refused_before_any_work(tmp_path):
    with pytest.raises(StorageError, match=r"does not exist: .*mkdir -p"):
        check_disk_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is not a directory"):
        TensorStore(tmp_path / "file")
    with pytest.raises(DiskFullError, match=r"free, .* are needed: free space there") as err:
        check_disk_dir(tmp_path, need_bytes=2**62)
    assert err.value.needed_bytes == 2**62 and err.value.free_bytes > 0


def test_read_only_directory_is_refused(tmp_path):
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs root with mount rights)")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only here")
        with pytest.raises(StorageError, match=r"is not writable \(Read-only file system\)"):
            TensorStore(ro)
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_tmpfs_warns_that_it_is_ram(mount_tmpfs):
    d = mount_tmpfs("4M")
    with pytest.warns(UserWarning, match="tmpfs, which is RAM"):
        check_disk_dir(d)
    with pytest.warns(UserWarning, match="RAM"), TensorStore(d, extent_bytes=E) as store:
        store.put("x", torch.arange(10))
        assert torch.equal(store.get("x"), torch.arange(10))


def test_real_enospc_keeps_the_previous_state(mount_tmpfs):
    d = mount_tmpfs("2M")
    old = _rand((200_000,), torch.float32, 5)  # 800 KB
    with pytest.warns(UserWarning, match="RAM"):
        store = TensorStore(d, extent_bytes=64 * 1024)
    with store:
        store.put("w", old)
        store.sync()
        with pytest.raises(DiskFullError, match=r"disk full \(ENOSPC\) while writing .* 'w'.* free") as err:
            store.put("w", _rand((400_000,), torch.float32, 6))  # 1.6 MB beside the old copy: no room
        assert err.value.needed_bytes == 1_600_000
        assert torch.equal(store.get("w"), old)  # the old copy survived the failed overwrite
        with pytest.raises(DiskFullError):
            store.put("new", torch.zeros(500_000))
        assert store.names() == ["w"]
        store.put("small", torch.ones(1000))  # the failed writes' space was given back
        store.sync()
    with pytest.warns(UserWarning, match="RAM"), TensorStore(d) as store:
        assert store.names() == ["small", "w"] and torch.equal(store.get("w"), old)


def test_cuda_tensors_and_bad_arguments_are_refused(tmp_path):
    with TensorStore(tmp_path, extent_bytes=E) as store:
        with pytest.raises(StorageError, match="neither a tensor nor a buffer"):
            store.write("x", 3.5)
        with pytest.raises(StorageError, match="offset=-1 must be"):
            store.write("x", b"abc", offset=-1)
        with pytest.raises(StorageError, match="non-empty string"):
            store.write("", b"abc")
        store.put("x", torch.ones(4))
        with pytest.raises(StorageError, match="not contiguous"):
            store.read_into("x", torch.empty(4, 2)[:, 0])
        with pytest.raises(StorageError, match="read-only"):
            store.read_into("x", b"0123")
        if torch.cuda.is_available():
            with pytest.raises(StorageError, match="pinned CPU tensor"):
                store.read_into("x", torch.empty(4, device="cuda"))
    with pytest.raises(StorageError, match="closed"):
        store.put("y", torch.ones(1))


def test_close_is_idempotent_and_waits(tmp_path):
    store = TensorStore(tmp_path, extent_bytes=E)
    futs = [store.write(f"x{i}", torch.full((3000,), float(i))) for i in range(10)]
    store.close()
    store.close()
    assert all(f.done() for f in futs)
    with TensorStore(tmp_path) as again:
        assert torch.equal(again.get("x9"), torch.full((3000,), 9.0))
    time.sleep(0)  # nothing left running


def test_delete_gives_the_space_back_at_sync(tmp_path):
    with TensorStore(tmp_path, extent_bytes=64 * 1024) as store:
        store.put("big", torch.ones(2**20))  # 4 MiB
        store.sync()
        used = os.stat(tmp_path / "data.bin").st_blocks * 512
        store.delete("big")
        store.sync()
        after = os.stat(tmp_path / "data.bin").st_blocks * 512
        assert used >= 4 * 2**20 and after < 2**20, (used, after)
        store.put("again", torch.full((1000,), 2.0))  # a punched slot is reused and reads back right
        assert torch.equal(store.get("again"), torch.full((1000,), 2.0))


@pytest.mark.parametrize("edit, match", [
    (lambda i: i["entries"]["w"].update(shape=[3]), "must both be given .* describe its 40 bytes"),
    (lambda i: i["entries"]["w"]["extents"][0].__setitem__(1, 99999), r"extent 0=.* must be \[slot, 1\.\.40"),
    (lambda i: i.update(extent_bytes=1000), "extent_bytes=1000 must be a positive multiple of 4096"),
    (lambda i: i.update(checksum="md5"), "checksum 'md5' is not 'crc32'"),
    (lambda i: i["entries"]["w"].update(dtype="object"), "dtype='object' is not one of"),
])
def test_inconsistent_index_is_refused_naming_the_field(tmp_path, edit, match):
    with TensorStore(tmp_path, extent_bytes=E) as store:
        store.put("w", torch.ones(10))
    index = json.loads((tmp_path / "index.json").read_text())
    edit(index)
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(StorageError, match=match):
        TensorStore(tmp_path)


def test_reads_in_flight_keep_their_extents_through_overwrites(tmp_path):
    """A read returns the data as of its submission even when the name is overwritten (and the space
    reused by another tensor) before it runs."""
    a, b = _rand((6 * E // 4,), torch.float32, 7), _rand((6 * E // 4,), torch.float32, 8)
    with TensorStore(tmp_path, extent_bytes=E, workers=4, max_inflight=64) as store:
        store.put("x", a)
        store.sync()
        store.put("x", b)  # a's slots are durable: kept until the next sync
        outs = [torch.empty_like(b) for _ in range(40)]
        reads = [store.read_into("x", o) for o in outs]
        store.put("x", a)  # b's slots are not durable: free as soon as no read uses them
        store.put("y", _rand((12 * E // 4,), torch.float32, 9))  # takes any slot that is free
        for r, o in zip(reads, outs):
            assert r.result() is o and torch.equal(o, b)
        assert torch.equal(store.get("x"), a)


def test_slot_rules_never_hand_out_a_slot_in_use():
    """The allocator's two rules: a slot the synced index references waits for the next sync; a slot a read in
    flight uses waits for the read."""
    from tightfit.storage.index import Slots

    slots = Slots({0, 1})  # 0 and 1 are in the synced index
    assert slots.alloc() == 2
    slots.release(0)  # overwritten: still what a crash would reopen
    assert slots.alloc() == 3
    slots.read_begin(2)
    slots.release(2)  # never synced, but being read
    assert slots.alloc() == 4
    slots.read_end(2)
    assert slots.alloc() == 2  # the read ended: free now
    given_back: list[int] = []
    slots.synced({1, 3, 4}, given_back.append)  # the new index no longer has 0
    assert given_back == [0] and slots.alloc() == 0
    slots.release(1)
    slots.read_begin(1)
    slots.synced({3, 4}, given_back.append)  # 1 left the index but is being read: no hole punched, not free
    assert given_back == [0] and slots.alloc() == 5
    slots.read_end(1)
    assert slots.alloc() == 1
