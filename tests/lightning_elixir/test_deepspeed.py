"""``ElixirDeepSpeedStrategy``: the plan's DeepSpeed ZeRO translation trains through Lightning's DeepSpeedStrategy.

On this CPU-only machine the adapter lifts Lightning's CUDA-only check knowingly and DeepSpeed runs on
its CPU accelerator over gloo (deepspeed_backend.py says why); two real processes, against DDP.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

# ZeRO-3 keeps fp32 partitions of flattened parameters and reduces in buckets, so sums run in another
# order than DDP's; 1e-4 on losses ~5 over 8 steps is still far below a one-step change (~0.05).
LOSS_ATOL = 1e-4


def _deepspeed_vs_ddp(rank: int, world: int, tmp: str) -> dict:
    import lightning as L

    from lightning_elixir import ElixirDeepSpeedStrategy
    from tests.lightning_elixir.common import TinyGPT, cpu_device, mixed_budget_for, trainer

    budget = mixed_budget_for(world)
    L.seed_everything(0)
    ref = TinyGPT()
    trainer("ddp", Path(tmp) / "ddp", devices=world, max_steps=8).fit(ref)
    L.seed_everything(0)
    model = TinyGPT()
    strategy = ElixirDeepSpeedStrategy(memory_budget=budget, device_profile=cpu_device(),
                                       verbose=rank == 0, config={"zero_optimization": {"reduce_bucket_size": 1 << 20}})
    trainer(strategy, Path(tmp) / "ds", devices=world, max_steps=8).fit(model)
    zero = strategy.config["zero_optimization"]
    return {"ddp": ref.losses, "ds": model.losses, "stage": zero["stage"],
            "offload": "offload_optimizer" in zero, "engine": type(strategy.model).__name__,
            "mixed": strategy.plan.is_mixed}


@RunIf(lightning=True, deepspeed=True, min_world=2)
def test_deepspeed_backend_runs_the_translated_plan(tmp_path):
    results = run_distributed(_deepspeed_vs_ddp, 2, args=(str(tmp_path),), timeout=420,
                              env={"GROUP_RANK": "0", "DS_ACCELERATOR": "cpu"})
    for r in results:
        assert r["mixed"] and r["stage"] == 3 and r["offload"], r
        assert r["engine"] == "DeepSpeedEngine"
        assert len(r["ds"]) == len(r["ddp"]) == 8
        assert max(abs(a - b) for a, b in zip(r["ddp"], r["ds"])) <= LOSS_ATOL, (r["ddp"], r["ds"])
