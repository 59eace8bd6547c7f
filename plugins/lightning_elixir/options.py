"""``ElixirOptions``: the knobs both Elixir strategies (FSDP2 and DeepSpeed) take, validated once.

The strategies keep their keyword arguments (so ``LightningCLI`` and YAML configs see every option
by name, with types) and build one :class:`ElixirOptions` from them; everything after reads the
options object. How the knobs map onto the planner is decided here, once
(:meth:`ElixirOptions.planner_constraints`): ``offload="all"`` and ``activation_checkpointing=True``
become forced choices that core's search honours, so the plugin never re-prices a plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from tightfit.planner.elixir import ElixirConstraints, ElixirPlan
from tightfit.planner.optimizers import optimizer_spec
from tightfit.profiler.types import ClusterSpec, DeviceProfile
from tightfit.units import parse_bytes

__all__ = ["ElixirOptions", "OFFLOAD_CHOICES"]

OFFLOAD_CHOICES = ("auto", "none", "all")


@dataclass(frozen=True, kw_only=True, slots=True)
class ElixirOptions:
    """What an Elixir strategy plans with.

    Args:
        memory_budget: per-device memory the plan may use: bytes, ``"20GiB"``, a fraction of the
            device's memory (``0.8``) or ``None`` for all of it.
        plan: ``None`` (search at fit start), a plan file written by ``tightfit plan elixir --json``
            or an :class:`ElixirPlan`; a given plan is checked against the model and world size.
        offload: ``"auto"`` (the search decides per unit), ``"none"`` or ``"all"``.
        activation_checkpointing: ``"auto"`` (the search decides per block), ``True`` (every block) or ``False``.
        optimizer: the optimizer the plan prices (a name of :data:`tightfit.planner.optimizers.OPTIMIZERS`).
        cluster: the devices to plan for (a :class:`ClusterSpec` or the path of its JSON) instead of measuring.
        device_profile: this rank's device to plan for: a :class:`DeviceProfile`, a datasheet preset
            name (``"a100-80g"``) or the path of a profile's JSON.
        constraints: limits on the search (:class:`ElixirConstraints`).
        host_budget: host memory per rank the plan may keep state in: bytes, ``"4GiB"``, or ``None`` (what the
            host has: its memory x ``ElixirConstraints.host_memory_fraction`` / ranks per node).
        disk_dir: an existing, writable directory for the disk tier (each rank keeps its store in
            ``<disk_dir>/rank<r>``): offloaded units may keep their optimizer state there, priced from
            ``profile_disk(disk_dir)`` (measured once per filesystem, then cached). ``None``: no disk tier.
        verbose: print the plan table and what was applied (rank 0).
        replan: re-plan from the measured step when it is off the prediction by more than the tolerance,
            applied at the next checkpoint boundary (:mod:`lightning_elixir.replan`; FSDP2 strategy only).
        calibrate: price the plan from measurements of this hardware (default): time the first batch's
            blocks one at a time and fit the collectives and FSDP2's per-unit overheads, cached per device,
            block shapes, world size and precision so the next run starts without measuring. ``False``:
            FLOPs / rate. Only when planning for this machine (no plan, cluster or device profile given).
        owner: the strategy's name, used in error messages.

    Example:
        >>> ElixirOptions(memory_budget="6GiB", offload="all").planner_constraints().force_offload
        True
    """

    memory_budget: int | float | str | None = None
    plan: str | Path | ElixirPlan | None = None
    offload: str = "auto"
    activation_checkpointing: str | bool = "auto"
    optimizer: str = "adamw"
    cluster: ClusterSpec | str | Path | None = None
    device_profile: DeviceProfile | str | Path | None = None
    constraints: ElixirConstraints | None = None
    host_budget: int | str | None = None
    disk_dir: str | Path | None = None
    verbose: bool = True
    replan: bool = False
    calibrate: bool = True
    owner: str = field(default="ElixirOptions", compare=False, repr=False)

    def __post_init__(self) -> None:
        name = self.owner
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"{name}(offload={self.offload!r}): use one of {OFFLOAD_CHOICES}")
        if self.activation_checkpointing not in ("auto", True, False):
            raise ValueError(f"{name}(activation_checkpointing={self.activation_checkpointing!r}): use 'auto', "
                             "True or False")
        if not isinstance(self.replan, bool):
            raise ValueError(f"{name}(replan={self.replan!r}): use True or False")
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"{name}(calibrate={self.calibrate!r}): use True (measure this hardware, cached) or "
                             "False (price from FLOPs / rate)")
        if self.cluster is not None and self.device_profile is not None:
            raise ValueError(f"{name}: give cluster= or device_profile=, not both")
        if self.memory_budget is not None and not (isinstance(self.memory_budget, float) and 0 < self.memory_budget <= 1):
            try:
                parse_bytes(self.memory_budget)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}(memory_budget={self.memory_budget!r}): give bytes, a size such as "
                                 "'20GiB', a fraction in (0, 1] such as 0.8, or None") from exc
        try:
            optimizer_spec(self.optimizer)
        except ValueError as exc:
            raise ValueError(f"{name}(optimizer={self.optimizer!r}): {exc}") from None
        if self.host_budget is not None:
            try:
                if isinstance(self.host_budget, bool) or parse_bytes(self.host_budget) <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise ValueError(f"{name}(host_budget={self.host_budget!r}): give bytes > 0 (an int or a size such "
                                 "as '4GiB'), or None for what the host has free") from None
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, Path)) or not str(self.disk_dir):
                raise ValueError(f"{name}(disk_dir={self.disk_dir!r}): give the path of an existing, writable "
                                 "directory (str or Path), or None for no disk tier")
            from tightfit.storage import StorageError, check_disk_dir

            try:
                object.__setattr__(self, "disk_dir", check_disk_dir(self.disk_dir))
            except StorageError as exc:
                raise ValueError(f"{name}(disk_dir=...): {exc}") from None
        if self.constraints is not None and not isinstance(self.constraints, ElixirConstraints):
            raise ValueError(f"{name}(constraints={self.constraints!r}): give an ElixirConstraints")
        if self.replan and self.disk_dir is not None:
            raise ValueError(f"{name}(replan=True, disk_dir=...): re-planning does not move optimizer state between "
                             "the host and the disk yet; drop replan or disk_dir")
        if self.constraints is not None and self.constraints.force_disk and self.disk_dir is None:
            raise ValueError(f"{name}(constraints=ElixirConstraints(force_disk=True)) needs a disk tier: give "
                             "disk_dir='/path/on/nvme' or drop force_disk")
        # Files and preset names become objects here, so a bad path fails at construction, not at fit.
        if isinstance(self.cluster, (str, Path)):
            object.__setattr__(self, "cluster", ClusterSpec.from_json(self.cluster))
        if isinstance(self.device_profile, (str, Path)):
            object.__setattr__(self, "device_profile", _device(self.device_profile))

    @property
    def host_budget_bytes(self) -> int | None:
        """:attr:`host_budget` in bytes (``None``: what the host has)."""
        return None if self.host_budget is None else parse_bytes(self.host_budget)

    @property
    def measures_device(self) -> bool:
        """Whether planning needs this machine measured (no plan, cluster or device profile given)."""
        return self.plan is None and self.cluster is None and self.device_profile is None

    @property
    def calibrates(self) -> bool:
        """Whether planning times the blocks and calibrates this machine (``calibrate`` and nothing given)."""
        return self.calibrate and self.measures_device

    def planner_constraints(self) -> ElixirConstraints:
        """The constraints the search runs with: the user's, with ``offload`` / ``activation_checkpointing`` applied."""
        cons = self.constraints or ElixirConstraints()
        return dataclasses.replace(
            cons,
            allow_offload=cons.allow_offload and self.offload != "none",
            # No disk_dir, no disk tier: a given cluster's disk profiles are not a directory this run can use.
            allow_disk=cons.allow_disk and self.disk_dir is not None,
            force_offload=cons.force_offload or self.offload == "all",
            allow_checkpointing=cons.allow_checkpointing and self.activation_checkpointing is not False,
            force_checkpointing=cons.force_checkpointing or self.activation_checkpointing is True,
            # Re-planning keeps FSDP2 units, so an all-replicate plan runs on FSDP2, not DDP (strategy.setup).
            replicate_on_ddp=cons.replicate_on_ddp and not self.replan,
        )


def _device(source: str | Path) -> DeviceProfile:
    from tightfit.profiler.device import DATASHEETS, device_preset

    if str(source).lower() in DATASHEETS:
        return device_preset(str(source))
    if not Path(source).is_file():
        raise ValueError(f"device_profile={str(source)!r} is neither a datasheet preset ({', '.join(DATASHEETS)}) nor "
                         "a profile JSON file; write one with `tightfit profile device --json FILE`")
    return DeviceProfile.from_json(source)
