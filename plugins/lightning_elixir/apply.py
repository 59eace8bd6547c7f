"""``apply_plan(module, plan, mesh)``: execute an :class:`~tightfit.planner.elixir.ElixirPlan` with FSDP2.

The plan names blocks (module FQNs, as the profiler found them); this file turns them into
``fully_shard`` calls in five plain steps, in this order (each step needs the previous one):

1. :func:`resolve_units` - plan units -> lists of modules. A unit spanning several blocks becomes
   one ``fully_shard([m1, m2, ...])`` group; a tied parameter (GPT's ``wte`` / ``lm_head``) pulls
   the module that shares it into the owning unit, so the tie survives sharding.
2. :func:`apply_activation_checkpointing` - the plan's recomputed blocks get composable
   ``torch.distributed._composable.checkpoint`` (hooks, no wrapper: parameter names do not change,
   so checkpoints and the exported state dict keep the model's own names).
3. :func:`shard_units` - ``fully_shard`` per unit with ``reshard_after_forward`` from its mode,
   ``CPUOffloadPolicy`` when offloaded, the plan's ``MixedPrecisionPolicy``; ``replicate`` units on
   a ``(world, 1)`` replicate x shard mesh; then the root ``fully_shard`` (a tied embedding's group is resharded
   after its head's backward: :mod:`lightning_elixir.tied`).
4. :func:`apply_prefetch` - explicit ``set_modules_to_forward_prefetch`` /
   ``set_modules_to_backward_prefetch`` with the plan's depths.
5. :func:`materialize` - meta parameters are allocated where their unit lives (host for offloaded
   units, the device otherwise), then initialised (``reset_parameters`` / ``init_weights``).

Example:
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (2,))                      # doctest: +SKIP
    >>> units = apply_plan(model, plan, mesh)                     # doctest: +SKIP
    >>> print(describe_units(model))                              # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from lightning_elixir._torch_adapter import (
    composable_checkpoint,
    composable_registry,
    fsdp_param_groups,
    reregister_root_parameters,
)
from lightning_elixir.tied import release_tied_after_head
from tightfit.planner.elixir import ElixirPlan, UnitPlan

if TYPE_CHECKING:
    from lightning_elixir.disk_params import DiskParameters

__all__ = ["AppliedUnit", "UnitState", "apply_plan", "resolve_units", "apply_activation_checkpointing",
           "set_checkpointing", "shard_units", "apply_prefetch", "materialize", "WholeDraws",
           "mixed_precision_policy", "inspect_units", "describe_units", "is_sharded", "is_replicated"]


@dataclass
class AppliedUnit:
    """One plan unit as applied: the modules of its ``fully_shard`` group (empty: nothing to shard).

    Args:
        index: the unit's position in the plan.
        plan: the :class:`UnitPlan`.
        names: FQNs of the modules in its group (tied-parameter holders included).
        modules: those modules (FSDP modules once :func:`shard_units` ran).
        on_root: the unit's parameters are managed by the root ``fully_shard`` (a block holding the
            root's own parameters, or one whose module also holds other blocks).
    """

    index: int
    plan: UnitPlan
    names: list[str]
    modules: list[nn.Module]
    on_root: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitState:
    """What FSDP2 actually holds for one sharded group, read back from the wrapped modules.

    Args:
        names: FQNs of the group's modules.
        reshard_after_forward: parameters are freed after forward (re-gathered in backward).
        offload: ``CPUOffloadPolicy`` is set: sharded parameters live on the host.
        param_device: device of the sharded parameters (``"cpu"`` when offloaded).
        replicated: the group's mesh has a replicate dimension of the world size (``replicate`` mode).
        checkpointed: modules of the group that run under activation checkpointing.
        numel: parameter elements of the group (unsharded).
    """

    names: tuple[str, ...]
    reshard_after_forward: bool
    offload: bool
    param_device: str
    replicated: bool
    checkpointed: tuple[str, ...]
    numel: int


# ---- 1. units -> modules -------------------------------------------------------------------------
def _holders(module: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> FQNs of every module that registers it directly (tied parameters: several)."""
    out: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for p in sub.parameters(recurse=False):
            out.setdefault(id(p), [])
            if name not in out[id(p)]:
                out[id(p)].append(name)
    return out


