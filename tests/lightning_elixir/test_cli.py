"""Every Elixir option from ``LightningCLI`` and YAML, with the strategy given as a class path, and
the package's import leaving Lightning untouched (the 16-mixed hook comes with a strategy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

ENV = {"GROUP_RANK": "0"}


def _cli(rank: int, world: int, tmp: str) -> dict:
    from lightning.pytorch.cli import LightningCLI

    from tests.lightning_elixir.common import TinyGPT, cpu_device

    tmp_path = Path(tmp)
    device_json = tmp_path / "cpu.json"
    cpu_device().to_json(device_json)
    config = tmp_path / "elixir.yaml"
    # The YAML a user writes: the strategy by class path and every knob by name (constraints nested).
    config.write_text(f"""
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {tmp_path / "run"}
  strategy:
    class_path: lightning_elixir.ElixirStrategy
    init_args:
      offload: all
      activation_checkpointing: true
      optimizer: adamw
      device_profile: {device_json}
      verbose: false
      constraints:
        prefetch_depths: [1]
        fragmentation: 0.05
""")
    # One knob from the command line on top of the YAML.
    cli = LightningCLI(TinyGPT, args=["fit", "--config", str(config), "--trainer.strategy.memory_budget=64MiB"],
                       save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    opts = strategy.options
    units = strategy.plan.units
    return {"type": type(strategy).__name__, "budget": opts.memory_budget, "offload": opts.offload,
            "ckpt": opts.activation_checkpointing, "depths": list(opts.constraints.prefetch_depths),
            "frag": opts.constraints.fragmentation, "device": opts.device_profile.name,
            "all_offloaded": all(u.offload for u in units), "checkpointed": len(strategy.plan.checkpointed_blocks),
            "budget_bytes": strategy.plan.budget_bytes, "losses": cli.model.losses}


@RunIf(lightning=True)
def test_lightning_cli_configures_every_option_by_class_path_and_yaml(tmp_path):
    (r,) = run_distributed(_cli, 1, args=(str(tmp_path),), timeout=300, env=ENV)
    assert r["type"] == "ElixirStrategy" and r["budget"] == "64MiB" and r["budget_bytes"] == 64 * 2**20, r
    assert r["offload"] == "all" and r["ckpt"] is True and r["depths"] == [1] and r["frag"] == 0.05, r
    assert r["device"] == "cpu" and r["all_offloaded"] and r["checkpointed"] > 0, r
    assert len(r["losses"]) == 2 and all(loss == loss for loss in r["losses"]), r


@RunIf(lightning=True)
def test_lightning_cli_class_path_on_the_command_line(tmp_path):
    # The command line that crashed with "unexpected keyword argument 'config'".
    from lightning.pytorch.cli import LightningCLI

    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import TinyGPT

    common = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false",
              f"--trainer.default_root_dir={tmp_path}"]
    cli = LightningCLI(TinyGPT, run=False, args=[*common, "--trainer.strategy=lightning_elixir.ElixirStrategy",
                                                 "--trainer.strategy.memory_budget=6MiB",
                                                 "--trainer.strategy.activation_checkpointing=false"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ElixirStrategy)
    assert strategy.options.memory_budget == "6MiB" and strategy.options.activation_checkpointing is False


@RunIf(lightning=True, deepspeed=True)
def test_lightning_cli_builds_the_deepspeed_class(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from lightning_elixir import ElixirDeepSpeedStrategy
    from tests.lightning_elixir.common import TinyGPT

    cli = LightningCLI(TinyGPT, run=False, args=[
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.strategy=lightning_elixir.ElixirDeepSpeedStrategy",
        "--trainer.strategy.memory_budget=6MiB", "--trainer.strategy.offload=none",
        '--trainer.strategy.config={"zero_optimization": {"reduce_bucket_size": 1048576}}'])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ElixirDeepSpeedStrategy)
    assert strategy.options.memory_budget == "6MiB" and strategy.options.offload == "none"
    assert strategy.user_config == {"zero_optimization": {"reduce_bucket_size": 1048576}}


@RunIf(lightning=True)
def test_import_does_not_patch_lightning_and_a_strategy_does():
    code = """
import json
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as C
before = C._check_and_init_precision
import lightning_elixir
from lightning.pytorch.strategies import StrategyRegistry
after_import = C._check_and_init_precision is before
registered = "elixir" in StrategyRegistry
strategy = lightning_elixir.ElixirStrategy(verbose=False)
while_alive = C._check_and_init_precision is before
del strategy
import gc
gc.collect()
print(json.dumps([after_import, registered, while_alive, C._check_and_init_precision is before]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    unchanged_by_import, registered, unchanged_by_strategy, restored = json.loads(out.stdout.strip().splitlines()[-1])
    assert unchanged_by_import and registered and not unchanged_by_strategy
    assert restored  # Lightning's own method is back once no Elixir strategy is alive
