"""``Fabric(strategy="elixir")``: the Trainer's plan search and runtime behind Lightning's other front door (issue 59).

On two real gloo processes a litgpt-style Fabric loop (``fabric.backward``, ``no_backward_sync`` for gradient
accumulation, ``clip_gradients``, ``fabric.save`` / ``fabric.load``) with ``strategy="elixir"`` gives the losses and
final weights of the same loop with Fabric's ``strategy="ddp"``: bit for bit in fp32 with an all-replicate plan
(run as DDP), within fp32 rounding under a budget that shards and offloads; a resume from ``fabric.save`` gives the
uninterrupted run's losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf
from tightfit.planner.elixir import Tier

ENV = {"GROUP_RANK": "0"}
LOSS_ATOL = 1e-5
MICRO = 4  # micro-batch size


def _example():
    from tests.lightning_elixir.common import token_data

    return token_data(MICRO).tensors[0]


def _profile():
    from lightning_elixir.planning import FORWARD, profile_module
    from tests.lightning_elixir.common import CONFIG
    from tightfit.models import GPT

    return profile_module(GPT(CONFIG), _example(), stage_method=FORWARD)


def _replicate_plan(world: int):
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import baseline
    from tightfit.profiler.types import ClusterSpec

    return baseline(_profile(), ClusterSpec.uniform(cpu_device(), world), "ddp", checkpoint=False, precision="32-true")


def _mixed_budget(world: int) -> int:
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import mixed_budget
    from tightfit.profiler.types import ClusterSpec

    return mixed_budget(_profile(), ClusterSpec.uniform(cpu_device(), world), precision="32-true")


def _loop(strategy, *, steps: int, accumulate: int = 1, clip: float | None = None, joint: bool = False,
          save: tuple[int, Path] | None = None, resume: Path | None = None, precision: str = "32-true") -> dict:
    """A litgpt-style Fabric loop: fixed per-rank micro-batches (so a resumed run sees the very same ones)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.lightning_elixir.common import CONFIG, token_data
    from tightfit.models import GPT

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    fabric.launch()
    fabric.seed_everything(0)
    model = GPT(CONFIG)
    if joint:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    x_all, y_all = token_data(steps * accumulate * MICRO * fabric.world_size).tensors
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    losses = []
    for step in range(state["step"], steps):
        for micro in range(accumulate):
            at = ((step * accumulate + micro) * fabric.world_size + fabric.global_rank) * MICRO
            x, y = x_all[at:at + MICRO], y_all[at:at + MICRO]
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if save is not None and state["step"] == save[0]:
            fabric.save(save[1], state)
    inner = model.module if hasattr(model, "module") else model
    # The whole model on rank 0 (torch gathers a full, CPU-offloaded state dict there only).
    weights = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    weights = weights if fabric.global_rank == 0 else {}
    return {"losses": losses, "weights": {k.removeprefix("module."): v for k, v in weights.items()},
            "strategy": fabric.strategy}


def _compare(rank: int, world: int, tmp: str) -> dict:
    from lightning_elixir import ElixirFabricStrategy
    from lightning_elixir.apply import inspect_units
    from tests.lightning_elixir.common import cpu_device

    tmp_path = Path(tmp)
    out: dict = {}
    # 1. All-replicate plan: DDP semantics, with accumulation (no_backward_sync) and a clip that binds every step.
    kw = dict(steps=6, accumulate=2, clip=0.05)
    ddp = _loop("ddp", joint=True, **kw)
    replicate = _loop(ElixirFabricStrategy(plan=_replicate_plan(world), example_input=_example(), verbose=False),
                      joint=True, save=(3, tmp_path / "rep"), **kw)
    out["ddp"], out["replicate"] = ddp["losses"], replicate["losses"]
    out["runtime"] = replicate["strategy"].runtime
    out["weights_equal"] = all(bool((ddp["weights"][k] == v).all()) for k, v in replicate["weights"].items())
    out["keys_equal"] = sorted(ddp["weights"]) == sorted(replicate["weights"])
    out["ddp_keys"] = sorted(ddp["weights"])
    resumed = _loop(ElixirFabricStrategy(plan=_replicate_plan(world), example_input=_example(), verbose=False),
                    resume=tmp_path / "rep", **kw)
    out["replicate_resumed"] = resumed["losses"]

    # 2. A budget that shards and offloads (FSDP2 units), set up model first then optimizer; no clipping.
    budget = _mixed_budget(world)
    mixed_kw = dict(steps=8)
    ddp = _loop("ddp", **mixed_kw)
    strategy = ElixirFabricStrategy(memory_budget=budget, device_profile=cpu_device(), example_input=_example,
                                    verbose=rank == 0)
    mixed = _loop(strategy, save=(4, tmp_path / "mixed"), **mixed_kw)
    out["ddp_mixed"], out["mixed"] = ddp["losses"], mixed["losses"]
    out["mixed_runtime"] = strategy.runtime
    out["plan_mixed"] = strategy.plan.is_mixed
    out["offloaded"] = sum(u.plan.offload for u in strategy.units)
    out["sharded"] = sum(u.plan.mode != "replicate" for u in strategy.units)
    out["applied_offload"] = [s.offload for s in inspect_units(strategy._module)]
    if rank == 0:
        out["weights_diff"] = max((ddp["weights"][k] - v).abs().max().item() for k, v in mixed["weights"].items())
    resumed = _loop(ElixirFabricStrategy(memory_budget=budget, device_profile=cpu_device(), example_input=_example,
                                         verbose=False), resume=tmp_path / "mixed", **mixed_kw)
    out["mixed_resumed"] = resumed["losses"]
    out["checkpoint_files"] = sorted(p.name for p in (tmp_path / "mixed").iterdir())
    return out


