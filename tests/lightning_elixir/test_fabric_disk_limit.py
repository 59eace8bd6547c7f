"""``Fabric(strategy="elixir")`` with parameters on disk (tier 3) under a hard memory limit (a cgroup v1 group,
``benchmarks/memlimit.py``): a model built under ``fabric.init_module(empty_init=True)`` whose parameters, gradients
and AdamW state are larger than the limit sets up (allocated and initialised one unit at a time into the store, never
whole in memory), trains and ``fabric.save``s inside the limit, with the losses of the same loop in RAM.

``python -m tests.lightning_elixir.test_fabric_disk_limit disk|ram WORK_DIR`` is the child the test runs; it prints
one JSON line last.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from benchmarks.memlimit import last_json_line, limit_unavailable, run_limited
from tests.helpers.multiprocess import unlaunched_env
from tests.helpers.runif import RunIf

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
# 64 M parameters in twelve 4.9 M-parameter blocks: fp32 weights 257 MB, with gradients and AdamW's two moments
# 1.03 GB, while the interpreter with torch and Lightning holds about 460 MiB.
GPT = {"vocab_size": 4096, "n_positions": 32, "hidden": 640, "layers": 12, "heads": 8, "tie_embeddings": False}
STEPS, SEQ = 2, 32
# Under it: the interpreter, one block's weights and gradients at a time, the disk tier's staging area (128 MiB)
# and the page cache the store's writes leave (reclaimed under pressure); not the whole model's weights beside them.
LIMIT = 800 * MiB


def _plan(tmp: Path, ram: bool):
    """Every unit's weights, gradients and optimizer state on disk (tiers 3 and 4; ``ram``: the same plan in memory), priced from stated
    CPU and disk profiles and profiled on meta (nothing allocated, no measuring in a test)."""
    import torch

    from lightning_elixir.planning import FORWARD, profile_module
    from tests.lightning_elixir.common import cpu_device
    from tightfit.models import GPTConfig, build_gpt
    from tightfit.planner.elixir import ElixirConstraints, Tier, search
    from tightfit.profiler.types import ClusterSpec, DiskProfile

    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    profile = profile_module(build_gpt(GPTConfig(**GPT), device="meta"), tokens, stage_method=FORWARD)
    disk = DiskProfile(path=str(tmp), free_bytes=2**34, read_fit=(1e-4, 1e9), write_fit=(1e-4, 1e9))
    cluster = ClusterSpec.uniform(dataclasses.replace(cpu_device(), disk=disk), 1)
    plan = search(profile, cluster, precision="32-true", optimizer="adamw",
                  constraints=ElixirConstraints(force_disk=True, modes=("reshard",), unit_blocks=(1,),
                                                prefetch_depths=(1,)))
    units = tuple(dataclasses.replace(u, tier=Tier.DISK_GRADS if u.tier >= Tier.DISK else u.tier) if not ram else
                  dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0) for u in plan.units)
    return dataclasses.replace(plan, units=units)


def child(kind: str, work: Path) -> dict:
    """A litgpt-style Fabric loop, one process: the model on meta, then setup, ``STEPS`` steps and a save."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_elixir import ElixirFabricStrategy
    from tightfit.models import GPTConfig, build_gpt

    torch.set_num_threads(2)
    work.mkdir(parents=True, exist_ok=True)
    (work / "disk").mkdir(exist_ok=True)
    plan = _plan(work, ram=kind == "ram")
    tokens = torch.randint(0, GPT["vocab_size"], (STEPS, SEQ + 1), generator=torch.Generator().manual_seed(7))
    strategy = ElixirFabricStrategy(plan=plan, disk_dir=work / "disk" if kind == "disk" else None,
                                    example_input=tokens[:1, :-1], verbose=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = build_gpt(GPTConfig(**GPT))
    # Together: Fabric's setup_optimizers refuses an optimizer over meta parameters; setup allocates them.
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for step in range(STEPS):
        x, y = tokens[step:step + 1, :-1], tokens[step:step + 1, 1:]
        loss = F.cross_entropy(model(x).reshape(-1, GPT["vocab_size"]), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fabric.save(work / "ckpt", {"model": model, "optimizer": optimizer, "step": STEPS})
    return {"losses": losses, "param_disk_units": len(plan.param_disk_units), "units": len(plan.units),
            "saved": {"meta.pt", "checksums.json"} <= {p.name for p in (work / "ckpt").iterdir()}}


def _run(kind: str, work: Path, limit: int):
    return run_limited([sys.executable, "-m", "tests.lightning_elixir.test_fabric_disk_limit", kind, str(work)],
                       limit, name=f"test-fabric-{kind}", cwd=ROOT, env=unlaunched_env(), timeout=300)


@pytest.mark.skipif(limit_unavailable() is not None, reason=str(limit_unavailable()))
@RunIf(lightning=True)
def test_fabric_tier3_model_larger_than_the_limit_sets_up_trains_and_saves_inside_it(tmp_path):
    params = 2 * GPT["vocab_size"] * GPT["hidden"] + GPT["layers"] * 12 * GPT["hidden"] ** 2
    assert 16 * params > LIMIT  # weights, gradients and AdamW state alone are larger than the limit
    limited = _run("disk", tmp_path / "disk", LIMIT)
    assert limited.enforced and not limited.oom_killed, (limited.returncode, limited.peak_bytes, limited.stderr[-3000:])
    assert limited.returncode == 0, limited.stderr[-3000:]
    got = last_json_line(limited.stdout)
    assert got["param_disk_units"] == got["units"] >= GPT["layers"], got  # every unit's weights waited on disk
    assert got["saved"], got
    assert limited.peak_bytes is not None and limited.peak_bytes <= LIMIT
    # The same loop in RAM, unlimited: more than the limit, the same losses.
    free = _run("ram", tmp_path / "ram", 1 << 50)
    assert free.returncode == 0, free.stderr[-3000:]
    ref = last_json_line(free.stdout)
    assert free.peak_bytes is not None and free.peak_bytes > LIMIT, free.peak_bytes
    assert ref["param_disk_units"] == 0 and got["losses"] == ref["losses"], (got["losses"], ref["losses"])


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], Path(sys.argv[2]))), flush=True)
