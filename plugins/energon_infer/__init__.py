"""EnergonAI: padding-free tensor/pipeline-parallel inference with a single controller and an HTTP server"""

from __future__ import annotations

from tightfit.plugins import Plugin

__all__ = ["plugin"]

plugin = Plugin(
    name="energon",
    kind="inference-backend",
    summary="EnergonAI: padding-free tensor/pipeline-parallel inference with a single controller and an HTTP server",
    requires=("safetensors",),
    available=False,
    reason="not implemented yet (issue #7)",
)
