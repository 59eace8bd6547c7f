"""Load a rank's slice of a checkpoint into a :class:`~energon_infer.worker.model.DecoderStage`, without unpickling.

Sources: a Hugging Face directory (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) read with ``safetensors.safe_open``; or any ``{name: tensor}``
mapping already in memory (how :func:`energon_infer.worker.gpt_checkpoint.load_tightfit_gpt` feeds a
tightfit/Lightning checkpoint). ``*.bin`` / ``*.pt`` pickles are refused.

Each runtime parameter is built from one or more checkpoint tensors (GPT-2's fused, transposed
``c_attn`` is split into q/k/v; q/k/v and gate/up are fused again per rank), then sliced for
tensor parallelism: column-parallel rows by head, row-parallel columns, vocabulary rows padded to a
multiple of ``tp``. Only the tensors of this rank's pipeline stage are read, and each is read,
sliced and released one at a time, so a rank's peak host memory is its own shard plus the largest
single tensor.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from energon_infer.errors import BadInputError
from energon_infer.loading.config import ModelConfig
from energon_infer.loading.families import FAMILIES
from energon_infer.parallel import Grid, vocab_shard

__all__ = ["CheckpointReader", "WeightError", "ModelTooLargeError", "load_stage_weights", "hf_parts",
           "check_stage_fits", "available_bytes", "build_param", "Part", "source_order"]


class WeightError(BadInputError, ValueError):
    """Weights are missing from the checkpoint or do not have the shape the config implies."""


class ModelTooLargeError(BadInputError, ValueError):
    """The stage's weights and KV cache cannot fit the memory available on this rank's device."""


def available_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on ``device``: ``cudaMemGetInfo``'s free bytes, or for the CPU core's
    reading of host memory (``MemAvailable`` bounded by the memory cgroup limit, :mod:`tightfit.memory_limit`);
    ``None`` where it cannot be read (the check is then skipped)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    from tightfit.memory_limit import read_memory

    reading = read_memory(settle=True)
    return reading.free if reading.capacity else None


def check_stage_fits(cfg: ModelConfig, layers: int, *, tp: int, itemsize: int, kv_tokens: int,
                     device: torch.device, weight_itemsize: float | None = None) -> int:
    """Raise :class:`ModelTooLargeError` if this rank's share of ``cfg`` cannot fit, before allocating it.

    The estimate is a lower bound (its ``layers`` blocks' weights split ``tp`` ways, no embedding,
    plus the KV cache), so it refuses only what surely does not fit: a config.json claiming
    ``n_layer=1000000000`` fails here in microseconds instead of allocating until the process is
    killed. Returns the estimate in bytes.
    """
    h, e = cfg.hidden_size, cfg.embed_dim
    attn = h * cfg.head_dim * (cfg.n_heads * 2 + cfg.n_kv_heads * 2)
    # the smaller of a dense and an MoE layer's MLP, of those the model has (a lower bound for any stage)
    mlp = min(cfg.mlp_params(sparse) for sparse in {cfg.n_sparse > 0, cfg.n_sparse < cfg.n_layers})
    # weight_itemsize: bytes per projection weight when they are held quantized (energon_infer.loading.quantization)
    weights = int(layers * (attn + mlp) // tp * (itemsize if weight_itemsize is None else weight_itemsize))
    cache = layers * kv_tokens * 2 * (cfg.n_kv_heads // tp) * cfg.head_dim * itemsize
    need = weights + cache
    free = available_bytes(device)
    if free is not None and need > free:
        gib = 2**30
        raise ModelTooLargeError(
            f"{cfg.model_type} with n_layers={cfg.n_layers}, hidden_size={cfg.hidden_size} (embedding {e}) needs at "
            f"least {need / gib:.2f} GiB on this rank for {layers} layers ({weights / gib:.2f} GiB of weights + "
            f"{cache / gib:.2f} GiB of KV cache) but {device} has {free / gib:.2f} GiB available; check config.json, "
            "or use more ranks (tp/pp), dtype='bfloat16', or a smaller kv_cache_tokens")
    return need


def _open(file: Path) -> object:
    """``safe_open`` of one shard; a truncated or garbage file raises :class:`WeightError` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as err:
        raise WeightError(f"{file} is not a readable safetensors file ({err}); it is truncated or corrupt: "
                          "copy it again from the original model directory") from None


