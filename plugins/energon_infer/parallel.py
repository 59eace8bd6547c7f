"""Where a rank sits in the ``pp x tp`` grid, and the tensor-parallel layers and pipeline messages it uses.

Tensor parallelism is Megatron's column/row split written out (as gpt-fast does, in a few dozen
lines) rather than DTensor's ``parallelize_module``: the runtime loads each rank's slice straight
from the safetensors file (no rank ever holds the full weight), attention runs on local heads with
a paged KV cache DTensor knows nothing about, and a decode step is dominated by per-op overhead
that DTensor dispatch would multiply. The collectives are the ones ``ColwiseParallel`` /
``RowwiseParallel`` would issue: one all-reduce after each row-parallel matmul (two per block) and
one all-gather of the vocabulary-parallel logits.

The grid itself is a :class:`torch.distributed.device_mesh.DeviceMesh` of shape ``(pp, tp)``
(global rank ``= stage * tp + tp_rank``), so tensor-parallel groups are the mesh's ``"tp"``
groups and pipeline neighbours are ``rank ± tp``. Pipeline messages are the packed hidden states
(``tokens x hidden``, no padding); their shape is known to both sides from the step's metadata,
so no header is sent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tightfit.kernels.packed_linear import (
    MIN_ROWS,
    SMALL_MIN_ROWS,
    apply_activation,
    pack_linear_weight,
    packed_linear,
    rows_worth_packing,
)
from tightfit.kernels.quant_linear import int4_linear, int8_linear
from tightfit.kernels.quant_linear_a8 import A8_ENV_VAR, a8_applies, a8_level, int4_linear_a8, int8_linear_a8
from tightfit.kernels.weight_tiles import int4_tiles_apply, int8_tiles_apply, tile_int4, tile_int8

__all__ = ["Grid", "ColumnLinear", "RowLinear", "VocabEmbedding", "VocabHead", "split_layers", "pack_weights", "move_unpacked",
           "microbatches"]


@dataclass(frozen=True, slots=True)
class Grid:
    """This rank's place in a ``pp x tp`` grid (``tp = pp = 1``: a single process, no collectives)."""

    tp: int = 1
    pp: int = 1
    tp_rank: int = 0
    stage: int = 0
    tp_group: object | None = None

    @classmethod
    def create(cls, tp: int, pp: int, device: torch.device) -> Grid:
        """Build the grid; with ``tp * pp > 1`` the default process group must span exactly ``tp * pp`` ranks."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp={tp} and pp={pp} must both be >= 1")
        if device.type == "cuda":
            # NCCL communicators bind to the current device: set it before any group is created.
            torch.cuda.set_device(device)
        if tp * pp == 1:
            return cls()
        if not dist.is_initialized():
            raise RuntimeError(
                f"tp={tp} x pp={pp} needs {tp * pp} processes in a torch.distributed process group; launch "
                f"with `torchrun --nproc-per-node {tp * pp} ...` (or call torch.distributed.init_process_group "
                "in each process) before loading"
            )
        world = dist.get_world_size()
        if world != tp * pp:
            raise ValueError(
                f"tp={tp} x pp={pp} = {tp * pp} ranks, but the process group has {world}; launch exactly "
                f"{tp * pp} processes or change tp/pp so that tp * pp == {world}"
            )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (pp, tp), mesh_dim_names=("pp", "tp"))
        rank = dist.get_rank()
        return cls(tp=tp, pp=pp, tp_rank=rank % tp, stage=rank // tp,
                   tp_group=mesh.get_group("tp") if tp > 1 else None)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def rank(self) -> int:
        return self.stage * self.tp + self.tp_rank

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp

    @property
    def result_rank(self) -> int:
        """The rank that samples and broadcasts: tp rank 0 of the last stage."""
        return (self.pp - 1) * self.tp

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def broadcast_result(self, x: torch.Tensor) -> torch.Tensor:
        """Send ``x`` from :attr:`result_rank` to every rank (same shape and dtype on all of them)."""
        if self.world > 1:
            dist.broadcast(x, src=self.result_rank)
        return x


def split_layers(n_layers: int, pp: int) -> list[range]:
    """Contiguous, even stage sizes (the first ``n_layers % pp`` stages get one more layer)."""
    if pp > n_layers:
        raise ValueError(
            f"pp={pp} stages for a model of {n_layers} layers: every stage needs at least one layer; use "
            f"pp <= {n_layers}"
        )
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def linear_weight(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device | str
                  ) -> nn.Parameter:
    """An ``(out, in)`` weight stored input-major (the transpose of a contiguous ``(in, out)`` tensor).

    ``F.linear`` then multiplies by a contiguous ``(in, out)`` matrix, a plain product instead of one with
    a transposed operand, which BLAS runs faster at the few rows a decode step has (about twice as fast at one
    row on the benchmark model's projections, weights cold in the caches; the gain shrinks as rows grow).
    Loading (``copy_``) and the shape are unchanged.
    """
    return nn.Parameter(torch.empty((in_features, out_features), dtype=dtype, device=device).t(),
                        requires_grad=False)


def quant_tiling(method: str | None, dtype: torch.dtype | None, device: torch.device | str) -> bool:
    """Whether ``method`` ("int8" / "int4") projections of a ``dtype`` model on ``device`` are held tiled
    (:mod:`tightfit.kernels.weight_tiles`, where the shape takes it): fp32 on a CPU whose int8-activation kernel reads
    that method's tiles (int4: AVX2 or AVX-512 VNNI; int8: AVX-512 VNNI) (``meta``: a layer streamed in later, on
    the CPU unless CUDA is here), unless ``TIGHTFIT_QUANT_ACTIVATIONS`` is ``fp32`` (the fp32-activation kernels
    read the row order)."""
    kind = torch.device(device).type
    level = a8_level()
    return (dtype == torch.float32 and (kind == "cpu" or (kind == "meta" and not torch.cuda.is_available()))
            and os.environ.get(A8_ENV_VAR, "int8") != "fp32"
            and (level == 1 or (level == 2 and method == "int4")) and method in ("int8", "int4"))


def tile_applies(method: str, n: int, k: int, group_size: int | None) -> bool:
    """Whether an ``(n, k)`` ``method`` weight has a tiled layout (:mod:`tightfit.kernels.weight_tiles`)."""
    return int4_tiles_apply(n, k, group_size or 0) if method == "int4" else int8_tiles_apply(n, k)


def tile_weight(method: str, qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` (:func:`energon_infer.loading.quantization.quantize_weight`'s) in its method's tiled order."""
    return tile_int4(qweight) if method == "int4" else tile_int8(qweight)


