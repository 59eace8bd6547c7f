"""How a model is laid out and cached on the worker grid: :class:`RuntimeConfig` (the engine's ``runtime=``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from energon_infer.scheduling.scheduler_config import DEFAULT_MAX_BATCH_TOKENS
from tightfit.checks import check_number

__all__ = ["RuntimeConfig", "DTYPE_NAMES"]  # and DTYPES, built on first use (below)

#: the dtype names a runtime takes -> torch's attribute; this module imports without torch (``tightfit serve --help``
#: reads these configs), so :data:`DTYPES`, the same names mapped to torch dtypes, is built on first use
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        import torch

        return {key: getattr(torch, value) for key, value in DTYPE_NAMES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    """How a model is laid out and cached.

    Args:
        tp: tensor-parallel ranks per stage (must divide the heads, key/value heads and MLP width).
        pp: pipeline stages (contiguous, even layer ranges).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (weights, activations and the cache), or ``"auto"``:
            the checkpoint's dtype where the device computes in it natively, else float32
            (:func:`energon_infer.loading.hf_files.auto_dtype`).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` picks ``cuda:<LOCAL_RANK>`` when CUDA is there.
        block_size: tokens per KV-cache block.
        kv_cache_tokens: cache capacity in tokens (rounded up to whole blocks), shared by all sequences.
        swap_space_tokens: host memory for preempted sequences' keys/values, in tokens (0: preemption recomputes).
        microbatches: micro-batches per step with ``pp > 1`` (0: ``pp``); more shrink the pipeline
            bubble, fewer make each matmul larger.
        max_batch_tokens: :meth:`ModelRunner.generate` admits new prompts while a step stays under this
            (default :data:`energon_infer.scheduling.scheduler.DEFAULT_MAX_BATCH_TOKENS`; the engine sets it from its own).
        seed: seeds the generator that seeds requests without their own seed.
        progress: print loading progress on rank 0 (stderr).
        nonfinite_weights: a NaN/inf weight at load: ``"warn"`` (naming the tensor), ``"error"``, ``"ignore"``.
        cuda_graphs: decode from CUDA graphs: None on for CUDA at tp=1; True/[sizes] insist; False off (cuda_graphs.py).
        packed_weights: on the CPU, also keep each projection weight in oneDNN's blocked layout: decode-step
            matmuls faster from two rows up, for a second copy of those weights (tightfit.kernels.packed_linear).
        quantization: ``None``, ``"int8"`` or ``"int4"``: hold every block's projection weights quantized with
            torchao (energon_infer.loading.quantization); needs torchao installed.
        group_size: inputs per int4 group (32, 64, 128 or 256; default 128); int4 only.
        model_impl: ``"auto"`` (a native family where one reads the checkpoint, else transformers' modeling code),
            ``"native"`` (refuse what no native family reads) or ``"transformers"`` (transformers' modeling code
            even where a native family exists); see :func:`energon_infer.loading.backend.choose_backend`.
    """

    tp: int = 1
    pp: int = 1
    dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    kv_cache_tokens: int = 32768
    swap_space_tokens: int = 0
    microbatches: int = 0
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    seed: int = 0
    progress: bool = True
    nonfinite_weights: str = "warn"
    cuda_graphs: bool | tuple[int, ...] | None = None
    packed_weights: bool = True
    quantization: str | None = None
    group_size: int | None = None
    model_impl: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "block_size", "kv_cache_tokens", "swap_space_tokens", "microbatches",
                     "max_batch_tokens", "seed"):
            check_number(getattr(self, name), name, where="RuntimeConfig", integer=True,
                         fix="give a whole number (e.g. tp=2, kv_cache_tokens=32768)")
            object.__setattr__(self, name, int(getattr(self, name)))  # 2.0 -> 2: ranks and ranges need ints
        from energon_infer.worker.cuda_graphs import check_cuda_graphs

        object.__setattr__(self, "cuda_graphs", check_cuda_graphs(self.cuda_graphs, device=self.device, tp=self.tp))
        if not isinstance(self.packed_weights, bool):
            raise ValueError(f"packed_weights={self.packed_weights!r} must be True or False")
        if self.nonfinite_weights not in ("warn", "error", "ignore"):
            raise ValueError(f"nonfinite_weights={self.nonfinite_weights!r} must be 'warn', 'error' or 'ignore'")
        from energon_infer.loading.quantization import QuantSpec

        QuantSpec.create(self.quantization, self.group_size)  # an unknown method or a bad group size: one line
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp={self.tp} and pp={self.pp} must be >= 1")
        from energon_infer.loading.backend import check_model_impl

        check_model_impl(self.model_impl)
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use 'auto' or one of {', '.join(DTYPE_NAMES)}")
        if self.block_size < 1 or self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"block_size={self.block_size} must be >= 1 and kv_cache_tokens={self.kv_cache_tokens} at least "
                "one block"
            )
        if self.microbatches < 0 or self.max_batch_tokens < 1 or self.swap_space_tokens < 0:
            raise ValueError(f"microbatches={self.microbatches} and swap_space_tokens={self.swap_space_tokens} must "
                             f"be >= 0 and max_batch_tokens={self.max_batch_tokens} >= 1")
