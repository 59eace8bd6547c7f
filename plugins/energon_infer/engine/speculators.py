"""The engine's speculator from its :class:`~energon_infer.scheduling.speculation.SpeculativeConfig`: the proposer
(prompt lookup, or a draft model loaded in the controller's process, checked against the served model first) and
the scheduler's :class:`~energon_infer.scheduling.speculation.Speculator` around it."""

from __future__ import annotations

from pathlib import Path

from energon_infer.scheduling.speculation import NgramProposer, Proposer, SpeculativeConfig, Speculator
from energon_infer.worker.runtime_config import RuntimeConfig

__all__ = ["build_speculator"]


def build_speculator(config: SpeculativeConfig | None, model_path: str, runtime: RuntimeConfig) -> Speculator | None:
    """``None`` when ``config`` is; a bad draft (another tokenizer, no model there) raises one line, before any
    worker starts."""
    if config is None:
        return None
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from energon_infer.worker.draft import DraftProposer, check_draft

        assert config.draft_model is not None  # SpeculativeConfig checks it
        if Path(model_path).is_dir():
            check_draft(model_path, config.draft_model)
        proposer = DraftProposer.from_pretrained(config.draft_model, device=runtime.device,
                                                 dtype=runtime.dtype, progress=False)
    return Speculator(config, proposer)