def _inside(name: str, roots: list[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def resolve_units(module: nn.Module, plan: ElixirPlan) -> list[AppliedUnit]:
    """The modules each plan unit shards, tied parameters resolved (see the module docstring)."""
    known = dict(module.named_modules())
    missing = [b for u in plan.units for b in u.blocks if b and b not in known]
    if missing:
        raise ValueError(f"plan names blocks {missing[:5]} that {type(module).__name__} does not have; the plan was "
                         "made for another model (re-plan with ElixirStrategy(plan=None))")
    all_blocks = [b for u in plan.units for b in u.blocks]
    holders = _holders(module)
    units: list[AppliedUnit] = []
    claimed: dict[str, int] = {}
    for i, u in enumerate(plan.units):
        names: list[str] = []
        on_root = False
        for b in u.blocks:
            # The root's own parameters, or a parameter-only block whose module also holds other
            # blocks (e.g. a wrapper with a bias next to its layer list): the root group takes them.
            if b == "" or any(o.startswith(b + ".") for o in all_blocks if o != b):
                on_root = on_root or any(True for _ in known[b].parameters(recurse=False))
                continue
            if any(True for _ in known[b].parameters()):
                names.append(b)
        units.append(AppliedUnit(index=i, plan=u, names=names, modules=[], on_root=on_root))
        for n in names:
            claimed[n] = i
    # Tied parameters: a module holding only parameters owned by another unit joins that unit.
    for unit in units:
        for name in list(unit.names):
            for p in known[name].parameters():
                for holder in holders[id(p)]:
                    if _inside(holder, unit.names):
                        continue
                    own = list(known[holder].parameters())
                    mine = {id(q) for n in unit.names for q in known[n].parameters()}
                    if all(id(q) in mine for q in own):
                        other = claimed.get(holder)
                        if other is not None and other != unit.index:
                            units[other].names.remove(holder)
                        claimed[holder] = unit.index
                        unit.names.append(holder)
                    else:
                        # It holds parameters of its own too: only the root group can own both.
                        unit.on_root = True
    for unit in units:
        if unit.on_root:
            unit.names = []
        unit.modules = [known[n] for n in unit.names]
    return units


# ---- 2. activation checkpointing -----------------------------------------------------------------
def apply_activation_checkpointing(module: nn.Module, plan: ElixirPlan, *, switchable: bool = False) -> list[str]:
    """Composable activation checkpointing on the plan's recomputed blocks; returns their names.

    ``switchable``: every block of the plan gets the checkpoint hooks now, before sharding (the hook order
    of a fresh plan), switched off where the plan does not recompute: :func:`set_checkpointing` can then
    turn recomputation on or off between steps (``ElixirStrategy(replan=True)``)."""
    checkpoint = composable_checkpoint()
    done = []
    wanted = set(plan.checkpointed_blocks)
    blocks = [b for u in plan.units for b in u.blocks]
    names = [b for b in blocks if b and not any(o.startswith(b + ".") for o in blocks)] if switchable \
        else list(plan.checkpointed_blocks)
    for name in names:
        sub = module.get_submodule(name)
        if not _is_checkpointed(sub):
            checkpoint(sub)
            done.append(name)
        if name not in wanted:
            checkpoint.state(sub).enable_hook = False
    return [n for n in done if n in wanted]


def set_checkpointing(module: nn.Module, name: str, on: bool) -> None:
    """Turn recomputation of block ``name`` on or off between steps (its hooks were installed by
    ``apply_activation_checkpointing(..., switchable=True)``; the parameters are untouched)."""
    checkpoint = composable_checkpoint()
    sub = module.get_submodule(name)
    if not _is_checkpointed(sub):
        raise ValueError(f"block {name!r} has no checkpoint hooks to switch; apply the plan with "
                         "switchable checkpointing (ElixirStrategy(replan=True) does)")
    checkpoint.state(sub).enable_hook = on


def _is_checkpointed(sub: nn.Module) -> bool:
    return "checkpoint" in composable_registry(sub)


# ---- 3. fully_shard per unit ---------------------------------------------------------------------
def mixed_precision_policy(plan: ElixirPlan):
    """FSDP2's ``MixedPrecisionPolicy`` for the plan's parameter and gradient-reduction dtypes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param, reduce = getattr(torch, plan.param_dtype), getattr(torch, plan.reduce_dtype)
    if param == torch.float32 and reduce == torch.float32:
        return MixedPrecisionPolicy()  # fp32 training: no casts at all
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def _offload_policy(offload: bool, device_type: str):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not offload:
        return OffloadPolicy()
    # Pinned host memory makes the host<->device copies asynchronous; it needs a GPU (CUDA host allocator).
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def _replicate_mesh(mesh):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(mesh.device_type, (mesh.size(), 1), mesh_dim_names=("replicate", "shard"))


def shard_units(module: nn.Module, plan: ElixirPlan, units: list[AppliedUnit], mesh) -> None:
    """``fully_shard`` each unit with its mode, offload and mixed precision, then the root."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision_policy(plan)
    hsdp = _replicate_mesh(mesh) if any(u.plan.mode == "replicate" for u in units) else None
    for unit in units:
        if not unit.modules:
            continue
        group = unit.modules[0] if len(unit.modules) == 1 else unit.modules
        fully_shard(group, mesh=hsdp if unit.plan.mode == "replicate" else mesh,
                    reshard_after_forward=unit.plan.reshard_after_forward, mp_policy=mp,
                    offload_policy=_offload_policy(unit.plan.offload, mesh.device_type))
    # The root takes every parameter no unit claimed; it follows the first unit that sent it some
    # (or stays gathered, FSDP2's own default for the root, which backward needs first anyway).
    root = next((u.plan for u in units if u.on_root), None)
    fully_shard(module, mesh=hsdp if root is not None and root.mode == "replicate" else mesh,
                reshard_after_forward=root.reshard_after_forward if root is not None else False, mp_policy=mp,
                offload_policy=_offload_policy(root.offload if root is not None else False, mesh.device_type))


# ---- 4. prefetch ---------------------------------------------------------------------------------
def apply_prefetch(units: list[AppliedUnit], forward: int, backward: int) -> None:
    """Unit ``i`` all-gathers the next ``forward`` units in forward and the previous ``backward`` in backward."""
    from torch.distributed.fsdp import FSDPModule

    # The first module of each group carries the group's FSDP2 state (every module of a group is an FSDPModule).
    sharded: list[FSDPModule] = [m for m in (u.modules[0] for u in units if u.modules) if isinstance(m, FSDPModule)]
    if len(sharded) < 2:
        return
    for i, m in enumerate(sharded):
        ahead = sharded[i + 1:i + 1 + forward]
        if ahead:
            m.set_modules_to_forward_prefetch(ahead)
        behind = sharded[max(0, i - backward):i][::-1]
        if behind:
            m.set_modules_to_backward_prefetch(behind)


# ---- 5. materialise ------------------------------------------------------------------------------
def _has_meta(module: nn.Module, recurse: bool) -> bool:
    return any(t.is_meta for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)])


