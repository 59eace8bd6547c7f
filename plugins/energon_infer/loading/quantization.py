"""Weight-only quantization of a stage's projections, on torchao: int8 per output row, int4 per group.

    spec = QuantSpec.create("int4", group_size=128)        # or "int8"; None: no quantization
    check_quantization(cfg, spec, tp=2)                     # refuses what the kernels cannot take, in one line
    q = quantize_weight(w, spec)                            # {"qweight": ..., "scale": ..., ("zero": ...)}

The projections of every block (fused QKV, attention out, (gate/)up, down; in a Mixture-of-Experts block each
expert's gate/up and down and the shared expert's, the router left as loaded: :func:`quantized_parts`) are
quantized; the embedding and the vocabulary head keep the model's dtype (as llama.cpp's Q4 files keep their output
layer at 6 bits or more: they carry most of the error per byte). Quantization happens at load, tensor by tensor, after each rank has cut
its tensor-parallel slice (:func:`energon_infer.loading.weights.build_param`): a rank quantises only its own
slice and never holds a full-precision copy of the whole stage. With int4 a group never straddles two ranks
(``group_size`` must divide each rank's input width), so tp=2 holds exactly the values tp=1 holds; int8's
per-row scale is taken over the rank's slice of a row-parallel projection (a finer scale than tp=1's).

The quantizers are torchao's (``Int8Tensor.from_hp`` with ``PerRow``, the format of ``Int8WeightOnlyConfig``;
the tinygemm affine choose/quantize of ``Int4WeightOnlyConfig``); the matmuls are
:mod:`tightfit.kernels.quant_linear`'s (a native CPU kernel for decode, dequantise + BLAS otherwise). torchao's own
CPU int4 path (``torchao.prototype.quantization.int4.Int4OpaqueTensor``, ATen's tinygemm
``_weight_int4pack_mm_for_cpu``) exists in torchao 0.18 but needs an output width divisible by 16 and runs
many times slower than fp32 at decode-sized inputs; ``Int4WeightOnlyConfig``'s default needs the ``mslk`` package (CUDA).
torchao is imported only here, only when quantization is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import torch

from energon_infer.errors import BadInputError
from energon_infer.loading.config import ModelConfig
from energon_infer.loading.weights import CheckpointReader, Part, WeightError, build_param, hf_parts
from energon_infer.parallel import Grid
from tightfit.kernels.quant_linear import INT4_GROUP_SIZES, pack_int4

__all__ = ["METHODS", "QuantSpec", "QuantizationError", "check_quantization", "quantize_weight", "torchao_error",
           "projection_inputs", "quantized_bytes_per_weight", "load_quantized", "quantized_weight_names",
           "reference_dequantize", "quantized_shapes", "meta_quantize", "quantize_head", "quantized_parts"]

METHODS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 128


class QuantizationError(BadInputError, ValueError):
    """A quantization that cannot be applied to this model, layout or installation."""


def torchao_error() -> str:
    """'' when torchao imports here, else one line saying why and how to install it."""
    import logging

    # torchao logs a failed load of each of its CUDA extension libraries on a CPU torch, and torch a deprecation
    # of how torchao registers its enums (both harmless here): quiet while it imports.
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
        from torchao.quantization import Int8Tensor  # noqa: F401  (the enums register on this import)
    except ImportError as exc:
        return (f"quantization needs torchao, which does not import here ({exc}); install it with "
                "`pip install torchao==0.18.0` (the release built for torch 2.13) or load without quantization")
    finally:
        loggers[0].setLevel(levels[0])  # torchao's own later warnings are its business
        loggers[1].setLevel(levels[1])
    return ""


def _torchao():  # type: ignore[no-untyped-def]
    why = torchao_error()
    if why:
        raise QuantizationError(why)
    import torchao.quantization.quant_primitives as primitives
    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    return Int8Tensor, PerRow, primitives


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantSpec:
    """How projection weights are held.

    Args:
        method: ``"int8"`` (symmetric, one scale per output row) or ``"int4"`` (asymmetric, a scale and a zero
            point per row and group of ``group_size`` inputs).
        group_size: inputs per int4 group (torchao's choices 32, 64, 128, 256); ``None`` for int8.
    """

    method: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantizationError(f"quantization={self.method!r} is not a known method; use one of "
                                    f"{', '.join(map(repr, METHODS))} or None (no quantization)")
        if self.method == "int8" and self.group_size is not None:
            raise QuantizationError(f"group_size={self.group_size} applies to int4 only: int8 keeps one scale per "
                                    "output row; drop group_size or use quantization='int4'")
        if self.method == "int4":
            g = DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size
            if isinstance(g, bool) or not isinstance(g, int) or g not in INT4_GROUP_SIZES:
                raise QuantizationError(f"group_size={g!r} is not an int4 group size; use one of "
                                        f"{', '.join(map(str, INT4_GROUP_SIZES))} (smaller: more accurate, more bytes)")
            object.__setattr__(self, "group_size", g)

    @classmethod
    def create(cls, method: str | None, group_size: int | None = None) -> QuantSpec | None:
        """``None`` when ``method`` is ``None`` (then ``group_size`` must be too)."""
        if method is None:
            if group_size is not None:
                raise QuantizationError(f"group_size={group_size} was given without a quantization; add "
                                        "quantization='int4' or drop group_size")
            return None
        return cls(method=method, group_size=group_size)


def quantized_bytes_per_weight(spec: QuantSpec | None, itemsize: int) -> float:
    """Bytes one projection weight takes (``itemsize`` unquantized): int8 1 (+ a row scale), int4 0.5 + 8/group."""
    if spec is None:
        return float(itemsize)
    if spec.method == "int8":
        return 1.0
    assert spec.group_size is not None
    return 0.5 + 8.0 / spec.group_size


def projection_inputs(cfg: ModelConfig, tp: int) -> dict[str, int]:
    """Each quantized projection's input width on one rank of ``tp`` (what a group must divide): the dense MLP's
    only where some layer is dense, an MoE model's experts (whole under expert parallelism, else sliced as the dense
    MLP is) and shared expert where it has them."""
    widths = {"qkv": cfg.hidden_size, "o": cfg.n_heads * cfg.head_dim // tp}
    if cfg.n_sparse < cfg.n_layers:
        widths.update(up=cfg.hidden_size, down=cfg.intermediate_size // tp)
    if cfg.n_sparse:
        widths.update({"expert gate_up": cfg.hidden_size,
                       "expert down": cfg.moe_intermediate_size // (1 if cfg.expert_parallel(tp) else tp)})
        if cfg.shared_expert_size:
            widths.update({"shared expert up": cfg.hidden_size, "shared expert down": cfg.shared_expert_size // tp})
    return widths


def check_quantization(cfg: ModelConfig, spec: QuantSpec | None, *, tp: int, dtype: torch.dtype) -> None:
    """Raise :class:`QuantizationError` (one line: the value, the rule, the fix) unless ``spec`` applies."""
    if spec is None:
        return
    why = torchao_error()
    if why:
        raise QuantizationError(why)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise QuantizationError(f"quantization={spec.method!r} needs float32, bfloat16 or float16 activations; got "
                                f"{dtype}; load with one of those dtypes")
    if spec.method != "int4":
        return
    g = spec.group_size
    assert g is not None
    for name, width in projection_inputs(cfg, tp).items():
        if width % g:
            fits = [s for s in INT4_GROUP_SIZES if all(w % s == 0 for w in projection_inputs(cfg, tp).values())]
            hint = f"use group_size in {fits}" if fits else "use quantization='int8' (one scale per row)"
            raise QuantizationError(
                f"group_size={g} does not divide the {width} inputs of the {name} projection of this "
                f"{cfg.model_type} model (per rank at tp={tp}); int4 groups must tile each rank's input width: {hint}")


# Rows quantized at once. torchao's quantizers make temporaries the size of their input (fp32 / int32 copies):
# whole 3584 x 9536 projections (137 MB each) had a 1.25 GiB cgroup kill the loading worker
# (benchmarks/_quant_disk.py); a row's scale and zero depend on that row only, so the result is the same.
QUANTIZE_ROWS = 512


def quantize_weight(w: torch.Tensor, spec: QuantSpec, *, rows: int = QUANTIZE_ROWS) -> dict[str, torch.Tensor]:
    """``w`` ``(out, in)`` quantized with torchao: ``qweight``, ``scale`` (and ``zero`` for int4), fp32 scales;
    ``rows`` at a time (the same values as all at once)."""
    if w.shape[0] <= rows:
        return _quantize_rows(w, spec)
    parts = [_quantize_rows(w[i: i + rows], spec) for i in range(0, w.shape[0], rows)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _quantize_rows(w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    Int8Tensor, PerRow, primitives = _torchao()
    w = w.detach()
    if spec.method == "int8":
        q = Int8Tensor.from_hp(w.float(), granularity=PerRow())
        return {"qweight": q.qdata.contiguous(), "scale": q.scale.reshape(-1).float().contiguous()}
    g = spec.group_size
    assert g is not None
    if w.shape[1] % g:
        raise QuantizationError(f"group_size={g} does not divide a weight's {w.shape[1]} inputs; use a group size "
                                f"dividing {w.shape[1]}")
    block = [1, g]
    wf = w.float()
    scale, zero = primitives._choose_qparams_affine_tinygemm(wf, primitives.MappingType.ASYMMETRIC, block, torch.int32,
                                                             0, 15, 1e-6, None, torch.float32)
    q = primitives._quantize_affine_tinygemm(wf, block, scale, zero, torch.int32, 0, 15)
    n = w.shape[0]
    return {"qweight": pack_int4(q, g).contiguous(), "scale": scale.reshape(n, -1).float().contiguous(),
            "zero": zero.reshape(n, -1).float().contiguous()}


def quantized_shapes(out_features: int, in_features: int, spec: QuantSpec
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tensor :func:`quantize_weight` makes of an ``(out_features, in_features)`` weight."""
    n, k = out_features, in_features
    if spec.method == "int8":
        return {"qweight": ((n, k), torch.int8), "scale": ((n,), torch.float32)}
    assert spec.group_size is not None
    groups = k // spec.group_size
    return {"qweight": ((n, k // 2), torch.uint8), "scale": ((n, groups), torch.float32),
            "zero": ((n, groups), torch.float32)}


def meta_quantize(blocks: Iterable[torch.nn.Module], spec: QuantSpec) -> None:
    """Hold every projection of ``blocks`` quantized on the meta device: the shapes and bytes a quantized block
    has, with nothing allocated (what the planners count, and the layout of a pooled block's bytes)."""
    for block in blocks:
        for _, module, attr in quantized_parts(block):
            w = module._parameters.get(attr)
            if w is None:
                continue  # already quantized
            shapes = quantized_shapes(w.shape[0], w.shape[1], spec)
            _install(module, attr, spec, {name: torch.empty(shape, dtype=dtype, device="meta")
                                          for name, (shape, dtype) in shapes.items()})


def reference_dequantize(q: Mapping[str, torch.Tensor], spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """torchao's own dequantisation of what :func:`quantize_weight` made (the tests' reference)."""
    Int8Tensor, _, primitives = _torchao()
    if spec.method == "int8":
        return (q["qweight"].float() * q["scale"][:, None]).to(dtype)
    from tightfit.kernels.quant_linear import unpack_int4

    g = spec.group_size
    assert g is not None
    ints = unpack_int4(q["qweight"], g).to(torch.int32)
    return primitives._dequantize_affine_tinygemm(ints, [1, g], q["scale"], q["zero"], torch.int32, 0, 15,
                                                  output_dtype=torch.float32).to(dtype)


PROJECTIONS = ("qkv", "o", "up", "down")


def quantized_parts(block: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """``(name within the block, module, parameter)`` of each weight of ``block`` held quantized: the fused QKV
    and attention out, then the dense MLP's (gate/)up and down or, in a Mixture-of-Experts layer
    (:mod:`energon_infer.worker.moe`), each of this rank's experts' ``gate_up`` and ``down`` and the shared expert's
    projections. The router and the shared expert's gate stay in the model's dtype (a few values a token that
    decide which experts run; llama.cpp keeps its MoE routers unquantized too)."""
    moe = getattr(block, "moe", None)
    names = PROJECTIONS if moe is None else PROJECTIONS[:2]
    parts = [(f"{p}.weight", getattr(block, p), "weight") for p in names]
    if moe is not None:
        for e, expert in moe.experts.items():
            parts += [(f"moe.experts.{e}.{attr}", expert, attr) for attr in ("gate_up", "down")]
        parts += [(f"moe.{p}.weight", getattr(moe, p), "weight") for p in ("shared_up", "shared_down")
                  if getattr(moe, p) is not None]
    return parts


def _install(module: torch.nn.Module, attr: str, spec: QuantSpec, tensors: dict[str, torch.Tensor]) -> int:
    """Hand ``module`` its quantized ``attr`` (a projection's ``weight`` or an expert's part); the bytes held."""
    if attr == "weight":
        return module.set_quantized(spec.method, tensors, spec.group_size)  # type: ignore[operator]
    return module.set_quantized(spec.method, tensors, spec.group_size, part=attr)  # type: ignore[operator]


def quantized_weight_names(stage: torch.nn.Module) -> list[str]:
    """Runtime names of the weights a quantized stage holds quantized (``layers.3.qkv.weight``,
    ``layers.3.moe.experts.5.gate_up``, ...: :func:`quantized_parts` of every block)."""
    blocks = stage.layers
    assert isinstance(blocks, torch.nn.ModuleDict)
    return [f"layers.{i}.{name}" for i, block in blocks.items() for name, _, _ in quantized_parts(block)]


def load_quantized(stage: torch.nn.Module, cfg: ModelConfig, grid: Grid, source: object, spec: QuantSpec, *,
                   parts_fn: Callable[[ModelConfig, str, set[str]], list[Part]] = hf_parts,
                   nonfinite: str = "warn", skip: Collection[int] = (), modules: Collection[str] = (),
                   saved: object = None) -> int:
    """Build, quantize and install every block projection of ``stage`` (left on meta by the runtime), one at a
    time: this rank's slice of each weight is read, quantized and released before the next. Returns the bytes
    the quantized weights hold. The blocks at positions ``skip`` (streamed from disk by the memory pool) and the
    modules named in ``modules`` (``layers.<i>.moe.experts.<e>``: read when routed by the expert pool) are only
    given their quantized shapes on meta (:func:`meta_quantize`). ``saved``: the checkpoint's weights already
    quantized by torchao (a :class:`~energon_infer.loading.torchao_checkpoint.TorchaoWeights`), installed as saved."""
    keys = set(source.keys()) if saved is None else saved.logical_keys()  # type: ignore[attr-defined]
    if saved is not None and (skip or modules):
        what = f"blocks {sorted(skip)[:3]}" if skip else f"modules {sorted(modules)[:3]}"
        raise QuantizationError(f"{what} are offloaded to the memory pool's disk tier, which reads "
                                "unquantized checkpoints only; load this torchao-quantized checkpoint without the "
                                "pool's offload, or save the model unquantized and load it with quantization='int8'")
    blocks = stage.layers
    assert isinstance(blocks, torch.nn.ModuleDict)
    skipped = {key for i, key in enumerate(blocks) if i in set(skip)}
    offloaded = set(modules)
    meta_quantize([blocks[key] for key in skipped], spec)

    def fetch(part: Part, want: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...], bool]:
        t = source.get(part.source) if isinstance(source, CheckpointReader) else source[part.source]  # type: ignore[index]
        t = part.take(t)
        return t, tuple(t.shape), False

    held = 0
    for name in quantized_weight_names(stage):
        if name.split(".")[1] in skipped:
            continue
        owner, attr = name.rsplit(".", 1)
        module = stage.get_submodule(owner)
        param = module._parameters.get(attr)
        if param is None or param.device.type != "meta":
            continue  # already quantized or not this loader's
        if owner in offloaded:  # read when routed: its quantized shapes only
            shapes = quantized_shapes(param.shape[0], param.shape[1], spec)
            _install(module, attr, spec, {key: torch.empty(shape, dtype=dtype, device="meta")
                                          for key, (shape, dtype) in shapes.items()})
            continue
        parts = parts_fn(cfg, name, keys)
        missing = [p.source for p in parts if p.source not in keys]
        if missing:
            raise WeightError(f"the checkpoint lacks {missing[:3]} for {name} of this {cfg.model_type} config; check "
                              "that config.json belongs to these weights")
        if saved is not None and any(saved.holds(p.source) for p in parts):  # type: ignore[attr-defined]
            tensors = _saved_int8(saved, name, parts, grid, tuple(param.shape), spec)
        else:
            value = build_param(cfg, grid, name, tuple(param.shape), parts, fetch, nonfinite=nonfinite)
            tensors = quantize_weight(value, spec)
        tensors = {k: v.to(stage_device(stage)) for k, v in tensors.items()}
        held += _install(module, attr, spec, tensors)
    # A torchao-saved checkpoint keeps its head as saved (unquantized: torchao's own model runs it so).
    return held + (quantize_head(stage, spec) if saved is None else 0)


def quantize_head(stage: torch.nn.Module, spec: QuantSpec) -> int:
    """Hold the last stage's vocabulary head (this rank's rows) quantized like the block projections, as llama.cpp
    does: at decode it is the largest single weight a step reads (vocab x hidden). Left as loaded where there is
    none (not the last stage) or its input width does not take the int4 group size.
    Returns the bytes it now holds (0 where left). On a meta stage (the planners'): the quantized shapes only."""
    head = getattr(stage, "lm_head", None)
    w = None if head is None else head._parameters.get("weight")
    if w is None or (spec.method == "int4" and w.shape[1] % (spec.group_size or 1)):
        return 0
    if w.device.type == "meta":
        tensors = {name: torch.empty(shape, dtype=dtype, device="meta")
                   for name, (shape, dtype) in quantized_shapes(w.shape[0], w.shape[1], spec).items()}
    else:
        tensors = {k: v.to(w.device) for k, v in quantize_weight(w.detach(), spec).items()}
    return head.set_quantized(spec.method, tensors, spec.group_size)  # type: ignore[union-attr,operator]


def _saved_int8(saved: object, name: str, parts: list[Part], grid: Grid, shape: tuple[int, ...], spec: QuantSpec
                ) -> dict[str, torch.Tensor]:
    """This rank's ``name`` from torchao's int8 qdata and scales as saved (fused parts: rows concatenated)."""
    held = [p.source for p in parts if not saved.holds(p.source)]  # type: ignore[attr-defined]
    if held or spec.method != "int8" or any(p.transform is not None for p in parts):
        raise QuantizationError(f"{name} mixes torchao-quantized and unquantized checkpoint tensors ({held[:2]} are "
                                "not quantized; modules_to_not_convert?); save the model unquantized and load it with "
                                "quantization='int8'")
    pieces = [saved.read(p.source, p.split, grid.tp, grid.tp_rank) for p in parts]  # type: ignore[attr-defined]
    q = pieces[0][0] if len(pieces) == 1 else torch.cat([x[0] for x in pieces])
    s = pieces[0][1] if len(pieces) == 1 else torch.cat([x[1] for x in pieces])
    if tuple(q.shape) != shape:
        raise WeightError(f"{name}: torchao's qdata gives {tuple(q.shape)} on this rank, the model needs {shape}; "
                          "check that config.json belongs to these weights")
    return {"qweight": q, "scale": s}


def stage_device(stage: torch.nn.Module) -> torch.device:
    return next(p.device for p in stage.parameters() if p.device.type != "meta")
