"""``python -m tests.gpu.elixir_job DIR [--deepspeed]``: Lightning + Elixir on one GPU in a fresh process
(Lightning starts NCCL itself there); prints one JSON line ``{precision: {"ref": [...], "elixir": [...], ...}}``.
``--deepspeed``: the plan translated to DeepSpeed ZeRO (``ElixirDeepSpeedStrategy``), bf16-mixed only.

Run by tests/gpu/test_elixir.py; a separate process so Lightning's global state and the process group
never leak into the pytest process (the CPU tests spawn a rank for the same reason).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(tmp: str, deepspeed: bool = False) -> dict:
    import lightning as L

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.apply import inspect_units
    from lightning_elixir.deepspeed_backend import ElixirDeepSpeedStrategy
    from lightning_elixir.precision import ElixirPrecision
    from tests.lightning_elixir.common import TinyGPT, cpu_device, mixed_budget_for

    def trainer(strategy, root: Path, **kwargs) -> L.Trainer:
        return L.Trainer(strategy=strategy, accelerator="gpu", devices=1, max_steps=12, default_root_dir=str(root),
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, **kwargs)

    out = {}
    for precision in ("bf16-mixed",) if deepspeed else ("bf16-mixed", "16-mixed"):
        L.seed_everything(0)
        ref = TinyGPT()
        # DDP on one device: the same DistributedSampler order as Elixir (ModelParallelStrategy) sees
        trainer("ddp", Path(tmp) / f"ref-{precision}", precision=precision).fit(ref)
        L.seed_everything(0)
        model = TinyGPT()
        # The fixed CPU profile and its mixed budget: the plan offloads some units and keeps others.
        strategy_cls = ElixirDeepSpeedStrategy if deepspeed else ElixirStrategy
        strategy = strategy_cls(memory_budget=mixed_budget_for(1, precision=precision), device_profile=cpu_device(),
                                verbose=False)
        plugins = [ElixirPrecision(precision="16-mixed", init_scale=2.0**10)] if precision == "16-mixed" else []
        kwargs = {"plugins": plugins} if plugins else {"precision": precision}
        trainer(strategy, Path(tmp) / f"elixir-{precision}", **kwargs).fit(model)
        out[precision] = {"ref": ref.losses, "elixir": model.losses, "mixed": strategy.plan.is_mixed,
                          "offloaded_groups": (int(bool(strategy.plan.offloaded_units)) if deepspeed
                                               else sum(s.offload for s in inspect_units(model)))}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], deepspeed="--deepspeed" in sys.argv[2:])), flush=True)
