from __future__ import annotations

import pytest

from tests.energon_infer.tiny import FAMILIES, PROMPTS, hf_greedy, hf_logits, save_tiny

GREEDY_TOKENS = 6


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """GPT-2, OPT and LLaMA tiny random checkpoints (sharded safetensors + tokenizer.json), saved once."""
    root = tmp_path_factory.mktemp("energon_models")
    return {f: str(save_tiny(f, root / f)) for f in FAMILIES}


@pytest.fixture(scope="session")
def hf_refs(tiny_dirs) -> dict[str, dict]:
    """transformers' logits (every position of PROMPTS, one prompt at a time) and greedy generate tokens."""
    return {f: {"logits": hf_logits(d, PROMPTS), "greedy": hf_greedy(d, PROMPTS, GREEDY_TOKENS)}
            for f, d in tiny_dirs.items()}
