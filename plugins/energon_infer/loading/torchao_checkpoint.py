"""Checkpoints saved already quantized by torchao (``save_pretrained`` of a transformers model loaded with
``TorchAoConfig``), read without unpickling and without requantizing.

transformers writes such a model with safetensors by flattening each torchao tensor subclass into plain
tensors: a projection ``P.weight`` held as torchao's ``Int8Tensor`` (``Int8WeightOnlyConfig``, one fp32
scale per output row) becomes ``P._weight_qdata`` (int8 ``(N, K)``), ``P._weight_scale`` (fp32 ``(N, 1)``) and
``P._weight_zero_point`` (int8 ``(N, 1)``, zeros: the quantization is symmetric), and the file's
``__metadata__`` names each weight's subclass (``{"_type": "Int8Tensor", "_data": {"block_size": [1, K],
...}}``); config.json's ``quantization_config`` says ``"quant_method": "torchao"`` and the config type. That
is energon's int8 format as it is (:mod:`tightfit.kernels.quant_linear`): qdata and scale are installed byte for
byte, fused projections (QKV, gate/up) by concatenating rows, a tensor-parallel rank's slice by slicing qdata's
rows (column-parallel; the scale rows with them) or columns (row-parallel; each row keeps its scale).

Only the JSON of config.json and of the safetensors header is parsed (:func:`read_header`); nothing is
unpickled. Other torchao formats (int4's packings, dynamic-activation configs, quantized embeddings) are refused
in one line naming the format and the fix (save the model unquantized, let energon quantize at load).

    method = checkpoint_quantization(path, requested=None)   # "int8" for such a directory, None for a plain one
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from energon_infer.loading.quantization import QuantizationError
from energon_infer.loading.safetensors_files import read_header
from energon_infer.loading.weights import WeightError

__all__ = ["checkpoint_quantization", "torchao_config_type", "TorchaoWeights", "QDATA", "SCALE", "ZERO"]

QDATA, SCALE, ZERO = "._weight_qdata", "._weight_scale", "._weight_zero_point"
# torchao config types energon reads as they are, and the method they are.
READABLE = {"Int8WeightOnlyConfig": "int8"}
FIX = ("save the model unquantized (save_pretrained of the fp32/bf16 model) and load it with "
       "quantization='int8' or 'int4': energon quantizes at load")


def torchao_config_type(path: str | Path) -> str | None:
    """The torchao config type config.json's ``quantization_config`` names (``"Int8WeightOnlyConfig"``), or
    ``None`` when the checkpoint is not torchao-quantized. A quantization_config of another method is refused."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None  # load_config reports an unreadable config.json in its own words
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "mxfp4":  # gpt-oss's shipped experts: packed blocks and scales, not weights
        raise QuantizationError(f"{file} has quantization_config quant_method='mxfp4' (gpt-oss's packed experts); "
                                "energon runs the experts unquantized: dequantize once with transformers "
                                "(from_pretrained(dir, quantization_config=Mxfp4Config(dequantize=True), "
                                "dtype=torch.bfloat16), then save_pretrained) and serve that directory")
    if method != "torchao":
        raise QuantizationError(f"{file} has quantization_config quant_method={method!r}; energon reads only "
                                f"torchao-quantized checkpoints (Int8WeightOnlyConfig): {FIX}")
    qt = qc.get("quant_type")
    if isinstance(qt, dict) and "default" in qt and isinstance(qt["default"], dict):
        qt = qt["default"]
    kind = qt.get("_type") if isinstance(qt, dict) else qt
    if not isinstance(kind, str):
        raise QuantizationError(f"{file}'s torchao quantization_config has no quant_type._type naming its config; "
                                f"it was not written by transformers' TorchAoConfig: {FIX}")
    extra = [k for k in ("include_input_output_embeddings",) if qc.get(k)]
    if kind in READABLE and extra:
        raise QuantizationError(f"{file}: torchao {kind} with {extra[0]}=true quantizes the embeddings, which "
                                f"energon keeps unquantized; {FIX}")
    if kind in READABLE and isinstance(qt, dict):
        gran = ((qt.get("_data") or {}).get("granularity") or {})
        if isinstance(gran, dict) and gran.get("_type") not in (None, "PerRow"):
            raise QuantizationError(f"{file}: torchao {kind} with granularity {gran.get('_type')} is not energon's "
                                    f"int8 format (one scale per output row, PerRow); {FIX}")
    return kind


