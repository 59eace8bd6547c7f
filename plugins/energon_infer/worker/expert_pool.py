"""Expert-level placement on a CPU: an MoE model's cold experts stay in the checkpoint, read when the router picks them.

A Mixture-of-Experts step touches a few experts per layer, and some far more often than others. So where the whole
model does not fit, the engine's serving plan (:mod:`energon_infer.engine.expert_plan`) asks core's expert planner
(:func:`tightfit.planner.experts.plan_experts`) where each expert lives: the dense parts of every layer (attention,
norms, router, shared expert) and the experts used most per byte stay in memory, the rest stay in the model
directory's safetensors files (``"disk"``). This module applies that plan to a loaded runner whose disk experts were
left on the meta device:

* each MoE layer gets the plan's cache slots (``ExpertPlan.slots``, one expert each), and core's
  :class:`~tightfit.policy.experts.ExpertCache` (the embedding cache's frequency sketch, TinyLFU admission) decides
  which of the layer's disk experts stay in them between steps;
* the layer's forward, once its router has chosen (``MoE.fetch_experts``), looks the step's disk experts up: a hit
  runs from its slot, a miss admitted takes a slot (the evicted expert's), a miss not admitted is read for this
  step only into the **arena** (one layer's disk experts at most, shared by every layer: layers run one at a time),
  so a step never runs an expert in more than one pass, whatever the batch. Reads run on ``io_threads`` threads, one
  expert each, straight from the files by byte range (:class:`~energon_infer.worker.disk_pool.DiskLayer`: the same
  assembly as loading, so an expert read holds exactly the loaded values);
* after the experts ran (``MoE.release_experts``) the arena's experts go back to their placeholders (views of one
  shared zero expert: a kernel handed all of a layer's experts reads real memory).

Every routed use is counted per tier (in memory, a cache hit, a read) with the bytes read, for the engine's metrics
(:meth:`ExpertPool.snapshot`), and the routing itself is counted into an
:class:`~tightfit.profiler.experts.ExpertPopularity` that the next plan can start from.
"""

from __future__ import annotations

import functools
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from energon_infer.loading.config import ModelConfig
from energon_infer.loading.safetensors_files import TensorFiles, direct_buffer_bytes
from energon_infer.loading.weights import hf_parts
from energon_infer.parallel import Grid
from energon_infer.worker.disk_pool import DiskLayer, _Scratch
from tightfit.planner.experts import ExpertPlan
from tightfit.policy.experts import ExpertCache, belady_hits
from tightfit.profiler.experts import ExpertPopularity
from tightfit.profiler.types import ProfileError

__all__ = ["ExpertPool", "expert_names", "expert_read_buffer_bytes", "moe_layers"]

# Slot ids of an expert's bound views (SlotLayer.slot_views caches them per id): a cache slot is (layer << 20) + slot,
# the arena's j-th place -1 - j, the shared zero expert this one.
_ZEROS = -(1 << 40)

#: Lookups per layer the pool keeps for its Belady yardstick (a window: older ones are dropped).
TRACE_STEPS = 1 << 14


def moe_layers(stage: nn.Module) -> list[tuple[str, Any]]:
    """``(layer number, its MoE module)`` of the stage's MoE layers, in execution order."""
    blocks = cast(nn.ModuleDict, stage.layers)
    return [(idx, block.moe) for idx, block in blocks.items() if getattr(block, "moe", None) is not None]


def expert_names(stage: nn.Module, plan: ExpertPlan) -> list[str]:
    """The stage's module names of the experts ``plan`` puts on disk (left unloaded: ``ModelRunner(offload=...)``)."""
    return [f"layers.{idx}.moe.experts.{e}" for (idx, _), tiers in zip(moe_layers(stage), plan.placement)
            for e, tier in enumerate(tiers) if tier == "disk"]


