"""The expert-popularity profile: counting, merging, and its file beside the model (atomic, strictly checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit.profiler.experts import POPULARITY_FILE, ExpertPopularity
from tightfit.profiler.types import ProfileError

tmp_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)


@st.composite
def profiles(draw):
    layers, experts = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    counts = draw(st.lists(st.lists(st.integers(0, 2**40), min_size=experts, max_size=experts),
                           min_size=layers, max_size=layers))
    return ExpertPopularity(num_layers=layers, num_experts=experts, experts_per_token=draw(st.integers(1, experts)),
                            model=draw(st.text(max_size=12)), counts=counts)


@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 5), max_size=10)), max_size=20))
def test_add_counts_every_routed_index(batches):
    pop = ExpertPopularity(num_layers=3, num_experts=6, experts_per_token=2)
    truth = [Counter() for _ in range(3)]
    for layer, ids in batches:
        pop.add(layer, torch.tensor(ids, dtype=torch.long) if ids else ids)
        truth[layer].update(ids)
    for layer in range(3):
        assert pop.counts(layer) == tuple(truth[layer][e] for e in range(6))
        total = sum(truth[layer].values())
        assert pop.shares(layer) == (tuple(truth[layer][e] / total for e in range(6)) if total else (1 / 6,) * 6)


@given(profiles())
def test_token_probabilities_sum_to_top_k_where_none_is_capped(pop):
    for layer in range(pop.num_layers):
        probs = pop.token_probabilities(layer)
        assert all(0.0 <= p <= 1.0 for p in probs)
        if max(probs) < 1.0:
            assert sum(probs) == pytest.approx(pop.experts_per_token)


@given(profiles())
def test_merge_adds_counts(pop):
    twice = pop.merge(pop)
    assert [twice.counts(i) for i in range(pop.num_layers)] == [
        tuple(2 * c for c in pop.counts(i)) for i in range(pop.num_layers)]


def test_merge_refuses_another_model():
    a = ExpertPopularity(num_layers=2, num_experts=4, experts_per_token=2)
    b = ExpertPopularity(num_layers=2, num_experts=8, experts_per_token=2)
    with pytest.raises(ProfileError, match=r"different models \(2 layers of 4 experts, top-2 vs 2 layers of 8"):
        a.merge(b)


@tmp_ok
@given(profiles())
def test_save_load_round_trip(tmp_path, pop):
    path = pop.save(tmp_path)
    assert path == tmp_path / POPULARITY_FILE
    assert ExpertPopularity.load(tmp_path, num_layers=pop.num_layers, num_experts=pop.num_experts) == pop
    assert [p.name for p in tmp_path.iterdir()] == [POPULARITY_FILE]  # no temporary file left


@tmp_ok
@given(profiles(), st.data())
def test_a_corrupted_file_is_refused_or_reads_the_same(tmp_path, pop, data):
    """Any byte changed, or the file cut short: a one-line refusal, or (whitespace, key order) the same profile."""
    path = pop.save(tmp_path)
    raw = path.read_bytes()
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([data.draw(st.integers(0, 255).filter(lambda b: b != raw[at]))]) + raw[at + 1:]
    else:
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    path.write_bytes(raw)
    try:
        loaded = ExpertPopularity.load(tmp_path)
    except ProfileError as err:
        assert "\n" not in str(err) and str(path) in str(err)
    else:
        assert loaded == pop


def _valid(**change):
    pop = ExpertPopularity(num_layers=2, num_experts=3, experts_per_token=1, model="m", counts=[[1, 2, 3], [0, 0, 5]])
    raw = json.loads(pop.to_json())
    raw.update(change)
    body = {k: v for k, v in raw.items() if k != "crc32"}
    # The checksum a writer of these bad values would record: CRC-32 of the compact, key-sorted content.
    crc = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps({**raw, "crc32": crc} if "crc32" not in change else raw)


@pytest.mark.parametrize(("text", "match"), [
    (_valid(counts=[[1, 2, -3], [0, 0, 5]]), r"counts\[0\]\[2\]=-3 must be a whole number >= 0"),
    (_valid(counts=[[1, 2, 3.0], [0, 0, 5]]), r"counts\[0\]\[2\]=3.0 must be a whole number"),
    (_valid(counts=[[1, 2, True], [0, 0, 5]]), r"counts\[0\]\[2\]=True must be a whole number"),
    (_valid(counts=[[1, 2, 3]]), r"counts must be 2 rows of 3 counts, got \[3\]"),
    (_valid(version=2), r"version=2, this tightfit reads version 1"),
    (_valid(kind="other"), r"kind='other' is not 'tightfit-expert-popularity'"),
    (_valid(crc32=5), r"checksum mismatch"),
    (_valid(experts_per_token=4), r"experts_per_token=4 must be a whole number >= 1 and <= 3"),
    ('["not", "an", "object"]', r"must be a JSON object with the fields"),
    ("{", r"not valid JSON"),
])
def test_bad_files_are_refused_in_one_line(tmp_path, text, match):
    (tmp_path / POPULARITY_FILE).write_text(text)
    with pytest.raises(ProfileError, match=match) as err:
        ExpertPopularity.load(tmp_path)
    assert "\n" not in str(err.value) and "count again" in str(err.value)


def test_a_profile_of_another_model_is_refused(tmp_path):
    ExpertPopularity(num_layers=2, num_experts=4, experts_per_token=2, model="a").save(tmp_path)
    with pytest.raises(ProfileError, match=r"counted for a: 2 layers of 4 experts, top-2, the model has a: 3 layers"):
        ExpertPopularity.load(tmp_path, num_layers=3)
    with pytest.raises(ProfileError, match=r"the model has b: 2 layers"):
        ExpertPopularity.load(tmp_path, model="b")
    with pytest.raises(FileNotFoundError, match=r"no expert popularity profile at .*plan with uniform popularity"):
        ExpertPopularity.load(tmp_path / "elsewhere")


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    old = ExpertPopularity(num_layers=1, num_experts=2, experts_per_token=1, counts=[[4, 1]])
    old.save(tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)  # fails between the temporary file and the rename
    with pytest.raises(OSError, match="No space left"):
        ExpertPopularity(num_layers=1, num_experts=2, experts_per_token=1, counts=[[0, 9]]).save(tmp_path)
    monkeypatch.undo()
    assert ExpertPopularity.load(tmp_path) == old
    assert [p.name for p in tmp_path.iterdir()] == [POPULARITY_FILE]


@pytest.mark.parametrize(("call", "match"), [
    (lambda p: p.add(2, [0]), r"layer=2 must be a whole number >= 0 and <= 1"),
    (lambda p: p.add(0, [0, 4]), r"expert 4 must be a whole number in \[0, 4\)"),
    (lambda p: p.add(0, [1.5]), r"expert 1.5 must be"),
    (lambda p: ExpertPopularity(num_layers=0, num_experts=4, experts_per_token=1), r"num_layers=0"),
])
def test_bad_arguments_are_refused_in_one_line(call, match):
    pop = ExpertPopularity(num_layers=2, num_experts=4, experts_per_token=2)
    with pytest.raises(ProfileError, match=match) as err:
        call(pop)
    assert "\n" not in str(err.value)


_WRITER = """
import sys
from tightfit.profiler.experts import ExpertPopularity
i = 0
while True:
    i += 1
    ExpertPopularity(num_layers=2, num_experts=64, experts_per_token=2, counts=[[i] * 64] * 2).save(sys.argv[1])
    print(i, flush=True)
"""


def test_a_killed_writer_leaves_a_whole_profile(tmp_path):
    """A process killed while it saves again and again: the file holds one whole version, never a mix."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(20):  # let it save a few times, then kill it mid-loop
            assert proc.stdout is not None and proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait()
    pop = ExpertPopularity.load(tmp_path, num_layers=2, num_experts=64)
    version = pop.counts(0)[0]
    assert version >= 20 and all(pop.counts(layer) == (version,) * 64 for layer in range(2))
