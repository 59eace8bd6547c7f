"""The one optimizer table against real ``torch.optim`` state (every planner and the profiler read it)."""

from __future__ import annotations

import pytest
import torch

from tightfit.planner.optimizers import OPTIMIZERS, optimizer_spec, optimizer_states, row_state_columns


def _real_states(name: str, kwargs: dict) -> tuple[int, bool, dict]:
    p = torch.nn.Parameter(torch.randn(3, 5))
    opt = getattr(torch.optim, name)([p], lr=0.1, **kwargs)
    p.grad = torch.randn(3, 5)
    opt.step()
    state = opt.state[p]
    sized = sum(1 for v in state.values() if torch.is_tensor(v) and v.shape == p.shape)
    return sized, "step" in state, opt.defaults


@pytest.mark.parametrize("name,kwargs", [
    ("SGD", {}), ("SGD", {"momentum": 0.9}), ("Adam", {}), ("AdamW", {"amsgrad": True}), ("Adagrad", {}),
    ("RMSprop", {}), ("RMSprop", {"momentum": 0.9, "centered": True}), ("Adamax", {}), ("NAdam", {}),
    ("RAdam", {}),
])
def test_states_match_torch(name, kwargs):
    sized, has_step, defaults = _real_states(name, kwargs)
    assert optimizer_states(name, defaults) == sized
    assert optimizer_spec(name).step_tensor == has_step


def test_names_rows_and_errors():
    assert list(OPTIMIZERS)[:4] == ["sgd", "adam", "adamw", "adagrad"]
    assert optimizer_spec("RowWiseAdagrad").name == "rowwise_adagrad"
    assert row_state_columns("rowwise_adagrad", 64) == 1 and row_state_columns("adagrad", 64) == 64
    assert optimizer_states("Lion", {"momentum": 0.9}, strict=False) == 1
    with pytest.raises(ValueError, match=r"unknown optimizer 'Lion'; known: sgd, adam"):
        optimizer_states("Lion")