@RunIf(lightning=True, min_world=2)
def test_fabric_elixir_matches_fabric_ddp_and_resumes(tmp_path):
    results = run_distributed(_compare, 2, args=(str(tmp_path),), timeout=420, env=ENV)
    for rank, r in enumerate(results):
        # All-replicate plan: run as DDP, the very losses and weights of Fabric's DDP, accumulation and clipping in.
        assert r["runtime"] == "DDP"
        assert len(r["replicate"]) == 12 and r["replicate"] == r["ddp"], f"rank {rank}: {r['replicate']} {r['ddp']}"
        assert r["keys_equal"] and r["weights_equal"] and (rank or len(r["ddp_keys"]) == 53), r["ddp_keys"]
        assert r["replicate_resumed"] == r["replicate"][6:], f"{r['replicate_resumed']} != {r['replicate'][6:]}"
        # Sharded and offloaded (FSDP2): DDP's losses and weights within fp32 rounding; the resume matches.
        assert r["mixed_runtime"] == "FSDP2" and r["plan_mixed"]
        assert r["offloaded"] >= 1 and r["sharded"] >= 1, r
        assert sum(r["applied_offload"]) == r["offloaded"]
        assert len(r["mixed"]) == 8
        assert max(abs(a - b) for a, b in zip(r["mixed"], r["ddp_mixed"])) <= LOSS_ATOL, (r["mixed"], r["ddp_mixed"])
        assert rank or r["weights_diff"] <= 1e-5
        assert r["mixed"][-1] < r["mixed"][0]
        assert max(abs(a - b) for a, b in zip(r["mixed_resumed"], r["mixed"][4:])) <= LOSS_ATOL
        assert len(r["mixed_resumed"]) == 4
        assert {"meta.pt", "checksums.json"} <= set(r["checkpoint_files"])


@RunIf(lightning=True)
def test_import_registers_elixir_in_both_registries():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_elixir
    from lightning_elixir import ElixirFabricStrategy, ElixirStrategy

    for name, kwargs in (("elixir", {}), ("elixir_offload", {"offload": "all"}),
                         ("elixir_no_offload", {"offload": "none"}),
                         ("elixir_checkpoint", {"activation_checkpointing": True})):
        assert STRATEGY_REGISTRY[name]["strategy"] is ElixirFabricStrategy
        assert STRATEGY_REGISTRY[name]["init_params"] == kwargs
        assert StrategyRegistry[name]["strategy"] is ElixirStrategy
        assert StrategyRegistry[name]["init_params"] == kwargs
    lightning_elixir.register()  # idempotent
    assert "elixir_deepspeed" in StrategyRegistry


@RunIf(lightning=True)
def test_fabric_strategy_name_builds_the_elixir_strategy_with_the_presets_options():
    import lightning as L

    import lightning_elixir  # noqa: F401
    from lightning_elixir import ElixirFabricStrategy, ElixirOptions

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="elixir_offload")
    assert isinstance(fabric.strategy, ElixirFabricStrategy)
    assert fabric.strategy.options == ElixirOptions(offload="all")
    # One options object for both front doors: the same keywords give equal options.
    from lightning_elixir import ElixirStrategy

    kw = dict(memory_budget="6GiB", offload="none", activation_checkpointing=True, optimizer="sgd")
    assert ElixirFabricStrategy(**kw).options == ElixirStrategy(**kw).options


@RunIf(lightning=True)
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"offload": "sometimes"}, r"ElixirFabricStrategy\(offload='sometimes'\): use one of"),
    ({"memory_budget": "lots"}, r"ElixirFabricStrategy\(memory_budget='lots'\): give bytes"),
    ({"optimizer": "nope"}, r"ElixirFabricStrategy\(optimizer='nope'\)"),
    ({"host_budget": 0}, r"ElixirFabricStrategy\(host_budget=0\): give bytes > 0"),
])
def test_bad_options_fail_in_one_line_naming_the_fabric_strategy(kwargs, match):
    from lightning_elixir import ElixirFabricStrategy

    with pytest.raises(ValueError, match=match) as info:
        ElixirFabricStrategy(**kwargs)
    assert "\n" not in str(info.value)


