"""Sky Computing: pipeline stages sized to each device's measured speed and memory; Trainer(strategy="sky")"""

from __future__ import annotations

from tightfit.plugins import Plugin

__all__ = ["plugin"]

plugin = Plugin(
    name="sky",
    kind="lightning-strategy",
    summary="Sky Computing: pipeline stages sized to each device's measured speed and memory; Trainer(strategy='sky')",
    requires=("lightning",),
    available=False,
    reason="not implemented yet (issue #9)",
)
