"""A stage that runs transformers' own modeling code over energon's packed steps and paged KV cache.

The fallback for a causal LM with no native family (:func:`energon_infer.loading.backend.choose_backend`).
transformers lets a serving engine supply attention: a function registered with ``AttentionInterface`` under a
name, chosen with ``attn_implementation=<name>``, is called by every attention layer with its queries, keys and
values after the model's own projections, norms and rotary embeddings. Ours writes the new keys/values into
:class:`~energon_infer.worker.kv_cache.KVCache` and runs :func:`~tightfit.kernels.varlen_attention.paged_attention`
over each sequence's cache, so a step is the native one: all sequences' new tokens back to back in a batch of
one, explicit ``position_ids``, no padding and no mask (a name transformers has no mask function for gets none).

The step's metadata and cache reach the attention function through a context variable the stage sets around
the model's forward (not as a forward keyword: some decoder layers do not pass keywords on to their attention).
Everything else, the embeddings, norms, MLPs, rotary variants and the head, is the model's own code, which is
what makes the fallback exact.

A model whose attention is its own code (it never calls the interface: falcon) runs with its own attention over
energon's cache instead: the stage hands it a :class:`~energon_infer.worker.hf_packed_cache.PackedCache` and a
packed mask.

Before serving, :func:`load_transformers_stage` runs one probe token through the model: it counts the
attention calls (the cache's layers), reads their key/value heads and width (the cache's shape), and refuses
a model whose attention this path would get wrong (one that builds its own mask or bias, soft-caps its scores,
attends within a window or both ways). Then it checks a packed step against the model's own forward
(:func:`~energon_infer.worker.hf_packed_cache.check_packed_step`), which refuses what the probe cannot see:
layers that carry state outside attention (Mamba) or mix the packed sequences some other way.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from energon_infer.loading.backend import FALLBACK_RULE, uses_attention_interface
from energon_infer.loading.config import UnsupportedModelError
from energon_infer.loading.safetensors_files import read_header
from energon_infer.loading.weights import ModelTooLargeError, available_bytes
from energon_infer.worker.hf_packed_cache import PackedCache, check_packed_step, packed_mask
from energon_infer.worker.kv_cache import KVCache, StepMetadata
from tightfit.kernels.varlen_attention import paged_attention, store_kv

__all__ = ["ATTENTION", "TransformersModelConfig", "TransformersStage", "load_transformers_stage"]

#: the name energon's attention is registered under in transformers' ``AttentionInterface``
ATTENTION = "energon_paged"
#: the step the running forward attends in (set by :meth:`TransformersStage.forward` and the probe)
_CURRENT: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("energon_hf_step", default=None)


@dataclass(slots=True)
class _Step:
    """One forward's attention context: the step's metadata and cache, and the next layer's index in it.

    ``probe``: a list to record each attention call's geometry into instead of attending (at load)."""

    meta: StepMetadata | None
    cache: KVCache | None
    layer: int = 0
    probe: list[dict[str, Any]] | None = None


@contextlib.contextmanager
def _stepping(step: _Step) -> Iterator[None]:
    token = _CURRENT.set(step)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query (1, H, T, D)``, ``key``/``value (1, Hkv, T, D)`` in, the
    output ``(1, T, H, D)`` out. Keys and values go to the layer's cache slots, then attention runs per sequence."""
    step = _CURRENT.get()
    if not isinstance(step, _Step):
        raise RuntimeError(f"attn_implementation={ATTENTION!r} runs only inside an energon step (TransformersStage); "
                           "load the model with another attn_implementation to run it on its own")
    if step.probe is not None:
        step.probe.append(dict(heads=query.shape[1], kv_heads=key.shape[1], head_dim=key.shape[-1],
                               value_dim=value.shape[-1], mask=attention_mask is not None,
                               **{k: kwargs.get(k) for k in _REFUSED},
                               # transformers' own rule: the keyword, else the module's flag, else causal
                               causal=kwargs.get("is_causal") if kwargs.get("is_causal") is not None
                               else getattr(module, "is_causal", True)))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    meta, cache, i = step.meta, step.cache, step.layer
    assert meta is not None and cache is not None
    step.layer += 1
    q = query[0].transpose(0, 1).contiguous()  # (T, H, D)
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), cache.k[i], cache.v[i], meta.slot_mapping)
    out = paged_attention(q, cache.k[i], cache.v[i], meta.block_tables, meta.cu_seqlens, meta.kv_lens,
                          scale=scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1]),
                          max_q_len=meta.max_q_len)
    return out.unsqueeze(0), None


