"""Longrope's switch: where a sequence's cached keys and values stop holding for its next tokens.

A ``longrope`` model (Phi-3, Phi-4-mini) rotates every position of a sequence with ``short_factor`` while the
sequence is at most ``original_max_position_embeddings`` tokens long and with ``long_factor`` once it is longer.
transformers' ``generate`` (Phi-3's ``prepare_inputs_for_generation``) drops its cache at the step whose input
first passes that length while the cache holds no more than it, and runs the whole sequence again: from then on
every cached key is a long-factor one. The scheduler does the same (``SchedulerConfig.rope_switch``):

* a sequence is *long* when the tokens it is (re)started with number more than the switch (a prompt past it, or
  prompt + generated tokens being recomputed); its prefill chunks say so to the workers
  (``Step.prefill_lengths``), so each chunk rotates with the factors of the whole prefill, as transformers' one
  forward call does;
* a short sequence whose next step would pass the switch is recomputed instead, once its latest token is known:
  its blocks are freed and prompt + generated tokens are prefilled again as one long sequence (in chunks where
  the step's budget asks), which happens once per sequence;
* a block's values depend on which of the two it was computed in, so the prefix cache names long sequences'
  blocks in a chain of their own (:data:`LONG_ROOT`): a short block is never handed out as a long one.

Example:
    >>> switch = 16
    >>> is_long(switch, 16), is_long(switch, 17), is_long(0, 500)
    (False, True, False)
    >>> chain_root(False), chain_root(True) == LONG_ROOT
    (0, True)
"""

from __future__ import annotations

from typing import Any

__all__ = ["LONG_ROOT", "chain_root", "is_long", "switch_of"]

#: The key a long sequence's chain of prefix-cache names starts from (short ones start from 0). Any fixed value
#: serves: a name is a hash of (parent key, tokens), and a match also compares the parent and the tokens.
LONG_ROOT = 0x6C6F6E67726F7065


def switch_of(rope: Any) -> int:
    """The context length past which a sequence's cached keys no longer hold: ``original_max_positions`` of a
    ``longrope`` rope (:class:`~energon_infer.loading.rope_config.Rope`), 0 for every other kind (or ``None``)."""
    if getattr(rope, "kind", None) != "longrope":
        return 0
    return int(rope.original_max_positions)


def is_long(switch: int, length: int) -> bool:
    """Whether a sequence (re)started with ``length`` tokens rotates with the long factors (``switch`` 0: never)."""
    return 0 < switch < length


def chain_root(long: bool) -> int:
    """The root of the prefix-cache chain a sequence names its blocks in (:meth:`BlockManager.lookup`)."""
    return LONG_ROOT if long else 0
