"""The private torch / Lightning internals Elixir relies on live in one module, ``lightning_elixir._torch_adapter``,
and are checked against the installed releases; the optimizer step is one call chain with nothing installed on the
user's optimizer (``lightning_elixir.step.ElixirOptimizer``)."""

from __future__ import annotations

import gc
import io
import tokenize
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.runif import RunIf

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "lightning_elixir"
# Private torch / Lightning names Elixir has used; only the adapter may name them.
PRIVATE = {"_composable", "_pytree", "_get_registry", "_get_fsdp_state", "_fsdp_param_group", "_fsdp_param_groups",
           "_training_state", "_all_gather_result", "_local_tensor", "_cdata", "_apply", "_wait_for_post_backward",
           "_unscale_grads_", "_amp_foreach_non_finite_check_and_unscale_", "_AcceleratorConnector",
           "_check_and_init_precision", "_precision_plugin_flag", "_precision_flag", "__wrapped__", "FSDPParamGroup",
           "_setup_distributed", "_forward_redirection", "_device_mesh", "_data_parallel_size",
           "_tensor_parallel_size", "_fully_shard", "reduce_scatter_states", "grad_offload_event",
           "unshard_in_backward"}
# Overrides of Lightning's DeepSpeedStrategy's own private methods (a subclass cannot move them elsewhere).
ALLOWED = {("deepspeed_backend.py", "_setup_model_and_optimizer"), ("deepspeed_backend.py", "_init_deepspeed_distributed")}


