"""Elixir: profile, then search the fastest sharding x offload plan that fits; Trainer(strategy="elixir")"""

from __future__ import annotations

from tightfit.plugins import Plugin

__all__ = ["plugin"]

plugin = Plugin(
    name="elixir",
    kind="lightning-strategy",
    summary="Elixir: profile, then search the fastest sharding x offload plan that fits; Trainer(strategy='elixir')",
    requires=("lightning",),
    available=False,
    reason="not implemented yet (issue #5)",
)
