"""Gradients on disk between backward and the optimizer step: a plan's tier-4 units (``Tier.DISK_GRADS``).

A tier-4 unit keeps no per-parameter state in RAM: its master weights and optimizer state wait in the store
(:mod:`lightning_elixir.disk_params`, :mod:`lightning_elixir.disk_state`), and so does its gradient, from the
moment it is final for the step to the step that consumes it. Per unit, after FSDP2's ``post_backward`` (the
reduce-scatter, the copy to the host: the shard's gradient is this rank's share of the step's sum):

    * if this backward is the step's last (Lightning's closure runs inside ``optimizer.step``: the disk state's
      pre-hook raises :attr:`DiskGradients.final` around it) or the plan does not accumulate on the host
      (``ElixirPlan.grads_accumulate_on_host``), each parameter's gradient is written to ``u<i>.grad`` (the
      flat layout of its master weights and state) and dropped; a sum already on disk from earlier
      micro-batches is read and added first (``new + old``: IEEE addition commutes, so the sum is bit-equal to
      FSDP2's in-RAM ``old += new``);
    * on the last backward, before the write, the clipping term of each gradient, ``sum(|g|^p)`` in float64 as
      :func:`lightning_elixir.clipping.clip_grad_norm_` computes it, is kept (one scalar per parameter), so the
      norm, and so the clip coefficient, is bit-identical to a run all in RAM;
    * otherwise (an earlier micro-batch, the plan says the sums fit the host) the gradient stays and FSDP2
      accumulates into it as usual.

Clipping records what it would have done to a gradient on disk (multiply by the coefficient, clamp to a value);
the streamed step reads each chunk's gradient with the chunk's state, applies those operations in order
(elementwise, so equal to applying them to the whole tensor), and steps. Writes run behind the backward: a
unit's writes are waited for when the unit before it (in backward order) flushes, so the host holds at most two
units' gradient shards, as the planner counts them (``UnitTerms.grad_buf``).

Limits: ``precision="16-mixed"`` is refused (its loss scaler unscales and checks gradients in RAM); hooks that
read ``param.grad`` after backward (``on_before_optimizer_step``) see ``None`` for these units. Clipping twice in
one step (``configure_gradient_clipping`` calling ``clip_gradients`` more than once): a second norm clip uses the
kept terms scaled by the first clip's ``coef ** p``, bit-equal to RAM where the first clip did not scale and
equal to float64 rounding of the norm where it did; a norm clip after a value clip is refused with the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_elixir._torch_adapter import (
    local_tensor,
    release_all_reduce_buffer,
    release_reduce_inputs,
    wait_gradient_offload,
    wrap_group_method,
)
from lightning_elixir.disk_layout import wait_all
from tightfit.storage import TensorStore, WriteBehind, WriteBehindError

__all__ = ["GRAD_KEY", "DiskGradients", "disk_gradients_of", "norm_term"]

GRAD_KEY = "grad"  # the store name's key of a tier-4 unit's gradients: u<i>.grad
_ATTR = "_tightfit_disk_grads"  # set on each tier-4 parameter: the DiskGradients that holds its gradient


def norm_term(local: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum(|g|^p)`` of one local gradient shard in float64: the term :func:`lightning_elixir.clipping.clip_grad_norm_`
    adds per gradient (one definition, so a term computed in backward equals one computed at clip time)."""
    return local.detach().double().abs().pow(norm_type).sum()


_local = local_tensor  # the local shard FSDP2 holds itself (lightning_elixir._torch_adapter)


def disk_gradients_of(params: Iterable[nn.Parameter]) -> DiskGradients | None:
    """The :class:`DiskGradients` holding gradients of any of ``params`` (``None``: no tier-4 parameter)."""
    for p in params:
        holder = getattr(p, _ATTR, None)
        if holder is not None:
            return holder
    return None


@dataclass
class _Unit:
    index: int
    group: Any  # FSDP2's parameter group
    pieces: list[tuple[nn.Parameter, int, int]]  # (parameter, first element in the flat buffer, local numel)


