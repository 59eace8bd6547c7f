"""Memory arithmetic on a :class:`ModelProfile` alone (pure: planners call these without torch work).

* :func:`estimate_peak`: activation and total peak of a training step with a chosen set of blocks
  checkpointed (recomputed in backward), from the per-block numbers the trace recorded.
* :func:`optimizer_state_bytes`: bytes the optimizer holds for SGD (with/without momentum),
  Adam/AdamW (optionally AMSGrad) and Adagrad, for fp32, bf16 or fp16 training and for mixed
  precision (an fp32 master copy plus fp32 state, ZeRO's K = 12 for Adam), exact to the byte for
  ``torch.optim`` (which keeps a 4-byte ``step`` tensor per parameter for Adam/AdamW/Adagrad).

The step model behind :func:`estimate_peak` (blocks ``0..n-1`` in first-use order; ``kept_j`` is
``checkpoint_bytes`` for a checkpointed block and ``saved_bytes`` otherwise; ``grads_{>=i}`` the
gradient bytes of the trainable parameters of blocks ``i..n-1``)::

    forward, block i:   sum(kept_<i) + saved_i + fwd_transient_i
    backward, block i:  sum(kept_<i) + saved_i + transient_i  (+ fwd_transient_i if checkpointed:
                        the recomputation runs first)             + grads_{>=i}

With nothing checkpointed this reproduces the traced peak (tests/core/test_profiler_model.py checks
both against real CPU steps measured with ``torch.profiler``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tightfit.planner.optimizers import OPTIMIZERS as OPTIMIZER_TABLE
from tightfit.planner.optimizers import PRECISION_ALIASES, STEP_TENSOR_BYTES, optimizer_spec

if TYPE_CHECKING:
    from tightfit.profiler.types import ModelProfile, ParamInfo

__all__ = ["PeakEstimate", "estimate_peak", "optimizer_state_bytes", "OPTIMIZERS", "PRECISIONS",
           "optimizer_bytes_per_element"]

# One table for the whole project (tightfit.planner.optimizers); re-exported under the names this module had.
OPTIMIZERS = tuple(OPTIMIZER_TABLE)
PRECISIONS = PRECISION_ALIASES  # short name -> PrecisionSpec ("mixed": fp32 master copy and fp32 state)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakEstimate:
    """Predicted peak of one training step.

    Args:
        activation_bytes: activations (and their gradients) at the peak, parameters and their gradients excluded.
        total_bytes: parameters + parameter gradients + activations at the step's peak (no optimizer state).
        checkpointed: the blocks assumed checkpointed.
        phase: where the total peak falls (``"forward"`` or ``"backward"``) and block: which block runs then.
    """

    activation_bytes: int
    total_bytes: int
    checkpointed: tuple[str, ...]
    phase: str
    block: str


def _resolve(profile: ModelProfile, checkpointed: Iterable[str] | str | None) -> tuple[str, ...]:
    if checkpointed is None:
        return ()
    if checkpointed == "all":
        return tuple(b.name for b in profile.blocks if b.checkpointable)
    if isinstance(checkpointed, str):
        checkpointed = [checkpointed]
    names = tuple(checkpointed)
    known = {b.name: b for b in profile.blocks}
    for name in names:
        if name not in known:
            raise KeyError(f"cannot checkpoint block {name!r}: no such block; blocks: "
                           f"{', '.join(b.name or '<root>' for b in profile.blocks)}")
        if not known[name].checkpointable:
            raise ValueError(f"block {name!r} cannot be checkpointed (it has no forward of its own); "
                             "leave it out of the checkpointed set")
    return names


def estimate_peak(profile: ModelProfile, checkpointed: Iterable[str] | str | None = None) -> PeakEstimate:
    """Peak of a training step of ``profile`` with ``checkpointed`` blocks recomputed (``"all"``: every block)."""
    chosen = _resolve(profile, checkpointed)
    ck = set(chosen)
    grad = {b.name: 0 for b in profile.blocks}
    for p in profile.params:
        if p.requires_grad and p.block in grad:
            grad[p.block] += p.bytes
    blocks = profile.blocks
    kept = [b.checkpoint_bytes if b.name in ck else b.saved_bytes for b in blocks]
    best = (-1, 0, "forward", "")  # (total, activation, phase, block)
    prefix = 0
    prefixes = []
    for i, b in enumerate(blocks):
        prefixes.append(prefix)
        act = prefix + b.saved_bytes + b.fwd_transient_bytes
        if act > best[0]:
            best = (act, act, "forward", b.name)
        prefix += kept[i]
    act_peak = max([best[1], prefix])
    if profile.step == "train":
        grads_done = 0
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
            grads_done += grad[b.name]
            whole = b.backward_transient_bytes  # the loss's backward included: this model holds no parameters apart
            extra = max(whole, b.fwd_transient_bytes) if b.name in ck else whole
            act = prefixes[i] + b.saved_bytes + extra
            act_peak = max(act_peak, act)
            if act + grads_done > best[0]:
                best = (act + grads_done, act, "backward", b.name)
    return PeakEstimate(activation_bytes=act_peak, total_bytes=profile.param_bytes + best[0], checkpointed=chosen,
                        phase=best[2], block=best[3])


def optimizer_bytes_per_element(optimizer: str = "adamw", *, precision: str = "fp32", momentum: float = 0.0,
                                amsgrad: bool = False) -> tuple[int, int]:
    """``(bytes per trainable element, bytes per trainable parameter tensor)`` the optimizer keeps.

    Example: AdamW at fp32 -> ``(8, 4)``; mixed precision -> ``(12, 4)`` (master copy + two moments).
    Row-wise optimizers (state per row, not per element) are priced by
    :func:`tightfit.planner.optimizers.row_state_columns` and refused here.
    """
    spec = optimizer_spec(optimizer)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)} "
                         "('mixed' = low-precision parameters with an fp32 master copy and fp32 state)")
    if spec.row_states:
        raise ValueError(f"optimizer {optimizer!r} keeps its state per embedding row, not per element; price it "
                         "with tightfit.planner.optimizers.row_state_columns(name, dim)")
    prec = PRECISIONS[precision]
    per_elem = spec.states(momentum=momentum, amsgrad=amsgrad) * prec.master_bytes + prec.master_copy_bytes
    return per_elem, STEP_TENSOR_BYTES if spec.step_tensor else 0


def optimizer_state_bytes(params: ModelProfile | Iterable[ParamInfo], optimizer: str = "adamw", *,
                          precision: str = "fp32", momentum: float = 0.0, amsgrad: bool = False) -> int:
    """Bytes of optimizer state for the trainable parameters of a profile (or a list of :class:`ParamInfo`)."""
    per_elem, per_tensor = optimizer_bytes_per_element(optimizer, precision=precision, momentum=momentum,
                                                       amsgrad=amsgrad)
    items = params.params if hasattr(params, "params") else params
    trainable = [p for p in items if p.requires_grad]
    return sum(p.numel for p in trainable) * per_elem + len(trainable) * per_tensor
