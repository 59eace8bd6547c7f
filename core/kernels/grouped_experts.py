"""A Mixture-of-Experts layer's routed experts in one pass: tokens grouped per expert, each expert run once.

    out = grouped_experts(x, weights, chosen, gate_up, down)   # (T, H) fp32: sum_j weights[t, j] * E_chosen[t, j](x[t])

``x`` is ``(T, H)``; ``chosen`` ``(T, k)`` the experts each token was routed to and ``weights`` ``(T, k)`` their
routing weights; ``gate_up[i]`` ``(2I, H)`` (gate rows, then up rows) and ``down[i]`` ``(H, I)`` are expert
``first + i``'s weights. An expert computes ``down(act(gate_up(x)))`` with ``act`` SwiGLU (``silu(gate) * up``) or,
with ``limit`` != 0, gpt-oss's clamped SwiGLU (``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``,
``g = clamp(gate, max=limit)``), optional biases on both products. Pairs routed to experts outside ``first ..
first + len(gate_up) - 1`` (another rank's, under expert parallelism) are skipped. Each expert's output row is
scaled by its routing weight (in fp32 where the weights are, else in the activations' dtype); a token's scaled rows
are summed in fp32, in ascending expert order, as ``index_add_`` over the expert-sorted pairs sums them.

The reference (:func:`grouped_experts_reference`) is the grouped PyTorch path: sort the pairs by expert, then per
expert with tokens an ``index_select``, two matmuls, the activation, a scale and an ``index_add_``: a dozen op
launches per active expert, which is most of a decode step's MoE time at the few tokens per expert a decode step
gives; a prefill's time is in the matmuls themselves.

The native CPU backend (fp32; other dtypes and weights not held input-major take the reference) is one C call per
layer (``core/kernels/cpu/grouped_experts.c``). It sorts the pairs by expert with a counting sort, splits each
expert's tokens into units of up to 64 rows and runs the units over PyTorch's OpenMP team (dynamic schedule). A
unit reads its tokens' rows of ``x`` in place (no gather copy). The weights are read input-major
(``energon_infer.parallel.linear_weight``'s layout: ``gate_up[i].t()`` contiguous). A unit of up to 6 rows (an
expert's share of a decode step) streams each weight row once, in order, into accumulator rows that stay in the L1
cache. A larger unit computes gate and up together, in tiles of 6 rows by 8 gate columns and the 8 matching up
columns, applies the activation to the tile, then the down product in tiles of 6 rows by 16 columns: every weight
vector loaded feeds six rows' FMAs, twelve accumulators stay in registers; from 13 rows it first copies each tile's
weight panel contiguous (at power-of-two widths the rows of a panel would otherwise map to a few L1 sets and evict
each other between its row tiles). Each pair's scaled row lands in a buffer of its own (a step whose pair rows would
pass 64 MiB runs in slices of tokens); a second parallel loop over tokens sums a token's rows in expert order into
the output: no atomics, and the same bits whatever the thread count. Calls with few multiply-adds stay on the calling
thread, as do forked children and builds without OpenMP.

The native kernel runs at every size: a PyTorch formulation keeps the op launches and the per-expert gathers and
scatters (one batched matmul over padded groups also multiplies the padding and still gathers and scatters).

Example:
    >>> import torch
    >>> x = torch.randn(3, 8)
    >>> gate_up, down = [torch.randn(8, 8) for _ in range(2)], [torch.randn(8, 4) for _ in range(2)]
    >>> chosen, weights = torch.tensor([[0, 1], [1, 0], [1, 1]]), torch.full((3, 2), 0.5)
    >>> out = grouped_experts(x, weights, chosen, gate_up, down)
    >>> one = 0.5 * expert_mlp(x[:1], gate_up[0], down[0]) + 0.5 * expert_mlp(x[:1], gate_up[1], down[1])
    >>> tuple(out.shape), torch.allclose(out[:1], one, atol=1e-4)
    ((3, 8), True)
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tightfit.kernels.dispatch import register_kernel
from tightfit.kernels.elementwise import silu_mul
from tightfit.kernels.native import load_kernel, native_error

__all__ = ["expert_activation", "expert_mlp", "grouped_experts", "grouped_experts_reference", "run_grouped"]

Biases = Sequence[torch.Tensor | None] | None
# Pair rows (fp32) the native kernel buffers per call at most: longer steps run in slices of tokens.
_BUFFER_FLOATS = 1 << 24
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
               down_bias: torch.Tensor | None = None, limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor:
    """One expert's gated MLP on the rows ``x``: ``down(act(gate_up(x)))`` (see the module docstring for ``act``)."""
    return F.linear(expert_activation(F.linear(x, gate_up, gate_up_bias), limit, alpha), down, down_bias)