@torch.no_grad()
def materialize(module: nn.Module, units: list[AppliedUnit], device: torch.device, *,
                streamed: DiskParameters | None = None) -> bool:
    """Allocate meta parameters where each unit lives and initialise them; ``False`` if nothing was on meta.

    Offloaded units are allocated on the host (never on the device, whose memory they do not fit),
    the rest on ``device``. Initialisation: ``reset_parameters()`` of every module that has one, then
    ``init_weights()`` of the outermost modules that define it (e.g. :class:`tightfit.models.GPT`,
    whose GPT-2 initialisation and tied head it restores). A random fill of a sharded parameter draws the whole
    parameter and keeps this rank's shard (:class:`WholeDraws`), so the values are those of the model built eagerly
    with the same seed and then sharded, on any number of ranks.

    ``streamed`` (tier-3 units' ``DiskParameters``): those units are allocated and dropped in turn, initialised
    paged in one at a time as touched (``DiskParameters.paging``: same values, draws and order as in memory).
    """
    if not _has_meta(module, recurse=True):
        return False
    cpu = torch.device("cpu")
    placed: list[str] = []
    paged = {u.index for u in streamed.units} if streamed is not None else set()
    for unit in units:
        for name, m in zip(unit.names, unit.modules):
            if _has_meta(m, recurse=True):
                m.to_empty(device=cpu if unit.plan.offload else device)
            placed.append(name)
        if unit.index in paged and unit.modules and streamed is not None:
            streamed.drop_blank(unit.index)  # before the next unit is allocated: one unit in memory at a time
    root_offload = next((u.plan.offload for u in units if u.on_root), False)
    for name, m in module.named_modules():
        if not _inside(name, placed) and _has_meta(m, recurse=False):
            m.to_empty(device=cpu if root_offload else device, recurse=False)
    # Re-register the root group's sharded parameters (FSDP2 does it in its ``_apply`` override).
    reregister_root_parameters(module)
    for unit in units:
        if unit.index in paged and not unit.modules and streamed is not None:
            streamed.drop_blank(unit.index)  # a unit the root group holds: allocated with the root's parameters
    with streamed.paging() if streamed is not None else nullcontext(), WholeDraws():
        _initialise(module)
    return True


