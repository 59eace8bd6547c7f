"""Configuration of the embedding cache: :class:`CacheConfig` and the fused :class:`RowOptimizer`.

Both are frozen, keyword-only dataclasses validated on construction, so a bad value fails where it is
written, not three calls later inside a training step.
"""

from __future__ import annotations

from dataclasses import dataclass

from tightfit.checks import check_number
from tightfit.planner.optimizers import row_state_columns
from tightfit.units import parse_bytes

__all__ = ["POLICIES", "OPTIMIZERS", "CacheConfig", "RowOptimizer"]

POLICIES = ("lfu", "lru", "static")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


@dataclass(frozen=True, kw_only=True, slots=True)
class RowOptimizer:
    """A fused row-wise optimizer whose state belongs to each row (and moves with it).

    The update is applied inside the backward pass to the rows the batch touched, like FBGEMM's
    fused TBE optimizers; rows a batch did not touch are left exactly as they are, which is what
    ``torch.optim.SGD`` / ``Adagrad`` / ``torchrec.optim.RowWiseAdagrad`` do with their zero
    gradients and what ``torch.optim.SparseAdam`` does for Adam.

    Args:
        kind: ``"sgd"``, ``"adagrad"`` (one accumulator per element, as ``torch.optim.Adagrad``),
            ``"rowwise_adagrad"`` (one accumulator per row: mean of the squared gradient, as
            ``torchrec.optim.RowWiseAdagrad``; 1 float of state per row instead of ``dim``) or
            ``"adam"`` (lazy Adam, as ``torch.optim.SparseAdam``).
        lr: learning rate.
        eps: added to the denominator (Adagrad, Adam).
        beta1: Adam's first-moment decay.
        beta2: Adam's second-moment decay.
        initial_accumulator_value: Adagrad's starting accumulator (``torch.optim.Adagrad``'s argument).

    Example:
        >>> RowOptimizer(kind="adam", lr=1e-3).state_columns(16)
        32
    """

    kind: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-10
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"RowOptimizer kind {self.kind!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
        for name in ("lr", "eps", "beta1", "beta2", "initial_accumulator_value"):  # NaN and inf: no update is right
            check_number(getattr(self, name), name, where="RowOptimizer", fix="give a finite number, e.g. lr=0.01")
        if not self.lr > 0:
            raise ValueError(f"RowOptimizer lr={self.lr} must be > 0 (e.g. 0.01)")
        if not self.eps >= 0:
            raise ValueError(f"RowOptimizer eps={self.eps} must be >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"RowOptimizer {name}={value} must be in [0, 1) (e.g. 0.9)")
        if self.initial_accumulator_value < 0:
            raise ValueError(f"RowOptimizer initial_accumulator_value={self.initial_accumulator_value} must be >= 0")

    def state_columns(self, dim: int) -> int:
        """Floats of optimizer state stored beside each row of width ``dim``."""
        return row_state_columns(self.kind, dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    """How much of each table lives on the device, and which rows.

    Args:
        capacity: the cache size. A float in (0, 1] is a ratio of the collection's rows (``0.015`` keeps
            1.5% of all its rows on the device), split across tables by
            :func:`tightfit.planner.cache.split_slots`: by frequency when statistics are given, else by
            size, a small table whose rows all fit staying wholly on the device; an int >= 1 is a row
            count per table; a string such as ``"64MiB"`` is a byte budget for the whole collection
            (weights, optimizer state, index and frequency sketch), split across tables by
            :func:`tightfit.planner.cache.plan_cache` (hottest rows first with statistics, by table size
            otherwise). The index is set-associative and sized by the cache: no device memory per table row.
        policy: which cached row leaves when a new one needs its slot (each row has one set of 32
            slots). ``"lfu"``: the row used least (a count-min sketch sized by the cache remembers the
            counts of rows that left, seeded with the dataset counts when given; counts age slowly, and
            drop at once when a batch's hit rate falls well below its recent level, i.e. the hot set
            moved), and a miss is admitted only if it
            is used more than the row it would evict (TinyLFU's admission); ``"lru"``: the row used
            longest ago; ``"static"``: the row with the lowest dataset frequency (needs statistics).
        warmup: fill the cache with the hottest rows from the frequency statistics at construction.
        prefetch: how many batches ahead :func:`torchrec_cache.prefetching` looks (0: off). It loads
            the next batch's rows on a background thread and pins the cached rows of every batch in
            the window until it has run (lookahead eviction).
        pin_memory: pin the host tables so host-to-device copies are asynchronous. ``None``: pin when
            the cache is on a CUDA device (pinning on a CPU-only machine buys nothing).
        reorder: store each table's rows in host memory by descending frequency (needs statistics),
            so hot rows are contiguous; the weights are permuted with the ids, and ``state_dict``
            still reads and writes them in id order.
        optimizer: a fused :class:`RowOptimizer` applied in the backward pass; ``None`` keeps plain
            autograd: the host table is a ``Parameter`` that receives a sparse gradient for any
            torch optimizer that accepts sparse gradients (SGD, Adagrad, SparseAdam).
        disk_dir: a directory on a local SSD for the full tables (rows and optimizer state, through
            :class:`tightfit.storage.TensorStore`); host memory then holds a second cache level of rows
            (:mod:`torchrec_cache.hostlevel`). Needs a fused ``optimizer``; not with ``reorder``.
        host_budget: host bytes for that second level (``"2GiB"`` or an int; ``None`` with a ``disk_dir``:
            none, every device miss reads the disk). Sized per table by
            :func:`tightfit.planner.cache.plan_cache` with the disk's profile.

    Example:
        >>> CacheConfig(capacity=0.015, policy="lfu").capacity_kind()
        'ratio'
    """

    capacity: float | int | str = 0.015
    policy: str = "lfu"
    warmup: bool = True
    prefetch: int = 0
    pin_memory: bool | None = None
    reorder: bool = False
    optimizer: RowOptimizer | None = None
    disk_dir: str | None = None
    host_budget: str | int | None = None

    def __post_init__(self) -> None:
        kind = self.capacity_kind()  # validates
        self._check_disk()
        if kind == "bytes" and parse_bytes(self.capacity) <= 0:  # type: ignore[arg-type]
            raise ValueError(f"CacheConfig capacity={self.capacity!r} is an empty byte budget; give e.g. '64MiB'")
        if self.policy not in POLICIES:
            raise ValueError(f"CacheConfig policy {self.policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ValueError(f"CacheConfig prefetch={self.prefetch!r} must be an int >= 0 (batches ahead)")
        if self.optimizer is not None and not isinstance(self.optimizer, RowOptimizer):
            raise ValueError(
                f"CacheConfig optimizer={self.optimizer!r} must be a RowOptimizer (or None for plain autograd)"
            )

    def _check_disk(self) -> None:
        if self.host_budget is not None:
            if isinstance(self.host_budget, bool) or not isinstance(self.host_budget, (int, str)):
                raise ValueError(f"CacheConfig host_budget={self.host_budget!r} must be bytes: an int or a string "
                                 "such as '2GiB'")
            if (parse_bytes(self.host_budget) if isinstance(self.host_budget, str) else self.host_budget) < 0:
                raise ValueError(f"CacheConfig host_budget={self.host_budget!r} must be >= 0 bytes; give e.g. '2GiB'")
            if self.disk_dir is None:
                raise ValueError(f"CacheConfig host_budget={self.host_budget!r} needs disk_dir: without a disk the "
                                 "full tables are in host memory; give disk_dir='/nvme/cache' or drop host_budget")
        if self.disk_dir is None:
            return
        if not isinstance(self.disk_dir, str) or not self.disk_dir:
            raise ValueError(f"CacheConfig disk_dir={self.disk_dir!r} must be a directory path (a str)")
        if self.optimizer is None:
            raise ValueError("CacheConfig disk_dir needs a fused optimizer: rows on disk are updated where they "
                             "live; give optimizer=RowOptimizer(kind='adagrad', lr=...)")
        if self.reorder:
            raise ValueError("CacheConfig disk_dir with reorder=True is not supported (rows on disk stay in id "
                             "order); drop reorder")

    def host_budget_bytes(self) -> int:
        """The host level's budget in bytes (0 when none is given)."""
        b = self.host_budget
        return 0 if b is None else parse_bytes(b) if isinstance(b, str) else int(b)

    def capacity_kind(self) -> str:
        """``"ratio"``, ``"rows"`` or ``"bytes"``; raises on a value that is none of them."""
        c = self.capacity
        if isinstance(c, bool):
            raise ValueError(f"CacheConfig capacity={c!r} is a bool; give a ratio (0.015), rows (4096) or bytes ('64MiB')")
        if isinstance(c, float):
            if not 0.0 < c <= 1.0:
                raise ValueError(
                    f"CacheConfig capacity={c} is a ratio outside (0, 1]; give e.g. 0.015 for 1.5% of the rows, "
                    "an int for a row count, or a string like '64MiB' for a byte budget"
                )
            return "ratio"
        if isinstance(c, int):
            if c < 1:
                raise ValueError(f"CacheConfig capacity={c} rows must be >= 1")
            return "rows"
        if isinstance(c, str):
            parse_bytes(c)  # raises with the accepted units
            return "bytes"
        raise ValueError(f"CacheConfig capacity={c!r} must be a float ratio, an int row count or a byte string")

    def needs_frequencies(self) -> bool:
        return self.policy == "static" or self.reorder
