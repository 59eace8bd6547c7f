"""A tied embedding's FSDP2 group gathered in backward only while the tied head needs it.

:func:`lightning_elixir.apply.resolve_units` puts a module that holds only another unit's parameters (GPT's
``lm_head`` tied to ``wte``) into that unit's ``fully_shard`` group, so the tie survives sharding. FSDP2 then
gathers the group for the head's backward (its pre-backward hook sits on the group's last output, the logits) and
keeps it gathered until the group's post-backward, which for an embedding (whose input, token ids, needs no
gradient) is the root's final callback: the whole table stays gathered through the backward of every layer.

An embedding lookup's backward reads the indices, never the weight: once the head's backward is done, nothing in
this backward needs the gathered table again. Where a unit's own modules are all lookups (``nn.Embedding``),
:func:`release_tied_after_head` reshards the group as soon as the head's backward has run and turns FSDP2's
``unshard_in_backward`` off for the rest of that backward (backward prefetches of the group become no-ops); the
lookup's gradient still lands on the gathered parameter object and the group's post-backward reduces it as before.
The next forward turns it back on. Just before the lookup's backward, where autograd sums the head's and the
lookup's gradients of the table, the gradients that tier-4 units are writing behind their backward are waited for
and dropped, and FSDP2's kept reduce-scatter input is released. The planner prices this
(:mod:`tightfit.planner.elixir.tied`: a tied lookup unit is gathered in backward only for the tied block's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_elixir._torch_adapter import fsdp_param_group, release_reduce_inputs, set_gathers_in_backward

__all__ = ["release_tied_after_head", "is_lookup"]


def is_lookup(module: nn.Module) -> bool:
    """Whether ``module``'s backward needs none of its parameters (an embedding lookup: indices only)."""
    return isinstance(module, nn.Embedding)


def release_tied_after_head(module: nn.Module, units: Sequence[Any]) -> list[RemovableHandle]:
    """For every applied unit whose own modules are all lookups and whose group also holds a tied head: reshard the
    group right after the head's backward, and before the lookup's backward (where the table's gradient is summed)
    release what the units reduced before it still hold (see the module docstring). Returns the hooks' handles."""
    handles: list[RemovableHandle] = []
    for unit in units:
        own = [m for name, m in zip(unit.names, unit.modules) if name in unit.plan.blocks]
        heads = [m for name, m in zip(unit.names, unit.modules) if name not in unit.plan.blocks]
        if not own or not heads or not all(is_lookup(m) for m in own):
            continue
        group = fsdp_param_group(own[0])
        if group is None:
            continue
        for head in heads:
            handles.append(head.register_forward_pre_hook(_after_backward_of(group)))
        handles.append(own[0].register_forward_hook(_before_backward_of(module, group)))
    return handles


def _before_backward_of(module: nn.Module, group: Any) -> Any:
    def post_forward(lookup: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: _release_reduced(module, group))

    return post_forward


def _release_reduced(module: nn.Module, group: Any) -> None:
    """Before a tied lookup's backward: the gradients of tier-4 units written behind their backward are on disk
    (their buffers dropped), and FSDP2's last reduce-scatter input, kept for the next unit's reduction, is released
    (after its event, as FSDP2 releases it)."""
    from lightning_elixir.disk_grads import disk_gradients_of

    disk = disk_gradients_of(module.parameters())
    if disk is not None:
        disk.drain()
    release_reduce_inputs(group)


def _after_backward_of(group: Any) -> Any:
    def pre_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
        set_gathers_in_backward(group, True)  # this forward's backward gathers the group for the head
        if not torch.is_grad_enabled():
            return
        x = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
        if x is None:
            return

        def head_done(grad: torch.Tensor) -> None:
            # The head's input has its gradient: the head's backward (which read the gathered weight) is over.
            if group.is_unsharded:
                group.reshard()
            set_gathers_in_backward(group, False)

        x.register_hook(head_done)

    return pre_forward
