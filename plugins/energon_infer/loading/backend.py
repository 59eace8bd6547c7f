"""Which path a checkpoint runs on: a native family, or transformers' own modeling code (the fallback).

A model whose ``config.json`` a native family reads (:func:`energon_infer.loading.config.load_config`) runs on
energon's own blocks and kernels. Any other causal LM that transformers can build runs through its
``AutoModelForCausalLM`` class with energon's attention underneath (:mod:`energon_infer.worker.hf_stage`): same
scheduler, batching and paged KV cache, slower, exact. :func:`choose_backend` is the one place that decides,
and says why; :func:`check_fallback_options` refuses what the fallback does not run, before any work starts.

Example:
    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_head": 4,
    ...     "n_layer": 2, "n_positions": 64, "vocab_size": 100}))
    >>> choose_backend(d)[0]
    'native'
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from energon_infer.errors import OptionError
from energon_infer.loading.config import (
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    UnsupportedModelError,
    load_config,
    read_config_json,
)

__all__ = ["Backend", "MODEL_IMPLS", "FALLBACK_RULE", "check_fallback_options", "check_model_impl", "choose_backend",
           "model_type_of", "transformers_causal_lm_types", "uses_attention_interface"]

Backend = Literal["native", "transformers"]
#: what ``model_impl`` (``RuntimeConfig``, ``tightfit serve --model-impl``) takes: ``auto`` lets
#: :func:`choose_backend` decide; ``native`` and ``transformers`` insist on one path.
MODEL_IMPLS = ("auto", "native", "transformers")


def check_model_impl(model_impl: object) -> str:
    """``model_impl`` if it is one of :data:`MODEL_IMPLS`, else a one-line ``ValueError``."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl={model_impl!r} is not a model implementation; use 'auto' (a native family where "
                         "one reads the checkpoint, else transformers' modeling code), 'native' or 'transformers'")
    return str(model_impl)


def transformers_causal_lm_types() -> frozenset[str]:
    """The ``model_type`` values transformers (the installed version) builds an ``AutoModelForCausalLM`` for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_type_of(path: str | Path) -> str:
    """The ``model_type`` in ``<path>/config.json``; a missing file, bad JSON or no string there raises in one line."""
    file = Path(path) / "config.json"
    raw = read_config_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: config.json holds a {type(raw).__name__}, not an object; it must be a JSON object "
                          'like {"model_type": "gpt2", "n_layer": 12, ...} (save it with save_pretrained)')
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{file}: model_type={model_type!r} must be a string naming the architecture "
                          "(e.g. \"llama\"); save the config with transformers' save_pretrained")
    return model_type


def choose_backend(path: str | Path, model_impl: str = "auto") -> tuple[Backend, str]:
    """``("native" | "transformers", why)`` for the model directory ``path``.

    ``model_impl="auto"``: native when a family reads the config; the transformers fallback when the model type has
    no native family, or its family refuses one of its options (an unknown rope type, an attention variant), and
    transformers builds a causal LM for it. ``"native"`` refuses what no native family reads (with the family's
    reason) instead of falling back; ``"transformers"`` takes transformers' modeling code even where a native family
    exists (to compare the two, or to step around a family's bug). A config with a malformed value
    (:class:`ConfigError`) is refused on either path; a model type neither path knows raises
    :class:`UnsupportedModelError` naming both lists.
    """
    path = Path(path)
    check_model_impl(model_impl)
    model_type = model_type_of(path)
    refusal = ""
    if model_type in SUPPORTED_MODEL_TYPES:
        try:
            cfg = load_config(path)
        except UnsupportedModelError as err:
            if model_impl == "native":
                raise
            refusal = str(err).removeprefix(f"{path / 'config.json'}: ")
        else:
            if model_impl != "transformers":
                return "native", f"{model_type} runs on energon's native {cfg.family} family"
    elif model_impl == "native":
        raise UnsupportedModelError(
            f"{path / 'config.json'}: model_type {model_type!r} has no native energon family "
            f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))}) and model_impl='native' rules out transformers' modeling "
            "code; leave model_impl at 'auto' (or --model-impl auto) to serve it through transformers")
    if model_type not in transformers_causal_lm_types():
        import transformers

        raise UnsupportedModelError(
            f"{path / 'config.json'}: model_type {model_type!r} has no native energon family "
            f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))}) and transformers {transformers.__version__} builds no "
            "causal LM for it; upgrade transformers or convert the checkpoint to one of those types"
            + (f" ({refusal})" if refusal else "")
        )
    if model_impl == "transformers" and not refusal:
        why = "model_impl='transformers' asked for it"
    else:
        why = f"its native family refuses it: {refusal}" if refusal else "no native family for this model type"
    return "transformers", f"{model_type} runs through transformers' modeling code ({why})"


#: what the transformers path needs of a model's attention, and what to do instead (the end of its refusals)
FALLBACK_RULE = ("energon runs it through transformers' modeling code over its own paged KV cache, which needs every "
                 "attention layer to call transformers' attention interface with plain causal attention, or to "
                 "attend over the cache and mask it is given; serve it with transformers itself, or add a native "
                 "energon family for it")


def uses_attention_interface(model_type: str) -> bool:
    """Whether ``model_type``'s transformers modeling code calls the attention interface (energon supplies the
    attention), or has attention of its own (falcon: energon supplies the cache and the mask it attends under)."""
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    module = importlib.import_module(getattr(transformers, name if isinstance(name, str) else name[0]).__module__)
    return hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def check_fallback_options(model_type: str, *, tp: int = 1, pp: int = 1, quantization: str | None = None,
                           memory_pool: bool = False) -> None:
    """Refuse, in one line, an option the transformers fallback does not run (it runs one rank, unquantized,
    every layer resident)."""
    if tp != 1 or pp != 1:
        raise OptionError(f"tp={tp} x pp={pp}: model_type {model_type!r} runs through transformers' modeling code, "
                          "which runs on one rank (tp=1, pp=1) only; serve it with tp=1 pp=1")
    if quantization is not None:
        raise OptionError(f"quantization={quantization!r}: model_type {model_type!r} runs through transformers' "
                          "modeling code, which holds the checkpoint's weights unquantized; drop the quantization "
                          "option")
    if memory_pool:
        raise OptionError(f"memory_pool: model_type {model_type!r} runs through transformers' modeling code, which "
                          "keeps every layer resident; drop memory_pool / memory_budget")
