"""The every-core table of benchmarks/energon_engine.py: the FLOPs it counts for a model and a batch, and the
root cause it records when vLLM's engine dies."""

from __future__ import annotations

import pytest


def test_matmul_work_counts_fed_tokens_through_layers_and_the_head_per_generated_token():
    from benchmarks._energon_shapes import matmul_work

    # 2 sequences, 10 prompt tokens, 6 generated: 10 + 6 - 2 = 14 tokens through the layers, 6 head products.
    assert matmul_work(100.0, 1000.0, 10, 6, 2) == 2.0 * (100 * 14 + 1000 * 6)
    with pytest.raises(ValueError, match="new_tokens=1, sequences=2"):
        matmul_work(100.0, 1000.0, 10, 1, 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_matmul_params_counts_the_head_once_and_no_embedding_lookups(tmp_path, family):
    from benchmarks._energon_shapes import matmul_params
    from benchmarks.energon_engine import save_gpt2, save_model

    hidden, layers, vocab = 64, 2, 128
    if family == "llama":
        path = save_model(tmp_path / "m", hidden=hidden, layers=layers, vocab=vocab, max_positions=64)
        inter = hidden * 8 // 3 // 32 * 32
        kv = hidden // 64 * 32 * 2
        per_layer = hidden * (hidden + kv) + hidden * hidden + 3 * hidden * inter
    else:
        path = save_gpt2(tmp_path / "m", hidden=hidden, layers=layers, vocab=vocab)
        per_layer = hidden * 3 * hidden + hidden * hidden + 2 * hidden * 4 * hidden
    assert matmul_params(path) == (layers * per_layer, hidden * vocab)


def test_gpt2_checkpoint_keeps_its_special_tokens_inside_the_vocabulary(tmp_path):
    import json

    from benchmarks.energon_engine import save_gpt2

    cfg = json.loads((save_gpt2(tmp_path / "g", hidden=64, layers=1, vocab=128) / "config.json").read_text())
    assert cfg["eos_token_id"] < 128 and cfg["bos_token_id"] < 128


def test_root_cause_skips_vllms_wrapper_errors():
    from benchmarks.peers import root_cause

    lines = ["(EngineCore) ERROR [core.py] EngineCore encountered a fatal error.",
             "(Worker) ERROR [x.py] IndexError: index 50256 is out of bounds for dimension 1 with size 4096",
             "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above)"]
    assert root_cause(lines) == ["IndexError: index 50256 is out of bounds for dimension 1 with size 4096"]
    assert root_cause(lines[2:]) == []