def checkpoint_quantization(path: str | Path, requested: str | None) -> str | None:
    """The quantization a load of ``path`` uses: the checkpoint's own when it is torchao-quantized (``requested``
    must be ``None`` or the same), else ``requested``. One-line :class:`QuantizationError` otherwise."""
    kind = torchao_config_type(path)
    if kind is None:
        return requested
    method = READABLE.get(kind)
    if method is None:
        raise QuantizationError(f"{Path(path)} was saved quantized by torchao's {kind}, a format energon cannot read "
                                f"as it is (it reads {', '.join(READABLE)}); {FIX}")
    if requested is not None and requested != method:
        raise QuantizationError(f"quantization={requested!r} conflicts with {Path(path)}, saved quantized by torchao's "
                                f"{kind} ({method!r}); drop quantization= (or give {method!r}), or {FIX}")
    return method


class TorchaoWeights:
    """The int8 projection weights of a torchao-quantized checkpoint: :meth:`read` gives one rank's slice of a
    checkpoint weight as ``(qdata, scale)``, the bytes torchao wrote. ``reader`` reads tensors by name
    (a :class:`~energon_infer.loading.weights.CheckpointReader`); ``files``: its safetensors files."""

    def __init__(self, reader: object, files: list[Path]):
        self.reader = reader
        self.meta: dict[str, dict] = {}
        for file in files:
            self.meta.update(_subclass_metadata(file))

    @classmethod
    def of(cls, source: object) -> TorchaoWeights | None:
        """For a :class:`CheckpointReader` of a directory holding flattened torchao weights, else ``None``."""
        keys = source.keys() if hasattr(source, "keys") else ()  # type: ignore[union-attr]
        if not any(k.endswith(QDATA) for k in keys):
            return None
        where = getattr(source, "_where", None)
        if not isinstance(where, Mapping):
            return None
        return cls(source, sorted(set(where.values())))

    def logical_keys(self) -> set[str]:
        """The checkpoint's tensor names with each flattened weight under its own name (``P.weight``)."""
        keys = set(self.reader.keys())  # type: ignore[attr-defined]
        return keys | {k[: -len(QDATA)] + ".weight" for k in keys if k.endswith(QDATA)}

    def holds(self, name: str) -> bool:
        return name.endswith(".weight") and name[: -len(".weight")] + QDATA in self.reader  # type: ignore[operator]

    def read(self, name: str, split: str | None, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``name``'s (``P.weight``) qdata ``(N, K)`` and scale ``(N,)`` (this rank's slice for ``split``)."""
        base = name[: -len(".weight")]
        info: dict = self.meta.get(name) or {}
        kind = info.get("_type")
        if kind != "Int8Tensor":
            raise QuantizationError(f"{name} is held as torchao {kind or 'an unknown subclass'} (safetensors metadata), "
                                    f"not Int8Tensor; {FIX}")
        q, s = self.reader.get(base + QDATA), self.reader.get(base + SCALE)  # type: ignore[attr-defined]
        raw = info.get("_data")
        data: dict = raw if isinstance(raw, dict) else {}
        block = data.get("block_size")
        if q.dtype != torch.int8 or q.dim() != 2 or tuple(s.shape) not in ((q.shape[0], 1), (q.shape[0],)) \
                or block not in (None, [1, q.shape[1]]) or data.get("act_quant_kwargs") is not None:
            raise QuantizationError(f"{name}: torchao Int8Tensor with qdata {q.dtype} {tuple(q.shape)}, scale "
                                    f"{tuple(s.shape)}, block_size {block} is not weight-only int8 with one scale "
                                    f"per row; {FIX}")
        zkey = base + ZERO
        if zkey in self.reader and bool(self.reader.get(zkey).any()):  # type: ignore[operator, attr-defined]
            raise QuantizationError(f"{name}: torchao Int8Tensor has non-zero zero points (asymmetric int8), which "
                                    f"energon's int8 kernels do not take; {FIX}")
        s = s.reshape(-1).float()
        if split == "col" and tp > 1:
            q, s = q.chunk(tp, dim=0)[rank], s.chunk(tp, dim=0)[rank]
        elif split == "row" and tp > 1:
            q = q.chunk(tp, dim=1)[rank]
        elif split not in (None, "col", "row"):
            raise WeightError(f"{name}: a quantized weight cannot be split as {split!r}")
        return q.contiguous(), s.contiguous()


def _subclass_metadata(file: Path) -> dict[str, dict]:
    """Each flattened weight's subclass description from ``file``'s safetensors ``__metadata__`` (JSON only)."""
    read_header(file)  # checks the header's extents
    import struct

    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n).decode("utf-8"))
    meta = header.get("__metadata__") or {}
    out: dict[str, dict] = {}
    for name, text in meta.items():
        if not isinstance(text, str) or not name.endswith(".weight"):
            continue
        try:
            info = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(info, dict):
            out[name] = info
    return out
