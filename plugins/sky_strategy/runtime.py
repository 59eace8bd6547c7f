"""Applies a :class:`~tightfit.planner.pipeline.PartitionPlan` on ``torch.distributed.pipelining``.

Every rank keeps the whole LightningModule *structure* with the original parameter objects, but only
the layers of its own stages hold data; the others hold an empty placeholder (``p.data`` of 0
elements), so optimizers built over all parameters stay valid, skip what a rank does not own
(no gradient) and keep one parameter index space on every rank. Moving a layer (first placement,
re-planning) sends its weights and optimizer state from the old owner to the new one.

The model output stays on the last stage (:meth:`run` returns it there only). The schedule's
per-microbatch loss is the module's ``loss_fn``, whose gradient at the output is kept on the side;
:meth:`backprop_output` pushes any further output gradient the user's loss needs back through the
pipeline (a second pass of the same schedule, same RNG state, loss ``<output, gradient>``).

With data-parallel replicas the runtime works inside its replica's pipeline group (``group``: ranks
and stage devices are ranks *in that group*), and :meth:`average_gradients` averages each owned
parameter's gradient over the ``replicas`` group (the same stage in every replica).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from sky_strategy.layers import Layer, StageModule, TimedStage, stage_timer
from tightfit.planner.pipeline import PartitionPlan

__all__ = ["PipelineRuntime"]


class PipelineRuntime:
    """One rank's view of the pipeline: which layers it owns, its stages and schedules.

    Args:
        module: the LightningModule (its ``loss_fn`` is the schedule's per-microbatch loss).
        layers: the declared layer sequence.
        device: this rank's device.
        slowdown: returns this rank's injected slowdown (1 / speed factor) at call time.
        context: a context manager factory each stage's forward runs in (autocast for mixed precision).
        group: this replica's pipeline process group (``None``: the whole world is one pipeline).
        replicas: the group of this rank's peers in the other replicas (``None``: no data parallelism).
    """

    def __init__(self, module: nn.Module, layers: list[Layer], *, device: torch.device,
                 slowdown: Callable[[], float], context: Callable[[], AbstractContextManager],
                 group: dist.ProcessGroup | None = None, replicas: dist.ProcessGroup | None = None):
        self.module = module
        self.layers = layers
        self.device = device
        self.group = group
        self.replicas = replicas
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.slowdown = slowdown
        self.context = context
        self.plan: PartitionPlan | None = None
        self.owner: list[int] = [0] * len(layers)  # before the first plan, rank 0's weights are the truth
        self._cache: dict[tuple, tuple] = {}
        self._pending: dict[nn.Parameter, torch.Tensor] = {}
        self._grad_target = False  # the schedule's loss: loss_fn (False) or <output, given gradient> (True)
        self._output_grads: list[torch.Tensor | None] = []  # d loss_fn / d output per microbatch, last pass
        self._rng: tuple | None = None  # the RNG state the last training pass started from
        self._output_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

    # -- placement --------------------------------------------------------------------------------
    def owns(self, index: int) -> bool:
        return self.owner[index] == self.rank

    def owned_parameters(self) -> list[nn.Parameter]:
        return [p for i, layer in enumerate(self.layers) if self.owns(i) for _, p in layer.parameters()]

    def apply(self, plan: PartitionPlan, optimizers: Sequence[torch.optim.Optimizer]) -> list[int]:
        """Place the layers as ``plan`` says; returns the indices of layers that changed owner."""
        if len(plan.order) != self.world:
            raise ValueError(f"the plan is for {len(plan.order)} devices but the world has {self.world} ranks")
        if plan.num_layers != len(self.layers):
            raise ValueError(f"the plan places {plan.num_layers} layers but the module declares {len(self.layers)}")
        new_owner = [0] * len(self.layers)
        for s in plan.stages:
            for i in range(s.start, s.stop):
                new_owner[i] = s.device
        moved = [i for i in range(len(self.layers)) if new_owner[i] != self.owner[i]]
        for i in range(len(self.layers)):
            src, dst = self.owner[i], new_owner[i]
            if src == dst:
                continue
            # every rank walks the layers in the same order, so sends and receives pair up
            if self.rank == src:
                dist.send_object_list([self._pack(i, optimizers)], group=self.group, group_dst=dst)
            elif self.rank == dst:
                payload: list = [None]
                dist.recv_object_list(payload, group=self.group, group_src=src)
                self._unpack(i, payload[0], optimizers)
        self.owner = new_owner
        for i in range(len(self.layers)):
            if self.owns(i):
                self.layers[i].module.to(self.device)
            else:
                self._release(i, optimizers)
        self.plan = plan
        self._cache.clear()
        return moved

    def _pack(self, index: int, optimizers) -> dict:
        layer = self.layers[index]
        params = {fqn: p.detach().cpu().clone() for fqn, p in layer.parameters()}
        buffers = {fqn: b.detach().cpu().clone() for fqn, b in layer.buffers()}
        states = []
        for opt in optimizers:
            states.append({fqn: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                                 for k, v in opt.state[p].items()}
                           for fqn, p in layer.parameters() if p in opt.state})
        return {"params": params, "buffers": buffers, "states": states}

    def _unpack(self, index: int, payload: dict, optimizers) -> None:
        layer = self.layers[index]
        for fqn, p in layer.parameters():
            p.data = payload["params"][fqn].to(self.device, dtype=p.dtype)
            p.grad = None
        for fqn, b in layer.buffers():
            b.data = payload["buffers"][fqn].to(self.device)
        for opt, states in zip(optimizers, payload["states"]):
            for fqn, p in layer.parameters():
                if fqn in states:
                    opt.state[p] = {k: (v.to(self.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                    for k, v in states[fqn].items()}

    def _release(self, index: int, optimizers) -> None:
        for _, p in self.layers[index].parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            p.grad = None
            for opt in optimizers:
                opt.state.pop(p, None)

    def drop_foreign_optimizer_state(self, optimizers) -> None:
        for i in range(len(self.layers)):
            if not self.owns(i):
                for _, p in self.layers[i].parameters():
                    for opt in optimizers:
                        opt.state.pop(p, None)

    # -- schedules --------------------------------------------------------------------------------
    def _schedule(self, batch_size: int, train: bool):
        assert self.plan is not None
        plan = self.plan
        n_mb = plan.microbatches if train else max(1, min(plan.microbatches, batch_size))
        kind = plan.schedule
        if not train and kind == "1f1b" and n_mb < len(plan.stages):
            kind = "gpipe"  # forward-only: the schedule only orders forwards; 1F1B needs >= S microbatches
        key = (batch_size, train, n_mb, kind)
        if key not in self._cache:
            mapping = {s.index: s.device for s in plan.stages}
            stages: list[Any] = []  # TimedStage; the interleaved schedule's list[_PipelineStageBase] is invariant
            for s in plan.stages:
                if s.device != self.rank:
                    continue
                sub = StageModule([self.layers[i].module for i in range(s.start, s.stop)], self.context)
                st = TimedStage(sub, s.index, len(plan.stages), self.device, slowdown=self.slowdown, timer=stage_timer(self.device),
                                group=self.group)
                st.stage_index_to_group_rank = dict(mapping)
                stages.append(st)
            loss_fn = self._loss
            sched: ScheduleInterleaved1F1B | ScheduleGPipe | Schedule1F1B
            if kind == "interleaved":
                sched = ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=loss_fn)
                sched.stage_index_to_group_rank = mapping
                for st in stages:
                    st.stage_index_to_group_rank = dict(mapping)
            else:
                cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
                sched = cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
            self._cache[key] = (sched, stages)
        return self._cache[key]

    def _roles(self) -> tuple[bool, bool, int]:
        assert self.plan is not None
        first = self.plan.stages[0].device == self.rank
        last_rank = self.plan.stages[-1].device
        return first, last_rank == self.rank, last_rank

    @property
    def last_rank(self) -> int:
        """The rank (in the pipeline group) that holds the last stage: it alone sees the model output."""
        return self._roles()[2]

    @property
    def is_last(self) -> bool:
        return self._roles()[1]

    def _loss(self, output, target):
        """The schedule's per-microbatch loss on the last stage.

        Normally the module's ``loss_fn``; the gradient that reaches ``output`` is kept (a hook, no extra
        compute) so the strategy can compare it with what the user's ``training_step`` loss asks for.
        In a gradient pass (:meth:`backprop_output`) ``target`` is the gradient to push into ``output``
        and the "loss" is their inner product, whose gradient with respect to ``output`` is ``target``.
        """
        if self._grad_target:
            return (output * target).sum()
        loss = self.module.loss_fn(output, target)  # type: ignore[operator]
        if isinstance(output, torch.Tensor) and output.requires_grad:
            index = len(self._output_grads)
            self._output_grads.append(None)

            def keep(grad: torch.Tensor, index: int = index) -> None:
                self._output_grads[index] = grad
            output.register_hook(keep)
        return loss

    def run(self, inputs, target: torch.Tensor, *, train: bool):
        """One pipelined forward (+ backward of ``loss_fn`` when ``train``) over the batch.

        Returns the model output on the last stage's rank and ``None`` on the others: nothing of the
        output crosses ranks (the strategy runs the user's step there and shares only scalars).
        Gradients wait in :meth:`take_gradients`.
        """
        batch_size = (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape[0]
        sched, _ = self._schedule(batch_size, train)
        first, last, _ = self._roles()
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        kwargs = {"target": target} if last else {}
        if train:
            self._rng = _rng_state(self.device)
            self._output_grads = []
            out = self._train_pass(sched, args if first else (), kwargs)
        else:
            with torch.no_grad():
                out = sched.eval(*(args if first else ()), **kwargs)
        return out if last else None

    def _train_pass(self, sched, args: tuple, kwargs: dict):
        owned = self.owned_parameters()
        before = [p.grad for p in owned]
        for p in owned:
            p.grad = None
        out = sched.step(*args, **kwargs)
        for p, g in zip(owned, before):
            if p.grad is not None:
                self._pending[p] = self._pending[p] + p.grad if p in self._pending else p.grad
            p.grad = g
        return out

    def output_meta(self, output, batch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the model output for a batch of ``batch_size``, on every rank (the last stage
        sends them once per batch size: a few pickled bytes, so the other ranks can build a stand-in)."""
        if batch_size not in self._output_meta:
            head: list[Any] = [None]
            if self.is_last:
                head = [(tuple(output.shape), output.dtype) if isinstance(output, torch.Tensor) else
                        f"the last pipeline layer returned a {type(output).__name__}; SkyStrategy needs the model "
                        "output to be one tensor (return a tensor from the last layer and unpack the rest in "
                        "loss_fn / training_step)"]
            dist.broadcast_object_list(head, group=self.group, group_src=self.last_rank)
            if isinstance(head[0], str):  # raised on every rank, so none waits for the others
                raise TypeError(head[0])
            self._output_meta[batch_size] = head[0]
        return self._output_meta[batch_size]

    def loss_fn_output_grad(self) -> torch.Tensor | None:
        """What the last training pass backpropagated into the model output (the last stage only):
        ``d loss_fn / d output`` per microbatch, divided by the microbatch count as the schedule
        divides the gradients (``scale_grads``). ``None`` if a microbatch's gradient was not seen."""
        assert self.plan is not None
        n = self.plan.microbatches
        # the microbatches are the last n calls: a schedule's first step also calls loss_fn once before them,
        # on a sample, to infer the gradients' shapes
        grads = self._output_grads[-n:]
        if len(grads) < n or any(g is None for g in grads):
            return None
        return torch.cat([g for g in grads if g is not None]) / n

    def backprop_output(self, inputs, grad: torch.Tensor | None) -> None:
        """Push ``grad`` (the extra gradient the model output needs, on the last stage; ``None`` elsewhere)
        back through the pipeline: one more forward+backward of the same schedule whose per-microbatch
        loss is ``<output, grad>``, from the RNG state the training pass started from, so dropout draws
        the same masks and the two passes add up to one backward of the full loss. The gradients join
        :meth:`take_gradients`."""
        batch_size = (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).shape[0]
        sched, _ = self._schedule(batch_size, True)
        first, last, _ = self._roles()
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        # the schedule divides gradients by the microbatch count (scale_grads): undo it on the target
        assert self.plan is not None
        kwargs = {"target": grad * self.plan.microbatches} if last else {}
        after = _rng_state(self.device)
        if self._rng is not None:
            _set_rng_state(self._rng, self.device)
        self._grad_target = True
        try:
            self._train_pass(sched, args if first else (), kwargs)
        finally:
            self._grad_target = False
            _set_rng_state(after, self.device)

    def drop_foreign_gradients(self) -> None:
        """Forget gradients that a step left on other ranks' placeholders (empty tensors): only the owner's
        gradient counts, and an optimizer would otherwise create state for a parameter it does not hold."""
        for i, layer in enumerate(self.layers):
            if not self.owns(i):
                for _, p in layer.parameters():
                    p.grad = None

    def take_gradients(self, scale: float = 1.0) -> None:
        """Add the gradients of the last :meth:`run` into ``p.grad`` (what ``loss.backward()`` would do)."""
        for p, g in self._pending.items():
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        self._pending.clear()

    def sync_replicas(self) -> None:
        """Copy replica 0's weights and buffers to the other replicas (before the first placement, while
        every rank still holds the whole model), as DDP does when it wraps a model."""
        if self.replicas is None:
            return
        for t in [*self.module.parameters(), *self.module.buffers()]:
            if t.numel():
                dist.broadcast(t.data, group=self.replicas, group_src=0)

    def average_gradients(self, bucket_elements: int = 1 << 24) -> None:
        """Average ``p.grad`` of this rank's layers over the replicas (a no-op without replicas).

        Sums in fp32 buckets of at most ``bucket_elements`` (64 MiB) plus one flag per parameter, so a
        gradient that is ``None`` on every replica stays ``None`` (optimizers skip it, as a single
        process would) and one that exists on some replicas only counts as zero on the others.
        """
        if self.replicas is None:
            return
        n = dist.get_world_size(self.replicas)
        params = [p for p in self.owned_parameters() if p.requires_grad]
        flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], device=self.device)
        dist.all_reduce(flags, group=self.replicas)
        live = [p for p, f in zip(params, flags.tolist()) if f > 0]
        start = 0
        while start < len(live):
            stop, size = start, 0
            while stop < len(live) and (stop == start or size + live[stop].numel() <= bucket_elements):
                size += live[stop].numel()
                stop += 1
            chunk = live[start:stop]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                              for p in chunk])
            dist.all_reduce(flat, group=self.replicas)
            flat /= n
            offset = 0
            for p in chunk:
                g = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
                p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
            start = stop

    def busy_seconds(self, reset: bool = True) -> tuple[float, int]:
        """Compute (+ injected delay) seconds this rank spent in its stages, and the forward chunks run."""
        busy, chunks = 0.0, 0
        for _sched, stages in self._cache.values():
            for st in stages:
                busy += st.busy_s
                chunks += st.chunks_run
                if reset:
                    st.busy_s, st.chunks_run = 0.0, 0
        return busy, chunks

    # -- checkpoints ------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict with the original names, on the pipeline's rank 0 ({} elsewhere;
        with replicas every replica's first rank holds it, identical, and Lightning writes global rank 0's)."""
        mine = {}
        for i, layer in enumerate(self.layers):
            if self.owns(i):
                mine.update({k: v.detach().cpu() for k, v in layer.parameters()})
                mine.update({k: v.detach().cpu() for k, v in layer.buffers()})
        parts: list = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, parts, group=self.group, group_dst=0)
        if self.rank != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        local = self.module.state_dict()
        return OrderedDict((k, merged.get(k, v.detach().cpu())) for k, v in local.items())

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state dict a single process would have, on the pipeline's rank 0 ({} elsewhere)."""
        sd = optimizer.state_dict()
        parts: list = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(sd["state"], parts, group=self.group, group_dst=0)
        if self.rank != 0:
            return {}
        state: dict = {}
        for part in parts:
            state.update(part)
        return {"state": dict(sorted(state.items())), "param_groups": sd["param_groups"]}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        owned = {k for i, layer in enumerate(self.layers) if self.owns(i)
                 for k, _ in [*layer.parameters(), *layer.buffers()]}
        foreign = {k for i, layer in enumerate(self.layers) if not self.owns(i)
                   for k, _ in [*layer.parameters(), *layer.buffers()]}
        keep = {k: v for k, v in state.items() if k in owned or k not in foreign}
        self.module.load_state_dict(keep, strict=False)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
