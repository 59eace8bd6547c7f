"""A hypothesis state machine drives random writes, byte-range writes, reads, overwrites, deletes, syncs,
reopens and corruptions against an in-memory model of the store (a dict of byte strings)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tightfit.storage import ChecksumError, TensorStore

E = 4096  # one alignment unit per extent: many extents, every boundary case
NAMES = st.sampled_from(["a", "b", "c", "d"])
DATA = st.binary(min_size=0, max_size=3 * E + 100)


class StoreModel(RuleBasedStateMachine):
    @initialize(direct=st.booleans(), workers=st.integers(1, 3))
    def open_store(self, direct: bool, workers: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tightfit-store-model-"))
        self.direct, self.workers = direct, workers
        self.store = TensorStore(self.dir, extent_bytes=E, direct=direct, workers=workers, max_inflight=2)
        self.model: dict[str, bytes] = {}
        self.damaged: set[str] = set()

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(name=NAMES, data=DATA)
    def put(self, name: str, data: bytes) -> None:
        self.store.put(name, data)
        self.model[name] = data
        self.damaged.discard(name)

    @precondition(lambda self: len(self.damaged) < 5)
    @rule(pick=st.data(), data=st.binary(min_size=1, max_size=2 * E + 10), gap=st.integers(0, E + 3))
    def write_range(self, pick: st.DataObject, data: bytes, gap: int) -> None:
        name = pick.draw(st.sampled_from(sorted(set("abcde") - self.damaged)))  # a damaged extent fails to merge
        old = self.model.get(name, b"")
        offset = pick.draw(st.integers(0, len(old) + gap))
        fut = self.store.write(name, data, offset=offset)
        assert fut.result() == len(data)
        grown = bytearray(old) + bytes(max(0, offset + len(data) - len(old)))
        grown[offset:offset + len(data)] = data
        self.model[name] = bytes(grown)

    @precondition(lambda self: self.model)
    @rule(pick=st.data())
    def read(self, pick: st.DataObject) -> None:
        name = pick.draw(st.sampled_from(sorted(self.model)))
        want = self.model[name]
        offset = pick.draw(st.integers(0, len(want)))
        n = pick.draw(st.integers(0, len(want) - offset))
        out = bytearray(n)
        if name in self.damaged:
            with pytest.raises(ChecksumError, match="data.bin"):
                self.store.read_into(name, bytearray(len(want))).result()
            return
        self.store.read_into(name, out, offset=offset).result()
        assert bytes(out) == want[offset:offset + n]

    @precondition(lambda self: self.model)
    @rule(pick=st.data())
    def delete(self, pick: st.DataObject) -> None:
        name = pick.draw(st.sampled_from(sorted(self.model)))
        self.store.delete(name)
        del self.model[name]
        self.damaged.discard(name)

    @rule()
    def sync(self) -> None:
        self.store.sync()

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = TensorStore(self.dir, direct=self.direct, workers=self.workers, max_inflight=2)

    @precondition(lambda self: any(self.model.values()))
    @rule(pick=st.data())
    def corrupt(self, pick: st.DataObject) -> None:
        """Flip one bit of one extent on disk (store closed), then expect reads of that name to fail."""
        name = pick.draw(st.sampled_from(sorted(n for n, v in self.model.items() if v)))
        self.store.close()
        index = json.loads((self.dir / "index.json").read_text())
        extents = [x for x in index["entries"][name]["extents"] if x is not None]
        if extents:
            slot, length, _ = pick.draw(st.sampled_from(extents))
            at = slot * index["extent_bytes"] + pick.draw(st.integers(0, length - 1))
            with open(self.dir / "data.bin", "r+b") as f:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ (1 << pick.draw(st.integers(0, 7)))]))
            self.damaged.add(name)
        self.store = TensorStore(self.dir, direct=self.direct, workers=self.workers, max_inflight=2)

    @invariant()
    def names_match(self) -> None:
        if hasattr(self, "store"):
            assert self.store.names() == sorted(self.model)
            for name, data in self.model.items():
                assert self.store.nbytes(name) == len(data)


StoreModel.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_store_against_model = StoreModel.TestCase


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(writes=st.lists(st.tuples(st.integers(0, 3 * E), st.binary(min_size=1, max_size=2 * E), st.booleans()),
                       min_size=1, max_size=12),
       workers=st.integers(1, 4))
def test_overlapping_writes_in_flight_apply_in_submission_order(tmp_path_factory, writes, workers):
    """Writes to one name submitted without waiting (overlapping, partial extents, some whole puts) end as if
    applied one after the other in the order submitted."""
    d = tmp_path_factory.mktemp("inflight")
    model = bytearray()
    with TensorStore(d, extent_bytes=E, workers=workers, max_inflight=3) as store:
        futures = []
        for offset, data, replace in writes:
            if replace:
                futures.append(None)
                store.put("x", data)  # synchronous: waits for itself only, older writes may still run
                model = bytearray(data)
                continue
            futures.append(store.write("x", data, offset=offset))
            model.extend(bytes(max(0, offset + len(data) - len(model))))
            model[offset:offset + len(data)] = data
        for f in futures:
            if f is not None:
                f.result()
        assert bytes(store.get("x").numpy()) == bytes(model)
