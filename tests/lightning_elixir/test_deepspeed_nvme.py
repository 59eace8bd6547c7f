"""``ElixirDeepSpeedStrategy``'s disk tier: a plan's disk units as ZeRO-Infinity NVMe settings.

The translation is a pure mapping (:func:`lightning_elixir.deepspeed_backend.nvme_translation`), tested on
plans of the tiny GPT whose units are put on disk by hand (the search does not put a model this small on
disk: the disk tier's 128 MiB staging area is larger than its whole state). One real single-process run
(slow: DeepSpeed's ``async_io`` op must load, a ~4 minute JIT build the first time) trains with the translated
config and checks that DeepSpeed wrote its swap files where the plan said.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from tests.helpers.runif import RunIf
from tightfit.planner.elixir import Tier

pytest.importorskip("lightning")


def _plan(disk: slice | None = slice(None), modes: tuple[str, ...] = ("reshard",), path: str = "", module=None):
    """A plan of ``module`` (TinyGPT) with every unit offloaded (ZeRO-3) and the units in ``disk`` on disk."""
    from torch.utils.data import DataLoader

    from lightning_elixir.planning import profile_module
    from tests.lightning_elixir.common import TinyGPT, cpu_device, token_data
    from tightfit.planner.elixir import ElixirConstraints, search
    from tightfit.profiler.types import ClusterSpec

    module = module if module is not None else TinyGPT()
    profile = profile_module(module, next(iter(DataLoader(token_data(8), batch_size=4))))
    plan = search(profile, ClusterSpec.uniform(cpu_device(), 1), precision="32-true",
                  constraints=ElixirConstraints(force_offload=True, modes=modes))
    units = list(plan.units)
    chosen = range(len(units))[disk] if disk is not None else range(0)
    for i in chosen:
        units[i] = dataclasses.replace(units[i], tier=Tier.DISK, disk_bytes=8 * units[i].param_numel)
    return dataclasses.replace(plan, units=tuple(units), disk_path=path,
                               disk_bytes_per_rank=sum(u.disk_bytes for u in units))


def _disk(tmp_path: Path, request: int = 2 << 20, depth: int = 6):
    from tightfit.profiler.disk_presets import disk_preset

    return dataclasses.replace(disk_preset("nvme-gen3", path=str(tmp_path), free_bytes=1 << 40),
                               request_bytes=request, queue_depth=depth)


def _wide():
    """TinyGPT widened to ~1.9 M parameters (7.6 MB of fp32 state: above a few MiB of aio block)."""
    from tests.lightning_elixir.common import TinyGPT
    from tightfit.models.gpt import GPT, GPTConfig

    module = TinyGPT()
    module.model = GPT(GPTConfig(vocab_size=256, n_positions=64, hidden=192, layers=4, heads=4))
    return module


def test_disk_units_become_nvme_optimizer_offload_with_the_profiled_aio(tmp_path):
    from lightning_elixir.deepspeed_backend import deepspeed_config, nvme_translation

    plan = _plan(module=_wide())
    cfg = deepspeed_config(plan, disk_dir=tmp_path, disk=_disk(tmp_path, request=2 << 20, depth=6),
                           host_budget=1 << 30)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": False,
                                         "pipeline_read": True, "pipeline_write": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}  # parameters stay on the host
    assert cfg["aio"]["block_size"] == 2 << 20 and cfg["aio"]["queue_depth"] == 6
    assert cfg["zero_force_ds_cpu_optimizer"] is False
    gaps = nvme_translation(plan, disk_dir=tmp_path, disk=_disk(tmp_path), host_budget=1 << 30)[1]
    assert any("host_budget 1.00 GiB" in g and "no host" in g for g in gaps), gaps
    assert any("12 bytes" in g for g in gaps), gaps
    # another drive, another aio: nothing is hand-tuned
    other = deepspeed_config(plan, disk_dir=tmp_path, disk=_disk(tmp_path, request=512 << 10, depth=32))
    assert (other["aio"]["block_size"], other["aio"]["queue_depth"]) == (512 << 10, 32)


def test_a_block_larger_than_the_swapped_state_falls_back_to_deepspeeds_floor(tmp_path):
    from lightning_elixir.deepspeed_backend import nvme_translation

    # ~1.9 M parameters: 7.6 MB of fp32 state on one rank, 3.8 MB on each of two
    wide = _plan(module=_wide())
    assert nvme_translation(wide, disk_dir=tmp_path, disk=_disk(tmp_path, request=4 << 20))[0]["aio"]["block_size"] \
        == 4 << 20
    two = dataclasses.replace(wide, world_size=2)
    cfg, gaps = nvme_translation(two, disk_dir=tmp_path, disk=_disk(tmp_path, request=4 << 20))
    assert cfg["aio"]["block_size"] == 1 << 20  # a 4 MiB block would keep each rank's 3.8 MB in RAM
    assert not any("below DeepSpeed's 1 MiB" in g for g in gaps), gaps
    # TinyGPT's 0.9 MB of state cannot reach the disk at any block size: said, not hidden
    cfg, gaps = nvme_translation(_plan(), disk_dir=tmp_path, disk=_disk(tmp_path, request=4 << 20))
    assert cfg["aio"]["block_size"] == 1 << 20
    assert any("below DeepSpeed's 1 MiB swap floor" in g for g in gaps), gaps


def test_without_a_profile_aio_takes_deepspeeds_defaults_and_says_so(tmp_path):
    from lightning_elixir.deepspeed_backend import nvme_translation

    cfg, gaps = nvme_translation(_plan(), disk_dir=tmp_path, disk=None)
    assert (cfg["aio"]["block_size"], cfg["aio"]["queue_depth"]) == (1 << 20, 8)
    assert any("no disk profile" in g for g in gaps)


def test_a_plan_without_disk_units_is_unchanged(tmp_path):
    from lightning_elixir.deepspeed_backend import deepspeed_config, nvme_translation

    plan = _plan(disk=None)
    assert nvme_translation(plan, disk_dir=tmp_path, disk=_disk(tmp_path)) == ({}, ())
    assert deepspeed_config(plan, disk_dir=tmp_path) == deepspeed_config(plan)
    assert deepspeed_config(plan)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "aio" not in deepspeed_config(plan)


def test_some_units_on_disk_put_all_offloaded_state_on_nvme_and_say_so(tmp_path):
    from lightning_elixir.deepspeed_backend import deepspeed_config

    plan = _plan(disk=slice(0, 2))
    assert len(plan.disk_units) == 2 < len(plan.offloaded_units)
    assert deepspeed_config(plan, disk_dir=tmp_path)["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert any("all of it goes there" in g for g in plan.deepspeed_gaps())


def test_the_plans_own_directory_is_used_when_no_disk_dir_is_given(tmp_path):
    from lightning_elixir.deepspeed_backend import deepspeed_config

    cfg = deepspeed_config(_plan(path=str(tmp_path / "planned")))
    assert cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path / "planned")


def test_a_disk_plan_below_stage_3_is_refused_with_the_fix(tmp_path):
    from lightning_elixir.deepspeed_backend import deepspeed_config

    plan = _plan(modes=("keep",))
    assert plan.to_deepspeed_config()["zero_optimization"]["stage"] == 2
    with pytest.raises(ValueError, match=r"ZeRO stage 2; DeepSpeed swaps optimizer state to NVMe only at stage 3.*"
                                         r"strategy='elixir'"):
        deepspeed_config(plan, disk_dir=tmp_path)


def test_a_disk_plan_without_a_directory_is_refused():
    from lightning_elixir.deepspeed_backend import deepspeed_config

    with pytest.raises(ValueError, match=r"disk_dir=None.*pass disk_dir="):
        deepspeed_config(_plan())


def test_the_users_config_wins_over_the_translation(tmp_path):
    from lightning_elixir.deepspeed_backend import deepspeed_config

    cfg = deepspeed_config(_plan(module=_wide()), {"aio": {"queue_depth": 3}, "zero_optimization": {"offload_param": {
        "device": "nvme", "nvme_path": str(tmp_path)}}}, disk_dir=tmp_path, disk=_disk(tmp_path, depth=6))
    assert cfg["aio"]["queue_depth"] == 3 and cfg["aio"]["block_size"] == 2 << 20
    assert cfg["zero_optimization"]["offload_param"]["device"] == "nvme"


@RunIf(deepspeed=True)
@pytest.mark.parametrize("kwargs, match", [
    ({"host_budget": "lots"}, r"host_budget='lots'.*'4GiB'"),
    ({"host_budget": 0}, r"host_budget=0.*bytes > 0"),
    ({"disk_dir": "/nonexistent/tightfit"}, r"/nonexistent/tightfit does not exist.*mkdir -p"),
])
def test_bad_tier_knobs_fail_at_construction_in_one_line(kwargs, match):
    from lightning_elixir import ElixirDeepSpeedStrategy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=match):
            ElixirDeepSpeedStrategy(**kwargs)


def _aio_available() -> bool:
    try:
        import importlib

        # import_module, not `import deepspeed.comm.torch as`: that binds deepspeed.comm's attribute `torch`, PyTorch
        ds_torch = importlib.import_module("deepspeed.comm.torch")
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return False
    ds_torch.build_shm_op = lambda: None
    builder = AsyncIOBuilder()
    return bool(builder.is_compatible(verbose=False))


# The first run in a checkout JIT-builds DeepSpeed's async_io op (tests/conftest.py's TORCH_EXTENSIONS_DIR): twelve
# g++ compilations at DeepSpeed's flags, nine of them through torch/extension.h, minutes of CPU that a machine running
# other work stretches past the suite's 600 s limit (a hang still fails, at this limit).
@pytest.mark.timeout(1800)
@RunIf(lightning=True, deepspeed=True)
def test_the_translated_plan_trains_with_its_state_on_nvme(tmp_path):
    """One process: the translated config trains TinyGPT for a few steps; DeepSpeed's optimizer swap files are
    under ``disk_dir`` and the losses match DDP within ZeRO-3's summation-order rounding."""
    if not _aio_available():
        pytest.skip("DeepSpeed's async_io op cannot build here (apt-get install -y libaio-dev)")
    import lightning as L
    import torch

    from lightning_elixir import ElixirDeepSpeedStrategy
    from tests.lightning_elixir.common import TinyGPT, trainer
    from tightfit.models import GPT, GPTConfig

    class SwapFiles(L.Callback):
        """DeepSpeed's swap files under ``root`` and their sizes, as they are after each training step."""

        def __init__(self, root: Path) -> None:
            self.root, self.sizes = root, {}

        def on_train_batch_end(self, *args, **kwargs) -> None:
            self.sizes = {str(f): f.stat().st_size for f in self.root.rglob("*.swp")}

    class WiderGPT(TinyGPT):
        """TinyGPT widened to ~1.9 M parameters (7.6 MB of master weights): well above DeepSpeed's 1 MiB swap floor
        and the 4 MiB blocks a quick disk profile may pick, so the state reaches the disk whatever profile is
        cached."""

        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(vocab_size=256, n_positions=64, hidden=192, layers=4, heads=4))

    disk_dir = tmp_path / "nvme"
    disk_dir.mkdir()
    plan = _plan(path=str(disk_dir), module=WiderGPT())
    L.seed_everything(0)
    ref = WiderGPT()
    trainer("ddp", tmp_path / "ref", devices=1, max_steps=4).fit(ref)  # a distributed sampler, as DeepSpeed's
    L.seed_everything(0)
    model = WiderGPT()
    strategy = ElixirDeepSpeedStrategy(plan=plan, disk_dir=disk_dir, host_budget="2GiB", verbose=False,
                                       config={"zero_optimization": {"reduce_bucket_size": 1 << 20}})
    torch_linear = torch.nn.functional.linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = SwapFiles(disk_dir)
        ds_trainer = trainer(strategy, tmp_path / "ds", devices=1, max_steps=4, callbacks=[swapped])
        ds_trainer.fit(model)
    # ZeRO-3 replaced torch's linear for the process while it trained; the strategy's teardown put it back.
    assert torch.nn.functional.linear is torch_linear
    zero = strategy.config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "nvme" and strategy.config["aio"]["block_size"] > 0
    # Read at the last training step: once the engine is collected after fit, DeepSpeed may remove its swap folder.
    assert swapped.sizes and sum(swapped.sizes.values()) >= 8 * plan.param_numel, swapped.sizes
    assert len(model.losses) == 4
    assert max(abs(a - b) for a, b in zip(ref.losses, model.losses)) <= 1e-4, (ref.losses, model.losses)
