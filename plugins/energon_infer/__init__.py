"""EnergonAI: padding-free tensor/pipeline-parallel inference with a single controller and an HTTP server.

    from energon_infer import ModelRunner, SamplingParams
    runner = ModelRunner.from_pretrained("path/to/hf-model-dir")          # tp=2, pp=2 under torchrun
    out = runner.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

The runtime loads the native families' checkpoints (GPT-2, OPT, Llama 1-3, Mistral, Qwen 2/3, Gemma 1-3, Phi-3,
OLMo 2, Granite; ``docs/model-families.md``) and the tightfit example GPT's training checkpoints, runs
batches packed with no padding over a paged KV cache, and splits models over a ``tp x pp`` grid of ranks. Any other
causal LM transformers builds loads as a :class:`TransformersRunner` (its modeling code over energon's scheduler and
cache). Names load on first use, so ``tightfit plugins`` stays fast.

The engine drives that runtime from one controller (continuous batching, worker processes, memory
pooling, faults) and the server puts it behind an OpenAI-compatible HTTP API:

    with Engine.from_pretrained("path/to/hf-model-dir", tp=2) as engine:   # spawns 2 worker processes
        print(engine.generate(["Hello"])[0].text)
    # tightfit serve path/to/hf-model-dir --tp 2 --port 8000
"""

from __future__ import annotations

import importlib
from typing import Any

from tightfit.plugins import Plugin

__all__ = [
    "plugin",
    "ModelRunner",
    "TransformersRunner",
    "RuntimeConfig",
    "Generation",
    "ContextLengthError",
    "SamplingParams",
    "StructuredOutput",
    "ModelConfig",
    "UnsupportedModelError",
    "WeightError",
    "KVCacheFullError",
    "load_tightfit_gpt",
    "Engine",
    "EngineConfig",
    "SchedulerConfig",
    "FaultConfig",
    "LaunchConfig",
    "EnergonError",
    "Completion",
    "TokenEvent",
    "QueueFullError",
    "WorkerFailedError",
    "EngineClosedError",
    "RequestFailedError",
    "MemoryPoolConfig",
    "ServerConfig",
    "run_worker",
]

_LAZY = {
    "ModelRunner": "energon_infer.worker.runtime",
    "TransformersRunner": "energon_infer.worker.hf_runner",
    "RuntimeConfig": "energon_infer.worker.runtime",
    "Generation": "energon_infer.worker.runtime",
    "ContextLengthError": "energon_infer.worker.runtime",
    "SamplingParams": "energon_infer.sampling",
    "StructuredOutput": "energon_infer.structured",
    "ModelConfig": "energon_infer.loading.config",
    "UnsupportedModelError": "energon_infer.loading.config",
    "WeightError": "energon_infer.loading.weights",
    "KVCacheFullError": "energon_infer.worker.kv_cache",
    "load_tightfit_gpt": "energon_infer.worker.gpt_checkpoint",
    "Engine": "energon_infer.engine.engine",
    "EngineConfig": "energon_infer.engine.engine_config",
    "SchedulerConfig": "energon_infer.scheduling.scheduler_config",
    "FaultConfig": "energon_infer.engine.engine_config",
    "LaunchConfig": "energon_infer.engine.engine_config",
    "EnergonError": "energon_infer.errors",
    "Completion": "energon_infer.engine.delivery",
    "TokenEvent": "energon_infer.engine.delivery",
    "WorkerFailedError": "energon_infer.engine.controller",
    "EngineClosedError": "energon_infer.engine.controller",
    "RequestFailedError": "energon_infer.engine.delivery",
    "QueueFullError": "energon_infer.scheduling.scheduler",
    "MemoryPoolConfig": "energon_infer.worker.memory_pool",
    "ServerConfig": "energon_infer.serving.server",
    "run_worker": "energon_infer.worker.torchrun",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'energon_infer' has no attribute {name!r}")


def _demo(quick: bool) -> str:
    from energon_infer.demo import run_demo

    summary = run_demo(quick)
    from energon_infer.engine_demo import run_engine_demo

    return f"{summary}; {run_engine_demo(quick)}"


def _serve(argv: list[str]) -> int:
    from energon_infer.serving.serve import main

    return main(argv)


def _plan_serve(argv: list[str]) -> int:
    from energon_infer.serving.plan_serve import main

    return main(argv)


plugin = Plugin(
    name="energon",
    kind="inference-backend",
    summary="EnergonAI: padding-free tensor/pipeline-parallel inference with a single controller and an HTTP server",
    requires=("safetensors", "tokenizers", "fastapi", "uvicorn", "prometheus_client"),
    demo=_demo,
    command="serve",
    cli=_serve,
    planner="serve",
    plan_cli=_plan_serve,
)
"""EnergonAI's entry in tightfit's plugin registry (the ``tightfit.plugins`` entry point):
its name, what it needs, its demo."""
