"""The profile types every planner and plugin consumes. Stable: extend, never rename.

Data flow (docs/architecture.md): ``profile_model`` -> :class:`ModelProfile`,
``profile_device`` -> :class:`DeviceProfile`, several devices (measured or from datasheet presets)
-> :class:`ClusterSpec`; planners are pure functions of these.

Vocabulary: a *block* is a module that can become one FSDP2 unit, one checkpointed region or one
pipeline layer (a transformer layer, an embedding, a head). A model's blocks cover every parameter
exactly once and are listed in first-use order, so contiguous runs of blocks are valid units/stages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tightfit.checks import check_number
from tightfit.serde import dump_json, load_json

if TYPE_CHECKING:
    from tightfit.profiler.memory import PeakEstimate

__all__ = [
    "DTYPE_BYTES",
    "ProfileError",
    "ParamInfo",
    "BlockProfile",
    "MemoryEvent",
    "ModelProfile",
    "DiskProfile",
    "DeviceProfile",
    "ClusterSpec",
]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1,
               "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
"""Bytes per element of each dtype, by its ``torch`` name without the ``torch.`` prefix."""


class ProfileError(ValueError):
    """A device profile or cluster description holds a number no planner can use (NaN, negative, zero rate)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamInfo:
    """One parameter tensor (tied parameters appear once, under their first name).

    Args:
        name: fully-qualified name where it is first registered (``"transformer.wte.weight"``).
        shape: tensor shape.
        dtype: torch dtype name without the ``torch.`` prefix (``"float32"``).
        numel: number of elements.
        bytes: ``numel * element size``.
        block: name of the block that owns it (see :class:`BlockProfile`).
        aliases: other names of the same tensor (tied weights, e.g. ``("lm_head.weight",)``).
        requires_grad: whether it is trained.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    bytes: int
    block: str
    aliases: tuple[str, ...] = ()
    requires_grad: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockProfile:
    """One block: a candidate FSDP2 unit, checkpoint region or pipeline layer.

    Args:
        name: module FQN (``"layers.3"``); ``""`` is the root module's own leftover parameters.
        type: module class name.
        index: position in first-use order (0-based).
        params: names of the parameters it owns, in first-use order.
        param_numel: elements of those parameters.
        param_bytes: bytes of those parameters at their profiled dtype.
        fwd_flops: forward FLOPs for the profiled batch.
        bwd_flops: backward FLOPs for the profiled batch (about 2x forward for matmuls).
        saved_bytes: activation bytes allocated by this block's forward and still alive when the
            forward ends (kept for its backward, plus its output) when it is not checkpointed.
        checkpoint_bytes: what remains of those when the block is checkpointed: its output, which
            the next block keeps (a checkpointed block keeps its input, but that input is the
            previous block's output and is counted there, so sums over blocks never count it twice).
        transient_bytes: backward: the peak while this block's backward runs, above everything
            saved by it and by the blocks before it (gradients of activations, temporaries).
        output_bytes: bytes of its output (what a pipeline stage boundary sends after it).
        checkpointable: whether activation checkpointing applies (has a pure forward).
        fwd_transient_bytes: forward: the peak while its forward runs above the level at its start,
            minus ``saved_bytes`` (temporaries freed before the forward ends).
        loss_transient_bytes: backward, the block the loss is folded into (the last): the peak while the
            loss's own backward runs (the ops after this block's forward, e.g. a cross-entropy's), above
            everything saved by it and the blocks before it; ``transient_bytes`` is then the rest of its
            backward. The loss's backward runs before any of this block's nodes, so before a sharded runtime
            gathers the block's parameters or allocates its gradients. 0: no loss folded in, or not measured apart
            (profiles from before: ``transient_bytes`` covers both).
        fwd_s: measured seconds of its forward on the profiled micro-batch
            (:func:`tightfit.profiler.time_blocks`); 0.0 = not measured (planners then use FLOPs / matmul rate).
        bwd_s: measured seconds of its backward, as ``fwd_s``.
        recompute_s: measured seconds of its re-run forward under checkpointing, as ``fwd_s``.

    The step model that combines these is in :func:`tightfit.profiler.memory.estimate_peak`.
    """

    name: str
    type: str
    index: int
    params: tuple[str, ...]
    param_numel: int
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    saved_bytes: int
    checkpoint_bytes: int
    transient_bytes: int
    output_bytes: int
    checkpointable: bool = True
    fwd_transient_bytes: int = 0
    loss_transient_bytes: int = 0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: float = 0.0

    @property
    def backward_transient_bytes(self) -> int:
        """The peak above everything saved while its whole backward runs, the loss's part included."""
        return max(self.transient_bytes, self.loss_transient_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEvent:
    """One point of the activation-memory timeline of a step.

    Args:
        phase: ``"forward"``, ``"backward"`` or ``"optimizer"``.
        block: the block running.
        bytes: activation (and gradient-of-activation) bytes live at this point, parameters excluded.
    """

    phase: str
    block: str
    bytes: int


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What planners know about a model, measured on the meta device.

    Args:
        model: a name for the model (class name or preset).
        step: ``"train"`` (forward + backward) or ``"forward"``.
        inputs: description of the example inputs (``{"input_ids": [8, 1024]}``).
        params: every parameter, tied ones once.
        blocks: blocks in first-use order, covering every parameter exactly once.
        forward_order: parameter names in the order forward first uses them.
        backward_order: parameter names in the order backward produces their gradients.
        timeline: activation-memory timeline of one step.
        activation_peak_bytes: peak of the timeline (no checkpointing).
        peak_bytes: peak of a whole training step without optimizer state: parameters + gradients
            + activations at the peak.
        fwd_flops: total forward FLOPs.
        bwd_flops: total backward FLOPs.
        param_dtype: dtype the parameters were profiled in.
        notes: anything the profiler wants the reader to know (fallbacks used, unsupported ops).
        device: device type the step was traced for (``"cpu"``, ``"cuda"``): kernels, and so saved
            activations, depend on it (e.g. which fused attention runs).
        checkpointed: blocks the ``checkpointed_*`` numbers assume recomputed (``profile_model(checkpointing=...)``).
        checkpointed_activation_peak_bytes: ``activation_peak_bytes`` with those blocks checkpointed (0 when none
            were asked for); any other set: :meth:`estimate_peak`.
        checkpointed_peak_bytes: ``peak_bytes`` with those blocks checkpointed, as above.
    """

    model: str
    step: Literal["train", "forward"]
    inputs: dict[str, list[int]]
    params: tuple[ParamInfo, ...]
    blocks: tuple[BlockProfile, ...]
    forward_order: tuple[str, ...]
    backward_order: tuple[str, ...]
    timeline: tuple[MemoryEvent, ...]
    activation_peak_bytes: int
    peak_bytes: int
    fwd_flops: float
    bwd_flops: float
    param_dtype: str = "float32"
    notes: tuple[str, ...] = ()
    device: str = "cpu"
    checkpointed: tuple[str, ...] = ()
    checkpointed_activation_peak_bytes: int = 0
    checkpointed_peak_bytes: int = 0

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.params)

    @property
    def timed(self) -> bool:
        """Whether every block with a forward carries measured seconds (:func:`tightfit.profiler.time_blocks`)."""
        return bool(self.blocks) and any(b.fwd_s > 0 for b in self.blocks) and all(
            b.fwd_s > 0 or (b.fwd_flops == 0 and b.bwd_flops == 0) for b in self.blocks)

    def block(self, name: str) -> BlockProfile:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no block named {name!r}; blocks: {', '.join(b.name for b in self.blocks)}")

    def estimate_peak(self, checkpointed: Iterable[str] | str | None = None) -> PeakEstimate:
        """Step peak with ``checkpointed`` blocks recomputed (``"all"`` for every block); pure arithmetic."""
        from tightfit.profiler.memory import estimate_peak

        return estimate_peak(self, checkpointed)

    def optimizer_state_bytes(self, optimizer: str = "adamw", *, precision: str = "fp32", momentum: float = 0.0,
                              amsgrad: bool = False) -> int:
        """Optimizer state for the trainable parameters; see :func:`tightfit.profiler.memory.optimizer_state_bytes`."""
        from tightfit.profiler.memory import optimizer_state_bytes

        return optimizer_state_bytes(self, optimizer, precision=precision, momentum=momentum, amsgrad=amsgrad)

    def summary(self, *, max_blocks: int = 12) -> str:
        """A printable report: totals, then one row per block (long runs of blocks are elided)."""
        from tightfit.units import format_bytes, format_table

        inputs = ", ".join(f"{k}{list(v)}" for k, v in self.inputs.items())
        adam = self.optimizer_state_bytes("adamw")
        lines = [
            f"{self.model}: {self.param_numel / 1e6:,.1f} M parameters ({format_bytes(self.param_bytes)} "
            f"{self.param_dtype}), {len(self.blocks)} blocks, step={self.step}, inputs {inputs}, device={self.device}",
            f"FLOPs per step: forward {self.fwd_flops:.3e}, backward {self.bwd_flops:.3e}",
            f"activation peak {format_bytes(self.activation_peak_bytes)}; step peak (params + grads + activations) "
            f"{format_bytes(self.peak_bytes)}; AdamW state {format_bytes(adam)} (fp32)",
        ]
        if self.checkpointed:
            lines.append(f"with {len(self.checkpointed)} blocks checkpointed: activation peak "
                         f"{format_bytes(self.checkpointed_activation_peak_bytes)}, step peak "
                         f"{format_bytes(self.checkpointed_peak_bytes)}")
        shown: list[BlockProfile | None] = list(self.blocks)
        if len(shown) > max_blocks:
            head = max_blocks // 2
            shown = shown[:head] + [None] + shown[-(max_blocks - head):]
        rows = []
        for b in shown:
            if b is None:
                rows.append(("...", "", "", "", "", "", ""))
                continue
            rows.append((b.name or "<root>", b.type, format_bytes(b.param_bytes), f"{b.fwd_flops:.2e}",
                         format_bytes(b.saved_bytes), format_bytes(b.checkpoint_bytes),
                         format_bytes(b.backward_transient_bytes)))
        lines.append(format_table(rows, ("block", "type", "params", "fwd FLOPs", "saved", "if ckpt", "bwd extra"),
                                  align="llrrrrr"))
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> ModelProfile:
        return load_json(cls, source)


@dataclass(frozen=True, kw_only=True)
class DiskProfile:
    """The disk tier: a local directory (NVMe/SSD), its free space and its measured read and write speed.

    A transfer of ``n`` bytes is priced ``latency + n / bandwidth`` from the fits (the collectives' α–β
    model), with requests of ``request_bytes`` kept ``queue_depth`` deep, as :mod:`tightfit.storage` issues them.

    Args:
        path: the directory the tier lives in (absolute).
        free_bytes: bytes free there when measured (what the disk budget defaults to).
        total_bytes: size of the filesystem.
        filesystem: its type (``"ext4"``, ``"xfs"``, ``"tmpfs"``...); ``""`` when unknown.
        read_fit: ``[latency_s, bytes_per_s]`` of sequential reads at ``request_bytes`` and ``queue_depth``.
        write_fit: the same for writes (buffered writes included in the time only once flushed to the device).
        read_bytes_per_s: measured read bandwidth by request size then queue depth (``{4194304: {4: 1.2e9}}``).
        write_bytes_per_s: likewise for writes.
        request_bytes: the request size the store uses (the smallest measured size within 5% of the best).
        queue_depth: requests the store keeps in flight.
        direct: whether the store opens files with ``O_DIRECT`` (where that measured faster than buffered I/O).
        source: ``"measured"`` or ``"datasheet:<preset>"``.
        key: cache key (device and filesystem of the path).
        compute_overlap: measured fraction of disk I/O hidden behind compute running at the same time (1.0: free,
            0.0: serialised with it); negative = not measured (full overlap assumed, as ``comm_overlap``).
        random_read_bytes_per_s: bandwidth of scattered reads by request size (``{4096: 2.1e8}``: a missed row's
            4 KiB block, a few rows' blocks), many requests in flight as a cache's batch of misses has them; empty
            = not measured (:meth:`random_read_seconds` then uses the sequential fit).
    """

    path: str
    free_bytes: int
    total_bytes: int = 0
    filesystem: str = ""
    read_fit: tuple[float, float] = (0.0, 1.0e9)
    write_fit: tuple[float, float] = (0.0, 1.0e9)
    read_bytes_per_s: dict[int, dict[int, float]] = field(default_factory=dict)
    write_bytes_per_s: dict[int, dict[int, float]] = field(default_factory=dict)
    request_bytes: int = 4 * 2**20
    queue_depth: int = 4
    direct: bool = True
    source: str = "measured"
    key: str = ""
    compute_overlap: float = -1.0
    random_read_bytes_per_s: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"disk profile {self.path!r}"
        fix = "re-measure with tightfit.profiler.profile_disk(path, refresh=True) or use a disk preset"
        for name in ("free_bytes", "total_bytes"):
            check_number(getattr(self, name), name, where=where, integer=True, low=0, error=ProfileError,
                         fix="give bytes (0 where unknown)")
        for name in ("request_bytes", "queue_depth"):
            check_number(getattr(self, name), name, where=where, integer=True, low=1, error=ProfileError, fix=fix)
        for name in ("read_fit", "write_fit"):
            fit = tuple(getattr(self, name))
            if len(fit) != 2:
                raise ProfileError(f"{where}: {name}={fit!r} must be [latency_s, bytes_per_s]; {fix}")
            check_number(fit[0], f"{name}[0] (latency)", where=where, low=0, error=ProfileError, fix=fix)
            check_number(fit[1], f"{name}[1] (bandwidth)", where=where, low=0, low_open=True, error=ProfileError,
                         fix=fix)
        for table in ("read_bytes_per_s", "write_bytes_per_s"):
            for size, per_depth in getattr(self, table).items():
                for depth, rate in per_depth.items():
                    check_number(rate, f"{table}[{size}][{depth}]", where=where, low=0, low_open=True,
                                 error=ProfileError, fix=f"leave unmeasured entries out; {fix}")
        for size, rate in self.random_read_bytes_per_s.items():
            check_number(size, "random_read_bytes_per_s size", where=where, integer=True, low=1, error=ProfileError,
                         fix=fix)
            check_number(rate, f"random_read_bytes_per_s[{size}]", where=where, low=0, low_open=True,
                         error=ProfileError, fix=f"leave unmeasured entries out; {fix}")
        if not self.compute_overlap < 0:  # NaN must fail here, not read as "not measured"
            check_number(self.compute_overlap, "compute_overlap", where=where, low=0, high=1, error=ProfileError,
                         fix="give a fraction in [0, 1], or -1 for not measured")

    @property
    def in_memory(self) -> bool:
        """The directory is RAM (tmpfs, ramfs): it saves no memory, whatever it measures."""
        return self.filesystem in ("tmpfs", "ramfs")

    def read_seconds(self, nbytes: float) -> float:
        """Seconds to read ``nbytes`` sequentially (0 bytes: free)."""
        return self.read_fit[0] + nbytes / self.read_fit[1] if nbytes > 0 else 0.0

    def random_read_seconds(self, requests: float, size: int) -> float:
        """Seconds to read ``requests`` scattered requests of ``size`` bytes (one batch: no latency per request),
        at the measured random-read bandwidth of the smallest measured size >= ``size`` (the largest measured one
        beyond them), else at the sequential read bandwidth.

        >>> p = DiskProfile(path="/d", free_bytes=0, random_read_bytes_per_s={4096: 2e8, 16384: 5e8})
        >>> round(p.random_read_seconds(1000, 4096), 6), round(p.random_read_seconds(10, 8192), 6)
        (0.02048, 0.00016384)
        """
        if requests <= 0:
            return 0.0
        measured = sorted(self.random_read_bytes_per_s)
        if not measured:
            return requests * size / self.read_fit[1]
        at = next((m for m in measured if m >= size), measured[-1])
        return requests * size / self.random_read_bytes_per_s[at]

    def write_seconds(self, nbytes: float) -> float:
        """Seconds to write ``nbytes`` sequentially (0 bytes: free)."""
        return self.write_fit[0] + nbytes / self.write_fit[1] if nbytes > 0 else 0.0

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> DiskProfile:
        return load_json(cls, source)


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One device's measured (or datasheet) capabilities.

    Args:
        name: device name (``"NVIDIA H200"``, ``"cpu"``).
        kind: ``"cuda"`` or ``"cpu"``.
        memory_bytes: total memory of the device.
        free_bytes: free memory when measured.
        matmul_flops: sustained matmul rate by dtype name (``{"float32": 1.2e11}``), FLOP/s.
        h2d_bytes_per_s: host -> device copy bandwidth by host memory kind (``"pinned"``, ``"pageable"``); empty on CPU.
        d2h_bytes_per_s: device -> host, likewise.
        host_adam_elems_per_s: AdamW parameter elements updated per second on the host CPU.
        device_adam_elems_per_s: AdamW elements per second on the device itself.
        collective_bytes_per_s: bus bandwidth by collective (``"all_gather"``, ``"reduce_scatter"``)
            and message size in bytes; measured with a process group, empty otherwise.
        world_size: size of the group the collectives were measured in (1: none).
        host_memory_bytes: memory of the host the device hangs off.
        collective_fit: latency + bandwidth fit per collective and world size,
            ``{"all_gather": {2: [alpha_s, bus_bytes_per_s]}}``: ``t = alpha + S * (W-1)/W / busbw``
            (all-reduce: twice the bandwidth term); empty = not measured (the size table above is used).
        unit_overhead_s: seconds one FSDP2 unit adds to a step by mode (``"reshard"``, ``"keep"``,
            ``"replicate"``, ``"offload"``) as ``[forward, backward, optimizer]``: hooks, copy-in/out,
            DTensor dispatch in the optimizer, collectives' latency excluded; ``"<mode>/tensor"`` and
            ``"<mode>/byte"``: the same per parameter tensor and per unsharded parameter byte
            (:func:`tightfit.profiler.calibrate_device`); empty = not modelled.
        comm_overlap: measured fraction of a collective hidden behind compute running at the same
            time (1.0: free, 0.0: serialised with it); negative = not measured (full overlap assumed).
        unified_memory: host and device are the same memory (a CPU "device"): offload copies cost
            nothing; ``False`` for old profiles (a host memcpy rate is then assumed).
        source: ``"measured"`` or ``"datasheet:<preset>"`` (presets are marked as such).
        key: cache key (device name, driver, torch version).
        disk: the disk tier this rank may use (:func:`tightfit.profiler.profile_disk`); ``None``: no disk tier.
    """

    name: str
    kind: Literal["cuda", "cpu"]
    memory_bytes: int
    free_bytes: int
    matmul_flops: dict[str, float]
    h2d_bytes_per_s: dict[str, float] = field(default_factory=dict)
    d2h_bytes_per_s: dict[str, float] = field(default_factory=dict)
    host_adam_elems_per_s: float = 0.0
    device_adam_elems_per_s: float = 0.0
    collective_bytes_per_s: dict[str, dict[int, float]] = field(default_factory=dict)
    world_size: int = 1
    host_memory_bytes: int = 0
    source: str = "measured"
    key: str = ""
    collective_fit: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    unit_overhead_s: dict[str, list[float]] = field(default_factory=dict)
    comm_overlap: float = -1.0
    unified_memory: bool = False
    disk: DiskProfile | None = None

    @property
    def calibrated(self) -> bool:
        """Whether any measured calibration term (α–β fits, unit overhead, overlap) is present."""
        return bool(self.collective_fit or self.unit_overhead_s) or self.comm_overlap >= 0

    def __post_init__(self) -> None:
        # A NaN rate would price its work as free (x / NaN compares false everywhere) and a 0 rate
        # divides by zero; both must fail here, naming the field, not as a wrong plan later.
        where = f"device profile {self.name!r}"
        fix = "re-measure with tightfit.profiler.profile_device(refresh=True) or use a datasheet preset"
        if self.kind not in ("cuda", "cpu"):
            raise ProfileError(f"{where}: kind={self.kind!r} must be 'cuda' or 'cpu'")
        check_number(self.memory_bytes, "memory_bytes", where=where, integer=True, low=0, low_open=True,
                     error=ProfileError, fix="give the device's memory in bytes, e.g. 24 * 2**30")
        for name in ("free_bytes", "host_memory_bytes"):
            check_number(getattr(self, name), name, where=where, integer=True, low=0, error=ProfileError,
                         fix="give bytes (0 where unknown)")
        for name in ("host_adam_elems_per_s", "device_adam_elems_per_s"):
            check_number(getattr(self, name), name, where=where, low=0, error=ProfileError,
                         fix="give elements per second (0 = not measured: the planner then assumes a rate)")
        check_number(self.world_size, "world_size", where=where, integer=True, low=1, error=ProfileError,
                     fix="the size of the group collectives were measured in (1: none)")
        tables: list[tuple[str, dict[str, float]]] = [
            ("matmul_flops", self.matmul_flops), ("h2d_bytes_per_s", self.h2d_bytes_per_s),
            ("d2h_bytes_per_s", self.d2h_bytes_per_s)]
        for coll, per_size in self.collective_bytes_per_s.items():
            for size in per_size:
                check_number(size, f"collective_bytes_per_s[{coll!r}] message size", where=where, integer=True,
                             low=0, low_open=True, error=ProfileError, fix="sizes are message bytes > 0")
            tables.append((f"collective_bytes_per_s[{coll!r}]", {str(k): v for k, v in per_size.items()}))
        for table, values in tables:
            for k, v in values.items():
                check_number(v, f"{table}[{k!r}]", where=where, low=0, low_open=True, error=ProfileError,
                             fix=f"leave the entry out when it was not measured (the planner then assumes a rate), or {fix}")

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> DeviceProfile:
        return load_json(cls, source)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The devices a plan is for: one :class:`DeviceProfile` per rank (need not be this machine's).

    Args:
        devices: one profile per rank, in rank order.
        nodes: number of hosts the ranks span (host memory is per node).
        inter_node_bytes_per_s: bandwidth between nodes for collectives (0: single node).
    """

    devices: tuple[DeviceProfile, ...]
    nodes: int = 1
    inter_node_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.devices:
            raise ProfileError("ClusterSpec needs at least one device; e.g. ClusterSpec.uniform(profile, 4)")
        for i, d in enumerate(self.devices):
            if not isinstance(d, DeviceProfile):
                raise ProfileError(f"ClusterSpec: devices[{i}]={d!r} is not a DeviceProfile; build one with "
                                   "profile_device() or device_preset(name)")
        check_number(self.nodes, "nodes", where="ClusterSpec", integer=True, low=1, error=ProfileError,
                     fix="give the number of hosts the ranks span, e.g. 1")
        check_number(self.inter_node_bytes_per_s, "inter_node_bytes_per_s", where="ClusterSpec", low=0,
                     error=ProfileError, fix="give the bandwidth between nodes in bytes/s (0: single node)")
        if len(self.devices) % self.nodes:
            raise ProfileError(
                f"ClusterSpec: {len(self.devices)} devices cannot be split evenly over nodes={self.nodes}; "
                "give a node count that divides the device count"
            )

    @classmethod
    def uniform(cls, device: DeviceProfile, count: int, *, nodes: int = 1) -> ClusterSpec:
        check_number(count, "count", where="ClusterSpec.uniform", integer=True, low=1, error=ProfileError,
                     fix="give the number of ranks, e.g. 4")
        return cls(devices=(device,) * count, nodes=nodes)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self, path)

    @classmethod
    def from_json(cls, source: str | Path) -> ClusterSpec:
        return load_json(cls, source)
