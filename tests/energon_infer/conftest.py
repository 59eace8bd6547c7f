from __future__ import annotations

import pytest

from tests.energon_infer.tiny import FAMILIES, references, save_all

GREEDY_TOKENS = 6


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """GPT-2, OPT and LLaMA tiny random checkpoints (sharded safetensors + tokenizer.json), saved once."""
    return save_all(FAMILIES, tmp_path_factory.mktemp("energon_models"))


@pytest.fixture(scope="session")
def hf_refs(tiny_dirs) -> dict[str, dict]:
    """transformers' logits (every position of PROMPTS, one prompt at a time) and greedy generate tokens."""
    return references(tiny_dirs, GREEDY_TOKENS)
