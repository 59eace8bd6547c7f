"""Serve the example GPT (:mod:`tightfit.models.gpt`) straight from a training checkpoint.

Accepted: a Lightning ``.ckpt`` (its ``state_dict``, parameters under the LightningModule's
attribute, e.g. ``model.wte.weight``), a plain ``torch.save`` of the model's ``state_dict``, or a
``.safetensors`` file. Pickle-based files are opened with ``torch.load(weights_only=True)``, which
refuses anything but tensors and plain containers, so a checkpoint cannot run code when it is loaded.

The model's shape comes from, in order: the ``gpt_config`` argument (a
:class:`~tightfit.models.gpt.GPTConfig` or a preset name), the checkpoint's ``hyper_parameters``
(a ``config`` entry, a ``preset``/``name`` plus overrides, or the config's own fields), or the
tensor shapes themselves plus ``heads`` (the one number shapes cannot tell).

Sharded checkpoints (FSDP2 / ``torch.distributed.checkpoint`` directories) are not read here: their
metadata is a pickle; consolidate them to one file first (``lightning.fabric.utilities.consolidate_checkpoint``).

Example:
    >>> runner = load_tightfit_gpt("last.ckpt", tp=2)        # doctest: +SKIP
    >>> runner.generate(["hello"])[0].text                   # doctest: +SKIP
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from energon_infer.loading.config import ModelConfig
from energon_infer.loading.weights import Part
from energon_infer.worker.runtime import ModelRunner, RuntimeConfig

__all__ = ["ByteTokenizer", "load_tightfit_gpt", "gpt_model_config", "read_gpt_checkpoint"]


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 (what a 256-token GPT trained on raw text uses); the ``tokenizers`` interface."""

    class _Encoding:
        def __init__(self, ids: list[int]):
            self.ids = ids

    def encode(self, text: str) -> ByteTokenizer._Encoding:
        return self._Encoding(list(text.encode("utf-8")))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def read_gpt_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state_dict with the GPT's own names, hyper_parameters)`` from a checkpoint file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist (give a Lightning .ckpt, a torch.save'd "
                                "state_dict, or a .safetensors file)")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            raw: Any = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc}); it is truncated or corrupt: "
                             "copy or export it again") from None
    else:
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError) as exc:  # torch: "failed finding central directory"
            raise ValueError(f"{path} is not a readable torch checkpoint ({str(exc).splitlines()[0]}); it is "
                             "truncated or corrupt: copy or save it again") from None
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"{path} holds objects other than tensors and plain containers, and loading them would mean "
                f"running arbitrary code ({str(exc).splitlines()[0]}); save the model's state_dict (or the "
                "Lightning checkpoint with plain hyperparameters) or use safetensors"
            ) from None
    hparams = dict(raw.get("hyper_parameters") or {}) if isinstance(raw, Mapping) else {}
    if path.suffix == ".safetensors" and not hparams:
        # lightning_elixir.export stores the LightningModule's hyperparameters as JSON in the file's metadata.
        import json

        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if "hyper_parameters" in meta:
            hparams = dict(json.loads(meta["hyper_parameters"]))
    state = raw.get("state_dict", raw) if isinstance(raw, Mapping) else raw
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not contain a state_dict of tensors (top-level keys: {list(raw)[:8]})")
    anchors = [k for k in state if k == "wte.weight" or k.endswith(".wte.weight")]
    if not anchors:
        raise ValueError(
            f"{path} has no 'wte.weight' tensor, so it is not a tightfit.models GPT checkpoint; keys start with "
            f"{list(state)[:5]}. Hugging Face GPT-2 directories load with ModelRunner.from_pretrained"
        )
    prefix = anchors[0][: -len("wte.weight")]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, hparams