#: attention keywords that change the math paged attention does; a layer passing one (not None) is refused
_REFUSED = ("softcap", "sliding_window", "s_aux", "sinks", "head_mask")


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformersModelConfig:
    """What the runner and the engine read of a model run through transformers (the fields of
    :class:`~energon_infer.loading.config.ModelConfig` they use).

    Args:
        model_type: ``model_type`` of the checkpoint.
        vocab_size: rows of the logits.
        hidden_size: width of the residual stream.
        n_layers: attention layers (KV-cache layers).
        n_heads: query heads.
        n_kv_heads: key/value heads.
        head_dim: width of one head.
        max_positions: longest context (tokens).
        n_params: parameter count.
        eos_token_ids: the end-of-sequence tokens from the config.
        bos_token_id: the beginning-of-sequence token, if any.
        family: always ``"transformers"``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_positions: int
    n_params: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    family: str = field(default="transformers")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TransformersStage(nn.Module):
    """A whole transformers causal LM as a one-stage :class:`~energon_infer.worker.model.DecoderStage`: token ids
    and a step's metadata and cache in, next-token logits out (every token's with ``all_logits``).

    Args:
        model: a transformers causal LM in eval mode, loaded with ``attn_implementation=ATTENTION`` unless
            ``own_attention``.
        n_layers: its attention layers (from the probe).
        own_attention: the model attends with its own code over a :class:`PackedCache` and a packed mask.
    """

    def __init__(self, model: nn.Module, n_layers: int, *, own_attention: bool = False):
        super().__init__()
        self.model = model
        self.layer_range = range(n_layers)
        self.first = self.last = True
        self.own_attention = own_attention
        params = inspect.signature(model.forward).parameters
        # Models whose forward takes logits_to_keep compute only the rows asked for; the others compute all.
        self._keeps = "logits_to_keep" in params
        self._cache_arg = _cache_arg(model)  # the cache keyword (transformers 5 renamed past_key_values)
        self._dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, meta: StepMetadata, cache: KVCache, *, all_logits: bool = False
                ) -> torch.Tensor:
        rows = None if all_logits or meta.n_tokens == meta.last_index.shape[0] else meta.last_index
        kwargs: dict[str, Any] = {"logits_to_keep": rows} if self._keeps and rows is not None else {}
        if self.own_attention:
            kwargs.update({self._cache_arg: PackedCache(meta, cache), "use_cache": True,
                           "attention_mask": packed_mask(meta, cache.block_size, self._dtype)})
        else:
            kwargs["use_cache"] = False
        with _stepping(_Step(meta, cache)):
            logits = self.model(input_ids=x[None], position_ids=meta.positions[None], **kwargs).logits[0]
        if rows is not None and not self._keeps:
            logits = logits.index_select(0, rows)
        return logits


def _first(cfg: Any, names: tuple[str, ...]) -> Any:
    return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), None)


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _probe(model: nn.Module, model_type: str, max_positions: int, device: torch.device) -> list[dict[str, Any]]:
    """Run one token through ``model`` recording every attention call; refuse what paged attention cannot run."""
    calls: list[dict[str, Any]] = []
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.inference_mode(), _stepping(_Step(None, None, probe=calls)):
        model(input_ids=ids, position_ids=ids, use_cache=False)
    if not calls:
        raise UnsupportedModelError(f"model_type {model_type!r}: no layer called transformers' attention interface "
                                    f"in a forward; {FALLBACK_RULE}")
    for i, c in enumerate(calls):
        bad = {k: c[k] for k in _REFUSED if c[k] is not None}
        if not c["causal"]:
            bad["is_causal"] = False  # bidirectional (an encoder's layers)
        if "sliding_window" in bad and bad["sliding_window"] >= max_positions:
            del bad["sliding_window"]  # a window at least the context long is full attention
        if c["mask"]:
            bad["attention_mask"] = "a mask or bias of the model's own"
        if c["value_dim"] != c["head_dim"]:
            bad["value width"] = f"{c['value_dim']} (keys {c['head_dim']})"
        if bad:
            raise UnsupportedModelError(f"model_type {model_type!r}: attention layer {i} asks for "
                                        f"{', '.join(f'{k}={v!r}' for k, v in bad.items())}; {FALLBACK_RULE}")
    shapes = {(c["heads"], c["kv_heads"], c["head_dim"]) for c in calls}
    if any(h % kv for h, kv, _ in shapes):
        raise UnsupportedModelError(f"model_type {model_type!r}: query heads {sorted(shapes)} (heads, kv heads, head "
                                    "width) are not a multiple of the key/value heads; fix num_key_value_heads in "
                                    "config.json")
    if len(shapes) > 1:
        raise UnsupportedModelError(f"model_type {model_type!r}: its layers have different head shapes "
                                    f"{sorted(shapes)} (heads, kv heads, head width); {FALLBACK_RULE}")
    return calls


def _cache_arg(model: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _probe_own(model: nn.Module, model_type: str, heads: int, device: torch.device) -> list[dict[str, Any]]:
    """:func:`_probe` for a model with attention of its own: one token through a recording :class:`PackedCache`."""
    seen: list[tuple[int, ...]] = []
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    mask = torch.zeros((1, 1, 1, 1), dtype=next(model.parameters()).dtype, device=device)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=ids, attention_mask=mask, use_cache=True,
              **{_cache_arg(model): PackedCache(None, None, probe=seen)})
    if [layer for layer, *_ in seen] != list(range(len(seen))) or not seen:
        raise UnsupportedModelError(f"model_type {model_type!r}: its layers do not update the cache once each, in "
                                    f"order (layers seen: {[layer for layer, *_ in seen][:8]}); {FALLBACK_RULE}")
    shapes = {tuple(shape) for _, *shape in seen}
    kv, dim, value_dim = next(iter(shapes))
    if len(shapes) > 1 or value_dim != dim or heads % kv:
        raise UnsupportedModelError(f"model_type {model_type!r}: its layers' key/value shapes {sorted(shapes)} (heads, "
                                    f"key width, value width) are not one shape of equal widths dividing {heads} "
                                    f"query heads; {FALLBACK_RULE}")
    return [dict(heads=heads, kv_heads=kv, head_dim=dim)] * len(seen)


#: the largest difference between a packed step and the model's own forward, relative to the logits' spread, that
#: a load accepts: rounding (summation order) is far below it, a mask or cache that mixes sequences far above
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _own_logits(model: Any, interface: bool) -> Any:  # a transformers PreTrainedModel
    """``ids (1, L) -> logits (L, vocab)`` from the model's own forward, with transformers' own attention."""
    def reference(ids: torch.Tensor) -> torch.Tensor:
        if interface:
            model.set_attn_implementation("eager")
        try:
            return model(input_ids=ids, use_cache=False).logits[0]
        finally:
            if interface:
                model.set_attn_implementation(ATTENTION)
    return reference


def _checked_stage(model: Any, model_type: str, interface: bool, max_positions: int, dtype: torch.dtype,
                   device: torch.device, vocab: int) -> tuple[TransformersStage, list[dict[str, Any]]]:
    """Probe the model's attention, wrap it as a stage, and check a packed step against the model's own forward
    (what the probe cannot see: layers that mix tokens outside attention, a model ignoring the cache or mask)."""
    try:
        if interface:
            calls = _probe(model, model_type, max_positions, device)
        else:
            heads = int(_first(model.config.get_text_config(), ("num_attention_heads", "n_head", "num_heads")))
            calls = _probe_own(model, model_type, heads, device)
        stage = TransformersStage(model, len(calls), own_attention=not interface)
        worst = check_packed_step(stage.forward, _own_logits(model, interface), len(calls), calls[0]["kv_heads"],
                                  calls[0]["head_dim"], dtype, device, vocab)
    except UnsupportedModelError:
        raise
    except Exception as err:  # the model's own code failed on the packed step: refused, not served
        raise UnsupportedModelError(f"model_type {model_type!r}: a packed step over energon's cache fails "
                                    f"({type(err).__name__}: {err}); {FALLBACK_RULE}") from err
    if not worst <= _CHECK_TOLERANCE[dtype]:
        raise UnsupportedModelError(f"model_type {model_type!r}: a packed step differs from the model's own forward "
                                    f"by {worst:.1e} of the logits' spread (at most {_CHECK_TOLERANCE[dtype]:.0e}): "
                                    f"it does not keep packed sequences apart over the cache; {FALLBACK_RULE}")
    return stage, calls


def _check_fits(path: Path, model_type: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before loading, weights that cannot fit ``device``'s free memory in ``dtype`` (from the safetensors
    headers: floating tensors take ``dtype``'s width, the others their own)."""
    need = 0
    for file in sorted(path.glob("*.safetensors")):
        for extent in read_header(file).values():
            need += extent.nbytes // extent.dtype.itemsize * (dtype.itemsize if extent.dtype.is_floating_point
                                                              else extent.dtype.itemsize)
    free = available_bytes(device)
    if free is not None and need > free:
        raise ModelTooLargeError(f"{model_type} weights need {need / 2**30:.2f} GiB in {dtype} but {device} has "
                                 f"{free / 2**30:.2f} GiB available; use dtype='bfloat16', or a smaller model")


