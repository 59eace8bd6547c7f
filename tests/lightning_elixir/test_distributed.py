"""Elixir on two real gloo processes, driven by Lightning: the same losses as DDP under a mixed plan,
the plan really applied, checkpoints that resume exactly, an export the plain model loads.

One spawn runs every Trainer and the unit-mode check (each costs ~2 s; a spawn ~15 s on a loaded 2-core machine). Lightning
finds the ranks through its TorchElastic environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK ...)
and reuses the process group the helper opened, so no launcher re-runs the test file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

# Losses are compared with this absolute tolerance (fp32, loss ~5.5 -> ~3.5 over 20 steps). FSDP2's
# reduce-scatter and DDP's all-reduce add the same two gradients, so in practice they agree bit for bit.
LOSS_ATOL = 1e-5
ENV = {"GROUP_RANK": "0"}


def _train_compare_checkpoint_export(rank: int, world: int, tmp: str) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.apply import inspect_units
    from tests.lightning_elixir.common import (
        CONFIG,
        TinyGPT,
        cpu_device,
        mixed_budget_for,
        token_data,
        trainer,
    )

    tmp_path = Path(tmp)
    budget = mixed_budget_for(world)
    out: dict = {}

    # 1. DDP reference and Elixir under the mixed budget, same seed and data.
    L.seed_everything(0)
    ref = TinyGPT()
    ref_trainer = trainer("ddp", tmp_path / "ddp", devices=world, max_steps=20, limit_val_batches=4)
    ref_trainer.fit(ref)
    out["ddp"] = ref.losses
    out["ddp_val"] = ref_trainer.validate(ref, verbose=False)[0]["val_loss"]

    L.seed_everything(0)
    model = TinyGPT()
    strategy = ElixirStrategy(memory_budget=budget, device_profile=cpu_device(), verbose=rank == 0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1,
                           filename="step{step}", auto_insert_metric_name=False)
    el_trainer = trainer(strategy, tmp_path / "elixir", devices=world, max_steps=20, callbacks=[ckpt],
                         enable_checkpointing=True, limit_val_batches=4)
    el_trainer.fit(model)
    out["elixir"] = model.losses
    plan = strategy.plan
    out["plan_mixed"] = plan.is_mixed
    out["plan_units"] = [(u.blocks, u.mode, u.offload, u.checkpoint) for u in plan.units]
    out["applied"] = [(s.names, s.reshard_after_forward, s.offload, s.checkpointed, s.param_device)
                      for s in inspect_units(model)]
    out["plan_json"] = (tmp_path / "elixir" / "plan.json").is_file()
    out["tied"] = model.model.lm_head.weight is model.model.wte.weight
    # 2. Lightning features on the sharded model: validate, predict.
    out["elixir_val"] = el_trainer.validate(model, verbose=False)[0]["val_loss"]
    preds = el_trainer.predict(model)
    out["predict_shape"] = list(preds[0].shape)

    # 3. Resume from the step-10 checkpoint in a new Trainer and a fresh model.
    L.seed_everything(0)  # as the original script: the DistributedSampler shuffles with this seed
    resumed = TinyGPT()
    trainer(ElixirStrategy(memory_budget=budget, device_profile=cpu_device(), verbose=False),
            tmp_path / "resume", devices=world, max_steps=20).fit(resumed, ckpt_path=str(tmp_path / "ckpt" / "step10.ckpt"))
    out["resumed"] = resumed.losses

    # 4. Gradient clipping and accumulation give DDP's losses too.
    for name, strat in (("ddp_clip", "ddp"),
                        ("elixir_clip", ElixirStrategy(memory_budget=budget, device_profile=cpu_device(),
                                                       verbose=False))):
        L.seed_everything(0)
        m = TinyGPT()
        trainer(strat, tmp_path / name, devices=world, max_steps=6, gradient_clip_val=0.05,
                accumulate_grad_batches=2).fit(m)
        out[name] = m.losses

    # 5. Export the final checkpoint (rank 0, no process group needed) and load it into the plain model.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        from safetensors.torch import load_file

        from lightning_elixir.export import export_checkpoint
        from tightfit.models import GPT

        path = export_checkpoint(tmp_path / "ckpt" / "step20.ckpt", tmp_path / "model.safetensors")
        plain = GPT(CONFIG)
        plain.load_state_dict(load_file(str(path)), strict=True)  # raises on any missing or unexpected name
        out["export_keys"] = sorted(load_file(str(path)))
        umask = os.umask(0)
        os.umask(umask)
        out["export_mode_ok"] = (path.stat().st_mode & 0o777) == (0o666 & ~umask)  # not safetensors' 0600
        out["export_max_diff"] = max((plain.state_dict()[k] - full["model." + k]).abs().max().item()
                                     for k in plain.state_dict())
        x = token_data(4, seed=9).tensors[0]
        with torch.no_grad():
            out["export_logits_finite"] = bool(torch.isfinite(plain(x)).all())
    torch.distributed.barrier()
    return out


def _both(rank: int, world: int, tmp: str) -> dict:
    """Both tests' runs on one process group: the unit modes applied by hand first (FSDP2 alone, seeded itself),
    then the Lightning runs, which reuse the group."""
    return {"every_mode": _every_mode(rank, world), "lightning": _train_compare_checkpoint_export(rank, world, tmp)}


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> list[dict]:
    """What each of two ranks returned from ``_both``."""
    tmp = tmp_path_factory.mktemp("elixir_two_ranks")
    return run_distributed(_both, 2, args=(str(tmp),), timeout=540, env=ENV)


@RunIf(lightning=True, min_world=2)
def test_two_processes_match_ddp_resume_and_export(on_two_ranks):
    results = [r["lightning"] for r in on_two_ranks]
    for rank, r in enumerate(results):
        # The budget forced a mixed plan, and that plan is what FSDP2 runs.
        assert r["plan_mixed"], r["plan_units"]
        assert r["plan_json"] or rank != 0
        assert r["tied"], "wte and lm_head must stay one parameter after sharding"
        assert len(r["ddp"]) == len(r["elixir"]) == 20
        diff = max(abs(a - b) for a, b in zip(r["ddp"], r["elixir"]))
        assert diff <= LOSS_ATOL, f"rank {rank}: Elixir vs DDP losses differ by {diff}"
        assert r["elixir"][-1] < r["elixir"][0] - 1.0, r["elixir"]  # it learns (5.5 -> ~3.5)
        assert abs(r["ddp_val"] - r["elixir_val"]) <= LOSS_ATOL
        assert r["predict_shape"] == [4, 32]
        # Resume: steps 11..20 of the resumed run are the original run's, exactly.
        assert len(r["resumed"]) == 10
        assert max(abs(a - b) for a, b in zip(r["resumed"], r["elixir"][10:])) <= LOSS_ATOL, f"{r['resumed']} {r['elixir']}"
        # Clipping (a tiny norm so it binds every step) and accumulation.
        assert len(r["ddp_clip"]) == len(r["elixir_clip"]) == 12
        assert max(abs(a - b) for a, b in zip(r["ddp_clip"], r["elixir_clip"])) <= LOSS_ATOL
    _check_applied(results[0]["plan_units"], results[0]["applied"])
    r0 = results[0]
    assert r0["export_max_diff"] == 0.0 and r0["export_logits_finite"] and r0["export_mode_ok"]
    assert "wte.weight" in r0["export_keys"] and "blocks.3.mlp.c_proj.weight" in r0["export_keys"]


def _check_applied(plan_units, applied) -> None:
    """Each plan unit's FSDP2 group has the plan's reshard and offload policy and its checkpointed blocks."""
    by_first = {names[0]: (names, reshard, offload, ckpt, device) for names, reshard, offload, ckpt, device in applied}
    seen = {"offloaded": 0, "resident": 0, "reshard": 0, "checkpointed": 0}
    for blocks, mode, offload, checkpoint in plan_units:
        if blocks[0] not in by_first:
            continue  # a unit without parameters (dropout, the tied head): nothing to shard
        names, reshard, applied_offload, ckpt, device = by_first[blocks[0]]
        assert reshard == (mode != "keep"), (blocks, mode, names)
        assert applied_offload == offload, (blocks, offload, names)
        assert set(checkpoint) <= set(ckpt), (blocks, checkpoint, ckpt)
        if offload:
            assert device == "cpu"
        seen["offloaded" if offload else "resident"] += 1
        seen["reshard"] += mode == "reshard"
        seen["checkpointed"] += bool(checkpoint)
    assert all(seen.values()), f"the plan should exercise every kind of unit: {seen}"


def _every_mode(rank: int, world: int) -> dict:
    import dataclasses

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_elixir.apply import apply_plan, inspect_units
    from lightning_elixir.clipping import clip_grad_norm_
    from tests.lightning_elixir.common import CONFIG, cpu_device
    from tightfit.models import build_gpt
    from tightfit.planner.elixir import estimate, search
    from tightfit.profiler import profile_model
    from tightfit.profiler.types import ClusterSpec

    profile = profile_model(build_gpt(CONFIG, device="meta"), torch.zeros(4, 32, dtype=torch.long))
    cluster = ClusterSpec.uniform(cpu_device(), world)
    modes = ("replicate", "keep", "reshard")
    units = [dataclasses.replace(u, mode=modes[i % 3], tier=i % 2)
             for i, u in enumerate(search(profile, cluster, precision="32-true").units)]
    plan = estimate(profile, cluster, units, precision="32-true")
    data = torch.randint(0, CONFIG.vocab_size, (10, world, 4, 33), generator=torch.Generator().manual_seed(1))

    def train(model, clip) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(10):
            x = data[step, rank]
            loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, CONFIG.vocab_size), x[:, 1:].reshape(-1))
            loss.backward()
            clip(model.parameters(), 0.05)  # small enough to bind on every step
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    ref = train(DDP(build_gpt(CONFIG)), torch.nn.utils.clip_grad_norm_)
    torch.manual_seed(0)
    model = build_gpt(CONFIG)
    apply_plan(model, plan, init_device_mesh("cpu", (world,)))
    return {"ref": ref, "elixir": train(model, clip_grad_norm_),
            "replicated": [s.replicated for s in inspect_units(model)],
            "kept": [not s.reshard_after_forward for s in inspect_units(model)]}


@RunIf(lightning=True, min_world=2)  # its model and device come from tests/lightning_elixir/common.py (Lightning)
def test_every_unit_mode_with_norm_clipping_matches_ddp(on_two_ranks):
    """replicate (a 2-D mesh), keep and reshard units, offloaded or not, in one model: torch's clipping
    refuses gradients on two meshes; lightning_elixir.clipping.clip_grad_norm_ counts each element once."""
    for r in (both["every_mode"] for both in on_two_ranks):
        assert any(r["replicated"]) and not all(r["replicated"]) and any(r["kept"]), r
        assert max(abs(a - b) for a, b in zip(r["ref"], r["elixir"])) <= LOSS_ATOL, (r["ref"], r["elixir"])