def _gpt_config(state: Mapping[str, torch.Tensor], hparams: Mapping[str, Any], gpt_config: Any, heads: int | None):
    from tightfit.models.gpt import PRESETS, GPTConfig
    from tightfit.models.gpt import gpt_config as preset

    if isinstance(gpt_config, GPTConfig):
        return gpt_config
    if isinstance(gpt_config, str):
        return preset(gpt_config)
    fields = set(GPTConfig.__dataclass_fields__)
    nested = hparams.get("config") or hparams.get("model_config")
    if isinstance(nested, GPTConfig):
        return nested
    if isinstance(nested, Mapping):
        return GPTConfig.from_dict(nested)
    overrides = {k: v for k, v in hparams.items() if k in fields and k != "name"}
    name = hparams.get("preset") or hparams.get("name")
    if isinstance(name, str) and name in PRESETS:
        return preset(name, **overrides)
    if heads is None and "heads" not in overrides:
        raise ValueError(
            "cannot tell the number of attention heads of this GPT checkpoint: its hyper_parameters "
            f"({sorted(hparams)}) name no preset or config; pass heads=N or gpt_config=GPTConfig(...)/'preset'"
        )
    wte, wpe, fc = state["wte.weight"], state["wpe.weight"], state["blocks.0.mlp.c_fc.weight"]
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    shape = dict(vocab_size=wte.shape[0], hidden=wte.shape[1], n_positions=wpe.shape[0], layers=layers,
                 mlp_ratio=fc.shape[0] // wte.shape[1], heads=heads,
                 tie_embeddings="lm_head.weight" not in state or state["lm_head.weight"] is wte)
    return GPTConfig(**{**shape, **overrides})


def gpt_model_config(cfg: Any) -> ModelConfig:
    """The runtime's :class:`ModelConfig` for a :class:`tightfit.models.gpt.GPTConfig` (GPT-2 blocks)."""
    return ModelConfig(
        family="gpt2", model_type="tightfit-gpt", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden,
        n_layers=cfg.layers, n_heads=cfg.heads, n_kv_heads=cfg.heads, head_dim=cfg.hidden // cfg.heads,
        intermediate_size=cfg.mlp_ratio * cfg.hidden, max_positions=cfg.n_positions, norm_eps=cfg.layer_norm_eps,
        activation="gelu_pytorch_tanh", tie_embeddings=cfg.tie_embeddings,
    )


def _rows(lo: int, hi: int):
    return lambda t: t[lo:hi]


def _tightfit_parts(cfg: ModelConfig, name: str, keys: set[str]) -> list[Part]:
    # tightfit's GPT uses nn.Linear (out, in) layouts, so nothing is transposed; c_attn rows are q|k|v.
    h = cfg.hidden_size
    simple = {"embed.weight": ("wte.weight", "vocab"), "pos_embed.weight": ("wpe.weight", None),
              "final_norm.weight": ("ln_f.weight", None), "final_norm.bias": ("ln_f.bias", None),
              "lm_head.weight": ("lm_head.weight" if "lm_head.weight" in keys else "wte.weight", "vocab")}
    if name in simple:
        return [Part(*simple[name])]
    _, i, *rest_parts = name.split(".")
    rest, p = ".".join(rest_parts), f"blocks.{i}."
    if rest.startswith("qkv."):
        kind = rest.split(".")[1]
        return [Part(f"{p}attn.c_attn.{kind}", "col", _rows(j * h, (j + 1) * h)) for j in range(3)]
    table = {"attn_norm": ("ln_1", None), "mlp_norm": ("ln_2", None), "o": ("attn.c_proj", "row"),
             "up": ("mlp.c_fc", "col"), "down": ("mlp.c_proj", "row")}
    src, split = table[rest.split(".")[0]]
    kind = rest.split(".")[1]
    return [Part(f"{p}{src}.{kind}", None if kind == "bias" and split == "row" else split)]


def load_tightfit_gpt(path: str | Path, runtime: RuntimeConfig | None = None, *, gpt_config: Any = None,
                      heads: int | None = None, tokenizer: Any = None, **kwargs: Any) -> ModelRunner:
    """A :class:`ModelRunner` for a tightfit GPT checkpoint (``kwargs``: :class:`RuntimeConfig` fields).

    ``tokenizer`` defaults to :class:`ByteTokenizer` for a 256-token vocabulary, else none (token ids only).
    """
    state, hparams = read_gpt_checkpoint(path)
    cfg = gpt_model_config(_gpt_config(state, hparams, gpt_config, heads))
    if tokenizer is None and cfg.vocab_size == 256:
        tokenizer = ByteTokenizer()
    rt = runtime if runtime is not None else RuntimeConfig(**kwargs)
    return ModelRunner(cfg, state, rt, tokenizer=tokenizer, parts_fn=_tightfit_parts)