# The in-place random fills of a tensor; torch.nn.init's functions (kaiming_uniform_, normal_, orthogonal_, ...)
# reach a mode as themselves, with the tensor as ``tensor=``.
_RANDOM_FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.cauchy_,
                           torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
                           torch.Tensor.random_})


class WholeDraws(TorchFunctionMode):
    """Within: a random fill of a DTensor (``Tensor.normal_``, ``uniform_``, ... or a ``torch.nn.init`` function)
    fills a whole tensor of its global shape from this rank's generator and keeps this rank's shard of it.

    A model built eagerly draws every parameter whole, on every rank from the same seed, and FSDP2 then keeps each
    rank's shard. Filled shard by shard instead, every rank would draw its shard from the start of the same random
    stream (on a CPU mesh, where DTensor has no random-offset tracker, rank 1's rows would repeat rank 0's) and the
    generator would advance by a shard's draws, not the parameter's. Drawing whole gives the eager values, draw for
    draw; one parameter is whole in memory at a time.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        fills = func in _RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init"
        target = args[0] if args else kwargs.get("tensor")
        if not fills or not isinstance(target, DTensor):
            return func(*args, **kwargs)
        whole = torch.empty(target.shape, dtype=target.dtype, device=target.device)
        if args:
            func(whole, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": whole})
        # src_data_rank=None: no communication, this rank's shard of its own draw (every rank drew the same).
        mine = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(mine.to_local())
        return target


def _initialise(module: nn.Module) -> None:
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and any(True for _ in m.parameters(recurse=False)):
            reset()
    done: list[str] = []
    for name, m in module.named_modules():
        if name and _inside(name, done):
            continue
        init = getattr(type(m), "init_weights", None)
        if callable(init):
            m.init_weights()  # type: ignore[operator]
            done.append(name)
            if not name:
                break


# ---- the whole thing -----------------------------------------------------------------------------
def apply_plan(module: nn.Module, plan: ElixirPlan, mesh, *, device: torch.device | None = None,
               switchable: bool = False, defer_materialize: bool = False) -> list[AppliedUnit]:
    """Apply ``plan`` to ``module`` in place on the 1-D data-parallel ``mesh``; returns the applied units.

    Args:
        module: the model (parameters real or on the meta device).
        plan: an :class:`ElixirPlan` for this model and ``mesh.size()`` ranks.
        mesh (DeviceMesh): a 1-D ``DeviceMesh`` over the data-parallel ranks.
        device: where resident units live (default: the mesh's device for this rank).
        switchable: checkpoint hooks on every block, off where the plan does not recompute
            (:func:`set_checkpointing` switches them later; used by re-planning).
        defer_materialize: leave step 5 (:func:`materialize`) to the caller (e.g. with the disk tier streamed).
    """
    if plan.world_size != mesh.size():
        raise ValueError(f"plan was made for world size {plan.world_size}, the mesh has {mesh.size()} ranks; "
                         "re-plan for this run")
    if device is None:
        device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device(
            mesh.device_type, torch.cuda.current_device())
    units = resolve_units(module, plan)                     # 1. which modules each unit shards
    apply_activation_checkpointing(module, plan, switchable=switchable)  # 2. recompute before sharding (hooks order)
    shard_units(module, plan, units, mesh)                  # 3. fully_shard per unit, then the root
    release_tied_after_head(module, units)                  # 3b. a tied lookup group: gathered in backward for its head
    apply_prefetch(units, plan.forward_prefetch, plan.backward_prefetch)  # 4. explicit prefetch
    if not defer_materialize:
        materialize(module, units, device)                  # 5. allocate + initialise meta parameters
    return units


# ---- reading it back -----------------------------------------------------------------------------
def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def is_replicated(module: nn.Module) -> bool:
    """``module`` runs under torch's composable ``replicate`` (an all-replicate plan applied with DDP)."""
    return "replicate" in composable_registry(module)


def inspect_units(module: nn.Module) -> list[UnitState]:
    """Every FSDP2 group in ``module`` (root last), read from FSDP2's own state: what really runs."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    if is_replicated(module):
        return [_replicated_state(module)]
    names = {id(m): n for n, m in module.named_modules()}
    sharded = [n for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    # Each module belongs to its nearest sharded ancestor (itself included).
    owner = {n: max((s for s in sharded if s == "" or n == s or n.startswith(s + ".")), key=len, default=None)
             for n, _ in module.named_modules()}
    out: list[UnitState] = []
    seen: set[int] = set()
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in fsdp_param_groups(m):
            if id(group) in seen:
                continue
            seen.add(id(group))
            group_modules = [names[id(x)] for x in group.modules]
            params = [fp.sharded_param for fp in group.fsdp_params]
            mesh = group.mesh_info.mesh
            ckpt = tuple(n for n, sub in module.named_modules()
                         if owner.get(n) in group_modules and _is_checkpointed(sub))
            out.append(UnitState(
                names=tuple(group_modules),
                reshard_after_forward=group.post_forward_mesh_info is not None,
                offload=isinstance(group.offload_policy, CPUOffloadPolicy),
                param_device=params[0].to_local().device.type if params else "",
                replicated=mesh.ndim == 2 and mesh.size(0) > 1,
                checkpointed=ckpt,
                numel=sum(fp.sharded_param.numel() for fp in group.fsdp_params),
            ))
    return out


def _replicated_state(module: nn.Module) -> UnitState:
    """The one DDP group of a module under composable ``replicate``: every parameter, whole, on every rank."""
    params = list(module.parameters())
    return UnitState(names=("",), reshard_after_forward=False, offload=False,
                     param_device=params[0].device.type if params else "", replicated=True,
                     checkpointed=tuple(n for n, sub in module.named_modules() if _is_checkpointed(sub)),
                     numel=sum(p.numel() for p in params))


def describe_units(module: nn.Module) -> str:
    """A table of :func:`inspect_units`."""
    from tightfit.units import format_table

    rows = [(", ".join(u.names) or "<root>", "reshard" if u.reshard_after_forward else "keep",
             "replicate" if u.replicated else "shard", "host" if u.offload else "device", u.param_device,
             ", ".join(u.checkpointed) or "-", f"{u.numel:,}") for u in inspect_units(module)]
    return format_table(rows, ("modules", "after forward", "layout", "state on", "param device", "checkpointed",
                               "params"))