def load_transformers_stage(path: str | Path, dtype: torch.dtype, device: torch.device
                            ) -> tuple[TransformersStage, TransformersModelConfig]:
    """Build the causal LM in ``path`` with transformers (safetensors weights only; no remote code), probe its
    attention, and wrap it as a stage; raises :class:`UnsupportedModelError` naming what cannot run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not any(path.glob("*.safetensors")):
        raise UnsupportedModelError(f"{path} has no *.safetensors files; energon loads safetensors weights only "
                                    "(never pickled .bin files): save the model again with transformers' "
                                    "save_pretrained, which writes safetensors")
    _register()
    model_type = str(AutoConfig.from_pretrained(str(path), trust_remote_code=False).model_type)
    _check_fits(path, model_type, dtype, device)
    interface = uses_attention_interface(model_type)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True, trust_remote_code=False,
                                                 **({"attn_implementation": ATTENTION} if interface else {}))
    cast(nn.Module, model).to(device).eval().requires_grad_(False)
    text = model.config.get_text_config()
    max_positions = _first(text, ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"))
    if max_positions is None:
        raise UnsupportedModelError(f"{path / 'config.json'}: model_type {model_type!r} names no context length "
                                    "(max_position_embeddings); add it to config.json")
    head = model.get_output_embeddings()
    vocab = int(head.weight.shape[0]) if head is not None else int(text.vocab_size)
    stage, calls = _checked_stage(model, model_type, interface, int(max_positions), dtype, device, vocab)
    config = TransformersModelConfig(
        model_type=model_type, vocab_size=vocab, hidden_size=int(_first(text, ("hidden_size", "n_embd", "d_model"))),
        n_layers=len(calls), n_heads=calls[0]["heads"], n_kv_heads=calls[0]["kv_heads"],
        head_dim=calls[0]["head_dim"], max_positions=int(max_positions),
        n_params=sum(p.numel() for p in model.parameters()), eos_token_ids=_eos(text.eos_token_id),
        bos_token_id=getattr(text, "bos_token_id", None))
    return stage, config
