"""``tightfit demo`` for energon: save a tiny model directory, load it, generate from a packed batch.

The directory is written the way ``save_pretrained`` writes one (``config.json``, sharded
``*.safetensors`` with an index, ``tokenizer.json``) from random weights, so the demo needs no
download and no ``transformers``. With ``quick=False`` it also runs the same prompts on
``tp=2`` (two gloo processes) and checks the tokens are identical.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["write_random_llama", "run_demo"]

_CORPUS = [
    "models larger than the hardware fit when the work is split well",
    "a batch of unequal prompts runs packed with no padding at all",
    "every rank holds a slice of each layer and the cache of its heads",
    "the controller sends a step and the workers answer with tokens",
] * 8


def _tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.save(str(path / "tokenizer.json"))


def write_random_llama(path: str | Path, *, vocab: int = 256, hidden: int = 64, layers: int = 4, heads: int = 4,
                       kv_heads: int = 2, intermediate: int = 128, max_positions: int = 256, seed: int = 0) -> Path:
    """Write a random LLaMA-architecture checkpoint directory (two safetensors shards + index + tokenizer)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    d = hidden // heads
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
              "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (shape[-1] ** -0.5) * 2.0

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * d, hidden), p + "self_attn.k_proj.weight": (kv_heads * d, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * d, hidden), p + "self_attn.o_proj.weight": (hidden, heads * d),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        })
    tensors = {n: (torch.ones(s) if len(s) == 1 else rand(*s)) for n, s in shapes.items()}
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in files.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _tokenizer(path, vocab)
    return path


PROMPTS = ["a batch of unequal prompts", "the controller sends", "every rank holds a slice of each layer and"]


def _tp2_worker(rank: int, world: int, path: str, port: int, expected: list[list[int]]) -> None:
    import os

    import torch.distributed as dist

    from energon_infer.sampling import SamplingParams
    from energon_infer.worker.runtime import ModelRunner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runner = ModelRunner.from_pretrained(path, tp=2, progress=False)
        got = [g.token_ids for g in runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))]
        if got != expected:
            raise SystemExit(f"tp=2 generated {got}, tp=1 generated {expected}")
    finally:
        dist.destroy_process_group()


def run_demo(quick: bool = True) -> str:
    from energon_infer.sampling import SamplingParams
    from energon_infer.worker.runtime import ModelRunner

    with tempfile.TemporaryDirectory(prefix="energon-demo-") as tmp:
        path = write_random_llama(tmp)
        print(f"saved a random LLaMA-architecture model (config.json, 2 safetensors shards, tokenizer.json) to\n  {path}")
        runner = ModelRunner.from_pretrained(path)
        start = time.perf_counter()
        gens = runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
        seconds = time.perf_counter() - start
        lengths = [len(g.prompt_token_ids) for g in gens]
        for prompt, g in zip(PROMPTS, gens):
            print(f"  {prompt!r} -> {g.text!r} ({len(g.token_ids)} tokens, {g.finish_reason})")
        print(f"prefill ran {sum(lengths)} packed tokens; a padded batch would run {len(lengths) * max(lengths)}")
        tokens = sum(len(g.token_ids) for g in gens)
        summary = (f"generated {tokens} tokens for {len(gens)} prompts from a saved {runner.config.model_type} "
                   f"directory ({tokens / seconds:.0f} tok/s, packed prefill {sum(lengths)} vs padded "
                   f"{len(lengths) * max(lengths)} tokens)")
        if not quick:
            import torch.multiprocessing as mp

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_tp2_worker, args=(2, str(path), port, [g.token_ids for g in gens]), nprocs=2, join=True)
            summary += "; tp=2 on 2 gloo ranks gave the same tokens"
        return summary
