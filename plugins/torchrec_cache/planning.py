"""How many device slots each table of a collection gets: the planner's split of a :class:`CacheConfig`.

A ratio is the collection's (split by frequency and size, small tables wholly resident), a row count is
per table, a byte budget goes to :func:`tightfit.planner.cache.plan_cache` (hottest rows across all
tables first). The result is the :class:`~torchrec_cache.layout.TableSpec` list a
:class:`~torchrec_cache.cache.FusedCache` is built from.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.modules.embedding_configs import DataType

from tightfit.memory_limit import read_memory
from tightfit.planner.cache import CacheTableSpec, plan_cache, split_slots
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.profiler.types import DiskProfile
from tightfit.storage import check_disk_dir, free_bytes
from tightfit.units import format_bytes, parse_bytes
from torchrec_cache.cache import SLOT_OVERHEAD_BYTES, FusedCache
from torchrec_cache.config import CacheConfig
from torchrec_cache.frequency import FrequencyStats
from torchrec_cache.layout import TableSpec
from torchrec_cache.tier import DiskSpec

__all__ = ["table_specs", "slot_split", "host_level_rows", "tier_profile", "fused_cache_for", "check_host_memory"]


def table_specs(tables: list[Any], cache: CacheConfig, frequencies: FrequencyStats | None) -> list[TableSpec]:
    """The cache's tables (TorchRec ``EmbeddingBagConfig`` / ``EmbeddingConfig``), each with its slots."""
    slots = slot_split(tables, cache, frequencies)
    return [TableSpec(name=c.name, rows=c.num_embeddings, dim=c.embedding_dim,
                      dtype=torch.float32 if c.data_type == DataType.FP32 else torch.float16,
                      capacity=slots[c.name]) for c in tables]


def _specs(tables: list[Any], cache: CacheConfig) -> list[CacheTableSpec]:
    state = cache.optimizer.state_columns if cache.optimizer else (lambda d: 0)
    return [CacheTableSpec(name=c.name, rows=c.num_embeddings, dim=c.embedding_dim,
                           weight_bytes=4 if c.data_type == DataType.FP32 else 2,
                           state_columns=state(c.embedding_dim),
                           index_bytes_per_slot=SLOT_OVERHEAD_BYTES)
            for c in tables]


def tier_profile(tables: list[Any], cache: CacheConfig) -> DiskProfile:
    """The disk of ``cache.disk_dir``, refused (one line: the directory, the rule, the fix) when it cannot hold
    the full tables; measured by :func:`tightfit.profiler.profile_disk` (cached per filesystem) when it has
    room for the measurement too, else its free space with the profile's defaults."""
    assert cache.disk_dir is not None
    need = sum(t.rows * t.row_bytes for t in _specs(tables, cache))
    d = check_disk_dir(cache.disk_dir, need_bytes=need)
    free, _ = free_bytes(d)
    if free >= need + 256 * 2**20:
        from tightfit.profiler import profile_disk  # the profiler imports more than the cache needs otherwise

        return profile_disk(d, quick=True, progress=False)
    return DiskProfile(path=str(d), free_bytes=free)


def host_level_rows(tables: list[Any], cache: CacheConfig, frequencies: FrequencyStats | None,
                    slots: dict[str, int], disk: DiskProfile) -> dict[str, int]:
    """Table name -> rows of the host cache level: :func:`~tightfit.planner.cache.plan_cache` with
    ``cache.host_budget`` and the disk profile, its device budget the bytes of the slots already split."""
    specs = _specs(tables, cache)
    device = sum(s.slot_bytes * slots[s.name] for s in specs)
    counts = frequencies.counts if frequencies is not None else None
    plan = plan_cache(specs, budget_bytes=device, frequencies=counts, index_bytes_per_row=0,
                      host_budget_bytes=cache.host_budget_bytes(), disk=disk)
    return dict(plan.host_rows)


def slot_split(tables: list[Any], cache: CacheConfig, frequencies: FrequencyStats | None) -> dict[str, int]:
    """Table name -> its device slots under ``cache.capacity``."""
    kind = cache.capacity_kind()
    specs = _specs(tables, cache)
    counts = frequencies.counts if frequencies is not None else None
    if kind == "ratio":
        # The ratio is the collection's: split by frequency and size, small tables wholly resident.
        total = max(len(tables), int(round(sum(c.num_embeddings for c in tables) * float(cache.capacity))))
        return split_slots(specs, total, frequencies=counts)
    if kind == "rows":
        return {c.name: min(int(cache.capacity), c.num_embeddings) for c in tables}
    # The index is hashed: no device bytes per table row.
    return plan_cache(specs, budget_bytes=parse_bytes(cache.capacity), frequencies=counts,
                      index_bytes_per_row=0).slots


def check_host_memory(tables: list[Any], cache: CacheConfig) -> None:
    """Refuse, in one line and before any row is allocated, host memory the process does not have: core's reading
    of memory (:mod:`tightfit.memory_limit`, the memory cgroup limit it runs under) against the full tables with
    their optimizer state (no ``disk_dir``: they live in host memory) or the host level's ``host_budget``."""
    reading = read_memory(settle=True)
    if not reading.capacity:
        return
    where = (f"the memory limit of {format_bytes(reading.capacity)} ({reading.limit_file}) leaves"
             if reading.limited else "this machine has")
    if cache.disk_dir is None:
        need = sum(t.rows * t.row_bytes for t in _specs(tables, cache))
        if need > reading.free:
            raise PlanInfeasibleError(
                f"the {len(tables)} tables with their optimizer state need {format_bytes(need)} of host memory but "
                f"{where} {format_bytes(reading.free)} free; give CacheConfig(disk_dir='/nvme/cache') so the full "
                "tables live on disk (a fused optimizer is needed there), or use smaller tables",
                needed_bytes=need, budget_bytes=reading.free, tier="host",
                suggestions=("give CacheConfig(disk_dir=...) on an NVMe/SSD drive",))
    elif cache.host_budget_bytes() > reading.free:
        raise PlanInfeasibleError(
            f"CacheConfig(host_budget={cache.host_budget!r}) asks for {format_bytes(cache.host_budget_bytes())} but "
            f"{where} {format_bytes(reading.free)} free; give at most that, or leave host_budget=None (no host level: "
            "every device miss reads the disk)", needed_bytes=cache.host_budget_bytes(), budget_bytes=reading.free,
            tier="host", suggestions=(f"host_budget={reading.free // 2} or None",))


def fused_cache_for(tables: list[Any], cache: CacheConfig, frequencies: FrequencyStats | None,
                    device: torch.device) -> FusedCache:
    """The collection's :class:`FusedCache`: slots split by :func:`table_specs`; with ``cache.disk_dir`` its disk
    tier, the host level sized by :func:`host_level_rows` with the disk's profile."""
    if torch.device(device).type != "meta":  # on meta nothing is allocated: a shape-only collection of any size
        check_host_memory(tables, cache)
    specs = table_specs(tables, cache, frequencies)
    if cache.disk_dir is None:
        return FusedCache(specs, policy=cache.policy, optimizer=cache.optimizer, device=device)
    profile = tier_profile(tables, cache)
    rows = host_level_rows(tables, cache, frequencies, {t.name: t.capacity for t in specs}, profile)
    return FusedCache(specs, policy=cache.policy, optimizer=cache.optimizer, device=device,
                      disk=DiskSpec(disk_dir=cache.disk_dir, host_rows=rows, profile=profile))