def _read_index(index: Path, root: Path) -> dict[str, Path]:
    """``weight_map`` of a shard index, each shard confined to ``root`` (no ``../``, no absolute paths)."""
    try:
        raw = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise WeightError(f"{index} is not valid JSON ({err}); restore it from the original model directory") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise WeightError(f"{index} has no \"weight_map\" object of tensor name -> shard file name; restore it "
                          "from the original model directory")
    base = root.resolve()
    where = {}
    for name, file in weight_map.items():
        shard = (root / file).resolve()
        # A hostile index can name ../../other/model.safetensors or /etc/...: only files inside the
        # model directory are ever opened.
        if not shard.is_relative_to(base) or shard == base:
            raise WeightError(f"{index} maps tensor {name!r} to {file!r}, which lies outside the model directory "
                              f"{root}; shard files must sit inside it (e.g. model-00001-of-00002.safetensors)")
        where[name] = shard
    return where


class CheckpointReader:
    """Tensors of a safetensors checkpoint directory (single file or sharded with an index), by name.

    Every error names the file it is about: a non-JSON index, a shard outside the directory, a
    truncated or garbage shard (:class:`WeightError`), a missing shard (``FileNotFoundError``).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            self._where = _read_index(index, self.path)
        elif single.is_file():
            with _open(single) as f:  # type: ignore[attr-defined]
                self._where = {name: single for name in f.keys()}
        else:
            pickles = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
            hint = (f" It holds {pickles[:3]}: pickled weights are never loaded (unpickling runs code); "
                    "convert them with `model.save_pretrained(dir, safe_serialization=True)`.") if pickles else ""
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {self.path}.{hint}"
            )
        missing_files = sorted({str(p.name) for p in self._where.values() if not p.is_file()})
        if missing_files:
            raise FileNotFoundError(
                f"{self.path} lists shard files that are not there: {missing_files[:5]}; copy the whole "
                "checkpoint directory"
            )
        self._handles: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError

        file = self._where[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _open(file)
        try:
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise WeightError(f"{file}: cannot read tensor {name!r} ({err}); the index names a tensor the shard "
                              "does not hold, or the shard is corrupt: copy it again") from None

    def close(self) -> None:
        self._handles.clear()


# How one runtime tensor is assembled: parts concatenated along dim 0, each part a checkpoint
# tensor (possibly transformed) and its split rule for tensor parallelism.
#   "col":  rows split evenly (output features: heads, MLP width)
#   "row":  columns split evenly (input features of o / down)
#   "vocab": rows split in vocab_shard(V, tp) chunks, the last padded with zeros
#   None:   replicated
#   "expert_col" / "expert_row": an expert's weights: whole where the ranks split the experts whole (expert
#           parallelism, ModelConfig.expert_parallel), else "col" / "row" like the dense MLP's
#   rows: (lo, hi) of the tensor's first dimension the part takes (a fused tensor's expert): ``transform`` applies to
#         those rows only, so a reader may read just them (:meth:`Part.take` from the whole tensor)
@dataclass(frozen=True, slots=True)
class Part:
    source: str
    split: str | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    rows: tuple[int, int] | None = None

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This part of checkpoint tensor ``whole``: its rows, transformed."""
        t = whole if self.rows is None else whole[self.rows[0]: self.rows[1]]
        return t if self.transform is None else self.transform(t)


