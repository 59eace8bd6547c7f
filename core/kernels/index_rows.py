"""Row gather / scatter / scatter-add by index for 2-D tensors (embedding-cache moves, sequence packing).

    out = gather_rows(src, index)             # out[i] = src[index[i]]
    scatter_rows(dst, index, src)             # dst[index[i]] = src[i]          (in place)
    scatter_add_rows(dst, index, src)         # dst[index[i]] += src[i]         (in place, duplicates add up)

Each op: a private ``@triton.jit`` kernel -> a launcher (``*_triton``) -> the dispatching public function,
with the pure-PyTorch reference (``*_reference``) beside it. Any 2-D strides work (the kernels take
both strides), indices may be int32 or int64, and every op accepts an empty index.

``scatter_add_rows`` is deterministic on both backends: the Triton launcher sorts the indices (on
the device, no host sync), then one program per *distinct* row sums that row's updates in fp32 and
writes the row once, so fp16/bf16 tables get a single rounding per row and no atomics are needed.
The cost of that choice: a row hit ``k`` times is summed serially by one program (k loads in a
loop), which is what frequency-skewed embedding indices do; the sort makes the rest coalesced.

``validate=True`` (the default) checks ``0 <= index < rows`` with one host sync and raises
``IndexError`` naming the bad value; hot loops whose indices are known good pass ``validate=False``.

Example:
    >>> import torch
    >>> table = torch.arange(12.).reshape(4, 3)
    >>> gather_rows(table, torch.tensor([3, 0])).tolist()
    [[9.0, 10.0, 11.0], [0.0, 1.0, 2.0]]
    >>> scatter_add_rows(torch.zeros(2, 3), torch.tensor([1, 1]), torch.ones(2, 3)).tolist()
    [[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tightfit.kernels.dispatch import register_kernel

__all__ = [
    "gather_rows",
    "scatter_rows",
    "scatter_add_rows",
    "gather_rows_reference",
    "scatter_rows_reference",
    "scatter_add_rows_reference",
    "gather_rows_triton",
    "scatter_rows_triton",
    "scatter_add_rows_triton",
]

_INDEX_DTYPES = (torch.int32, torch.int64)

# Module globals the jit kernels resolve at compile time; bound by _kernels() on first use so that
# importing this module never imports Triton.
triton: Any = None
tl: Any = None


# --------------------------------------------------------------------------- Triton kernels


@functools.cache
def _kernels() -> dict[str, Any]:
    global triton, tl
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl

    @triton.jit
    def _gather_rows_kernel(src_ptr, idx_ptr, out_ptr, n_idx, n_cols, src_s0, src_s1, out_s0, out_s1,
                            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
        rmask = rows < n_idx
        # int64 offsets: a 10M x 512 table already overflows int32 element offsets.
        idx = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        mask = rmask[:, None] & (cols[None, :] < n_cols)
        vals = tl.load(src_ptr + idx[:, None] * src_s0 + cols[None, :] * src_s1, mask=mask)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_s0 + cols[None, :] * out_s1, vals, mask=mask)

    @triton.jit
    def _scatter_rows_kernel(dst_ptr, idx_ptr, src_ptr, n_idx, n_cols, dst_s0, dst_s1, src_s0, src_s1,
                             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
        rmask = rows < n_idx
        idx = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        mask = rmask[:, None] & (cols[None, :] < n_cols)
        vals = tl.load(src_ptr + rows.to(tl.int64)[:, None] * src_s0 + cols[None, :] * src_s1, mask=mask)
        tl.store(dst_ptr + idx[:, None] * dst_s0 + cols[None, :] * dst_s1, vals, mask=mask)

    @triton.jit
    def _scatter_add_rows_kernel(dst_ptr, src_ptr, sorted_idx_ptr, order_ptr, starts_ptr, ends_ptr, n_cols,
                                 dst_s0, dst_s1, src_s0, src_s1, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
        # One program per (position in sorted order, column block); only the first position of
        # each run of equal indices does work, so every destination row is written exactly once.
        i = tl.program_id(0)
        cols = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
        cmask = cols < n_cols
        start = tl.load(starts_ptr + i)
        if start == i:
            end = tl.load(ends_ptr + i)
            row = tl.load(sorted_idx_ptr + i).to(tl.int64)
            acc = tl.zeros([BLOCK_D], dtype=ACC)
            for j in range(start, end):
                pos = tl.load(order_ptr + j).to(tl.int64)
                acc += tl.load(src_ptr + pos * src_s0 + cols * src_s1, mask=cmask, other=0.0).to(ACC)
            dst = dst_ptr + row * dst_s0 + cols * dst_s1
            old = tl.load(dst, mask=cmask, other=0.0)
            tl.store(dst, (old.to(ACC) + acc).to(old.dtype), mask=cmask)

    return {"gather": _gather_rows_kernel, "scatter": _scatter_rows_kernel, "scatter_add": _scatter_add_rows_kernel}


def _blocks(n_cols: int) -> tuple[int, int]:
    # Columns per program: the whole row up to 128 elements (512 B at fp32, four 128-B lines);
    # rows per program so that a program moves ~4K elements. Not yet tuned on a GPU.
    block_d = min(triton.next_power_of_2(max(n_cols, 1)), 128)
    return max(1, 4096 // block_d), block_d


# --------------------------------------------------------------------------- launchers


def _launch_rowwise(kind: str, table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    # The gather and scatter kernels share one signature: (table, index, rows, sizes, table strides,
    # rows strides); only the direction of the copy differs.
    kernel = _kernels()[kind]  # first: it binds the module's `triton` that _blocks uses
    n_idx, n_cols = rows.shape
    if n_idx and n_cols:
        block_m, block_d = _blocks(n_cols)
        grid = (triton.cdiv(n_idx, block_m), triton.cdiv(n_cols, block_d))
        kernel[grid](table, index, rows, n_idx, n_cols, table.stride(0), table.stride(1),
                     rows.stride(0), rows.stride(1), BLOCK_M=block_m, BLOCK_D=block_d)


def gather_rows_triton(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton launcher: ``out[i] = src[index[i]]`` (no checks; call :func:`gather_rows`)."""
    _launch_rowwise("gather", src, index, out)
    return out


