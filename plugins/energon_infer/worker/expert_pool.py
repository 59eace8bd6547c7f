"""Expert-level placement on a CPU: an MoE model's cold experts stay on disk, read when the router picks them.

A Mixture-of-Experts step touches a few experts per layer, and some far more often than others. So where the whole
model does not fit, the engine's serving plan (:mod:`energon_infer.engine.expert_plan`) asks core's expert planner
(:func:`tightfit.planner.experts.plan_experts`) where each expert lives: the dense parts of every layer (attention,
norms, router, shared expert) and the experts used most per byte stay in memory, the rest stay in the model
directory's safetensors files (``"disk"``). This module applies that plan to a loaded runner whose disk experts were
left on the meta device. Quantized experts (``quantization="int8"`` / ``"int4"``) are read from the quantized store
instead (:func:`install_expert_pool`: each disk expert quantized once at load, as the in-memory quantized model holds
it, and written as one packed run of bytes, :class:`~energon_infer.worker.quantized_pool.StoredLayer`); their slots,
arena and lookahead buffers hold those bytes, 4 KiB aligned, and the layer's grouped quantized kernel runs on views of
them. Everything below holds for both:

* each MoE layer gets the plan's cache slots (``ExpertPlan.slots``, one expert each), and core's
  :class:`~tightfit.policy.experts.ExpertCache` (the embedding cache's frequency sketch, TinyLFU admission) decides
  which of the layer's disk experts stay in them between steps;
* the layer's forward, once its router has chosen (``MoE.fetch_experts``), looks the step's disk experts up: a hit
  runs from its slot, a miss admitted takes a slot (the evicted expert's), a miss not admitted is read for this
  step only into the **arena** (one layer's disk experts at most, shared by every layer: layers run one at a time),
  so a step never runs an expert in more than one pass, whatever the batch. Reads run on ``io_threads`` threads, one
  expert each, straight from the files by byte range (:class:`~energon_infer.worker.disk_pool.DiskLayer`: the same
  assembly as loading, so an expert read holds exactly the loaded values);
* **lookahead**: before this layer's experts run, the next MoE layer's router is applied to this layer's input (a
  cheap approximation of the next layer's own input: the residual stream changes little in one layer), and the
  predicted experts that are neither in memory nor cached, most-voted first, are read into a **lookahead buffer**
  (``lookahead`` experts; two of them, alternate layers, so a layer can run from one while the next layer's reads
  fill the other). The reads queue behind this layer's own reads on the same threads, so they overlap this layer's
  expert compute and the next layer's attention. When the next layer routes, a predicted expert the cache admits
  is copied from the buffer into its slot and one it streams runs from the buffer; either way it is not read again.
  The cache sees the same lookups it would without lookahead (an expert read ahead is a load or a stream, never a
  hit), so its hit rate and the Belady yardstick keep their meaning. In a prefill step the same holds for the whole
  batch: each layer's own routing is known once its router ran (all its reads are issued at once), and the next
  layer's prediction is the union over the batch's tokens;
* after the experts ran (``MoE.release_experts``) the arena's experts go back to their placeholders (views of one
  shared zero expert: a kernel handed all of a layer's experts reads real memory).

Every routed use is counted per tier (in memory, a cache hit, a read: on demand or ahead) with the bytes read (a
mispredicted read ahead included), the lookahead's accuracy (the share of the routed experts it predicted) and how
many of its reads were used, for the engine's metrics (:meth:`ExpertPool.snapshot`); :attr:`ExpertPool.events` keeps
the order reads were issued in and layers ran. The routing itself is counted into an
:class:`~tightfit.profiler.experts.ExpertPopularity` that the next plan can start from.
"""

from __future__ import annotations

import functools
import sys
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from energon_infer.loading.config import ModelConfig
from energon_infer.loading.safetensors_files import TensorFiles
from energon_infer.loading.weights import hf_parts
from energon_infer.parallel import Grid
from energon_infer.worker.disk_pool import DiskLayer
from energon_infer.worker.quantized_pool import (
    StoredLayer,
    open_quantized_store,
    packed_block_bytes,
    write_missing_layers,
)
from tightfit.planner.experts import ExpertPlan
from tightfit.policy.experts import ExpertCache, belady_hits
from tightfit.profiler.experts import ExpertPopularity
from tightfit.profiler.types import ProfileError
from tightfit.storage import ALIGN, IOEngine, StagingBuffers, TensorStore, aligned_empty, direct_buffer_bytes

