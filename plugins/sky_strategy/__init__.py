"""Sky Computing: pipeline stages sized to each device's measured speed and memory; Trainer(strategy="sky")

Importing this package registers ``"sky"`` in Lightning's ``StrategyRegistry`` (when Lightning is
installed), so ``Trainer(strategy="sky")`` works; ``SkyStrategy(...)`` takes the knobs of
:class:`sky_strategy.config.SkyConfig`. The LightningModule convention is in :mod:`sky_strategy.layers`.
``SkyStrategy(data_parallel=N)`` runs ``N`` data-parallel replicas of the pipeline when the world is
larger than it (see :mod:`sky_strategy.strategy`).
"""

from __future__ import annotations

from tightfit.plugins import Plugin, registers_on_import

__all__ = ["plugin", "SkyStrategy", "SkyConfig", "register"]


def register() -> None:
    """Add ``"sky"`` to Lightning's strategy registry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from sky_strategy.strategy import SkyStrategy

    if "sky" not in StrategyRegistry:
        SkyStrategy.register_strategies(StrategyRegistry)


def _demo(quick: bool) -> str:
    from sky_strategy.demo import run_demo

    return run_demo(quick)


def __getattr__(name: str):
    if name == "SkyStrategy":
        from sky_strategy.strategy import SkyStrategy

        return SkyStrategy
    if name == "SkyConfig":
        from sky_strategy.config import SkyConfig

        return SkyConfig
    raise AttributeError(f"module 'sky_strategy' has no attribute {name!r}")


plugin = Plugin(
    name="sky",
    kind="lightning-strategy",
    summary="Sky Computing: pipeline stages sized to each device's measured speed and memory; Trainer(strategy='sky')",
    requires=("lightning",),
    register_hook=register,
    demo=_demo,
)
"""Sky's entry in tightfit's plugin registry (the ``tightfit.plugins`` entry point):
its name, what it needs, its demo."""

if registers_on_import():  # False only while `tightfit plugins` lists plugins without Lightning
    try:  # registering at import is what makes Trainer(strategy="sky") work after `import sky_strategy`
        register()
    except ImportError:  # Lightning is missing: the plugin reports itself unavailable instead
        pass
