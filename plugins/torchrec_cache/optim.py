"""Fused row-wise optimizer updates on gathered rows.

Each function takes the rows a batch touched (``weight`` U x D), their state (U x S, the columns
:meth:`RowOptimizer.state_columns` reserves beside each row) and their summed gradient, and returns
the new rows and state. The caller gathers rows from wherever they live (cache slots, or host memory
for rows that spilled) and scatters the result back, so the state always belongs to the row.

The arithmetic mirrors the PyTorch / TorchRec optimizers it replaces, term for term, so that a
cached table trains to the same weights within float rounding:
``torch.optim.SGD``, ``torch.optim.Adagrad``, ``torchrec.optim.RowWiseAdagrad``, ``torch.optim.SparseAdam``.
"""

from __future__ import annotations

import math

import torch

from torchrec_cache.config import RowOptimizer

__all__ = ["initial_state", "apply_update", "state_names"]


def state_names(opt: RowOptimizer | None) -> tuple[str, ...]:
    """Names of the state tensors, in column order (matching the PyTorch optimizers' state keys)."""
    if opt is None or opt.kind == "sgd":
        return ()
    return {"adagrad": ("sum",), "rowwise_adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}[opt.kind]


def initial_state(opt: RowOptimizer | None, rows: int, dim: int, *, device: torch.device | str = "cpu",
                  pin: bool = False) -> torch.Tensor:
    """The (rows x S) fp32 state tensor a table starts with."""
    cols = 0 if opt is None else opt.state_columns(dim)
    state = torch.zeros(rows, cols, dtype=torch.float32, device=device, pin_memory=pin)
    if opt is not None and opt.kind in ("adagrad", "rowwise_adagrad") and opt.initial_accumulator_value:
        state.fill_(opt.initial_accumulator_value)
    return state


def apply_update(opt: RowOptimizer, weight: torch.Tensor, state: torch.Tensor, grad: torch.Tensor,
                 step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on gathered rows; ``step`` counts this table's steps, starting at 1."""
    w = weight.float()
    g = grad.float()
    lr = opt.lr
    if opt.kind == "sgd":
        w = w - lr * g
    elif opt.kind == "adagrad":
        # torch.optim.Adagrad: state_sum += g*g; p -= lr * g / (sqrt(state_sum) + eps)
        s = state + g * g
        w = w - lr * g / (s.sqrt() + opt.eps)
        state = s
    elif opt.kind == "rowwise_adagrad":
        # torchrec.optim.RowWiseAdagrad: one accumulator per row, fed the row's mean squared gradient
        s = state + g.pow(2).mean(dim=1, keepdim=True)
        w = w - lr * g / (s.sqrt() + opt.eps)
        state = s
    elif opt.kind == "adam":
        # torch.optim.SparseAdam, in its own order of operations (updates as (g - m) * (1 - beta))
        d = w.shape[1]
        m, v = state[:, :d], state[:, d:]
        m_new = m + (g - m) * (1 - opt.beta1)
        v_new = v + (g * g - v) * (1 - opt.beta2)
        bias1 = 1 - opt.beta1**step
        bias2 = 1 - opt.beta2**step
        step_size = lr * math.sqrt(bias2) / bias1
        w = w - step_size * (m_new / (v_new.sqrt() + opt.eps))
        state = torch.cat([m_new, v_new], dim=1)
    else:  # pragma: no cover - RowOptimizer validates kind
        raise AssertionError(opt.kind)
    return w.to(weight.dtype), state