def _cols(lo: int, hi: int, transpose: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    # GPT-2 stores Conv1D weights as (in, out); its fused c_attn is (hidden, 3 * hidden).
    if transpose:
        return lambda w: w[:, lo:hi].t()
    return lambda b: b[lo:hi]


def hf_parts(cfg: ModelConfig, name: str, keys: set[str]) -> list[Part]:
    """The checkpoint tensors runtime parameter ``name`` is built from, for ``cfg``'s family."""
    head = name.split(".")
    if cfg.family == "gpt2":
        pre = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
        h = cfg.hidden_size
        simple = {"embed.weight": (f"{pre}wte.weight", "vocab"), "pos_embed.weight": (f"{pre}wpe.weight", None),
                  "final_norm.weight": (f"{pre}ln_f.weight", None), "final_norm.bias": (f"{pre}ln_f.bias", None)}
        if name == "lm_head.weight":
            return [Part("lm_head.weight" if "lm_head.weight" in keys else f"{pre}wte.weight", "vocab")]
        if name in simple:
            return [Part(*simple[name])]
        i, rest = head[1], ".".join(head[2:])
        p = f"{pre}h.{i}."
        if rest == "qkv.weight":
            return [Part(f"{p}attn.c_attn.weight", "col", _cols(j * h, (j + 1) * h)) for j in range(3)]
        if rest == "qkv.bias":
            return [Part(f"{p}attn.c_attn.bias", "col", _cols(j * h, (j + 1) * h, False)) for j in range(3)]
        table = {"attn_norm.weight": (f"{p}ln_1.weight", None, None), "attn_norm.bias": (f"{p}ln_1.bias", None, None),
                 "mlp_norm.weight": (f"{p}ln_2.weight", None, None), "mlp_norm.bias": (f"{p}ln_2.bias", None, None),
                 "o.weight": (f"{p}attn.c_proj.weight", "row", torch.t), "o.bias": (f"{p}attn.c_proj.bias", None, None),
                 "up.weight": (f"{p}mlp.c_fc.weight", "col", torch.t), "up.bias": (f"{p}mlp.c_fc.bias", "col", None),
                 "down.weight": (f"{p}mlp.c_proj.weight", "row", torch.t),
                 "down.bias": (f"{p}mlp.c_proj.bias", None, None)}
        return [Part(*table[rest])]
    if cfg.family == "opt":
        pre = "model.decoder."
        simple = {"embed.weight": (f"{pre}embed_tokens.weight", "vocab"),
                  "pos_embed.weight": (f"{pre}embed_positions.weight", None),
                  "project_in.weight": (f"{pre}project_in.weight", None),
                  "project_out.weight": (f"{pre}project_out.weight", None),
                  "final_norm.weight": (f"{pre}final_layer_norm.weight", None),
                  "final_norm.bias": (f"{pre}final_layer_norm.bias", None)}
        if name == "lm_head.weight":
            return [Part("lm_head.weight" if "lm_head.weight" in keys else f"{pre}embed_tokens.weight", "vocab")]
        if name in simple:
            return [Part(*simple[name])]
        i, rest = head[1], ".".join(head[2:])
        p = f"{pre}layers.{i}."
        kind = rest.split(".")[-1]
        if rest.startswith("qkv."):
            return [Part(f"{p}self_attn.{x}_proj.{kind}", "col") for x in "qkv"]
        splits: dict[str, tuple[str, str | None]] = {
            "attn_norm": (f"{p}self_attn_layer_norm", None), "mlp_norm": (f"{p}final_layer_norm", None),
            "o": (f"{p}self_attn.out_proj", "row"), "up": (f"{p}fc1", "col"), "down": (f"{p}fc2", "row")}
        src, split = splits[rest.split(".")[0]]
        if kind == "bias" and split == "row":
            split = None
        return [Part(f"{src}.{kind}", split)]
    return _decoder_parts(cfg, name, keys)


def _rows(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    # Rows lo:hi of a tensor a checkpoint fuses (Phi-3's qkv_proj and gate_up_proj).
    return lambda t: t[lo:hi]


def _decoder_parts(cfg: ModelConfig, name: str, keys: set[str]) -> list[Part]:
    """The rotary families' parts, by their declaration's tensor names (:mod:`energon_infer.loading.families`)."""
    tensors = FAMILIES[cfg.family].tensors
    if name == "lm_head.weight":
        tied = cfg.tie_embeddings and "lm_head.weight" not in keys
        return [Part("model.embed_tokens.weight" if tied else "lm_head.weight", "vocab")]
    if name == "embed.weight":
        return [Part("model.embed_tokens.weight", "vocab")]
    if name == "final_norm.weight":
        return [Part("model.norm.weight")]
    head = name.split(".")
    p, module, kind = f"model.layers.{head[1]}.", head[2], head[-1]
    if module == "moe":
        return _fused_expert_parts(tensors, p, head[3:]) if "experts" in tensors else _moe_parts(tensors, p, head[3:])
    if module == "sinks":  # one logit per query head: split by heads, as q's rows are
        return [Part(f"{p}{tensors['sinks']}", "col")]
    if module in ("qkv", "up"):
        names = ("q", "k", "v") if module == "qkv" else ("gate", "up")
        fused = tensors.get("qkv" if module == "qkv" else "gate_up")
        if fused is None:
            return [Part(f"{p}{tensors[x]}.{kind}", "col") for x in names]
        q, kv, inter = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
        bounds = [0, q, q + kv, q + 2 * kv] if module == "qkv" else [0, inter, 2 * inter]
        return [Part(f"{p}{fused}.{kind}", "col", _rows(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    split = {"o": "row", "down": "row", "q_norm": "col", "k_norm": "col"}.get(module)
    if kind == "bias" and split == "row" or module in ("q_norm", "k_norm") and cfg.qk_norm == "head":
        split = None  # a row-parallel bias is added once, after the all-reduce; a per-head norm is shared
    return [Part(f"{p}{tensors[module]}.{kind}", split)]


def _moe_parts(tensors: Mapping[str, str], p: str, rest: list[str]) -> list[Part]:
    """An MoE layer's parts (:class:`energon_infer.worker.moe.MoE`): ``router.weight``, ``experts.<e>.gate_up`` /
    ``.down``, ``shared_up.weight`` (the shared expert's gate and up), ``shared_down.weight``,
    ``shared_expert_gate.weight``."""
    if rest[0] == "experts":
        e, which = rest[1], rest[2]
        if which == "gate_up":
            return [Part(f"{p}{tensors[x].format(e=e)}.weight", "expert_col") for x in ("expert_gate", "expert_up")]
        return [Part(f"{p}{tensors['expert_down'].format(e=e)}.weight", "expert_row")]
    if rest[0] == "shared_up":
        return [Part(f"{p}{tensors[x]}.weight", "col") for x in ("shared_gate", "shared_up")]
    split = "row" if rest[0] == "shared_down" else None
    return [Part(f"{p}{tensors[rest[0]]}.weight", split)]


def _expert(e: int, cols: slice | None = None, t: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Expert ``e`` of a fused experts tensor, its columns ``cols`` (gate or up of an interleaved gate_up), as an
    ``(out, in)`` weight where ``t`` (the checkpoint holds them ``(in, out)``)."""
    def take(x: torch.Tensor) -> torch.Tensor:
        x = x[e] if cols is None else x[e][..., cols]
        return x.t() if t else x
    return take


def _fused_expert_parts(tensors: Mapping[str, str], p: str, rest: list[str]) -> list[Part]:
    """gpt-oss's MoE parts (:data:`~energon_infer.loading.families.GPT_OSS_TENSORS`): ``router.weight`` / ``.bias``
    and each expert's ``gate_up`` / ``gate_up_bias`` (gate rows, then up rows: de-interleaved here) and ``down`` /
    ``down_bias``, sliced out of the four fused tensors."""
    if rest[0] == "router":
        return [Part(f"{p}{tensors['router']}.{rest[1]}")]
    e, which, src = int(rest[1]), rest[2], f"{p}{tensors['experts']}"
    gate, up = slice(0, None, 2), slice(1, None, 2)
    rows = (e, e + 1)  # expert e's slab of each fused tensor: a reader may read only it
    if which == "gate_up":
        return [Part(f"{src}.gate_up_proj", "expert_col", _expert(0, c, t=True), rows) for c in (gate, up)]
    if which == "gate_up_bias":
        return [Part(f"{src}.gate_up_proj_bias", "expert_col", _expert(0, c), rows) for c in (gate, up)]
    if which == "down":
        return [Part(f"{src}.down_proj", "expert_row", _expert(0, t=True), rows)]
    return [Part(f"{src}.down_proj_bias", None, _expert(0), rows)]


def source_order(recipes: Sequence[Sequence[Part]]) -> list[int]:
    """The indices of ``recipes`` (each parameter's parts) grouped by the checkpoint tensor of their first part, the
    groups in first-use order and each in its own: a reader that keeps the tensor it read last reads a fused tensor
    many parameters are sliced from once."""
    first: dict[str, int] = {}
    for parts in recipes:
        first.setdefault(parts[0].source, len(first))
    return sorted(range(len(recipes)), key=lambda i: first[recipes[i][0].source])


def _resolve(split: str | None, cfg: ModelConfig, tp: int) -> str | None:
    """An expert part's split at ``tp`` (whole experts, or sliced like the dense MLP); any other as given."""
    if split in ("expert_col", "expert_row"):
        return None if cfg.expert_parallel(tp) else split.removeprefix("expert_")
    return split


def _full_shape(local: tuple[int, ...], split: str | None, tp: int, cfg: ModelConfig) -> tuple[int, ...]:
    if split == "col":
        return (local[0] * tp, *local[1:])
    if split == "row":
        return (local[0], local[1] * tp)
    if split == "vocab":
        return (cfg.vocab_size, *local[1:])
    return local


def _shard(t: torch.Tensor, split: str | None, grid: Grid) -> torch.Tensor:
    if split is None or grid.tp == 1 and split != "vocab":
        return t
    if split == "col":
        return t.chunk(grid.tp, dim=0)[grid.tp_rank]
    if split == "row":
        return t.chunk(grid.tp, dim=1)[grid.tp_rank]
    rows = vocab_shard(t.shape[0], grid.tp)
    start = grid.tp_rank * rows
    piece = t[start:start + rows]
    if piece.shape[0] < rows:  # the last rank's rows past the vocabulary are zeros (never looked up)
        piece = torch.cat([piece, piece.new_zeros((rows - piece.shape[0], *piece.shape[1:]))])
    return piece


def _part_shapes(shape: tuple[int, ...], parts: list[Part]) -> list[tuple[int, ...]]:
    # Fused parameters split their rows evenly among parts, except fused qkv with grouped-query
    # attention (q is wider than k and v): the caller passes the split explicitly.
    n = len(parts)
    rows = shape[0] // n
    return [(rows, *shape[1:])] * n


def _check_finite(t: torch.Tensor, name: str, mode: str) -> None:
    bad = int(t.numel() - torch.isfinite(t).sum().item())
    if not bad:
        return
    msg = (f"checkpoint tensor {name!r} holds {bad} non-finite value(s) (NaN or inf) of {t.numel()}; the model "
           "will produce NaN logits. Re-export the weights from a run whose loss stayed finite")
    if mode == "error":
        raise WeightError(msg)
    warnings.warn(msg + " (pass nonfinite_weights='error' to refuse such checkpoints)", RuntimeWarning, stacklevel=3)


def load_stage_weights(stage: torch.nn.Module, cfg: ModelConfig, grid: Grid,
                       source: CheckpointReader | Mapping[str, torch.Tensor], *,
                       parts_fn: Callable[[ModelConfig, str, set[str]], list[Part]] = hf_parts,
                       progress: Callable[[str], None] | None = None, nonfinite: str = "warn") -> None:
    """Fill every parameter of ``stage`` from ``source``; raise :class:`WeightError` naming what is wrong.

    ``nonfinite``: what a NaN or infinite weight does: ``"warn"`` (a ``RuntimeWarning`` naming the
    tensor and the count; the model would otherwise generate token 0 forever without a word),
    ``"error"`` (a :class:`WeightError`), or ``"ignore"``.
    """
    if nonfinite not in ("warn", "error", "ignore"):
        raise ValueError(f"nonfinite={nonfinite!r} must be 'warn', 'error' or 'ignore'")
    keys = set(source.keys())
    # Parameters left on the meta device belong to layers the memory pool streams from disk: not loaded here.
    params = {n: p for n, p in stage.named_parameters() if p.device.type != "meta"}
    plan = {name: parts_fn(cfg, name, keys) for name in params}
    missing = sorted({p.source for parts in plan.values() for p in parts if p.source not in keys})
    if missing:
        raise WeightError(
            f"the checkpoint lacks {len(missing)} tensor(s) this {cfg.model_type} config needs, e.g. "
            f"{missing[:5]}; it holds {len(keys)} tensors. Check that config.json belongs to these weights "
            "and that every shard listed in model.safetensors.index.json is present"
        )
    # The tensor read last stays until the next read (released before it: one checkpoint tensor in memory at a
    # time): a fused tensor that many parameters are sliced from (gpt-oss's experts) is read once, as the
    # parameters are loaded grouped by the tensor they come from (source_order).
    last: dict[str, torch.Tensor] = {}
    names = list(params)

    def fetch(part: Part, want: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...], bool]:
        if part.source not in last:
            last.clear()
            last[part.source] = source.get(part.source) if isinstance(source, CheckpointReader) \
                else source[part.source]
        t = part.take(last[part.source])
        return t, tuple(t.shape), False

    done = 0
    for name in (names[i] for i in source_order([plan[n] for n in names])):
        param = params[name]
        value = build_param(cfg, grid, name, tuple(param.shape), plan[name], fetch, nonfinite=nonfinite)
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        done += 1
        if progress is not None and (done % 50 == 0 or done == len(params)):
            progress(f"loaded {done}/{len(params)} tensors")


def _copy_into(dst: torch.Tensor, src: torch.Tensor, rows: int = 64) -> None:
    """``dst.copy_(src)``; into a transposed view (an input-major linear weight) 64 rows at a time: each block's
    writes stay in cache lines already loaded, several times faster than one strided copy (64 rows is about the
    best block on one thread; 16 and 256 come close)."""
    if dst.dim() != 2 or dst.is_contiguous() or dst.shape[0] <= rows:
        dst.copy_(src)
        return
    for r in range(0, dst.shape[0], rows):
        dst[r: r + rows].copy_(src[r: r + rows])


# fetch(part, full shape wanted) -> (tensor, its full shape before any slicing, already this rank's slice)
Fetch = Callable[[Part, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...], bool]]


def build_param(cfg: ModelConfig, grid: Grid, name: str, shape: tuple[int, ...], parts: list[Part], fetch: Fetch, *,
                nonfinite: str = "warn", out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's value of runtime parameter ``name`` (of local ``shape``) from its checkpoint ``parts``.

    The one assembly both loaders use (all in memory here, streamed from disk in
    :mod:`energon_infer.worker.disk_pool`), so a streamed layer holds exactly the loaded values. With ``out``
    (a tensor of ``shape``) each part is copied into its rows as soon as it is fetched (a fetch may reuse
    its buffer) and ``out`` is returned.
    """
    shapes = _part_shapes(shape, parts)
    if name.endswith(("qkv.weight", "qkv.bias")):
        q_rows = cfg.n_heads * cfg.head_dim // grid.tp
        kv_rows = cfg.n_kv_heads * cfg.head_dim // grid.tp
        shapes = [(r, *shape[1:]) for r in (q_rows, kv_rows, kv_rows)]
    pieces, row = [], 0
    for part, local in zip(parts, shapes):
        split = _resolve(part.split, cfg, grid.tp)
        want = _full_shape(local, split, grid.tp, cfg)
        t, full, sliced = fetch(part, want)
        if full != want:
            raise WeightError(
                f"tensor {part.source!r} has shape {full}, but {cfg.model_type} config.json implies "
                f"{want} for {name} (hidden_size={cfg.hidden_size}, heads={cfg.n_heads}/{cfg.n_kv_heads}, "
                f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}); the weights and "
                "config.json come from different models"
            )
        if nonfinite != "ignore" and t.is_floating_point():
            _check_finite(t, part.source, nonfinite)
        piece = t if sliced else _shard(t, split, grid)
        if out is None:
            pieces.append(piece)
        else:
            _copy_into(out[row: row + piece.shape[0]], piece)
            row += piece.shape[0]
    if out is not None:
        return out
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
