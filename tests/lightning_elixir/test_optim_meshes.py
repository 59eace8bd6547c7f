"""One optimizer over Elixir units on two meshes: each step sees one param group per (mesh, device).

foreach/fused kernels over DTensors of two meshes (``replicate`` units on ``(world, 1)``, the rest on
the 1-D mesh) are refused by the DTensor of the GPU image's torch; ``mesh_step`` presents the
user's groups split by (mesh, device) for the step only. Checked on 2 gloo ranks against DDP with
the same optimizer and LR schedule; the groups seen inside each step are recorded by the user's pre-hook.
"""

from __future__ import annotations

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

LOSS_ATOL = 1e-4


def _mixed_meshes(rank: int, world: int, kw: dict, fused_on_host: bool) -> dict:
    import dataclasses

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_elixir.apply import apply_plan, inspect_units
    from lightning_elixir.optim import mesh_step, placement_key
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
    data = torch.randint(0, CONFIG.vocab_size, (4, world, 4, 33), generator=torch.Generator().manual_seed(1))
    seen: list[list[tuple[int, bool | None, float]]] = []

    def train(model, install: bool) -> tuple[list[float], int, float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # the schedule must reach every split
        if install:
            def record(o, args, kwargs):
                seen.append([(len({placement_key(p) for p in g["params"]}), g.get("fused"), g["lr"])
                             for g in o.param_groups])
            opt.register_step_pre_hook(record)
        losses = []
        for step in range(4):
            x = data[step, rank]
            loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, CONFIG.vocab_size), x[:, 1:].reshape(-1))
            loss.backward()
            if install:
                mesh_step(opt, fused_on_host=fused_on_host)
            else:
                opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, len(opt.param_groups), opt.param_groups[0]["lr"]

    torch.manual_seed(0)
    ref = train(DDP(build_gpt(CONFIG)), install=False)
    torch.manual_seed(0)
    model = build_gpt(CONFIG)
    apply_plan(model, plan, init_device_mesh("cpu", (world,)))
    return {"ref": ref, "elixir": train(model, install=True), "seen": seen,
            "meshes": len({placement_key(p) for p in model.parameters()}),
            "replicated": any(s.replicated for s in inspect_units(model))}


def _check(results: list[dict], fused: bool | None) -> None:
    for r in results:
        assert r["replicated"] and r["meshes"] >= 2, r
        (ref_losses, _, ref_lr), (losses, groups, lr) = r["ref"], r["elixir"]
        assert max(abs(a - b) for a, b in zip(ref_losses, losses)) <= LOSS_ATOL, (ref_losses, losses)
        assert groups == 1 and lr == ref_lr == 1e-2 * 0.5 ** 4  # the user's one group is back after every step
        assert len(r["seen"]) == 4
        for step, groups_seen in enumerate(r["seen"]):
            assert len(groups_seen) == r["meshes"], groups_seen          # one group per (mesh, device) ...
            assert all(n == 1 and g_lr == 1e-2 * 0.5 ** step for n, _, g_lr in groups_seen)  # ... with the live LR
            assert all(f == fused for _, f, _ in groups_seen), groups_seen


@RunIf(min_world=2)
def test_foreach_adamw_steps_one_mesh_at_a_time_and_matches_ddp():
    _check(run_distributed(_mixed_meshes, 2, args=({"foreach": True}, True), timeout=300), fused=None)


@RunIf(min_world=2)
def test_host_buckets_step_fused_when_the_user_did_not_choose():
    """``fused_on_host``: every bucket here lives on the host (CPU ranks), so each steps fused."""
    _check(run_distributed(_mixed_meshes, 2, args=({}, True), timeout=300), fused=True)
