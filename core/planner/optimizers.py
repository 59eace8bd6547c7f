"""The one table of optimizer state and training precisions every planner and the profiler read.

The Elixir cost model, the profiler's memory arithmetic, Sky's per-class state factors and the embedding
cache's row optimizer all read it, so they cannot drift apart.

* :data:`OPTIMIZERS`: one :class:`OptimizerSpec` per optimizer, keyed by a lower-case name; lookups
  accept ``torch.optim`` class names too (``"AdamW"``, ``"RMSprop"``, TorchRec's ``"RowWiseAdagrad"``).
* :data:`PRECISIONS`: one :class:`PrecisionSpec` per Lightning precision string; the profiler's short
  names (``"fp32"``, ``"mixed"`` ...) are aliases of them (:data:`PRECISION_ALIASES`).

Example:
    >>> optimizer_spec("AdamW").states(amsgrad=True), optimizer_spec("sgd").states(momentum=0.9)
    (3, 1)
    >>> row_state_columns("rowwise_adagrad", 64), row_state_columns("adam", 64)
    (1, 128)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "OptimizerSpec",
    "OPTIMIZERS",
    "optimizer_spec",
    "optimizer_states",
    "row_state_columns",
    "STEP_TENSOR_BYTES",
    "PrecisionSpec",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "precision_spec",
]

STEP_TENSOR_BYTES = 4
"""Bytes of ``torch.optim``'s ``step``: a float32 scalar tensor per parameter."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """What one optimizer keeps per trained parameter.

    Args:
        name: lower-case name (``"adamw"``).
        element_states: state tensors the size of the parameter it always keeps (Adam: ``exp_avg``,
            ``exp_avg_sq``).
        momentum_states: extra parameter-sized states when ``momentum > 0`` (SGD's and RMSprop's buffer).
        amsgrad_states: extra parameter-sized states with ``amsgrad=True`` (``max_exp_avg_sq``).
        centered_states: extra parameter-sized states with ``centered=True`` (RMSprop's ``grad_avg``).
        row_states: floats per row (first dimension) independent of the row's width (row-wise Adagrad: 1).
        step_tensor: whether ``torch.optim`` keeps a 4-byte ``step`` tensor per parameter.
        temp_states: parameter-sized temporaries live during ``step()`` (torch's foreach AdamW
            materialises ``sqrt(exp_avg_sq)`` for the whole group: one more state-sized tensor).
        planned_momentum: whether planners, which see only a name, assume the momentum buffer
            (plain SGD keeps nothing, but SGD is almost always run with momentum).
    """

    name: str
    element_states: int
    momentum_states: int = 0
    amsgrad_states: int = 0
    centered_states: int = 0
    row_states: int = 0
    step_tensor: bool = True
    temp_states: int = 0
    planned_momentum: bool = False

    def states(self, *, momentum: float = 0.0, amsgrad: bool = False, centered: bool = False) -> int:
        """Parameter-sized state tensors under these hyper-parameters."""
        return (self.element_states + (self.momentum_states if momentum else 0)
                + (self.amsgrad_states if amsgrad else 0) + (self.centered_states if centered else 0))

    @property
    def planned_states(self) -> int:
        """State tensors a planner assumes when it knows only the name (momentum as ``planned_momentum``)."""
        return self.states(momentum=1.0 if self.planned_momentum else 0.0)


# Order matters for messages: the four the profiler has always known come first.
OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec(name="sgd", element_states=0, momentum_states=1, step_tensor=False, planned_momentum=True),
    OptimizerSpec(name="adam", element_states=2, amsgrad_states=1, temp_states=1),
    OptimizerSpec(name="adamw", element_states=2, amsgrad_states=1, temp_states=1),
    OptimizerSpec(name="adagrad", element_states=1, temp_states=1),
    OptimizerSpec(name="rowwise_adagrad", element_states=0, row_states=1, step_tensor=False),
    OptimizerSpec(name="rmsprop", element_states=1, momentum_states=1, centered_states=1),
    OptimizerSpec(name="adamax", element_states=2, temp_states=1),
    OptimizerSpec(name="nadam", element_states=2, temp_states=1),
    OptimizerSpec(name="radam", element_states=2, temp_states=1),
)}
"""One :class:`OptimizerSpec` per optimizer, keyed by its lower-case name (:func:`optimizer_spec` also takes
``torch.optim`` class names)."""
# torch / TorchRec class names whose lower-case form is not the table's name.
_ALIASES = {"rowwiseadagrad": "rowwise_adagrad", "sparseadam": "adam"}


def optimizer_spec(optimizer: str) -> OptimizerSpec:
    """The spec of a name or ``torch.optim`` class name (case-insensitive); unknown names raise listing the known."""
    key = optimizer.lower()
    spec = OPTIMIZERS.get(_ALIASES.get(key, key))
    if spec is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)} "
                         "(or their torch.optim class names, e.g. 'AdamW')")
    return spec


def optimizer_states(optimizer: str, defaults: Mapping[str, Any] | None = None, *, strict: bool = True) -> int:
    """Parameter-sized state tensors of an optimizer built with ``defaults`` (a ``torch.optim`` ``defaults`` dict).

    ``strict=False``: an optimizer not in the table counts one state if it has momentum, none otherwise
    (what a third-party SGD-like optimizer keeps), instead of raising.
    """
    d = defaults or {}
    try:
        spec = optimizer_spec(optimizer)
    except ValueError:
        if strict:
            raise
        return 1 if d.get("momentum") else 0
    return spec.states(momentum=d.get("momentum", 0.0) or 0.0, amsgrad=bool(d.get("amsgrad", False)),
                       centered=bool(d.get("centered", False)))


def row_state_columns(optimizer: str, dim: int, *, momentum: float = 0.0) -> int:
    """Floats of state stored beside one embedding row of width ``dim`` (row-wise optimizers: a few, not ``dim``)."""
    spec = optimizer_spec(optimizer)
    return spec.states(momentum=momentum) * dim + spec.row_states


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionSpec:
    """Bytes per parameter element under one Lightning precision string, as FSDP2 runs it.

    Args:
        name: the Lightning precision (``"bf16-mixed"``).
        param_dtype: dtype of the gathered parameters compute runs in (``MixedPrecisionPolicy.param_dtype``).
        reduce_dtype: dtype gradients are reduced in (``MixedPrecisionPolicy.reduce_dtype``).
        master_bytes: bytes of a sharded (master) parameter element; optimizer state lives in this dtype.
        compute_bytes: bytes of a gathered parameter element, and of its unsharded gradient.
        reduce_bytes: bytes of a gradient element in the reduce-scatter buffer and of the sharded gradient.
        matmul_dtype: key of ``DeviceProfile.matmul_flops`` the compute rate is read from.
    """

    name: str
    param_dtype: str
    reduce_dtype: str
    master_bytes: int
    compute_bytes: int
    reduce_bytes: int
    matmul_dtype: str

    @property
    def master_copy_bytes(self) -> int:
        """Bytes of the separate master copy a model stored in ``compute`` dtype needs (0 when they are one)."""
        return self.master_bytes if self.master_bytes != self.compute_bytes else 0


PRECISIONS: dict[str, PrecisionSpec] = {
    "32-true": PrecisionSpec(name="32-true", param_dtype="float32", reduce_dtype="float32", master_bytes=4,
                             compute_bytes=4, reduce_bytes=4, matmul_dtype="float32"),
    "bf16-mixed": PrecisionSpec(name="bf16-mixed", param_dtype="bfloat16", reduce_dtype="float32",
                                master_bytes=4, compute_bytes=2, reduce_bytes=4, matmul_dtype="bfloat16"),
    "16-mixed": PrecisionSpec(name="16-mixed", param_dtype="float16", reduce_dtype="float32", master_bytes=4,
                              compute_bytes=2, reduce_bytes=4, matmul_dtype="float16"),
    "bf16-true": PrecisionSpec(name="bf16-true", param_dtype="bfloat16", reduce_dtype="bfloat16",
                               master_bytes=2, compute_bytes=2, reduce_bytes=2, matmul_dtype="bfloat16"),
}
"""One :class:`PrecisionSpec` per Lightning precision string. Mixed precision keeps fp32 master weights and
reduces gradients in fp32, as torchtitan does by default (bf16 reductions over many ranks lose precision in the
averaged gradient)."""
# fp16 weights everywhere has no Lightning-planner entry ("16-true" is not a plan Elixir makes), so it is
# spelled out here.
PRECISION_ALIASES: dict[str, PrecisionSpec] = {
    "fp32": PRECISIONS["32-true"],
    "bf16": PRECISIONS["bf16-true"],
    "fp16": PrecisionSpec(name="16-true", param_dtype="float16", reduce_dtype="float16", master_bytes=2,
                          compute_bytes=2, reduce_bytes=2, matmul_dtype="float16"),
    "mixed": PRECISIONS["16-mixed"],
    "mixed-bf16": PRECISIONS["bf16-mixed"],
    "mixed-fp16": PRECISIONS["16-mixed"],
}
"""The profiler's short precision names: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"mixed"`` (low-precision parameters
plus an fp32 master copy and fp32 state, ZeRO's K = 12 for Adam), ``"mixed-bf16"``, ``"mixed-fp16"``."""


def precision_spec(precision: str) -> PrecisionSpec:
    """The :class:`PrecisionSpec` of a Lightning precision string; unknown ones raise listing the known."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(
            f"precision {precision!r} is not one the planner models; use one of {', '.join(PRECISIONS)}"
        ) from None