class _Projection(nn.Module):
    """A ``weight`` (:func:`linear_weight`) with, on the CPU, an optional oneDNN-packed copy (:meth:`pack`).

    The copy is used for inputs of at least ``rows_worth_packing`` rows for the weight's size (fewer run as fast
    through ``F.linear``: 2 rows for most weights, 64 for small ones such as a 256 x 256 out projection), and
    only while ``weight`` is the same tensor at the same version it was packed from: a memory pool
    rebinding the parameter, or anything writing to it, makes :meth:`matmul` drop the copy for good. A weight a
    memory pool moves keeps no copy but runs the copy's product on the plain weight (:meth:`move_unpacked`).
    """

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    _packed_from: tuple[int, int] = (0, -1)
    _min_rows: int = MIN_ROWS  # the fewest rows that use ``packed``
    # oneDNN's packed product on the plain weight, from _min_rows rows (a weight a memory pool moves: move_unpacked)
    plain_packed: bool = False
    # Weight-only quantization (energon_infer.loading.quantization): "int8" or "int4", with the weight held as the
    # parameters qweight, qscale (and qzero for int4) instead of ``weight``.
    quant: str | None = None
    group_size: int = 0
    # qweight in tile_int8 / tile_int4's order (the int8-activation kernel's; quant_tiling says where), not the row
    # order quantize_weight gives
    tiled: bool = False

    def set_quantized(self, method: str, tensors: dict[str, torch.Tensor], group_size: int | None) -> int:
        """Hold the weight quantized (``tensors`` from :func:`energon_infer.loading.quantization.quantize_weight`);
        ``weight`` goes away. The weight is tiled where :func:`quant_tiling` says (same bytes). Returns the
        bytes now held for the weight."""
        old = self._parameters.pop("weight", None)
        self.packed = None
        q = tensors["qweight"]
        k = q.shape[1] * (2 if method == "int4" else 1)  # int4: two inputs a byte
        self.tiled = (old is not None and quant_tiling(method, old.dtype, q.device)
                      and tile_applies(method, q.shape[0], k, group_size))
        for name in ("qweight", "scale", "zero"):
            if name in tensors:
                key = name if name == "qweight" else "q" + name
                value = (tile_weight(method, q) if name == "qweight" and self.tiled and q.device.type != "meta"
                         else tensors[name])
                self._parameters[key] = nn.Parameter(value, requires_grad=False)
        self.quant, self.group_size = method, group_size or 0
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def pack(self) -> int:
        """Keep a packed copy of the weight (:mod:`tightfit.kernels.packed_linear`); its bytes, 0 where none."""
        if self.quant is not None:
            return 0
        w = self.weight
        rows = rows_worth_packing(w.numel())
        self.packed = pack_linear_weight(w)  # None where rows is None: too small to earn a copy
        self._min_rows = rows or MIN_ROWS
        self._packed_from = (id(w), w._version)
        return 0 if self.packed is None else w.numel() * w.element_size()

    def move_unpacked(self, packs: bool) -> None:
        """The weight will move (a memory pool binds a slot's view to it each pass): drop the packed copy, and where
        ``packs`` (the weight, loaded whole, is packed) run oneDNN's product on the bound weight as it is, for as
        many rows as the copy would serve. oneDNN reads the plain weight about as fast as ``F.linear`` (a copy
        reordered per call would cost several times the product) and gives the packed copy's results, bit for bit
        (:func:`_plain_matches_packed`; where it does not, ``F.linear`` runs), so a moved layer computes what the
        engine that holds the weight computes."""
        self.packed = None
        rows = rows_worth_packing(self.weight.numel()) if self.quant is None else None
        self.plain_packed = packs and rows is not None and _plain_matches_packed(self.weight.dtype)
        self._min_rows = rows or MIN_ROWS

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "") -> torch.Tensor:
        """``activation(x W^T + bias)``; ``activation`` a key of ``packed_linear.ACTIVATIONS`` (``""``: none), fused
        into the product where the weight is packed (a quantized weight is never packed)."""
        if self.plain_packed and x.shape[0] >= self._min_rows:
            return packed_linear(x, self.weight, bias, activation)
        packed = self.packed
        if packed is not None and x.shape[0] >= self._min_rows:
            w = self.weight
            if (id(w), w._version) == self._packed_from:
                return packed_linear(x, packed, bias, activation)
            self.packed = None  # stale: the weight was replaced or written since
        return apply_activation(self._product(x, bias), activation)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Decode-sized fp32 inputs on an AVX-512 VNNI CPU: activations quantised to int8 per block of 128 or 32
        # (tightfit.kernels.quant_linear_a8, its error bound there); elsewhere the fp32-activation kernels.
        # Else prefill (more rows than the kernel takes: dequantised from the tiles in C) or
        # TIGHTFIT_QUANT_ACTIVATIONS=fp32 set after loading.
        if self.quant == "int8":
            if a8_applies(x, x.shape[-1], 0, self.tiled):
                return int8_linear_a8(x, self.qweight, self.qscale, bias, tiled=self.tiled)
            return int8_linear(x, self.qweight, self.qscale, bias, tiled=self.tiled)
        if self.quant == "int4":
            if a8_applies(x, x.shape[-1], self.group_size, self.tiled):
                return int4_linear_a8(x, self.qweight, self.qscale, self.qzero, self.group_size, bias,
                                      tiled=self.tiled)
            return int4_linear(x, self.qweight, self.qscale, self.qzero, self.group_size, bias, tiled=self.tiled)
        return F.linear(x, self.weight, bias)


