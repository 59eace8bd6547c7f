"""``Fabric(strategy="elixir")`` with parameters on disk (tier 3), the model built under
``fabric.init_module(empty_init=True)``: ``fabric.setup(model, optimizer)`` allocates and initialises the tier-3 units
one at a time into the disk tier, never the whole model in host memory (the Trainer's ``configure_model`` path,
``lightning_elixir.engine.materialize_streamed``), with the values an eager build gives.

On two real gloo ranks:

* memory: the peak resident set (``ru_maxrss``) grows across ``fabric.setup`` by far less than this rank's share of
  the tier-3 weights, and at most one tier-3 unit was held at a time (allocating the model whole first, then handing it
  to the disk tier, grows it by the whole share);
* equality: a loop on that model gives, bit for bit in fp32, the losses and final weights of the same loop on the
  model built eagerly (same seed) with the same plan: a sharded parameter's random initialisation draws it whole and
  keeps the rank's shard (``lightning_elixir.apply.WholeDraws``), as the eager build does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

ENV = {"GROUP_RANK": "0"}
MiB = 1 << 20
MICRO, STEPS = 4, 3
# Memory: 24 linear layers of 4.2 M parameters (fp32: 16.8 MB a unit, 201 MB a rank's shards of them on two ranks),
# so a rank's whole share stands far above what a streamed setup adds to the resident set: one unit's shard, one
# parameter drawn whole (WholeDraws) and a fixed cost of the store's first writes (under 40 MiB, whatever the model).
WIDE, DEEP = 2048, 24


def _config():
    from tests.lightning_elixir.common import CONFIG

    # Untied: a unit whose weights wait on disk needs its own storage per parameter (test_disk_params).
    return dataclasses.replace(CONFIG, tie_embeddings=False)


def _gpt():
    from tightfit.models import GPT

    return GPT(_config())


def _wide():
    from torch import nn

    return nn.Sequential(*(nn.Linear(WIDE, WIDE) for _ in range(DEEP)))


def _plan(build, example, world: int, disk_dir: Path):
    """ZeRO-Infinity's layout with the weights on disk too: every unit offloaded, its fp32 weights and AdamW state on
    disk (tier 3). Priced from stated CPU and disk profiles, profiled on meta (nothing allocated, nothing measured)."""
    import torch

    from lightning_elixir.planning import FORWARD, profile_module
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import Tier, baseline
    from tightfit.profiler.types import ClusterSpec, DiskProfile

    with torch.device("meta"):
        profile = profile_module(build(), example, stage_method=FORWARD)
    disk = DiskProfile(path=str(disk_dir), free_bytes=2**34, read_fit=(1e-4, 1e9), write_fit=(1e-4, 1e9))
    cluster = ClusterSpec.uniform(dataclasses.replace(cpu_device(), disk=disk), world)
    plan = baseline(profile, cluster, "zero3-offload-nvme", checkpoint=False, precision="32-true")
    units = tuple(dataclasses.replace(u, tier=Tier.DISK_PARAMS) if u.tier >= Tier.DISK else u for u in plan.units)
    return dataclasses.replace(plan, units=units)


def _fabric(plan, disk_dir: Path | None, example):
    import lightning as L

    from lightning_elixir import ElixirFabricStrategy

    strategy = ElixirFabricStrategy(plan=plan, disk_dir=disk_dir, example_input=example, verbose=False)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    return fabric


def _build(fabric, build, meta: bool):
    if not meta:
        return build()
    with fabric.init_module(empty_init=True):  # on the meta device: nothing allocated
        return build()


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _setup_memory(tmp: Path) -> dict:
    """``fabric.setup`` of the wide model built on meta: how much the peak resident set grew, against this rank's
    share of the tier-3 weights and its largest unit."""
    import torch

    example = torch.zeros(2, WIDE)
    disk_dir = tmp / "wide"
    disk_dir.mkdir(exist_ok=True)
    fabric = _fabric(_plan(_wide, example, 2, disk_dir), disk_dir, example)
    model = _build(fabric, _wide, meta=True)
    before = _peak_rss()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    grown = _peak_rss() - before
    master = fabric.strategy.disk_state.master
    sizes = [sum(n for _, _, n in u.pieces) * 4 for u in master.units]
    out = {
        "grown": grown,
        "tier3_bytes": sum(sizes),
        "unit_bytes": max(sizes),
        "units": len(sizes),
        "peak_resident": master.peak_resident,
        "held": master.resident_units,
        "stored": all(u.stored for u in master.units),
    }
    fabric.strategy.teardown()
    return out


def _loop(plan, disk_dir: Path | None, *, meta: bool) -> dict:
    """A litgpt-style Fabric loop, ``STEPS`` steps of fixed per-rank micro-batches; its losses and this rank's final
    shards (read back into the module by the teardown)."""
    import torch
    import torch.nn.functional as F

    from tests.lightning_elixir.common import token_data

    x_all, y_all = token_data(STEPS * MICRO * 2).tensors
    fabric = _fabric(plan, disk_dir, x_all[:MICRO])
    model = _build(fabric, _gpt, meta)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for step in range(STEPS):
        at = (step * fabric.world_size + fabric.global_rank) * MICRO
        logits = model(x_all[at : at + MICRO])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[at : at + MICRO].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fabric.strategy.teardown()  # tier-3 weights back into the module
    shards = {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return {"losses": losses, "shards": shards, "param_disk_units": len(plan.param_disk_units)}


def _ranks(rank: int, world: int, tmp: str) -> dict:
    import torch

    from tests.lightning_elixir.common import token_data

    torch.set_num_threads(1)
    root = Path(tmp)
    out = {"memory": _setup_memory(root)}  # first: the peak resident set is this process's high-water mark
    example = token_data(MICRO).tensors[0]
    disk_dir = root / "small"
    disk_dir.mkdir(exist_ok=True)
    plan = _plan(_gpt, example, world, disk_dir)
    meta = _loop(plan, disk_dir, meta=True)
    eager = _loop(plan, disk_dir, meta=False)  # the same plan (test_fabric: the disk tier's losses are RAM's)
    out["param_disk_units"], out["units"] = meta["param_disk_units"], len(plan.units)
    out["losses"] = {"meta": meta["losses"], "eager": eager["losses"]}
    out["differ"] = [n for n, t in meta["shards"].items() if not t.equal(eager["shards"][n])]
    out["names"] = sorted(meta["shards"]) == sorted(eager["shards"])
    return out


@RunIf(lightning=True, min_world=2)
def test_fabric_meta_model_with_tier3_params_sets_up_one_unit_at_a_time_equal_to_eager(tmp_path):
    for rank, r in enumerate(run_distributed(_ranks, 2, args=(str(tmp_path),), timeout=300, env=ENV)):
        m = r["memory"]
        assert m["units"] == DEEP and m["tier3_bytes"] == DEEP * m["unit_bytes"] > 160 * MiB, m  # all on disk
        # One unit held at a time while the model was allocated and initialised, all in the store after it.
        assert m["peak_resident"] == 1 and m["held"] == () and m["stored"], m
        # Allocated whole, then handed to the disk tier, the peak grows by the whole share (tier3_bytes); streamed,
        # by a unit's shard, a parameter drawn whole (twice a shard on two ranks) and the store's fixed cost.
        assert m["grown"] < 64 * MiB + 2 * m["unit_bytes"] < m["tier3_bytes"] / 2, (rank, m["grown"] / MiB)
        assert r["param_disk_units"] == r["units"] >= 4, r
        losses = r["losses"]
        assert len(losses["meta"]) == STEPS and losses["meta"][-1] < losses["meta"][0], losses
        assert losses["meta"] == losses["eager"], (rank, losses)
        assert r["names"] and r["differ"] == [], (rank, r["differ"])
