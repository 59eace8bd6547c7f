"""Why no partition fits: the shortfall in bytes and the cheapest changes, as a typed error.

Example:
    >>> from tightfit.planner.pipeline import DeviceSpec, PipelineProblem
    >>> devs = [DeviceSpec(name=f"d{i}", speed=1.0, memory_bytes=1000) for i in range(2)]
    >>> problem = PipelineProblem(layer_costs=[1.0] * 4, layer_memory=[200] * 4, devices=devs,
    ...                           microbatches=2, schedule="1f1b")
    >>> err = diagnose_infeasible(problem)   # 4 layers x 200 B x (weights + grads + Adam's 2 states)
    >>> err.needed_bytes, err.budget_bytes
    (3200, 2000)
"""

from __future__ import annotations

from tightfit.planner.errors import PlanInfeasibleError
from tightfit.planner.pipeline.problem import PipelineProblem
from tightfit.units import format_bytes

__all__ = ["diagnose_infeasible"]


def diagnose_infeasible(problem: PipelineProblem) -> PlanInfeasibleError:
    """The error to raise when no contiguous partition of ``problem`` fits: either the devices hold too
    little in total (``needed_bytes`` is the total), or one layer is too big for the stage it would
    need (``needed_bytes`` is the larger of that layer and an even share)."""
    p = problem
    in_flight = max(p.in_flight(k) for k in range(p.num_stages))
    last = p.in_flight(p.num_stages - 1)  # the fewest microbatches any stage keeps
    per_layer = [(p.param_prefix[i + 1] - p.param_prefix[i]) * p.state_factor
                 + (p.activation_prefix[i + 1] - p.activation_prefix[i]) * last for i in range(p.num_layers)]
    need_total = sum(per_layer)
    have = float(p.device_memory.sum())
    biggest = max(per_layer)
    fix = ("add devices or raise their memory caps; " + ("use schedule='1f1b' (GPipe keeps all "
           f"{p.microbatches} microbatches' activations) or " if p.schedule == "gpipe" else "")
           + "use fewer microbatches or activation checkpointing; an optimizer with less state "
           f"(optimizer_state_factor={p.optimizer_state_factor:g})")
    if need_total > have:
        short = need_total - have
        msg = (f"no partition of {p.num_layers} layers fits {p.num_devices} devices: weights + gradients + "
               f"optimizer state + activations need at least {format_bytes(need_total)} but the devices hold "
               f"{format_bytes(have)} together, short by {format_bytes(short)}. Fix: {fix}")
        return PlanInfeasibleError(msg, needed_bytes=int(need_total), budget_bytes=int(have), suggestions=(fix,))
    short = biggest - float(p.device_memory.max()) / p.chunks
    msg = (f"no contiguous partition of {p.num_layers} layers fits {p.num_devices} devices ({format_bytes(have)} "
           f"in all, the model needs ~{format_bytes(need_total)} with up to {in_flight} microbatches in flight): "
           f"the largest layer needs {format_bytes(biggest)}"
           + (f", {format_bytes(short)} more than the largest device holds" if short > 0 else
              " and contiguous stages cannot pack the memory the devices have")
           + f". Fix: {fix}")
    return PlanInfeasibleError(msg, needed_bytes=int(max(biggest, need_total / p.num_devices)),
                               budget_bytes=int(p.device_memory.max()), suggestions=(fix,))
