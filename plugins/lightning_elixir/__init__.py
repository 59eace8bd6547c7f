"""Elixir: profile, then search the fastest sharding x offload plan that fits; Trainer or Fabric(strategy="elixir")

Importing this package registers ``"elixir"`` and its presets (``elixir_offload``,
``elixir_no_offload``, ``elixir_checkpoint``, ``elixir_deepspeed``) in Lightning's
``StrategyRegistry`` when Lightning is installed, so ``Trainer(strategy="elixir")`` works, and
``"elixir"`` with the same presets but ``elixir_deepspeed`` in Fabric's ``STRATEGY_REGISTRY``, so
``Fabric(strategy="elixir")`` does.

* :class:`ElixirStrategy` - the Trainer's strategy (:mod:`lightning_elixir.strategy`), its options
  :class:`ElixirOptions` (:mod:`lightning_elixir.options`);
* :class:`ElixirFabricStrategy` - Fabric's, the same options and runtime (:mod:`lightning_elixir.fabric_strategy`);
* :class:`ElixirDeepSpeedStrategy` - the plan run by DeepSpeed ZeRO (``strategy="elixir_deepspeed"``);
* :class:`ElixirPrecision` - ``precision="16-mixed"`` with loss scaling for sharded gradients (:mod:`lightning_elixir.precision`);
  :class:`ElixirFabricPrecision` - the same for Fabric (``plugins=[ElixirFabricPrecision()]``);
* :func:`apply_plan` - a plan onto a module with FSDP2, usable without Lightning (:mod:`lightning_elixir.apply`);
* :func:`export_checkpoint` - a sharded checkpoint to one safetensors file (``python -m lightning_elixir.export``).

Example:
    >>> import lightning as L
    >>> import lightning_elixir
    >>> trainer = L.Trainer(strategy="elixir", accelerator="cpu", devices=2, max_steps=100)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from tightfit.plugins import Plugin, registers_on_import

__all__ = ["plugin", "register", "ElixirStrategy", "ElixirFabricStrategy", "ElixirDeepSpeedStrategy", "ElixirOptions", "ElixirPrecision",
           "ElixirFabricPrecision",
           "apply_plan", "export_checkpoint", "MemoryLimitError"]

_LAZY = {
    "ElixirStrategy": ("lightning_elixir.strategy", "ElixirStrategy"),
    "ElixirFabricStrategy": ("lightning_elixir.fabric_strategy", "ElixirFabricStrategy"),
    "ElixirDeepSpeedStrategy": ("lightning_elixir.deepspeed_backend", "ElixirDeepSpeedStrategy"),
    "ElixirOptions": ("lightning_elixir.options", "ElixirOptions"),
    "ElixirPrecision": ("lightning_elixir.precision", "ElixirPrecision"),
    "ElixirFabricPrecision": ("lightning_elixir.precision", "ElixirFabricPrecision"),
    "apply_plan": ("lightning_elixir.apply", "apply_plan"),
    "export_checkpoint": ("lightning_elixir.export", "export_checkpoint"),
    "MemoryLimitError": ("lightning_elixir.memory_budget", "MemoryLimitError"),
}


def register() -> None:
    """Add ``"elixir"`` and its presets to the Trainer's and Fabric's strategy registries (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    if "elixir" not in StrategyRegistry:
        from lightning_elixir.strategy import ElixirStrategy

        ElixirStrategy.register_strategies(StrategyRegistry)
    if "elixir_deepspeed" not in StrategyRegistry:
        from lightning_elixir.deepspeed_backend import ElixirDeepSpeedStrategy

        ElixirDeepSpeedStrategy.register_strategies(StrategyRegistry)
    if "elixir" not in STRATEGY_REGISTRY:
        from lightning_elixir.fabric_strategy import ElixirFabricStrategy

        ElixirFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    # Registering patches nothing in Lightning: the 16-mixed precision hook is installed when an
    # ElixirStrategy is constructed, while one is alive (lightning_elixir.precision.admit_fp16_flag).


def _demo(quick: bool) -> str:
    from lightning_elixir.demo import run_demo

    return run_demo(quick)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'lightning_elixir' has no attribute {name!r}")


plugin = Plugin(
    name="elixir",
    kind="lightning-strategy",
    summary="Elixir: profile, then search the fastest sharding x offload plan that fits; Trainer(strategy='elixir')",
    requires=("lightning",),
    register_hook=register,
    demo=_demo,
)
"""Elixir's entry in tightfit's plugin registry (the ``tightfit.plugins`` entry point):
its name, what it needs, its demo."""

if registers_on_import():  # False only while `tightfit plugins` lists plugins without Lightning
    try:  # registering at import is what makes Trainer(strategy="elixir") work after `import lightning_elixir`
        register()
    except ImportError:  # Lightning is missing: the plugin reports itself unavailable instead
        pass