__all__ = ["ExpertPool", "expert_names", "expert_read_buffer_bytes", "install_expert_pool", "lookahead_experts",
           "moe_layers", "stored_experts"]

# Slot ids of an expert's bound views (SlotLayer.slot_views caches them per id): a cache slot is (layer << 20) + slot,
# the arena's j-th place -1 - j, lookahead buffer b's j-th place _AHEAD - (b << 20) - j, the shared zero expert this.
_ZEROS = -(1 << 40)
_AHEAD = -(1 << 30)

#: Lookups per layer the pool keeps for its Belady yardstick (a window: older ones are dropped).
TRACE_STEPS = 1 << 14


def moe_layers(stage: nn.Module) -> list[tuple[str, Any]]:
    """``(layer number, its MoE module)`` of the stage's MoE layers, in execution order."""
    blocks = cast(nn.ModuleDict, stage.layers)
    return [(idx, block.moe) for idx, block in blocks.items() if getattr(block, "moe", None) is not None]


def lookahead_experts(experts_per_token: int, disk_experts: int) -> int:
    """Experts each of the pool's two lookahead buffers holds by default: one token's picks (all of a batch-1 step's
    next layer), at most the most disk experts of any layer (``disk_experts``)."""
    return max(0, min(experts_per_token, disk_experts))


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


