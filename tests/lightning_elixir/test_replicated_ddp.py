"""A plan that replicates every unit runs with DDP semantics (issue 32: never slower than DDP with memory to spare).

On two real gloo processes, ``ElixirStrategy`` given the all-replicate plan trains with torch's composable
``replicate`` (not FSDP2): the losses equal ``strategy="ddp"``'s bit for bit with gradient accumulation and a norm
clip that binds every step, a checkpoint resumes to the very same losses, and the export loads into the plain model.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf
from tightfit.planner.elixir import Tier

ENV = {"GROUP_RANK": "0"}


def _replicate_plan(world: int):
    from torch.utils.data import DataLoader

    from lightning_elixir.planning import profile_module
    from tests.lightning_elixir.common import TinyGPT, cpu_device, token_data
    from tightfit.planner.elixir import baseline
    from tightfit.profiler.types import ClusterSpec

    batch = next(iter(DataLoader(token_data(8), batch_size=4)))
    profile = profile_module(TinyGPT(), batch)
    return baseline(profile, ClusterSpec.uniform(cpu_device(), world), "ddp", checkpoint=False, precision="32-true")


def _runs(rank: int, world: int, tmp: str) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.tensor import DTensor

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.apply import describe_units, inspect_units
    from tests.lightning_elixir.common import TinyGPT, trainer

    tmp_path = Path(tmp)
    plan = _replicate_plan(world)
    kw = dict(devices=world, max_steps=10, gradient_clip_val=0.05, accumulate_grad_batches=2)
    out: dict = {"plan_modes": sorted({u.mode for u in plan.units})}
    L.seed_everything(0)
    ref = TinyGPT()
    trainer("ddp", tmp_path / "ddp", **kw).fit(ref)
    out["ddp"] = ref.losses

    L.seed_everything(0)
    model = TinyGPT()
    strategy = ElixirStrategy(plan=plan, verbose=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="step{step}",
                           auto_insert_metric_name=False)
    trainer(strategy, tmp_path / "elixir", callbacks=[ckpt], enable_checkpointing=True, **kw).fit(model)
    out["elixir"] = model.losses
    out["runtime"] = strategy.runtime
    out["dtensors"] = sum(isinstance(p, DTensor) for p in model.parameters())
    out["applied"] = [(s.names, s.replicated, s.offload, s.numel) for s in inspect_units(model)]
    out["numel"] = sum(p.numel() for p in model.parameters())
    out["table"] = describe_units(model)
    out["tied"] = model.model.lm_head.weight is model.model.wte.weight

    L.seed_everything(0)  # as the original run: the DistributedSampler shuffles with this seed
    resumed = TinyGPT()
    trainer(ElixirStrategy(plan=plan, verbose=False), tmp_path / "resume", **kw).fit(
        resumed, ckpt_path=str(tmp_path / "ckpt" / "step5.ckpt"))
    out["resumed"] = resumed.losses
    if rank == 0:
        from safetensors.torch import load_file

        from lightning_elixir.export import export_checkpoint
        from tests.lightning_elixir.common import CONFIG
        from tightfit.models import GPT

        path = export_checkpoint(tmp_path / "ckpt" / "step10.ckpt", tmp_path / "model.safetensors")
        plain = GPT(CONFIG)
        plain.load_state_dict(load_file(str(path)), strict=True)
        out["export_diff"] = max((plain.state_dict()[k] - model.model.state_dict()[k]).abs().max().item()
                                 for k in plain.state_dict())
    torch.distributed.barrier()
    return out


@RunIf(lightning=True, min_world=2)
def test_all_replicate_plan_runs_as_ddp_bit_for_bit_with_accumulation_clipping_and_resume(tmp_path):
    results = run_distributed(_runs, 2, args=(str(tmp_path),), timeout=300, env=ENV)
    for rank, r in enumerate(results):
        assert r["plan_modes"] == ["replicate"]
        assert r["runtime"] == "DDP" and r["dtensors"] == 0, r["table"]
        assert r["applied"] == [(("",), True, False, r["numel"])], r["table"]
        assert r["tied"], "wte and lm_head must stay one parameter"
        # 10 optimizer steps of 2 accumulated micro-batches; a 0.05 clip binds on every step.
        assert len(r["ddp"]) == len(r["elixir"]) == 20
        assert r["elixir"] == r["ddp"], f"rank {rank}: {r['elixir']} != {r['ddp']}"
        assert r["elixir"][-1] < r["elixir"][0], r["elixir"]
        # Resume from the step-5 checkpoint (the first epoch's end): the second epoch's 10 micro-batches, exactly.
        assert r["resumed"] == r["elixir"][10:], f"{r['resumed']} != {r['elixir'][10:]}"
    assert results[0]["export_diff"] == 0.0


@RunIf(lightning=True)
def test_only_a_plan_that_replicates_every_unit_on_the_device_without_recompute_runs_as_ddp():
    from dataclasses import replace

    from lightning_elixir.replicate import replicates_everything

    plan = _replicate_plan(2)
    assert replicates_everything(plan)
    first = plan.units[0]
    for changed in (replace(first, mode="keep"), replace(first, tier=Tier.HOST),
                    replace(first, checkpoint=first.blocks[:1])):
        assert not replicates_everything(replace(plan, units=(changed, *plan.units[1:])))
    # Mixed precision casts the parameters for compute (FSDP2's MixedPrecisionPolicy): not plain DDP.
    assert not replicates_everything(replace(plan, param_dtype="bfloat16"))


def _unsharded_storage(rank: int, world: int) -> tuple[bool, bool]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=hsdp)
    fully_shard(model, mesh=hsdp)
    sharded = model[0].weight.to_local()
    seen: dict[str, bool] = {}

    def before_forward(mod, _inputs) -> None:
        seen["aliased"] = mod.weight.untyped_storage().data_ptr() == sharded.untyped_storage().data_ptr()

    model[0].register_forward_pre_hook(before_forward)
    model(torch.randn(4, 32)).sum().backward()
    grad = model[0].weight.grad.to_local()
    return seen["aliased"], grad.untyped_storage().data_ptr() == sharded.untyped_storage().data_ptr()


def test_fsdp2_copies_a_replicated_unit_which_the_planner_prices_unless_the_plan_runs_as_ddp():
    # The planner prices a replicate unit of a mixed plan (an FSDP2 group on a (world, 1) mesh) with a gathered copy
    # of its parameters, and one of an all-replicate plan (DDP) without: FSDP2 copies the one-rank shard into its
    # all-gather output. If a torch release aliases them, the planner's rule (sim.unit_terms) should follow.
    for aliased_params, aliased_grads in run_distributed(_unsharded_storage, world_size=2):
        assert not aliased_params and not aliased_grads


def test_replanning_plans_replicated_units_as_the_fsdp2_groups_it_runs():
    # replan=True keeps FSDP2 (strategy.setup): the search must not price an all-replicate plan as DDP runs it.
    from lightning_elixir.options import ElixirOptions

    assert ElixirOptions().planner_constraints().replicate_on_ddp
    assert not ElixirOptions(replan=True).planner_constraints().replicate_on_ddp