def expert_read_buffer_bytes(stage: nn.Module, cfg: ModelConfig, files: TensorFiles) -> int:
    """One I/O thread's read buffer: the largest checkpoint tensor an expert reads (with ``O_DIRECT``'s slack);
    ``-1`` where an expert is transformed out of a whole tensor it cannot read a part of (an expert of a fused tensor
    reads only its own rows, ``Part.rows``: gpt-oss's)."""
    keys, largest = set(files.keys()), 0
    for idx, moe in moe_layers(stage):
        for e, expert in moe.experts.items():
            for name, _ in expert.named_parameters():
                for part in hf_parts(cfg, f"layers.{idx}.moe.experts.{e}.{name}", keys):
                    if (part.transform is not None and part.rows is None) or part.source not in files.extents:
                        return -1
                    ext = files.extents[part.source]
                    largest = max(largest, ext.nbytes if part.rows is None else
                                  (part.rows[1] - part.rows[0]) * ext.row_bytes)
    return direct_buffer_bytes(largest) if largest else 0


class ExpertPool:
    """Apply an :class:`ExpertPlan` to a loaded stage (see the module docstring).

    Args:
        stage: the runner's stage, its disk experts on the meta device.
        cfg / grid: the model and this rank's place.
        plan: the expert placement (its ``placement`` lists the stage's MoE layers in order).
        files: the checkpoint's tensors by byte range.
        io_threads: experts read at once.
        nonfinite: the first read of each expert checks its values as loading does.
    """

    def __init__(self, stage: nn.Module, cfg: ModelConfig, grid: Grid, plan: ExpertPlan, files: TensorFiles, *,
                 io_threads: int = 2, nonfinite: str = "warn"):
        layers = moe_layers(stage)
        if len(layers) != len(plan.placement):
            raise ValueError(f"the expert plan places {len(plan.placement)} MoE layers; this stage has {len(layers)}")
        self.plan, self.files = plan, files
        scratch = _Scratch(expert_read_buffer_bytes(stage, cfg, files))
        self.units: list[dict[int, DiskLayer]] = []
        for li, (idx, moe) in enumerate(layers):
            experts = cast(nn.ModuleDict, moe.experts)
            units = {e: DiskLayer(experts[str(e)], int(idx), files, cfg, grid, scratch, nonfinite=nonfinite,
                                  prefix=f"layers.{idx}.moe.experts.{e}.")
                     for e, tier in enumerate(plan.placement[li]) if tier == "disk"}
            self.units.append(units)
            setattr(moe, "fetch_experts", functools.partial(self._fetch, li))  # noqa: B010 (nn.Module's typing)
            setattr(moe, "release_experts", functools.partial(self._release, li))  # noqa: B010
        numel = max((u.numel for units in self.units for u in units.values()), default=0)
        dtype = next((u.dtype for units in self.units for u in units.values()), torch.float32)
        self.expert_numel = numel
        # The cache's slots, per layer, and the arena the step's other disk experts are read into.
        self.slots = [[torch.empty(numel, dtype=dtype) for _ in range(plan.slots[li] if units else 0)]
                      for li, units in enumerate(self.units)]
        self.arena = torch.empty(numel * max((len(u) for u in self.units), default=0), dtype=dtype)
        # Between uses a disk expert's parameters are views of one shared zero expert, not meta tensors: a kernel
        # handed every expert of a layer (its first-use check runs them all) reads real, harmless memory.
        self._zeros = torch.zeros(numel, dtype=dtype)
        for units in self.units:
            for unit in units.values():
                unit.placeholders = unit.slot_views(_ZEROS, self._zeros)
                unit.unbind()
        self.cache = ExpertCache(num_layers=len(layers), num_experts=cfg.n_experts,
                                 slots=[len(s) for s in self.slots])
        self.popularity = ExpertPopularity(num_layers=len(layers), num_experts=cfg.n_experts,
                                           experts_per_token=cfg.experts_per_token, model=cfg.model_type)
        self._slot_of: list[dict[int, int]] = [{} for _ in layers]
        # Each layer's lookups of disk experts, the last TRACE_STEPS of them: the offline optimum at the same slots
        # (belady_hits) is the cache's yardstick in the snapshot.
        self.trace: list[deque[tuple[int, ...]]] = [deque(maxlen=TRACE_STEPS) for _ in layers]
        self._streamed: list[list[int]] = [[] for _ in layers]
        self._reader = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="energon-expert-read",
                                          initializer=torch.set_num_threads, initargs=(1,))
        self.in_memory_uses = self.bytes_read = self.reads = 0

    @property
    def held_bytes(self) -> int:
        """The slots' and the arena's bytes."""
        each = self.arena.element_size()
        return sum(s.numel() for slots in self.slots for s in slots) * each + self.arena.numel() * each

    def _fill(self, unit: DiskLayer, dst: torch.Tensor, slot_id: int) -> None:
        unit.fill(dst)
        unit.bind(slot_id, dst)

    def _fetch(self, li: int, chosen: torch.Tensor) -> None:
        """Make every expert ``chosen`` (the router's picks, any shape) names usable for this step of layer ``li``."""
        used = sorted(set(chosen.reshape(-1).tolist()))
        self.popularity.add(li, chosen.reshape(-1).tolist())
        units = self.units[li]
        disk = [e for e in used if e in units]
        self.in_memory_uses += len(used) - len(disk)
        if not disk:
            return
        step = self.cache.lookup(li, disk)
        self.trace[li].append(tuple(disk))
        free: list[int] = []
        for e in step.evicted:
            units[e].unbind()
            free.append(self._slot_of[li].pop(e))
        taken = set(self._slot_of[li].values())
        free += [i for i in range(len(self.slots[li])) if i not in taken and i not in free]
        jobs: list[tuple[DiskLayer, torch.Tensor, int]] = []
        for e in step.loads:
            slot = free.pop(0)
            self._slot_of[li][e] = slot
            jobs.append((units[e], self.slots[li][slot][: units[e].numel], (li << 20) + slot))
        for j, e in enumerate(step.streamed):
            at = j * self.expert_numel
            jobs.append((units[e], self.arena[at: at + units[e].numel], -1 - j))
        self._streamed[li] = list(step.streamed)
        before = sum(u.bytes_read for u, _, _ in jobs)
        for done in [self._reader.submit(self._fill, *job) for job in jobs]:
            done.result()
        self.reads += len(jobs)
        self.bytes_read += sum(u.bytes_read for u, _, _ in jobs) - before

    def _release(self, li: int) -> None:
        for e in self._streamed[li]:
            self.units[li][e].unbind()
        self._streamed[li] = []

    def snapshot(self) -> dict[str, Any]:
        """Uses per tier since the start, the cache's hit rate, bytes read, and ``expert_belady_hits``: the hits the
        offline optimum (Belady's, reading on demand) gets with the same slots on the same lookups (the last
        :data:`TRACE_STEPS` per layer; the cache's own hits are counted since the start)."""
        stats = self.cache.stats()
        uses = self.in_memory_uses + stats.uses
        belady = sum(belady_hits(t, len(s)) for t, s in zip(self.trace, self.slots))
        return {"expert_uses": uses, "expert_uses_in_memory": self.in_memory_uses, "expert_cache_hits": stats.hits,
                "expert_reads": self.reads, "expert_loads": stats.loads, "expert_streamed": stats.streamed,
                "expert_cache_hit_rate": stats.hit_rate, "expert_belady_hits": belady,
                "expert_hit_rate": (self.in_memory_uses + stats.hits) / uses if uses else 0.0,
                "expert_bytes_read": self.bytes_read, "experts_on_disk": sum(len(u) for u in self.units),
                "expert_slots": sum(len(s) for s in self.slots)}

    def save_popularity(self, model_dir: str | Path) -> Path | None:
        """Add this pool's routing counts to the popularity profile beside the model (``ExpertPopularity.save``,
        atomic), so the next plan starts from what serving saw; a profile of another shape is replaced. Where the
        directory is not writable, one line on stderr says so and nothing is lost but the counts."""
        total = self.popularity
        if not any(any(total.counts(layer)) for layer in range(total.num_layers)):
            return None
        try:
            try:
                total = ExpertPopularity.load(model_dir, num_layers=total.num_layers, num_experts=total.num_experts,
                                              experts_per_token=total.experts_per_token).merge(total)
            except (FileNotFoundError, ProfileError):
                pass
            return total.save(model_dir)
        except OSError as err:
            print(f"energon: the expert popularity counted while serving was not saved beside the model ({err}); "
                  "the next plan assumes what it had", file=sys.stderr, flush=True)
            return None

    def close(self) -> None:
        self._reader.shutdown(wait=True)