def expert_activation(h: torch.Tensor, limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor:
    """The gated activation of an expert's gate/up product ``h`` (gate columns, then up columns)."""
    if not limit:
        return silu_mul(h)
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_bias(biases: Biases, i: int) -> torch.Tensor | None:
    """Expert ``i``'s bias of ``biases`` (None: the experts have none)."""
    return None if biases is None else biases[i]


def run_grouped(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, n: int, first: int,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The grouped loop of the reference: the pairs sorted by expert, then for each of experts ``first .. first + n
    - 1`` with tokens ``expert(i, rows of x)`` (its output rows), scaled by their routing weights and summed into
    an fp32 ``(T, H)`` output in ascending expert order."""
    top_k = chosen.shape[-1]
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # a stable sort keeps each expert's tokens in token order
    tokens = order // top_k
    scale = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=first + n).tolist()  # one host sync for the whole layer
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = sum(counts[:first])
    for i in range(n):
        count = counts[first + i]
        if count:
            rows = tokens[start:start + count]
            y = expert(i, x.index_select(0, rows))
            out.index_add_(0, rows, (y * scale[start:start + count, None]).float())
        start += count
    return out


def grouped_experts_reference(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                              gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor], first: int = 0,
                              gate_up_bias: Biases = None, down_bias: Biases = None, limit: float = 0.0,
                              alpha: float = 0.0) -> torch.Tensor:
    return run_grouped(x, weights, chosen, len(gate_up), first, lambda i, rows: expert_mlp(
        rows, gate_up[i], down[i], expert_bias(gate_up_bias, i), expert_bias(down_bias, i), limit, alpha))


@functools.cache
def _library() -> Any:
    return load_kernel("grouped_experts", (
        ("tf_grouped_experts_f32", _I, (_P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _F, _F, _P, _I)),
    ), openmp=True)


def _native_error() -> str:
    return "" if _library() is not None else native_error("grouped_experts") or "not built"


def _input_major(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.stride() == (1, w.shape[0])


def _pointers(tensors: Sequence[torch.Tensor | None] | None, n: int) -> Any:
    if tensors is None or all(t is None for t in tensors):
        return None
    return (_P * n)(*(None if t is None else t.data_ptr() for t in tensors))


def _grouped_experts_native(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                            gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor], first: int = 0,
                            gate_up_bias: Biases = None, down_bias: Biases = None, limit: float = 0.0,
                            alpha: float = 0.0) -> torch.Tensor:
    biases = [b for group in (gate_up_bias or (), down_bias or ()) for b in group if b is not None]
    if (x.dtype != torch.float32 or x.stride(-1) != 1 or not all(map(_input_major, gate_up))
            or not all(map(_input_major, down)) or not all(b.dtype == torch.float32 and b.stride(0) == 1
                                                            for b in biases)):
        return grouped_experts_reference(x, weights, chosen, gate_up, down, first, gate_up_bias, down_bias,
                                         limit, alpha)
    tokens, hidden = x.shape
    n = len(gate_up)
    chosen = chosen.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty((tokens, hidden), dtype=torch.float32, device=x.device)
    top_k = chosen.shape[-1]
    pointers = (_pointers(gate_up, n), _pointers(down, n), _pointers(gate_up_bias, n), _pointers(down_bias, n))
    step = max(1, _BUFFER_FLOATS // max(1, top_k * hidden))  # the kernel holds one fp32 row per (token, expert) pair
    x_ptr, c_ptr, w_ptr, o_ptr = x.data_ptr(), chosen.data_ptr(), weights.data_ptr(), out.data_ptr()
    for t0 in range(0, tokens, step):  # byte offsets of row t0: fp32 x / weights / out, int64 chosen
        t1 = min(tokens, t0 + step)
        done = _library().tf_grouped_experts_f32(
            x_ptr + 4 * t0 * x.stride(0), x.stride(0), c_ptr + 8 * t0 * top_k, w_ptr + 4 * t0 * top_k, t1 - t0,
            top_k, hidden, down[0].shape[1], first, n, *pointers, float(limit), float(alpha), o_ptr + 4 * t0 * hidden,
            torch.get_num_threads())
        if done != 0:
            raise MemoryError(f"grouped_experts: the native kernel could not allocate its buffers for {t1 - t0} "
                              f"tokens x {top_k} experts of width {hidden}; free host memory or run fewer tokens "
                              "a step")
    return out


def _class(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: Sequence[torch.Tensor],
           down: Sequence[torch.Tensor], first: int = 0, gate_up_bias: Biases = None, down_bias: Biases = None,
           limit: float = 0.0, alpha: float = 0.0) -> tuple:
    return (str(x.dtype), str(weights.dtype), x.shape[-1], down[0].shape[1] if down else 0, chosen.shape[-1],
            bool(gate_up) and _input_major(gate_up[0]), gate_up_bias is not None, down_bias is not None, bool(limit))


def _probe(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: Sequence[torch.Tensor],
           down: Sequence[torch.Tensor], first: int = 0, gate_up_bias: Biases = None, down_bias: Biases = None,
           limit: float = 0.0, alpha: float = 0.0) -> tuple[tuple, dict]:
    """Seven tokens over this call's own experts (and one expert past them, skipped), random routing."""
    gen = torch.Generator(device=x.device).manual_seed(0)
    top_k, span = chosen.shape[-1], len(gate_up) + 1
    small = torch.randn(7, x.shape[-1], generator=gen, device=x.device).to(x.dtype)
    picks = torch.stack([torch.randperm(max(span, top_k), generator=gen, device=x.device)[:top_k] for _ in range(7)])
    routed = torch.rand(7, top_k, generator=gen, device=x.device).to(weights.dtype)
    return (small, routed, picks + first, gate_up, down, first, gate_up_bias, down_bias, limit, alpha), {}


_grouped = register_kernel("grouped_experts", reference=grouped_experts_reference, triton=None,
                           doc="a MoE layer's routed experts, tokens grouped per expert, weighted sum in fp32",
                           shape_class=_class, probe=_probe, native=_grouped_experts_native,
                           native_error=_native_error)


def check_routing(op: str, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> None:
    """``op``'s tokens and routing: ``x`` (tokens, hidden), ``weights`` and integer ``chosen`` (tokens, top_k)."""
    if x.dim() != 2 or chosen.dim() != 2 or weights.shape != chosen.shape or chosen.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: x must be (tokens, hidden) and weights, chosen (tokens, top_k); got x "
                         f"{tuple(x.shape)}, weights {tuple(weights.shape)}, chosen {tuple(chosen.shape)}")
    if chosen.dtype.is_floating_point or chosen.dtype == torch.bool:
        raise ValueError(f"{op}: chosen holds expert indices and must be an integer tensor, not "
                         f"{chosen.dtype}; pass topk's indices")


def _check(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: Sequence[torch.Tensor],
           down: Sequence[torch.Tensor], gate_up_bias: Biases, down_bias: Biases) -> None:
    check_routing("grouped_experts", x, weights, chosen)
    if len(down) != len(gate_up) or any(g.dim() != 2 or d.dim() != 2 or g.shape != (2 * d.shape[1], x.shape[1])
                                        or d.shape[0] != x.shape[1] for g, d in zip(gate_up, down)):
        raise ValueError(f"grouped_experts: each expert needs gate_up (2I, {x.shape[1]}) and down ({x.shape[1]}, I) "
                         f"of one I; got gate_up {[tuple(g.shape) for g in gate_up]}, "
                         f"down {[tuple(d.shape) for d in down]}")
    if len({d.shape[1] for d in down}) > 1:
        raise ValueError(f"grouped_experts: every expert must have the same intermediate width; got "
                         f"{sorted({d.shape[1] for d in down})}; run experts of other widths in a call of their own")
    for name, biases, width in (("gate_up_bias", gate_up_bias, 2 * (down[0].shape[1] if down else 0)),
                                ("down_bias", down_bias, x.shape[1])):
        if biases is not None and (len(biases) != len(gate_up)
                                   or any(b is not None and tuple(b.shape) != (width,) for b in biases)):
            raise ValueError(f"grouped_experts: {name} must hold one ({width},) tensor or None per expert "
                             f"({len(gate_up)}); got {[None if b is None else tuple(b.shape) for b in biases]}")


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: Sequence[torch.Tensor],
                    down: Sequence[torch.Tensor], *, first: int = 0, gate_up_bias: Biases = None,
                    down_bias: Biases = None, limit: float = 0.0, alpha: float = 0.0,
                    backend: str | None = None) -> torch.Tensor:
    """The fp32 ``(T, H)`` sum over each token's routed experts among ``first .. first + len(gate_up) - 1`` of
    its routing weight times the expert's output (see the module docstring)."""
    _check(x, weights, chosen, gate_up, down, gate_up_bias, down_bias)
    if not gate_up or x.shape[0] == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return _grouped(x, weights, chosen, gate_up, down, first, gate_up_bias, down_bias, limit, alpha, backend=backend)
