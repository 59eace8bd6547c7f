"""The user's step on every rank of a pipeline, and the backward that completes it (:class:`PipelineStep`).

Only the last stage holds the model output. Every rank runs the LightningModule's own step with
``self(x)`` answered by :class:`StandIn`: the output itself on the last stage (a leaf, so the step's
loss can be differentiated with respect to it), zeros of its shape elsewhere. A term on parameters
(a regulariser) reaches them on the rank that holds them. What the step returns and logs is the last
stage's numbers plus what each other rank's own parameters add (its step run again with them
emptied): only these scalars cross ranks.

Then :meth:`PipelineStep.backward`: the gradients the schedule computed for ``loss_fn`` per
microbatch, the step's loss's own backward, and - when the gradient that loss puts on the output
differs from ``loss_fn``'s (an auxiliary term on the output, a loss not split by microbatch) - a
second pipeline pass of the difference from the same RNG state (backpropagation is linear in that
gradient, so the passes add up). A term mixing the output with an earlier stage's parameters cannot
be split so and is refused (:meth:`PipelineStep.run` checks the first two training steps).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from sky_strategy.runtime import PipelineRuntime
from sky_strategy.scalars import delta, logged_value, minus, scalars, with_values

__all__ = ["PipelineStep", "StandIn", "check_same_batch", "emptied"]

LogCall = tuple[str, Any, tuple, dict]  # one recorded ``self.log(name, value, *args, **kwargs)``
_MISSING = object()


class StandIn:
    """While the user's step runs: ``module(x)`` returns ``output`` and ``module.log`` only records its calls.

    This is the one place the strategy patches the LightningModule, and it must be a patch: ``nn.Module``
    has no hook that replaces ``forward`` without running it (a forward pre-hook changes the inputs, a
    forward hook the output, but the module's own ``forward`` over parameters this rank holds empty would
    still run), and ``LightningModule.log`` has no hook that defers a value (the values logged off the
    last stage are replaced by the last stage's before they reach Lightning). Both are instance
    attributes shadowing the class's methods inside the ``with`` block only; on exit, error or not, they
    are removed, or a ``forward``/``log`` the instance itself held before is put back.

    Args:
        module: the LightningModule.
        output: what ``module(x)`` returns (the model output on the last stage, a stand-in elsewhere).
        batch_shape: the shape of the inputs the pipeline ran; a call on another batch size is refused.

    Attributes: ``calls`` (each ``self.log`` call recorded in the block, in order).
    """

    def __init__(self, module: nn.Module, output: torch.Tensor, batch_shape: torch.Size) -> None:
        self.module, self.output, self.batch_shape = module, output, batch_shape
        self.calls: list[LogCall] = []
        self._saved: dict[str, Any] = {}

    def _forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        got = args[0].shape if args and isinstance(args[0], torch.Tensor) else None
        if got is not None and got[:1] != self.batch_shape[:1]:
            raise MisconfigurationException(
                f"SkyStrategy: the step called the model on inputs of shape {tuple(got)} but the pipeline ran "
                f"the batch's inputs of shape {tuple(self.batch_shape)}; transform inputs in `pipeline_batch(batch)` "
                "(or the dataloader), not inside the step")
        return self.output

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, value, args, kwargs))

    def __enter__(self) -> StandIn:
        for name, fn in (("forward", self._forward), ("log", self._log)):
            self._saved[name] = vars(self.module).get(name, _MISSING)
            object.__setattr__(self.module, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, before in self._saved.items():
            if before is _MISSING:
                object.__delattr__(self.module, name)
            else:
                object.__setattr__(self.module, name, before)
        self._saved.clear()


@contextlib.contextmanager
def emptied(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """These parameters hold no data for a while, as on the ranks that do not own them."""
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        yield
    finally:
        for p, data in zip(params, saved):
            p.data = data


def check_same_batch(inputs: Any, target: torch.Tensor, *, ranks: int, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank unless the ``ranks`` ranks of ``group`` hold the same batch (a few sums compared):
    the first stage consumes the inputs and the last the target. Collective."""
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    mine = torch.tensor([float(first.double().sum()), float(target.double().sum()), float(first.shape[0])],
                        dtype=torch.float64)
    sums: list = [None] * ranks
    dist.all_gather_object(sums, mine.tolist(), group=group)
    if any(s != sums[0] for s in sums):
        raise MisconfigurationException(
            f"SkyStrategy: ranks of one pipeline received different batches (input/target sums by pipeline "
            f"rank: {sums}); every stage must see the same batch. Keep Lightning's sampler (use_distributed_sampler=True) or give every "
            "rank the same data order (no unseeded shuffling)")


@dataclass(frozen=True, slots=True)
class _Pending:
    """What a training step leaves for its backward: the output (stand-in) its loss saw, and the inputs."""

    leaf: torch.Tensor
    inputs: Any


class PipelineStep:
    """The user's step on every rank of one pipeline and its backward (see the module docstring).

    Args:
        module: the LightningModule.
        runtime: the pipeline the step's output came from.
        device: this rank's device (stand-in outputs and logged values live there).
        group: this replica's pipeline process group (``None``: the world).
        coupling_checks: training steps on which :meth:`run` verifies that the terms on a rank's own
            parameters do not depend on the output.

    Attributes: ``second_passes`` (training steps whose loss needed a second pipeline pass).
    """

    def __init__(self, module: Any, runtime: PipelineRuntime, *, device: torch.device,
                 group: dist.ProcessGroup | None, coupling_checks: int = 2) -> None:
        self.module, self.runtime, self.device, self.group = module, runtime, device, group
        self.second_passes = 0
        self._coupling_checks_left = coupling_checks
        self._pending: _Pending | None = None  # set by a training run, taken by its backward

    def run(self, step: Callable[..., Any], args: tuple, kwargs: dict, output: Any, inputs: Any, *,
            train: bool) -> Any:
        """Run ``step(*args, **kwargs)`` (the module's own step) on this rank; returns what it returns, with
        the pipeline's numbers. Collective over the pipeline; an error on one rank is raised on every rank."""
        runtime = self.runtime
        batch_size = (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape[0]
        shape, dtype = runtime.output_meta(output, batch_size)
        leaf = output.detach() if runtime.is_last else torch.zeros(shape, dtype=dtype, device=self.device)
        if train:
            leaf.requires_grad_(True)
        error: Exception | None = None
        result: Any = None
        numbers: dict[str, float] | None = None
        logged: list[float] = []
        calls: list[LogCall] = []
        try:  # an error on one rank is raised on every rank (after the exchange), not left to hang the others
            result, numbers, logged, calls = self._own_numbers(step, args, kwargs, leaf, inputs, train=train)
        except Exception as exc:
            error = exc
        parts: list[Any] = [None] * runtime.world
        dist.all_gather_object(parts, (numbers, logged, None if error is None else f"{type(error).__name__}: {error}"),
                               group=self.group)
        if error is not None:
            raise error
        totals, logged_totals = self._pipeline_numbers(parts, step)
        for (name, value, rest, kw), number in zip(calls, logged_totals):
            value = torch.tensor(number, device=self.device) if isinstance(value, torch.Tensor) else number
            self.module.log(name, value, *rest, **kw)
        if train:
            self._pending = _Pending(leaf, inputs)
        return with_values(result, totals)

    def _own_numbers(self, step: Callable[..., Any], args: tuple, kwargs: dict, leaf: torch.Tensor, inputs: Any, *,
                     train: bool) -> tuple[Any, dict[str, float] | None, list[float], list[LogCall]]:
        """This rank's step result, its numbers and logged values (off the last stage: what its own
        parameters add), and the log calls it made."""
        runtime = self.runtime
        result, calls = self._call(step, args, kwargs, leaf, inputs)
        numbers, logged = scalars(result), [logged_value(name, value) for name, value, _, _ in calls]
        if not runtime.is_last:
            with torch.no_grad(), emptied(runtime.owned_parameters()):
                base, base_calls = self._call(step, args, kwargs, leaf.detach(), inputs)
            numbers = minus(numbers, scalars(base))
            logged = [delta(a, logged_value(name, value)) for a, (name, value, _, _) in zip(logged, base_calls)]
            if train and self._coupling_checks_left > 0:
                self._coupling_checks_left -= 1
                self._check_separable(step, args, kwargs, leaf, inputs, numbers)
        return result, numbers, logged, calls

    def _pipeline_numbers(self, parts: list[Any], step: Callable[..., Any],
                          ) -> tuple[dict[str, float] | None, list[float]]:
        """What the step returned and logged for the pipeline: the last stage's numbers plus what every
        other rank adds (``parts``: every rank's ``(numbers, logged, error)``)."""
        runtime = self.runtime
        failed = next(((rank, p[2]) for rank, p in enumerate(parts) if p[2] is not None), None)
        if failed is not None:
            raise MisconfigurationException(f"SkyStrategy: pipeline rank {failed[0]} stopped the step: {failed[1]}")
        last_numbers, last_logged, _ = parts[runtime.last_rank]
        for rank, (their_numbers, their_logged, _) in enumerate(parts):
            if len(their_logged) != len(last_logged) or (last_numbers is not None and (
                    their_numbers is None or set(their_numbers) != set(last_numbers))):
                raise MisconfigurationException(
                    f"SkyStrategy: {type(self.module).__name__}.{step.__name__} returned or logged "
                    f"different things on the last stage ({sorted(last_numbers or {})}, {len(last_logged)} values "
                    f"logged) and on pipeline rank {rank} ({sorted(their_numbers or {})}, {len(their_logged)} "
                    "logged), where `self(x)` returns zeros: make what the step returns and logs independent of the "
                    "output's values (log a NaN rather than skip a value)")
        others = [p for r, p in enumerate(parts) if r != runtime.last_rank]
        totals = None if last_numbers is None else {k: v + sum(p[0][k] for p in others) for k, v in last_numbers.items()}
        logged_totals = [v + sum(p[1][i] for p in others) for i, v in enumerate(last_logged)]
        return totals, logged_totals

    def _check_separable(self, step: Callable[..., Any], args: tuple, kwargs: dict, leaf: torch.Tensor, inputs: Any,
                         own: dict[str, float] | None) -> None:
        """Refuse a loss whose terms on this rank's parameters depend on the model output (a product of the
        output and an earlier stage's weights): they would be differentiated at the stand-in output here.
        What the parameters add must not change when the stand-in does (zeros vs ones)."""
        runtime = self.runtime
        ones = torch.ones_like(leaf)
        with torch.no_grad():
            with_own, _ = self._call(step, args, kwargs, ones, inputs)
            with emptied(runtime.owned_parameters()):
                without, _ = self._call(step, args, kwargs, ones, inputs)
        other = minus(scalars(with_own), scalars(without))
        for key, value in (own or {}).items():
            again = (other or {}).get(key, value)
            if not math.isclose(value, again, rel_tol=1e-4, abs_tol=1e-6):
                raise MisconfigurationException(
                    f"SkyStrategy: the loss {type(self.module).__name__}.{step.__name__} returns mixes the "
                    f"model output with parameters of pipeline rank {runtime.rank}'s layers (their terms add {value:.6g} "
                    f"with one stand-in output and {again:.6g} with another). Only the last stage sees the output, so "
                    "a term on an earlier stage's parameters must not depend on it: keep such terms separate "
                    "(`loss_fn(self(x), y) + aux(self(x)) + reg(params)`), or train this module with another "
                    "strategy (ddp, elixir)")

    def _call(self, step: Callable[..., Any], args: tuple, kwargs: dict, leaf: torch.Tensor,
              inputs: Any) -> tuple[Any, list[LogCall]]:
        batch_shape = (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape
        with StandIn(self.module, leaf, batch_shape) as stand_in:
            try:
                return step(*args, **kwargs), stand_in.calls
            except MisconfigurationException:
                raise
            except Exception as exc:
                raise RuntimeError(
                    f"SkyStrategy: {type(self.module).__name__}.{step.__name__} failed on pipeline rank "
                    f"{self.runtime.rank}: it runs on every rank, where the parameters of "
                    "the layers other ranks hold are empty tensors and, off the last stage, `self(x)` returns zeros "
                    "of the output's shape (the output stays on the last stage). Write the step as a function of "
                    "`self(x)` and the batch, plus terms on parameters that also work for an empty tensor (e.g. "
                    f"`sum(p.pow(2).sum() for p in self.parameters())`): {type(exc).__name__}: {exc}") from exc

    def backward(self, own_backward: Callable[[], None], scale: float) -> None:
        """The backward of the last training :meth:`run`, in three parts.

        Args:
            own_backward: runs the step's loss's own backward (Lightning's precision plugin).
            scale: ``1 / accumulate_grad_batches`` (Lightning divides the step's loss alike).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("SkyStrategy: backward without a training step before it; Lightning's automatic "
                               "optimization calls training_step, then backward, once per batch")
        runtime = self.runtime
        # 1. what the schedule already backpropagated, loss_fn per microbatch (it ran before Lightning's
        #    zero_grad, so its gradients waited aside until now)
        runtime.take_gradients(scale)
        # 2. the user's loss itself: its terms on this rank's parameters reach them directly, and the
        #    stand-in output (a leaf) receives d loss / d output
        own_backward()
        runtime.drop_foreign_gradients()
        # 3. the part of d loss / d output that loss_fn did not account for goes back through the pipeline
        self._backprop_rest(pending, scale)

    def _backprop_rest(self, pending: _Pending, scale: float) -> None:
        """Compare, on the last stage, the gradient the step's loss puts on the output with the one the
        schedule backpropagated (``loss_fn`` per microbatch); if they differ, backpropagate the difference
        through the pipeline in a second pass. Only a flag crosses ranks."""
        runtime, leaf = self.runtime, pending.leaf
        rest, differs = None, False
        if runtime.is_last:
            wanted = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            done = runtime.loss_fn_output_grad()
            done = torch.zeros_like(wanted) if done is None else done.to(wanted.dtype) * scale
            rest = wanted - done
            # within a few rounding steps of the largest gradient: the same gradient (splitting the batch
            # into microbatches reorders sums; fp32 CE on 16 rows agrees to ~1e-7 relative). The bound is the
            # output dtype's: 8 ulps is ~1e-6 of the largest element in fp32 but ~6% in bf16, where a smaller
            # output term is taken for rounding and not backpropagated (put it in loss_fn to be sure)
            tol = 8 * torch.finfo(wanted.dtype).eps * float(wanted.abs().max()) if wanted.numel() else 0.0
            differs = not bool((rest.abs() <= tol).all())  # NaN differs: propagated as one process would
        flag = [differs]
        dist.broadcast_object_list(flag, group=self.group, group_src=runtime.last_rank)
        if flag[0]:
            runtime.backprop_output(pending.inputs, rest)
            runtime.take_gradients(1.0)
            self.second_passes += 1
