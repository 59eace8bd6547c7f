"""The vocabulary tables read from the checkpoint per step (``MemoryPoolConfig(disk_vocab=...)``): the embedding by
row, the head by chunk. Each checks against the runtime that loaded the tables: the same logits bit for bit (F.linear
on both sides), the same greedy tokens, and only the rows a step needs read."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.loading.config import load_config
from energon_infer.loading.safetensors_files import CheckpointChangedError, TensorFiles
from energon_infer.parallel import Grid
from energon_infer.worker.disk_vocab import (
    DiskEmbedding,
    DiskHead,
    disk_vocab_bytes,
    install_disk_vocab,
    vocab_source,
)
from energon_infer.worker.memory_pool import MemoryPoolConfig
from tests.energon_infer.tiny import PROMPTS, VOCAB, save_tiny
from tests.helpers.runif import RunIf

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
OPTS = dict(progress=False, block_size=4, packed_weights=False)


def _tables_on_disk(path, parts=("embed", "lm_head"), chunk_bytes=None) -> ModelRunner:
    runner = ModelRunner.from_pretrained(path, offload=list(parts), **OPTS)
    for part in parts:
        assert getattr(runner.stage, part).weight.device.type == "meta"  # never loaded
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}  # a few rows per chunk: many, the last short
    install_disk_vocab(runner.stage, runner.config, runner.grid, TensorFiles(path), tuple(parts), runner.dtype, **kw)
    return runner


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "gemma", "llama3-untied"])
def test_tables_read_from_disk_give_the_loaded_models_logits_and_tokens(tmp_path, family):
    path = save_tiny(family, tmp_path / family, shard=None)
    ref = ModelRunner.from_pretrained(path, **OPTS)
    runner = _tables_on_disk(path, chunk_bytes=0)  # chunks of the fewest rows, balanced: 51 and 50
    assert runner.stage.lm_head.chunk == 51 and VOCAB == 101
    items = list(enumerate(PROMPTS))
    assert torch.equal(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True))
    assert [g.token_ids for g in runner.generate(PROMPTS, GREEDY)] == \
        [g.token_ids for g in ref.generate(PROMPTS, GREEDY)]
    # The head read its whole table once per step; the embedding only the distinct ids it looked up.
    held = runner.stage.lm_head
    assert sum(b.numel() for b in held._reads) + held._major.numel() * 4 == \
        disk_vocab_bytes("lm_head", runner.config, 4, 4, chunk_bytes=0)  # what the plan counts
    head, embed = held.table, runner.stage.embed.table
    row = 4 * runner_width(path)
    assert head.bytes_read % (VOCAB * row) == 0 and head.bytes_read > 0
    assert embed.bytes_read < head.bytes_read


def runner_width(path) -> int:
    return load_config(path).embed_dim


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
def test_any_ids_look_up_the_same_rows_as_the_loaded_table(tmp_path_factory, ids):
    path = _llama(tmp_path_factory)
    cfg, files = load_config(path), TensorFiles(path)
    source = vocab_source(cfg, "embed.weight", set(files.keys()))
    assert source is not None
    table = files.read(source).clone()  # the checkpoint's rows, read whole: the reference
    embed = DiskEmbedding(files, source, VOCAB, Grid(), torch.float32)
    got = embed(torch.tensor(ids))
    assert torch.equal(got, torch.nn.functional.embedding(torch.tensor(ids), table))
    assert embed.table.bytes_read == len(set(ids)) * table.shape[1] * 4  # each distinct row once


_CACHE: dict[str, object] = {}


def _llama(factory):
    if "llama" not in _CACHE:
        _CACHE["llama"] = save_tiny("llama", factory.mktemp("vocab") / "llama", shard=None)
    return _CACHE["llama"]


def test_a_vocabulary_shard_pads_past_the_checkpoints_rows_with_zeros(tmp_path):
    path = save_tiny("llama", tmp_path / "m", shard=None)
    cfg, files = load_config(path), TensorFiles(path)
    source = vocab_source(cfg, "lm_head.weight", set(files.keys()))
    full = files.read(source).clone()
    rows = -(-VOCAB // 2)  # rank 1 of tp=2 holds the last 50 rows and one padding row
    head = DiskHead(files, source, VOCAB, rows, Grid(tp=1), torch.float32, chunk_bytes=0)
    head.table.start = rows
    x = torch.randn(3, full.shape[1])
    local = head(x)
    assert local.shape == (3, min(rows, VOCAB))  # trimmed to the vocabulary like the loaded head
    torch.testing.assert_close(local[:, : VOCAB - rows], x @ full[rows:].t())
    assert torch.equal(local[:, VOCAB - rows:], torch.zeros(3, 2 * rows - VOCAB))


def test_a_checkpoint_changed_under_the_tables_is_refused_naming_the_file(tmp_path):
    path = save_tiny("llama", tmp_path / "m", shard=None)
    runner = _tables_on_disk(path)
    file = path / "model.safetensors"
    with open(file, "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(CheckpointChangedError, match="model.safetensors"):
        runner.forward([(0, PROMPTS[0])])


def test_disk_vocab_names_only_the_two_tables():
    with pytest.raises(ValueError, match=r"disk_vocab=\('head',\) may name only 'embed' and 'lm_head'"):
        MemoryPoolConfig(memory_budget="1GiB", disk_vocab=("head",))
    assert MemoryPoolConfig(memory_budget="1GiB", disk_vocab=["embed"]).disk_vocab == ("embed",)


@RunIf(min_world=2)
def test_tp2_ranks_read_their_own_shards_and_equal_the_loaded_model(tmp_path):
    from tests.energon_infer.test_disk_pool import _budget, _tp2_reads
    from tests.helpers.multiprocess import run_distributed

    path = save_tiny("llama", tmp_path / "m", shard=None)
    ref = [g.token_ids for g in ModelRunner.from_pretrained(path, **OPTS).generate(PROMPTS, GREEDY)]
    budget, _, _ = _budget(path, keep=0, tp=2)
    out = run_distributed(_tp2_reads, 2, args=(str(path), budget, 2, 1, ("embed", "lm_head")))
    assert out[0]["gen"] == ref and out[1]["gen"] == ref
