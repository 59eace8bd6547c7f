"""Fast, single-process pieces: registration and discovery, argument errors, the plan's knobs
(offload / checkpointing forced), atomic checkpoint saves that survive a failure, DeepSpeed translation."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runif import RunIf


@RunIf(lightning=True)
def test_registered_on_import_and_through_discovery():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_elixir
    from lightning_elixir.deepspeed_backend import ElixirDeepSpeedStrategy
    from lightning_elixir.strategy import ElixirStrategy
    from tightfit.plugins import discover

    found = {r.name: r for r in discover()}
    assert found["elixir"].ok and found["elixir"].plugin is lightning_elixir.plugin
    assert lightning_elixir.plugin.is_usable() and lightning_elixir.plugin.demo is not None
    assert StrategyRegistry["elixir"]["strategy"] is ElixirStrategy
    assert StrategyRegistry["elixir_offload"]["init_params"] == {"offload": "all"}
    assert StrategyRegistry["elixir_checkpoint"]["init_params"] == {"activation_checkpointing": True}
    assert StrategyRegistry["elixir_deepspeed"]["strategy"] is ElixirDeepSpeedStrategy
    assert isinstance(StrategyRegistry.get("elixir_no_offload"), ElixirStrategy)
    # The DeepSpeed adapter is its own class with the same knobs; backend="deepspeed" points to it.
    ds = ElixirDeepSpeedStrategy(memory_budget="1GiB", offload="none")
    assert isinstance(ds, ElixirDeepSpeedStrategy) and ds.options.memory_budget == "1GiB" and ds.options.offload == "none"
    with pytest.raises(ValueError, match=r"backend='deepspeed'.*ElixirDeepSpeedStrategy.*'elixir_deepspeed'"):
        ElixirStrategy(backend="deepspeed")


@RunIf(lightning=True)
@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"backend": "zero"}, r"backend='zero'.*'fsdp2'.*'deepspeed'"),
    ({"offload": "some"}, r"offload='some'.*\('auto', 'none', 'all'\)"),
    ({"activation_checkpointing": "yes"}, r"activation_checkpointing='yes'.*'auto', True or False"),
])
def test_bad_arguments_name_the_value_and_the_choices(kwargs, pattern):
    from lightning_elixir import ElixirStrategy

    with pytest.raises(ValueError, match=pattern):
        ElixirStrategy(**kwargs)


@RunIf(lightning=True, deepspeed=True)
@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"offload": "some"}, r"ElixirDeepSpeedStrategy\(offload='some'\).*\('auto', 'none', 'all'\)"),
    ({"activation_checkpointing": "yes"}, r"activation_checkpointing='yes'.*'auto', True or False"),
    ({"cluster": object(), "device_profile": object()}, r"give cluster= or device_profile=, not both"),
])
def test_deepspeed_backend_validates_the_same_arguments(kwargs, pattern):
    from lightning_elixir import ElixirDeepSpeedStrategy

    with pytest.raises(ValueError, match=pattern):
        ElixirDeepSpeedStrategy(**kwargs)


def _profile():
    from torch.utils.data import DataLoader

    from lightning_elixir.planning import profile_module
    from tests.lightning_elixir.common import BATCH, TinyGPT, token_data

    return profile_module(TinyGPT(), next(iter(DataLoader(token_data(8), batch_size=BATCH))))


@RunIf(lightning=True)
def test_profile_is_the_training_step_and_the_module_is_untouched():
    from tests.lightning_elixir.common import TinyGPT

    module = TinyGPT()
    before = {n: p.clone() for n, p in module.named_parameters()}
    prof = _profile()
    assert [b.name for b in prof.blocks if b.param_numel][:2] == ["model.wte", "model.wpe"]
    assert any(b.name == "model.blocks.3" for b in prof.blocks)
    assert prof.bwd_flops > prof.fwd_flops > 0  # a training step: forward, loss and backward
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


@RunIf(lightning=True)
def test_forced_offload_and_checkpointing_are_applied_to_every_unit():
    from lightning_elixir.planning import make_plan
    from tests.lightning_elixir.common import cpu_device
    from tightfit.profiler.types import ClusterSpec

    prof = _profile()
    cluster = ClusterSpec.uniform(cpu_device(), 2)
    plan = make_plan(prof, cluster, offload="all", activation_checkpointing=True)
    assert all(u.offload for u in plan.units)
    checkpointable = {b.name for b in prof.blocks if b.checkpointable}
    assert set(plan.checkpointed_blocks) == checkpointable
    none = make_plan(prof, cluster, offload="none", activation_checkpointing=False)
    assert not any(u.offload for u in none.units) and not none.checkpointed_blocks


def test_atomic_save_keeps_the_last_good_checkpoint_when_a_save_fails(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lightning_elixir.checkpoint import atomic_save, is_checkpoint_dir, recover

    path = tmp_path / "last.ckpt"

    def save(value: float, meta: dict) -> None:
        atomic_save({"state_dict": {"w": torch.full((4,), value)}}, meta, path, rank=0, barrier=lambda: None,
                    broadcast=lambda x: x)

    def load() -> float:
        state: dict = {}
        _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
        return float(state["state_dict"]["w"][0])

    save(1.0, {"epoch": 0})
    assert is_checkpoint_dir(path) and load() == 1.0
    # A save that dies after the shards are written (its metadata cannot be pickled): the old one stays.
    with pytest.raises(Exception, match="pickle|lambda"):
        save(2.0, {"callback": lambda: None})
    assert load() == 1.0
    assert not list(tmp_path.glob(".last.ckpt.tmp-*")), "the failed save's temporary directory must be removed"
    save(3.0, {"epoch": 1})
    assert load() == 3.0 and not (tmp_path / ".last.ckpt.old").exists()
    # A crash between the two renames leaves the previous checkpoint at .old; recover() puts it back.
    path.rename(tmp_path / ".last.ckpt.old")
    assert recover(path) and load() == 3.0


@RunIf(lightning=True)
def test_deepspeed_config_from_a_mixed_plan():
    from lightning_elixir.deepspeed_backend import deepspeed_config
    from lightning_elixir.planning import make_plan
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import mixed_budget
    from tightfit.profiler.types import ClusterSpec

    prof = _profile()
    cluster = ClusterSpec.uniform(cpu_device(), 2)
    plan = make_plan(prof, cluster, memory_budget=mixed_budget(prof, cluster, precision="32-true"))
    cfg = deepspeed_config(plan, {"zero_optimization": {"overlap_comm": False}, "gradient_clipping": 1.0})
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3  # some unit reshards
    assert zero["offload_optimizer"]["device"] == "cpu"  # some units are offloaded
    assert zero["overlap_comm"] is False and cfg["gradient_clipping"] == 1.0  # the user's entries win
    assert cfg["zero_force_ds_cpu_optimizer"] is False  # configure_optimizers' optimizer is used as is
    assert "ratio" not in zero["offload_optimizer"]  # DeepSpeed runs a partial ratio only with its CPUAdam
    assert "activation_checkpointing" not in cfg  # blocks are checkpointed by the adapter itself