def pack_weights(module: nn.Module) -> int:
    """Pack every projection weight in ``module`` for the CPU (see :class:`_Projection`); bytes added."""
    return sum(m.pack() for m in module.modules() if isinstance(m, _Projection))


_PLAIN_MATCHES: dict[torch.dtype, bool] = {}


def _plain_matches_packed(dtype: torch.dtype) -> bool:
    """Whether oneDNN's product from a plain input-major ``dtype`` weight equals the one from its packed copy, bit for
    bit, at :data:`MIN_ROWS` and :data:`SMALL_MIN_ROWS` rows (probed once per dtype)."""
    if dtype not in _PLAIN_MATCHES:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(256, 384, generator=gen).to(dtype).t()  # (384 out, 256 in), stored input-major
        packed = pack_linear_weight(w, min_numel=0)
        try:
            _PLAIN_MATCHES[dtype] = packed is not None and all(
                torch.equal(packed_linear(x, w), packed_linear(x, packed))
                for x in (torch.randn(rows, 256, generator=gen).to(dtype) for rows in (MIN_ROWS, SMALL_MIN_ROWS)))
        except (RuntimeError, TypeError):
            _PLAIN_MATCHES[dtype] = False
    return _PLAIN_MATCHES[dtype]


def move_unpacked(module: nn.Module, packs: bool | None = None) -> None:
    """:meth:`_Projection.move_unpacked` for every projection in ``module``, whose weights a memory pool moves;
    ``packs``: whether the weights, loaded whole, pack (``None``: each projection's own packed copy says)."""
    for m in module.modules():
        if isinstance(m, _Projection):
            m.move_unpacked(m.packed is not None if packs is None else packs)