def _buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A slot, the arena or a lookahead buffer: packed bytes (a quantized expert's) 4 KiB-aligned."""
    return aligned_empty(numel) if dtype == torch.uint8 else torch.empty(numel, dtype=dtype)


def _largest_packed_expert(stage: nn.Module) -> int:
    """Bytes of the stage's largest expert packed as a quantized slot holds it (a store read's largest)."""
    return max((packed_block_bytes(e) for _, moe in moe_layers(stage) for e in moe.experts.values()), default=0)


def stored_experts(stage: nn.Module, plan: ExpertPlan, store: TensorStore) -> list[dict[int, StoredLayer]]:
    """Per MoE layer of ``stage``, each quantized expert ``plan`` puts on disk as one run of packed bytes in ``store``
    (:class:`~energon_infer.worker.quantized_pool.StoredLayer`, ``expert.<layer>.<expert>.<layout>``: its quantized
    weights, scales, zero points and biases, as the in-memory quantized model holds them)."""
    # pinned where CUDA is present: a GPU slot's bytes pass through it
    staging = StagingBuffers(_largest_packed_expert(stage))
    return [{e: StoredLayer(moe.experts[str(e)], int(idx), store, staging, expert=e)
             for e, tier in enumerate(tiers) if tier == "disk"}
            for (idx, moe), tiers in zip(moe_layers(stage), plan.placement)]


class ExpertPool:
    """Apply an :class:`ExpertPlan` to a loaded stage (see the module docstring).

    Args:
        stage: the runner's stage, its disk experts on the meta device.
        cfg / grid: the model and this rank's place.
        plan: the expert placement (its ``placement`` lists the stage's MoE layers in order).
        files: the checkpoint's tensors by byte range (unquantized experts are read from them).
        store: quantized experts (``quantization="int8"`` / ``"int4"``) are read from this quantized store
            (:func:`~energon_infer.worker.quantized_pool.open_quantized_store`), each expert's packed bytes as the
            in-memory quantized model holds them, written there first (:func:`stored_experts`,
            :func:`install_expert_pool`); the pool closes it.
        io_threads: experts read at once.
        nonfinite: the first read of each expert checks its values as loading does.
        lookahead: experts of the next layer read ahead per layer (each of the two lookahead buffers' size; ``None``:
            :func:`lookahead_experts`, one token's picks; 0: no lookahead).
    """

    def __init__(self, stage: nn.Module, cfg: ModelConfig, grid: Grid, plan: ExpertPlan, files: TensorFiles | None,
                 *, store: TensorStore | None = None, io_threads: int = 2, nonfinite: str = "warn",
                 lookahead: int | None = None):
        layers = moe_layers(stage)
        if len(layers) != len(plan.placement):
            raise ValueError(f"the expert plan places {len(plan.placement)} MoE layers; this stage has {len(layers)}")
        quantized = any(getattr(e, "quant", None) for _, moe in layers for e in moe.experts.values())
        if quantized and store is None:
            raise ValueError("ExpertPool: this stage's experts are quantized and store=None; quantized experts are "
                             "read from the quantized store, never from the checkpoint: give store= (written by "
                             "energon_infer.worker.expert_pool.stored_experts), or use install_expert_pool")
        if not quantized and files is None:
            raise ValueError("ExpertPool: files=None, and this stage's experts are unquantized: they are read from "
                             "the checkpoint's files; give TensorFiles(model directory)")
        if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0):
            raise ValueError(f"ExpertPool: lookahead={lookahead!r} must be an int >= 0 (experts read ahead per layer); "
                             "give 0 to turn lookahead off or None for one token's picks")
        self.plan, self.files, self.store = plan, files, store
        self.units = _disk_units(stage, cfg, grid, plan, files, store if quantized else None, nonfinite)
        for li, (_, moe) in enumerate(layers):
            setattr(moe, "fetch_experts", functools.partial(self._fetch, li))  # noqa: B010 (nn.Module's typing)
            setattr(moe, "release_experts", functools.partial(self._release, li))  # noqa: B010
        numel = max((u.numel for units in self.units for u in units.values()), default=0)
        dtype = next((u.dtype for units in self.units for u in units.values()), torch.float32)
        if quantized:  # packed bytes: each place starts 4 KiB-aligned, so a store's O_DIRECT read lands there directly
            numel = -(-numel // ALIGN) * ALIGN
        self.expert_numel = numel
        # The cache's slots, per layer, and the arena the step's other disk experts are read into.
        self.slots = [[_buffer(numel, dtype) for _ in range(plan.slots[li] if units else 0)]
                      for li, units in enumerate(self.units)]
        widest = max((len(u) for u in self.units), default=0)
        self.arena = _buffer(numel * widest, dtype)
        # Two lookahead buffers, alternate layers: layer i may run from one while layer i + 1's reads fill the other.
        self.lookahead = lookahead_experts(cfg.experts_per_token, widest) if lookahead is None else \
            min(lookahead, widest)
        self.ahead = [_buffer(numel * self.lookahead, dtype)
                      for _ in range(2 if self.lookahead and len(layers) > 1 else 0)]
        self._moes = [moe for _, moe in layers]
        # The reads issued ahead: (the layer, the experts predicted for it, {expert: (its read, its buffer place)}).
        self._pending: tuple[int, set[int], dict[int, tuple[Future[None], int]]] | None = None
        #: ("read", layer, expert, "demand" | "ahead") as each read is issued, ("ready", layer) once a layer's
        #: experts are all in memory, ("ran", layer) once they ran: the last TRACE_STEPS events.
        self.events: deque[tuple[Any, ...]] = deque(maxlen=TRACE_STEPS)
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
        # The store's I/O engine reads the experts, with room for a layer's demand reads and the reads ahead of
        # it and of the next layer in flight (a submit never waits).
        self._reader = IOEngine(workers=max(1, io_threads), max_inflight=widest + 2 * self.lookahead + 1,
                                name="energon-expert-read", initializer=lambda: torch.set_num_threads(1))
        self.in_memory_uses = self.reads = 0
        # The lookahead's counters: experts predicted, predicted and routed, routed where a prediction was made;
        # reads issued ahead, and those a lookup then used.
        self.predicted = self.predicted_right = self.predicted_routed = 0
        self.prefetches = self.prefetches_used = 0

    @property
    def bytes_read(self) -> int:
        """Bytes every expert read took, on demand and ahead (completed reads only)."""
        return sum(u.io.totals.bytes_read for units in self.units for u in units.values())

    @property
    def held_bytes(self) -> int:
        """The slots', the arena's and the lookahead buffers' bytes."""
        each = self.arena.element_size()
        return (sum(s.numel() for slots in self.slots for s in slots) + self.arena.numel()
                + sum(b.numel() for b in self.ahead)) * each

    def _fill(self, unit: DiskLayer | StoredLayer, dst: torch.Tensor, slot_id: int) -> None:
        unit.fill(dst)
        unit.bind(slot_id, dst)

    def _ahead_place(self, li: int, j: int, numel: int) -> tuple[int, torch.Tensor]:
        at = j * self.expert_numel
        return _AHEAD - ((li % 2) << 20) - j, self.ahead[li % 2][at: at + numel]

    def _take_ahead(self, li: int) -> tuple[set[int] | None, dict[int, tuple[Future[None], int]]]:
        """The prediction and the reads issued ahead for layer ``li`` (none where they were for another layer: a step
        that stopped early; those reads are waited for and dropped, their buffer is written again)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None, {}
        layer, predicted, reads = pending
        if layer == li:
            return predicted, reads
        for done, _ in reads.values():
            done.exception()
        return None, {}

    def _read_ahead(self, li: int, x: torch.Tensor) -> None:
        """Predict the next MoE layer's experts from this layer's input ``x`` and issue the reads of those on disk and
        not cached, most-voted first, up to the lookahead buffer's size."""
        nxt = li + 1
        if not self.lookahead or nxt >= len(self.units):
            return
        _, chosen = self._moes[nxt].route(x)
        votes = torch.bincount(chosen.reshape(-1), minlength=self.cache.num_experts).tolist()
        predicted = {e for e, v in enumerate(votes) if v}
        self.predicted += len(predicted)
        units, cached = self.units[nxt], self._slot_of[nxt]
        want = sorted((e for e in predicted if e in units and e not in cached), key=lambda e: (-votes[e], e))
        reads: dict[int, tuple[Future[None], int]] = {}
        for j, e in enumerate(want[: self.lookahead]):
            self.events.append(("read", nxt, e, "ahead"))
            reads[e] = (self._reader.submit(units[e].fill, self._ahead_place(nxt, j, units[e].numel)[1]), j)
        self.prefetches += len(reads)
        self._pending = (nxt, predicted, reads)

    def _fetch(self, li: int, chosen: torch.Tensor, x: torch.Tensor) -> None:
        """Make every expert ``chosen`` (the router's picks, any shape) names usable for this step of layer ``li``,
        and issue the next layer's reads ahead from ``x`` (this layer's input) before this layer's experts run."""
        picks = chosen.reshape(-1).tolist()
        used = sorted(set(picks))
        self.popularity.add(li, picks)
        predicted, ahead = self._take_ahead(li)
        if predicted is not None:
            self.predicted_routed += len(used)
            self.predicted_right += len(predicted.intersection(used))
        units = self.units[li]
        disk = [e for e in used if e in units]
        self.in_memory_uses += len(used) - len(disk)
        jobs: list[tuple[int, torch.Tensor, int]] = []  # (expert, where its bytes go, the slot id it is bound as)
        from_ahead: list[tuple[int, torch.Tensor | None, int]] = []  # (expert, its cache slot or None, slot id)
        if disk:
            step = self.cache.lookup(li, disk)
            self.trace[li].append(tuple(disk))
            free: list[int] = []
            for e in step.evicted:
                units[e].unbind()
                free.append(self._slot_of[li].pop(e))
            taken = set(self._slot_of[li].values())
            free += [i for i in range(len(self.slots[li])) if i not in taken and i not in free]
            for e in step.loads:
                slot = free.pop(0)
                self._slot_of[li][e] = slot
                dst = self.slots[li][slot][: units[e].numel]
                if e in ahead:  # read ahead: copied into its slot once the read is done
                    from_ahead.append((e, dst, (li << 20) + slot))
                else:
                    jobs.append((e, dst, (li << 20) + slot))
            j = 0
            for e in step.streamed:
                if e in ahead:  # runs from the lookahead buffer
                    from_ahead.append((e, None, 0))
                    continue
                at = j * self.expert_numel
                jobs.append((e, self.arena[at: at + units[e].numel], -1 - j))
                j += 1
            self._streamed[li] = list(step.streamed)
        for e, _, _ in jobs:
            self.events.append(("read", li, e, "demand"))
        reading = [self._reader.submit(self._fill, units[e], dst, slot_id) for e, dst, slot_id in jobs]
        self._read_ahead(li, x)  # queued behind this layer's reads: they overlap its expert compute
        for done in reading:
            done.result()
        for done, _ in ahead.values():  # every read issued ahead, used or not: its buffer is written again
            done.result()
        for e, kept, slot_id in from_ahead:
            ahead_id, buf = self._ahead_place(li, ahead[e][1], units[e].numel)
            if kept is None:
                units[e].bind(ahead_id, buf)
            else:
                kept.copy_(buf)
                units[e].bind(slot_id, kept)
        self.reads += len(jobs) + len(from_ahead)
        self.prefetches_used += len(from_ahead)
        self.events.append(("ready", li))

    def _release(self, li: int) -> None:
        for e in self._streamed[li]:
            self.units[li][e].unbind()
        self._streamed[li] = []
        self.events.append(("ran", li))

    def snapshot(self) -> dict[str, Any]:
        """Uses per tier since the start (``expert_reads``: uses served by a read, on demand or ahead), the cache's hit
        rate, bytes read (mispredicted reads ahead included), ``expert_belady_hits``: the hits the offline optimum
        (Belady's, reading on demand) gets with the same slots on the same lookups (the last :data:`TRACE_STEPS` per
        layer; the cache's own hits are counted since the start), and the lookahead's figures:
        ``expert_lookahead_accuracy`` (the share of the routed experts of the layers it predicted that it predicted),
        ``expert_prefetches`` (reads issued ahead) and ``expert_prefetches_used`` (those a lookup used)."""
        stats = self.cache.stats()
        uses = self.in_memory_uses + stats.uses
        belady = sum(belady_hits(t, len(s)) for t, s in zip(self.trace, self.slots))
        return {"expert_uses": uses, "expert_uses_in_memory": self.in_memory_uses, "expert_cache_hits": stats.hits,
                "expert_reads": self.reads, "expert_loads": stats.loads, "expert_streamed": stats.streamed,
                "expert_cache_hit_rate": stats.hit_rate, "expert_belady_hits": belady,
                "expert_hit_rate": (self.in_memory_uses + stats.hits) / uses if uses else 0.0,
                "expert_bytes_read": self.bytes_read, "experts_on_disk": sum(len(u) for u in self.units),
                "expert_slots": sum(len(s) for s in self.slots),
                "expert_lookahead_predicted": self.predicted, "expert_lookahead_correct": self.predicted_right,
                "expert_lookahead_routed": self.predicted_routed,
                "expert_lookahead_accuracy": self.predicted_right / self.predicted_routed if self.predicted_routed
                else 0.0, "expert_prefetches": self.prefetches, "expert_prefetches_used": self.prefetches_used}

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
        self._take_ahead(-1)  # reads still issued ahead are waited for
        self._reader.close()
        if self.store is not None:
            self.store.close()


def _disk_units(stage: nn.Module, cfg: ModelConfig, grid: Grid, plan: ExpertPlan, files: TensorFiles | None,
                store: TensorStore | None, nonfinite: str) -> list[dict[int, DiskLayer | StoredLayer]]:
    """Per MoE layer, its disk experts' readers: from the quantized ``store`` when given, else the checkpoint."""
    if store is not None:
        stored = stored_experts(stage, plan, store)
        missing = [u.name for units in stored for u in units.values() if u.name not in store]
        if missing:
            raise ValueError(f"ExpertPool: the quantized store {store.path} lacks {len(missing)} of the plan's "
                             f"disk experts ({missing[:3]}); write them first (quantized_pool.write_missing_layers "
                             "over stored_experts(...)), or use install_expert_pool")
        return [dict(units) for units in stored]
    assert files is not None
    scratch = StagingBuffers(expert_read_buffer_bytes(stage, cfg, files), pin=False)
    out: list[dict[int, DiskLayer | StoredLayer]] = []
    for li, (idx, moe) in enumerate(moe_layers(stage)):
        experts = cast(nn.ModuleDict, moe.experts)
        out.append({e: DiskLayer(experts[str(e)], int(idx), files, cfg, grid, scratch, nonfinite=nonfinite,
                                 prefix=f"layers.{idx}.moe.experts.{e}.")
                    for e, tier in enumerate(plan.placement[li]) if tier == "disk"})
    return out


def install_expert_pool(runner: Any, plan: ExpertPlan, config: Any, path: str | Path) -> ExpertPool:
    """The expert pool of ``plan`` for a runner loaded with ``offload=expert_names(runner.stage, plan)``, with
    ``config``'s (a :class:`~energon_infer.worker.memory_pool.MemoryPoolConfig`) I/O settings: unquantized experts are
    read from the checkpoint's files; quantized ones from the quantized store
    (:func:`~energon_infer.worker.quantized_pool.open_quantized_store`), where each disk expert is quantized and
    written now if the store lacks it (one expert's full-precision tensors in memory at a time; a store made from the
    same checkpoint with the same method, group size, dtype and grid is reused)."""
    files, store = None, None
    if runner.quant is None:
        files = TensorFiles(path, drop_page_cache=config.drop_page_cache, direct=config.direct_io)
    else:
        store = open_quantized_store(path, runner, config, _largest_packed_expert(runner.stage))
        write_missing_layers(store, path, runner, [u for units in stored_experts(runner.stage, plan, store)
                                                   for u in units.values()])
    return ExpertPool(runner.stage, runner.config, runner.grid, plan, files, store=store, io_threads=config.io_threads,
                      nonfinite=runner.runtime.nonfinite_weights, lookahead=config.expert_lookahead)