class DiskGradients:
    """Tier-4 units' gradients: written to ``store`` behind each unit's backward, read by the streamed step.

    Args:
        units: ``(plan unit index, FSDP2 parameter group, [(parameter, flat offset, local numel), ...])``.
        store: this rank's store (the optimizer state's).
        accumulate_on_host: earlier micro-batches' sums stay in RAM (the plan says they fit); ``False``: every
            backward reads, adds and writes them back.
        norm_type: the clipping term each final gradient keeps (``None``: no norm clipping configured).
    """

    def __init__(self, units: Sequence[tuple[int, Any, Sequence[tuple[nn.Parameter, int, int]]]],
                 store: TensorStore, *, accumulate_on_host: bool = True, norm_type: float | None = 2.0) -> None:
        self.store, self.accumulate_on_host, self.norm_type = store, accumulate_on_host, norm_type
        self.units = [_Unit(i, g, list(pieces)) for i, g, pieces in units]
        self.where = {id(p): (u.index, start) for u in self.units for p, start, _ in u.pieces}
        self.final = False  # the backward running now is the step's last (set around Lightning's closure)
        self.on_disk: set[int] = set()  # parameters (ids) whose gradient for this step is in the store
        self.terms: dict[int, torch.Tensor] = {}  # id -> sum(|g|^p) of its final gradient (float64 scalar)
        self.ops: list[tuple[str, Any]] = []  # clipping applied to every gradient on disk, in order
        self.clamped = False  # value clipping ran in this step: the kept norm terms no longer hold
        self.bytes_written = self.bytes_read = 0
        self.flushes = 0
        # One unit's writes behind the backward (a job holds its gradients alive until written).
        self.writes: WriteBehind[tuple[str, list[tuple[int, torch.Tensor]]]] = WriteBehind(
            self._write, max_pending=1, name="lightning_elixir-grad-writes")
        self._undo: list[Callable[[], None]] = []
        for u in self.units:
            for p, _, _ in u.pieces:
                setattr(p, _ATTR, self)
            if u.group is not None:
                self._wrap(u)

    def name(self, unit: int) -> str:
        """The store name of unit ``unit``'s gradients (a flat buffer)."""
        return f"u{unit}.{GRAD_KEY}"

    def holds(self, p: nn.Parameter) -> bool:
        """Whether ``p``'s gradient for this step waits in the store."""
        return id(p) in self.on_disk

    # ---- backward: write each unit's gradients behind it ------------------------------------------------
    def flush(self, u: _Unit) -> None:
        """Unit ``u``'s gradients to the store (see the module docstring for when)."""
        if not self.final and self.accumulate_on_host:
            return
        # Every earlier write is done now: the previous unit's in backward order (written while this one computed),
        # so the host holds two units' gradients at most, and an earlier micro-batch's of this unit before it is read.
        self.drain()
        offload = {id(fp.sharded_param): fp for fp in getattr(u.group, "fsdp_params", ())}
        job: list[tuple[int, torch.Tensor]] = []  # (byte offset, flat gradient)
        for p, start, n in u.pieces:
            g = p.grad
            if g is None or n == 0:
                continue
            if id(p) in offload:
                wait_gradient_offload(offload[id(p)])  # a GPU's non-blocking copy to the host: done before we read it
            local = _local(g)
            flat = local.reshape(-1)
            size = flat.element_size()
            if id(p) in self.on_disk:  # the sum of earlier micro-batches: read, add, write back
                old = torch.empty_like(flat)
                self.store.read_into(self.name(u.index), old, start * size).result()
                self.bytes_read += old.nbytes
                flat.add_(old)
            if self.final and self.norm_type is not None:
                self.terms[id(p)] = norm_term(local, self.norm_type)
            job.append((start * size, flat))
            self.bytes_written += flat.nbytes
            self.on_disk.add(id(p))
            p.grad = None
        if job:
            self.writes.submit((self.name(u.index), job))
        self.flushes += 1

    def _write(self, job: tuple[str, list[tuple[int, torch.Tensor]]]) -> None:
        name, parts = job
        wait_all([self.store.write(name, flat, offset) for offset, flat in parts])

    def drain(self) -> None:
        """Every gradient write done (before the step reads them)."""
        try:
            self.writes.flush()
        except WriteBehindError as err:  # a DiskFullError surfaces here, out of backward, once every write is done
            raise err.error from None

    # ---- clipping: what it does to a gradient on disk, replayed in the step -------------------------------
    def term(self, p: nn.Parameter, norm_type: float) -> torch.Tensor:
        """The clipping term of ``p``'s final gradient on disk (raises where backward did not keep one)."""
        if self.clamped:
            raise ValueError(f"gradient clipping by the {norm_type}-norm after clipping by value in the same step, "
                             "with gradients waiting on disk: the norms kept in backward no longer describe the "
                             "clamped gradients; clip by norm before clipping by value, or plan with "
                             "ElixirConstraints(allow_disk_grads=False)")
        t = self.terms.get(id(p))
        if t is None or norm_type != self.norm_type:
            raise ValueError(f"gradient clipping by the {norm_type}-norm needs the norm of a gradient that waits on "
                             "disk, and none was kept for it (norms are kept in the last backward before "
                             "optimizer.step when Trainer(gradient_clip_val=...) or configure_gradient_clipping is "
                             "set, 2-norm): clip through Lightning's automatic optimization, or plan with "
                             "ElixirConstraints(allow_disk_grads=False)")
        return t

    def scale(self, coef: torch.Tensor) -> None:
        """Norm clipping: every gradient on disk is multiplied by ``coef`` (the host copy) in the step.

        The kept norm terms follow (``|c g|^p = |c|^p |g|^p``), so a second norm clip in the same step sees the
        clipped norm: bit-equal to RAM where the first clip left the gradients as they were (``coef`` 1), equal to
        float64 rounding of the norm where it scaled them (RAM sums the fp32-rounded products)."""
        if self.on_disk:
            c = coef.detach().to("cpu")
            self.ops.append(("mul", c))
            if self.norm_type is not None and float(c) != 1.0:
                factor = c.double().abs().pow(self.norm_type)
                self.terms = {k: t * factor for k, t in self.terms.items()}

    def clamp(self, value: float) -> None:
        """Value clipping: every gradient on disk is clamped to ``[-value, value]`` in the step (the kept norm
        terms no longer describe them: a later norm clip in this step is refused, see :meth:`term`)."""
        if self.on_disk:
            self.ops.append(("clamp", float(value)))
            self.clamped = True

    def apply_ops(self, grad: torch.Tensor) -> None:
        """Replay clipping on a chunk of a gradient read from disk (elementwise: equal on any chunk)."""
        for op, arg in self.ops:
            if op == "mul":
                grad.mul_(arg.to(grad.dtype))
            else:
                grad.clamp_(min=-arg, max=arg)

    def consumed(self) -> None:
        """After the step: the gradients on disk are spent (the next backward writes new ones)."""
        self.on_disk.clear()
        self.terms.clear()
        self.ops.clear()
        self.clamped = False

    # ---- hooks ---------------------------------------------------------------------------------------
    def _wrap(self, u: _Unit) -> None:
        group = u.group

        def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                after(out)
                return out
            return run

        def after(out: Any) -> None:
            self.flush(u)
            if getattr(getattr(group, "device", None), "type", "") == "cpu":
                release_reduce_inputs(group)  # no stream reuses it on a CPU: the next unit computes without it
            if self.final or not self.accumulate_on_host:
                # FSDP2 keeps a replicated unit's all-reduce buffer (its flat, reduced gradient, which the shards'
                # gradients view) until the whole backward ends; written to disk, it is garbage: release it now.
                release_all_reduce_buffer(group)

        self._undo.append(wrap_group_method(group, "post_backward", wrapped))

    def wrap_zero_grad(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """``optimizer.zero_grad`` forgets the gradients on disk too; returns the undo."""
        original = optimizer.zero_grad
        had = "zero_grad" in vars(optimizer)

        def zero_grad(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            self.drain()
            self.consumed()

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

        def undo() -> None:
            if had:
                optimizer.zero_grad = original  # type: ignore[method-assign]
            elif "zero_grad" in vars(optimizer):
                del optimizer.zero_grad
        return undo

    def close(self) -> None:
        """Remove the hooks (before tier 3's own close, which removes its hooks on the same groups); a write that
        failed is raised after they are gone."""
        try:
            self.drain()
        finally:
            self._unhook()

    def _unhook(self) -> None:
        self.writes.close()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for u in self.units:
            for p, _, _ in u.pieces:
                if getattr(p, _ATTR, None) is self:
                    delattr(p, _ATTR)
