"""Sky Computing: pipeline stages sized to each device's measured speed and memory; Trainer(strategy="sky")

Importing this package registers ``"sky"`` in Lightning's ``StrategyRegistry`` (when Lightning is
installed), so ``Trainer(strategy="sky")`` works; ``SkyStrategy(...)`` takes the knobs of
:class:`sky_strategy.config.SkyConfig`. The LightningModule convention is in :mod:`sky_strategy.layers`.
``SkyStrategy(data_parallel=N)`` runs ``N`` data-parallel replicas of the pipeline when the world is
larger than it (see :mod:`sky_strategy.strategy`). ``Fabric(strategy="sky")`` is refused with the reason
(:data:`FABRIC_REFUSAL`): the pipeline schedule must own each microbatch's loss and backward, which a Fabric loop keeps.
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
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "sky" not in STRATEGY_REGISTRY:
        # Registered to refuse with the reason: without it, Fabric(strategy="sky") would only say the name is unknown.
        STRATEGY_REGISTRY.register("sky", refuse_fabric, description="Sky runs under the Trainer only: "
                                   + FABRIC_REFUSAL)


FABRIC_REFUSAL = (
    "Fabric(strategy='sky') is not supported: Sky's pipeline schedules (1F1B, GPipe) run each microbatch's backward "
    "inside the step, interleaved with the other microbatches' forwards, so the strategy must own the loss and the "
    "backward; a Fabric loop calls model(x), computes the loss itself and only then fabric.backward(loss), which "
    "leaves no schedule to run - use Trainer(strategy='sky'), or Fabric(strategy='elixir') to shard instead")


def refuse_fabric(**_: object) -> None:
    """What ``Fabric(strategy="sky")`` builds: an error with the reason (:data:`FABRIC_REFUSAL`)."""
    raise ValueError(FABRIC_REFUSAL)


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