def _no_example(rank: int, world: int) -> str:
    import lightning as L
    import torch

    from lightning_elixir import ElixirFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ElixirFabricStrategy(verbose=False))
    fabric.launch()
    try:
        fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    except ValueError as err:
        return str(err)
    return ""


@RunIf(lightning=True, min_world=2)
def test_a_model_without_an_example_input_is_refused_with_the_fix():
    for message in run_distributed(_no_example, 2, timeout=120, env=ENV):
        assert message.startswith("ElixirFabricStrategy cannot profile Sequential: no example input; give "
                                  "ElixirFabricStrategy(example_input="), message
        assert "\n" not in message


def _disk(rank: int, world: int, tmp: str) -> dict:
    import dataclasses

    from lightning_elixir import ElixirFabricStrategy
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import ElixirConstraints

    root = Path(tmp)
    (root / "disk").mkdir(exist_ok=True)

    def on_disk() -> ElixirFabricStrategy:
        return ElixirFabricStrategy(disk_dir=root / "disk", device_profile=cpu_device(), example_input=_example(),
                                    constraints=ElixirConstraints(force_disk=True), verbose=False)

    kw = dict(steps=6, accumulate=2, clip=0.05)
    strategy = on_disk()
    run = _loop(strategy, save=(3, root / "ckpt"), **kw)
    plan, state = strategy.plan, strategy.disk_state
    out = {"disk_units": list(plan.disk_units), "steps": state.steps, "losses": run["losses"]}
    strategy.teardown()
    ram = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0) for u in plan.units))
    out["ram"] = _loop(ElixirFabricStrategy(plan=ram, example_input=_example(), verbose=False), **kw)["losses"]
    resumed = on_disk()
    out["resumed"] = _loop(resumed, resume=root / "ckpt", **kw)["losses"]
    resumed.teardown()
    return out


@RunIf(lightning=True, min_world=2)
def test_fabric_disk_tier_steps_checkpoints_and_resumes_as_in_ram(tmp_path):
    for r in run_distributed(_disk, 2, args=(str(tmp_path),), timeout=300, env=ENV):
        assert r["disk_units"] and r["steps"] == 6
        assert len(r["losses"]) == 12 and r["losses"] == r["ram"], (r["losses"], r["ram"])
        # The optimizer state on disk went into the checkpoint and back into a fresh store, streamed.
        assert r["resumed"] == r["losses"][6:], (r["resumed"], r["losses"][6:])


@RunIf(lightning=True)
def test_fabric_example_resumes_to_the_uninterrupted_runs_losses(tmp_path):
    # examples/lightning_elixir/fabric_finetune.py on 2 CPU processes: 2 steps, then --resume to 4, equals 4 straight.
    import json
    import subprocess
    import sys

    pytest.importorskip("transformers")
    from tests.helpers.multiprocess import unlaunched_env
    from tests.lightning_elixir.common import cpu_device

    script = Path(__file__).resolve().parents[2] / "examples" / "lightning_elixir" / "fabric_finetune.py"
    profile = tmp_path / "cpu.json"
    cpu_device().to_json(profile)

    def run(out: str, *extra: str) -> list[float]:
        argv = [sys.executable, str(script), "--device-profile", str(profile), "--out", out, *extra]
        done = subprocess.run(argv, cwd=tmp_path, env=unlaunched_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads((tmp_path / out / "summary.json").read_text())["losses"]

    straight = run("straight", "--steps", "4")
    first = run("split", "--steps", "2")
    resumed = run("split", "--steps", "4", "--resume")
    assert len(straight) == 4 and first == straight[:2]
    assert resumed == straight[2:], (resumed, straight)


def _bf16(rank: int, world: int) -> dict:
    from lightning_elixir import ElixirFabricStrategy
    from tests.lightning_elixir.common import cpu_device

    ddp = _loop("ddp", steps=6, precision="bf16-mixed")
    strategy = ElixirFabricStrategy(memory_budget=_mixed_budget(world), device_profile=cpu_device(),
                                    example_input=_example(), verbose=False)
    elixir = _loop(strategy, steps=6, precision="bf16-mixed")
    return {"ddp": ddp["losses"], "elixir": elixir["losses"], "priced": strategy.plan.precision,
            "param_dtype": strategy.plan.param_dtype, "runtime": strategy.runtime}


@RunIf(lightning=True, min_world=2)
def test_fabric_precision_flag_is_priced_and_trains_as_ddp_within_bf16_rounding():
    for r in run_distributed(_bf16, 2, timeout=300, env=ENV):
        assert r["priced"] == "bf16-mixed" and r["param_dtype"] == "bfloat16" and r["runtime"] == "FSDP2"
        assert len(r["elixir"]) == 6
        # bf16 keeps 8 bits of mantissa: 2**-8 relative per rounding, a few of them through a step.
        assert max(abs(a - b) for a, b in zip(r["elixir"], r["ddp"])) <= 0.05, (r["elixir"], r["ddp"])
