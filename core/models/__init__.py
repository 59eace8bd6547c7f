"""Reference models shared by the plugins (the Elixir example trains it, the inference engine serves it).

Example:
    >>> from tightfit.models import build_gpt
    >>> build_gpt("gpt2-xl", device="meta").num_params()
    1557611200
"""

from __future__ import annotations

from tightfit.models.gpt import (
    GPT,
    PRESETS,
    Block,
    GPTConfig,
    build_gpt,
    convert_hf_gpt2_state_dict,
    gpt_config,
)

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS", "build_gpt", "gpt_config", "convert_hf_gpt2_state_dict"]
