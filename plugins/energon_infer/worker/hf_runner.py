"""The model runner for the transformers fallback: a :class:`~energon_infer.worker.runtime.ModelRunner` whose stage
is a :class:`~energon_infer.worker.hf_stage.TransformersStage`.

Everything above the stage is the runner's own: the packed step, the paged KV cache and its block tables, the
sampler, :meth:`~ModelRunner.run_step` for the engine's workers and :meth:`~ModelRunner.generate` with every
scheduling mode. Only loading differs: transformers builds the model, and the cache takes its shape from the
probe of the model's attention. One rank only (tp=1, pp=1), unquantized, every layer resident, no CUDA graphs.

    runner = TransformersRunner.from_pretrained("path/to/phi-dir")      # any causal LM transformers builds
    outs = runner.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=8))
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any, cast

import torch

from energon_infer.loading.backend import check_fallback_options, model_type_of
from energon_infer.loading.hf_files import auto_dtype
from energon_infer.loading.weights import ModelTooLargeError, available_bytes
from energon_infer.parallel import Grid, local_rank_device
from energon_infer.scheduling.blocks import BlockManager
from energon_infer.worker.building import extra_eos, load_tokenizer
from energon_infer.worker.grammar import GrammarSampler
from energon_infer.worker.hf_stage import load_transformers_stage
from energon_infer.worker.kv_cache import KVCache
from energon_infer.worker.runtime import ModelRunner
from energon_infer.worker.runtime_config import DTYPES, RuntimeConfig

__all__ = ["TransformersRunner"]


class TransformersRunner(ModelRunner):
    """A :class:`ModelRunner` over a model built by transformers (see the module docstring).

    Args:
        path: the model directory (``config.json`` + ``*.safetensors``).
        runtime: layout and cache settings; ``tp``, ``pp`` and ``quantization`` must stay at their defaults.
        tokenizer: a ``tokenizers.Tokenizer``, or ``None``.
    """

    kv_window = 0  # transformers' attention reads a sequence's whole block table: no block is released early

    def __init__(self, path: str | Path, runtime: RuntimeConfig | None = None, *, tokenizer: Any = None):
        rt = runtime or RuntimeConfig()
        self.device = torch.device(rt.device) if rt.device else local_rank_device()
        if rt.dtype == "auto":  # from_pretrained resolved (and said) it already; a direct construction resolves here
            rt = dataclasses.replace(rt, dtype=auto_dtype(path, str(self.device))[0])
        self.runtime, self.tokenizer = rt, tokenizer
        self.dtype = DTYPES[rt.dtype]
        self.grid = Grid.create(1, 1, self.device)
        self.quant = None
        # duck-typed: the stage and config ModelRunner's inherited stepping reads, over transformers' model
        self.stage, self.config = load_transformers_stage(path, self.dtype, self.device)  # type: ignore[assignment]
        config = self.config
        self._say(f"energon: {config.model_type} {config.n_params / 1e6:.1f}M params, {config.n_layers} layers "
                  f"through transformers' modeling code ({self.device}, {rt.dtype})")
        num_blocks = -(-rt.kv_cache_tokens // rt.block_size)
        _check_cache_fits(config.model_type, (num_blocks + 1) * rt.block_size * 2 * config.n_layers
                          * config.n_kv_heads * config.head_dim * self.dtype.itemsize, self.device)
        self.cache = KVCache(n_layers=config.n_layers, num_blocks=num_blocks, block_size=rt.block_size,
                             n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, dtype=self.dtype,
                             device=self.device, host_blocks=-(-rt.swap_space_tokens // rt.block_size), scratch=True)
        # The same state ModelRunner.__init__ starts with (its step-level API and the sampler's bookkeeping).
        self.allocator = BlockManager(num_blocks, rt.block_size, prefix_caching=False)
        self.decode_graphs = None
        self.sampler = GrammarSampler(rt.seed, self)
        self._params = {}
        self._last = {}
        self._seen = {}
        self._ids = itertools.count(-1, -1)
        self.eos_token_ids = config.eos_token_ids

    @classmethod
    def from_pretrained(cls, path: str | Path, runtime: RuntimeConfig | None = None, *, offload: Any = (),
                        **kwargs: Any) -> TransformersRunner:
        """Load a Hugging Face directory; ``kwargs`` are :class:`RuntimeConfig` fields. Options the fallback does
        not run (``tp``/``pp`` > 1, quantization, offloaded blocks) are refused in one line before anything loads."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist; give a directory saved with "
                                    "save_pretrained (config.json + *.safetensors)")
        rt = runtime if runtime is not None else RuntimeConfig(**kwargs)
        if rt.dtype == "auto":  # the checkpoint's own dtype where the device computes in it, as the native path
            dtype, why = auto_dtype(path, rt.device)
            rt = dataclasses.replace(rt, dtype=dtype)
            if rt.progress:
                print(f"energon: dtype {dtype}: {why}", file=sys.stderr, flush=True)
        model_type = model_type_of(path)
        check_fallback_options(model_type, tp=rt.tp, pp=rt.pp, quantization=rt.quantization,
                               memory_pool=bool(offload))
        runner = cls(path, rt, tokenizer=load_tokenizer(path))
        runner.eos_token_ids = tuple(dict.fromkeys(runner.config.eos_token_ids + extra_eos(path)))
        return runner

    def layer_bytes(self) -> tuple[int, ...]:
        """Bytes of each decoder layer (the model's ``layers`` list where it has one, else one figure for all)."""
        layers = _decoder_layers(cast(torch.nn.Module, self.stage.model))
        if layers is None:
            return (sum(p.numel() * p.element_size() for p in self.stage.parameters()),)
        return tuple(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The longest ``ModuleList`` in ``model`` (its decoder layers in every transformers causal LM)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else None


def _check_cache_fits(model_type: str, need: int, device: torch.device) -> None:
    """Refuse a KV cache that cannot fit ``device``'s free memory (the weights are loaded by now)."""
    free = available_bytes(device)
    if free is not None and need > free:
        raise ModelTooLargeError(f"{model_type}: the KV cache needs {need / 2**30:.2f} GiB but {device} has "
                                 f"{free / 2**30:.2f} GiB available after the weights; load with a smaller "
                                 "kv_cache_tokens")