def scatter_rows_triton(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Triton launcher: ``dst[index[i]] = src[i]`` in place (no checks; call :func:`scatter_rows`)."""
    _launch_rowwise("scatter", dst, index, src)
    return dst


def scatter_add_rows_triton(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Triton launcher: ``dst[index[i]] += src[i]`` in place, fp32 accumulation (fp64 for fp64), deterministic."""
    kernels = _kernels()
    n_idx, n_cols = src.shape
    if n_idx and n_cols:
        sorted_idx, order = torch.sort(index.to(torch.int64), stable=True)
        # Run boundaries without a host sync: searchsorted on the sorted indices themselves.
        starts = torch.searchsorted(sorted_idx, sorted_idx, right=False)
        ends = torch.searchsorted(sorted_idx, sorted_idx, right=True)
        _, block_d = _blocks(n_cols)
        grid = (n_idx, triton.cdiv(n_cols, block_d))
        kernels["scatter_add"][grid](dst, src, sorted_idx, order, starts, ends, n_cols, dst.stride(0),
                                     dst.stride(1), src.stride(0), src.stride(1), BLOCK_D=block_d,
                                     ACC=tl.float64 if dst.dtype == torch.float64 else tl.float32)
    return dst


# --------------------------------------------------------------------------- references


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pure PyTorch: ``out[i] = src[index[i]]``."""
    return torch.index_select(src, 0, index.to(torch.int64), out=out)


def scatter_rows_reference(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Pure PyTorch: ``dst[index[i]] = src[i]`` in place."""
    return dst.index_copy_(0, index.to(torch.int64), src)


def scatter_add_rows_reference(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Pure PyTorch: ``dst[index[i]] += src[i]``; fp16/bf16 sum in fp32 and round once per row (as the kernel)."""
    index = index.to(torch.int64)
    if dst.dtype in (torch.float32, torch.float64) or not dst.is_floating_point():
        return dst.index_add_(0, index, src.to(dst.dtype))
    rows, inverse = torch.unique(index, return_inverse=True)
    acc = dst.index_select(0, rows).float().index_add_(0, inverse, src.float())
    return dst.index_copy_(0, rows, acc.to(dst.dtype))


# --------------------------------------------------------------------------- first-use self-check


def _row_class(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> tuple:
    # The column count picks BLOCK_D; strides are kernel arguments, so row-major or not is its own class.
    return (str(table.dtype), str(index.dtype), table.shape[1], table.stride(1) == 1, rows.stride(1) == 1)


def _probe_values(n: int, cols: int, like: torch.Tensor, gen: torch.Generator, row_major: bool) -> torch.Tensor:
    shape = (n, cols) if row_major else (cols, n)
    if like.is_floating_point():
        x = torch.randn(shape, generator=gen, device=like.device).to(like.dtype)
    else:
        x = torch.randint(-100, 100, shape, generator=gen, device=like.device).to(like.dtype)
    return x if row_major else x.t()


def _row_probe(unique: bool):
    # 37 table rows and 29 indices: neither a multiple of a block; duplicates unless the op needs unique rows.
    def probe(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> tuple[tuple, dict]:
        gen = torch.Generator(device=table.device).manual_seed(0)
        n_rows, n_idx, cols = 37, 29, table.shape[1]
        t = _probe_values(n_rows, cols, table, gen, table.stride(1) == 1)
        idx = (torch.randperm(n_rows, generator=gen, device=table.device)[:n_idx] if unique
               else torch.randint(0, n_rows, (n_idx,), generator=gen, device=table.device)).to(index.dtype)
        r = _probe_values(n_idx, cols, rows, gen, rows.stride(1) == 1)
        return (t, idx, r), {}
    return probe


_gather = register_kernel("gather_rows", reference=gather_rows_reference, triton=gather_rows_triton,
                          doc="out[i] = src[index[i]] for a 2-D src", shape_class=_row_class,
                          probe=_row_probe(unique=False))
_scatter = register_kernel("scatter_rows", reference=scatter_rows_reference, triton=scatter_rows_triton,
                           doc="dst[index[i]] = src[i] in place", shape_class=_row_class, probe=_row_probe(unique=True))
_scatter_add = register_kernel("scatter_add_rows", reference=scatter_add_rows_reference,
                               triton=scatter_add_rows_triton, doc="dst[index[i]] += src[i] in place, deterministic",
                               shape_class=_row_class, probe=_row_probe(unique=False))


# --------------------------------------------------------------------------- public API


def _check(op: str, table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None, validate: bool) -> None:
    if table.dim() != 2:
        raise ValueError(f"{op}: the table must be 2-D (rows x columns), got shape {tuple(table.shape)}; "
                         "reshape it with .view(rows, -1)")
    if index.dim() != 1 or index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{op}: index must be a 1-D int32 or int64 tensor, got {index.dim()}-D {index.dtype}; "
                         "convert it with index.flatten().long()")
    if index.device != table.device or (rows is not None and rows.device != table.device):
        raise ValueError(f"{op}: tensors are on different devices ({table.device}, {index.device}"
                         f"{'' if rows is None else ', ' + str(rows.device)}); move them to one device")
    if rows is not None:
        if rows.dim() != 2 or rows.shape[0] != index.shape[0] or rows.shape[1] != table.shape[1]:
            raise ValueError(f"{op}: src must have shape ({index.shape[0]}, {table.shape[1]}) = (len(index), "
                             f"table columns), got {tuple(rows.shape)}")
        if rows.dtype != table.dtype:
            raise ValueError(f"{op}: src dtype {rows.dtype} differs from the table's {table.dtype}; cast one of them")
    if validate and index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= table.shape[0]:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{op}: index value {bad} is out of range for a table of {table.shape[0]} rows; "
                             f"indices must satisfy 0 <= index < {table.shape[0]}")


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, index: torch.Tensor, backend: str | None) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.backend = src.shape[0], backend
        out = torch.empty((index.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
        return _gather(src, index, out, backend=backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (index,) = ctx.saved_tensors
        grad_src = torch.zeros((ctx.rows, grad.shape[1]), dtype=grad.dtype, device=grad.device)
        return _scatter_add(grad_src, index, grad.contiguous(), backend=ctx.backend), None, None


def gather_rows(src: torch.Tensor, index: torch.Tensor, *, out: torch.Tensor | None = None,
                validate: bool = True, backend: str | None = None) -> torch.Tensor:
    """Rows of ``src`` picked by ``index``: ``out[i] = src[index[i]]``, shape ``(len(index), src.shape[1])``.

    Differentiable in ``src`` (the gradient is :func:`scatter_add_rows` of the output gradient) when
    ``out`` is not given. ``backend`` overrides ``TIGHTFIT_KERNELS`` for this call.
    """
    _check("gather_rows", src, index, None, validate)
    if out is None and src.requires_grad and torch.is_grad_enabled():
        return _GatherRows.apply(src, index, backend)
    if out is None:
        out = torch.empty((index.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    elif tuple(out.shape) != (index.shape[0], src.shape[1]) or out.dtype != src.dtype or out.device != src.device:
        raise ValueError(f"gather_rows: out must be a {src.dtype} tensor of shape ({index.shape[0]}, {src.shape[1]}) "
                         f"on {src.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return _gather(src, index, out, backend=backend)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, *, validate: bool = True,
                 backend: str | None = None) -> torch.Tensor:
    """``dst[index[i]] = src[i]`` in place; returns ``dst``. With duplicate indices one write wins
    (which one is unspecified, as for ``torch.Tensor.index_copy_``)."""
    _check("scatter_rows", dst, index, src, validate)
    return _scatter(dst, index, src, backend=backend)


def scatter_add_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, *, validate: bool = True,
                     backend: str | None = None) -> torch.Tensor:
    """``dst[index[i]] += src[i]`` in place; duplicate indices accumulate; returns ``dst``."""
    _check("scatter_add_rows", dst, index, src, validate)
    return _scatter_add(dst, index, src, backend=backend)
