"""``Fabric(strategy="sky")`` is refused in one line with the reason (issue 59); the Trainer's name still works."""

from __future__ import annotations

import pytest

from tests.helpers.runif import RunIf


@RunIf(lightning=True)
def test_fabric_sky_is_refused_with_the_reason_and_the_alternatives():
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    import sky_strategy
    from sky_strategy.strategy import SkyStrategy

    with pytest.raises(ValueError, match=r"^Fabric\(strategy='sky'\) is not supported: Sky's pipeline schedules") as info:
        L.Fabric(accelerator="cpu", devices=1, strategy="sky")
    message = str(info.value)
    assert "\n" not in message and message == sky_strategy.FABRIC_REFUSAL
    assert "Trainer(strategy='sky')" in message and "Fabric(strategy='elixir')" in message
    assert StrategyRegistry["sky"]["strategy"] is SkyStrategy