def _names(path: Path) -> set[str]:
    """The identifiers of ``path``'s code (strings and comments are not code)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def test_private_torch_and_lightning_names_are_named_in_the_adapter_only():
    found = {(p.name, n) for p in PLUGIN.glob("*.py") if p.name != "_torch_adapter.py"
             for n in _names(p) & (PRIVATE | {"_setup_model_and_optimizer", "_init_deepspeed_distributed"})}
    assert found <= ALLOWED, sorted(found - ALLOWED)
    assert _names(PLUGIN / "_torch_adapter.py") & PRIVATE  # the adapter is where they are


@RunIf(lightning=True)
def test_the_internals_the_adapter_uses_exist_in_the_installed_releases():
    from lightning_elixir._torch_adapter import describe, missing_internals

    problems = missing_internals()
    assert not problems, describe(problems)


@RunIf(lightning=True)
def test_a_changed_internal_is_named_by_the_check(monkeypatch):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from lightning_elixir._torch_adapter import describe, missing_internals

    monkeypatch.delattr(FSDPParamGroup, "wait_for_unshard")
    problems = missing_internals()
    assert problems == ["torch: FSDPParamGroup.wait_for_unshard()"], problems
    assert "written against torch 2.13 and Lightning 2.6" in describe(problems)


@RunIf(lightning=True)
def test_lightnings_connector_is_its_own_again_once_no_elixir_strategy_lives():
    """The ``"16-mixed"`` flag is admitted for Elixir strategies only while one exists (no process-wide patch)."""
    import inspect

    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from lightning_elixir import ElixirStrategy, _torch_adapter

    def lightnings() -> bool:
        return inspect.getmodule(_AcceleratorConnector._check_and_init_precision).__name__.startswith("lightning.")

    gc.collect()
    before = _torch_adapter._alive
    strategy = ElixirStrategy(verbose=False)
    assert _torch_adapter.fp16_flag_admitted() and not lightnings()
    assert _torch_adapter._alive == before + 1
    del strategy
    gc.collect()
    assert _torch_adapter._alive == before
    if before == 0:  # another test's strategy may still be referenced (a traceback): then the patch stays with it
        assert not _torch_adapter.fp16_flag_admitted() and lightnings()


def _two_groups(seed: int) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(n, generator=g)) for n in (70_001, 5_000, 40_000, 9)]
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}],
                            lr=1e-2)
    return params, opt


def _grads(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_one_step_call_runs_the_closure_once_the_users_hooks_once_and_the_disk_chunks_bit_equal(tmp_path):
    from lightning_elixir.disk_state import DiskOptimizerState
    from lightning_elixir.step import ElixirOptimizer
    from tightfit.storage import TensorStore

    params, opt = _two_groups(0)
    ram_params, ram = _two_groups(0)
    own_groups = opt.param_groups
    hooked: list[int] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: hooked.append(sum(len(g["params"]) for g in o.param_groups)))
    with TensorStore(tmp_path) as store:
        # Units 0 and 1: one parameter of each group on disk, streamed in chunks of 4,096 elements.
        disk = DiskOptimizerState(opt, [(0, [params[0]]), (1, [params[2]])], store, chunk_elements=4096)
        _grads(params, 0)
        opt.step()  # the user's own step: nothing is installed on it, so the disk tier does not run
        assert disk.steps == 0 and disk.bytes_written == 0 and hooked == [4]
        params, opt = _two_groups(0)  # start again: that step changed every parameter
        own_groups = opt.param_groups
        hooked.clear()
        opt.register_step_pre_hook(lambda o, args, kwargs: hooked.append(sum(len(g["params"]) for g in o.param_groups)))
        disk = DiskOptimizerState(opt, [(0, [params[0]]), (1, [params[2]])], store, chunk_elements=4096)
        stepper = ElixirOptimizer(opt, disk=disk)
        calls = []
        for step in range(3):
            def closure(step=step) -> float:
                calls.append(step)
                _grads(params, step)
                return float(step)
            assert stepper.step(closure) == float(step)
            _grads(ram_params, step)
            ram.step()
        assert calls == [0, 1, 2]
        assert hooked == [2, 2, 2]  # once a step, over the parameters in RAM only
        assert opt.param_groups is own_groups and [len(g["params"]) for g in opt.param_groups] == [2, 2]
        assert disk.steps == 3 and disk.keys == ("exp_avg", "exp_avg_sq") and len(disk.chunks) > 2
        for a, b in zip(params, ram_params):
            assert a.detach().equal(b.detach())
        for p, q in zip((params[1], params[3]), (ram_params[1], ram_params[3])):
            assert opt.state[p]["exp_avg"].equal(ram.state[q]["exp_avg"])
        assert int(opt.state[params[0]]["step"]) == 3  # the small state stays in the optimizer beside placeholders


def test_init_state_gives_the_first_steps_state_and_leaves_the_parameters(tmp_path):
    from lightning_elixir.disk_state import DiskOptimizerState
    from lightning_elixir.step import ElixirOptimizer
    from tightfit.storage import TensorStore

    params, opt = _two_groups(1)
    before = [p.detach().clone() for p in params]
    with TensorStore(tmp_path) as store:
        disk = DiskOptimizerState(opt, [(0, [params[0]])], store, chunk_elements=4096)
        stepper = ElixirOptimizer(opt, disk=disk)
        stepper.init_state()
        assert all(p.grad is None for p in params) and [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]
        assert all(p.detach().equal(b) for p, b in zip(params, before))
        assert disk.keys == ("exp_avg", "exp_avg_sq") and disk.is_placeholder(opt.state[params[0]]["exp_avg"])
        assert sorted(store.names()) == ["u0.exp_avg", "u0.exp_avg_sq"]
        assert opt.state[params[1]]["exp_avg"].eq(0).all()
        written = disk.bytes_written
        stepper.init_state()  # the state exists: nothing happens
        assert disk.bytes_written == written


def test_elixir_optimizer_refuses_a_disk_state_of_another_optimizer(tmp_path):
    from lightning_elixir.disk_state import DiskOptimizerState
    from lightning_elixir.step import ElixirOptimizer
    from tightfit.storage import TensorStore

    params, opt = _two_groups(2)
    _, other = _two_groups(2)
    with TensorStore(tmp_path) as store:
        disk = DiskOptimizerState(opt, [(0, [params[0]])], store)
        with pytest.raises(ValueError, match=r"ElixirOptimizer\(disk=...\).*another optimizer"):
            ElixirOptimizer(other, disk=disk)


def test_a_grad_scaler_skips_the_whole_step_on_inf_even_for_a_fused_optimizer(tmp_path):
    """GradScaler hands a fused optimizer its inf check to skip inside the kernel; through the wrapper it must skip
    the whole step itself (the user's call and the disk chunks), so the wrapper forwards no private flag."""
    from lightning_elixir.disk_state import DiskOptimizerState
    from lightning_elixir.step import ElixirOptimizer
    from tightfit.storage import TensorStore

    g = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.randn(5000, generator=g)) for _ in range(2)]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    assert getattr(opt, "_step_supports_amp_scaling", False)  # torch's fused AdamW takes the check itself
    before = [p.detach().clone() for p in params]
    with TensorStore(tmp_path) as store:
        disk = DiskOptimizerState(opt, [(0, [params[0]])], store, chunk_elements=4096)
        stepper = ElixirOptimizer(opt, disk=disk)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))  # what scaling the loss does first: the scale tensor exists
        for p in params:
            p.grad = torch.ones_like(p)
        params[1].grad[7] = float("inf")
        scaler.unscale_(stepper)
        scaler.step(stepper)
        scaler.update()
        assert disk.steps == 0 and not opt.state and scaler.get_scale() == 2.0
        assert all(p.detach().equal(b) for p, b in zip(params, before))
        for p in params:
            p.grad = torch.ones_like(p)
        scaler.unscale_(stepper)
        scaler.step(stepper)  # finite: both parts step
        assert disk.steps == 1 and not any(p.detach().equal(b) for p, b in zip(params, before))