class ColumnLinear(_Projection):
    """``y = x W_local^T + b_local``: this rank's slice of the output features (no communication)."""

    def __init__(self, in_features: int, out_local: int, bias: bool, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = linear_weight(out_local, in_features, dtype, device)
        self.bias = _empty((out_local,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor, activation: str = "") -> torch.Tensor:
        return self.matmul(x, self.bias, activation)


class RowLinear(_Projection):
    """``y = all_reduce(x_local W_local^T) + b``: this rank's slice of the input features; bias added once."""

    def __init__(self, in_local: int, out_features: int, bias: bool, grid: Grid, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.grid = grid
        self.weight = linear_weight(out_features, in_local, dtype, device)
        self.bias = _empty((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grid.tp == 1:  # nothing to reduce: the bias goes into the product (one pass fewer)
            return self.matmul(x, self.bias)
        y = self.grid.all_reduce(self.matmul(x))
        return y + self.bias if self.bias is not None else y


def vocab_shard(vocab_size: int, tp: int) -> int:
    """Rows per rank of a vocabulary-parallel table (the vocabulary padded up to a multiple of ``tp``)."""
    return -(-vocab_size // tp)


class VocabEmbedding(nn.Module):
    """Token embedding split by vocabulary rows; each rank looks up the ids it owns, then all-reduce."""

    def __init__(self, vocab_size: int, dim: int, grid: Grid, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.grid = grid
        self.rows = vocab_shard(vocab_size, grid.tp)
        self.start = grid.tp_rank * self.rows
        self.weight = _empty((self.rows, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.grid.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        return self.grid.all_reduce(out)


class VocabHead(_Projection):
    """Output projection split by vocabulary rows; logits all-gathered and trimmed to the true vocabulary."""

    def __init__(self, vocab_size: int, dim: int, grid: Grid, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.grid = grid
        self.vocab_size = vocab_size
        self.weight = linear_weight(vocab_shard(vocab_size, grid.tp), dim, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.grid.all_gather_last_dim(self.matmul(x))
        return logits[..., : self.vocab_size]


def local_rank_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def microbatches(items: list, m: int) -> list[list]:
    """``items`` (``(seq_id, tokens)``) in at most ``m`` contiguous chunks of roughly equal token counts
    (a pipeline stage's time grows with its tokens)."""
    if m <= 1:
        return [items]
    total = sum(len(t) for _, t in items)
    chunks: list[list] = [[]]
    acc = 0
    for i, item in enumerate(items):
        left_items, left_chunks = len(items) - i, m - len(chunks)
        if chunks[-1] and (acc >= total * len(chunks) / m or left_items <= left_chunks):
            chunks.append([])
        chunks[-1].append(item)
        acc += len(item[1])
    return chunks
