"""What the model runner builds before it runs: the stage of decoder blocks (parameters allocated where they are
loaded, left on meta where they are offloaded or loaded quantized), the tokenizer and the extra end-of-sequence ids of
a checkpoint directory. Split out of :mod:`energon_infer.worker.runtime`, which uses them in ``from_pretrained``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from energon_infer.loading.config import ModelConfig
from energon_infer.loading.quantization import quantized_parts
from energon_infer.parallel import Grid, pack_weights
from energon_infer.worker.model import DecoderStage

__all__ = ["build_stage", "extra_eos", "load_tokenizer", "pack_loaded"]


def load_tokenizer(path: Path) -> Any:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def extra_eos(path: Path) -> tuple[int, ...]:
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    eos = json.loads(file.read_text()).get("eos_token_id")
    return () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))


def build_stage(cfg: ModelConfig, grid: Grid, layers: range, dtype: torch.dtype, device: torch.device,
                 offload: Sequence[int | str], quantized: bool = False) -> DecoderStage:
    """The stage with its parameters allocated on ``device``, except the ``offload`` blocks' (left on meta:
    never allocated, so a model larger than memory can be built) and, when ``quantized``, the block projections'
    weights (left on meta for :func:`energon_infer.loading.quantization.load_quantized` to fill quantized)."""
    if not offload and not quantized:
        return DecoderStage(cfg, grid, layers, dtype=dtype, device=device)
    stage = DecoderStage(cfg, grid, layers, dtype=dtype, device="meta")
    blocks = list(stage.layers.values())
    # ints: block positions; names: modules read from the checkpoint when used ("embed" / "lm_head": disk_vocab;
    # "layers.<i>.moe.experts.<e>": expert_pool), absent ones (another stage's) skipped
    names = dict(stage.named_modules())
    parts = [blocks[i] if isinstance(i, int) else names.get(i) for i in offload]
    skip = {id(m) for part in parts if part is not None for m in part.modules()}
    later = {(id(m), attr) for b in blocks for _, m, attr in quantized_parts(b)} if quantized else set()
    for module in stage.modules():
        if id(module) in skip:
            continue
        for name, p in module._parameters.items():
            if p is not None and (id(module), name) not in later:
                # empty_like keeps the strides (input-major linear weights stay so)
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
    return stage


def pack_loaded(stage: DecoderStage) -> int:
    """:func:`pack_weights` for every part of ``stage`` that was loaded (offloaded blocks and tables have nothing to
    pack)."""
    loaded = [m for name, m in stage.named_children() if name != "layers"] + list(stage.layers.values())
    return sum(pack_weights(m) for m in loaded if next(m.parameters(), torch.empty(0)).device.type != "meta")
