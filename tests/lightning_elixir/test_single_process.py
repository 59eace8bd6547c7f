"""Elixir in one process: a mixed plan gives the losses of DDP on one process; a model built
in ``configure_model`` stays on meta until the plan places it; Lightning's demo Transformer trains;
an infeasible budget fails before anything is allocated; a plan made for something else is refused.

Each test that builds a process group runs in a spawned rank (world size 1), so Lightning's global
state and the group never leak into the pytest process.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

LOSS_ATOL = 1e-5  # see test_distributed.py
ENV = {"GROUP_RANK": "0"}


def _one_process(rank: int, world: int, tmp: str) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.demos import Transformer
    from lightning.pytorch.demos.transformer import LightningTransformer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.apply import inspect_units
    from tests.lightning_elixir.common import TinyGPT, cpu_device, mixed_budget_for, trainer

    tmp_path = Path(tmp)
    out: dict = {}
    budget = mixed_budget_for(1)

    # 1. Mixed plan vs plain single-device training, same seed and data.
    L.seed_everything(0)
    ref = TinyGPT()
    trainer("ddp", tmp_path / "ref", devices=1, max_steps=20).fit(ref)  # same DistributedSampler order
    L.seed_everything(0)
    model = TinyGPT()
    strategy = ElixirStrategy(memory_budget=budget, device_profile=cpu_device(), verbose=False)
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path / "logs"), name="elixir")
    trainer(strategy, tmp_path / "elixir", devices=1, max_steps=20, logger=logger).fit(model)
    out["ref"], out["elixir"] = ref.losses, model.losses
    # Predicted vs measured after warm-up: a record on the strategy and the same numbers in the logger.
    rec = strategy.prediction
    out["prediction"] = None if rec is None else (rec.predicted_step_s, rec.measured_step_s, rec.steps,
                                                  rec.cost_model, rec.time_error)
    metrics = Path(logger.log_dir) / "metrics.csv"
    out["logged"] = metrics.read_text().splitlines()[0].split(",") if metrics.is_file() else []
    out["mixed"] = strategy.plan.is_mixed
    out["offloaded_groups"] = sum(s.offload for s in inspect_units(model))

    # 2. configure_model: built on meta, materialised by the plan, GPT-2 initialisation applied.
    L.seed_everything(0)
    lazy = TinyGPT(meta=True)
    seen: dict = {}

    class Probe(L.Callback):
        def on_fit_start(self, trainer, pl_module):  # after setup: the plan has been applied
            seen["meta_after_setup"] = any(p.is_meta for p in pl_module.parameters())
            seen["init_std"] = pl_module.model.blocks[0].mlp.c_fc.weight.full_tensor().std().item()
            seen["init_bias"] = pl_module.model.blocks[0].mlp.c_fc.bias.full_tensor().abs().max().item()

    class Before(ElixirStrategy):
        def _decide_plan(self, trainer):  # what configure_model left behind, before any plan
            seen["meta_before_plan"] = all(p.is_meta for p in self.lightning_module.parameters())
            return super()._decide_plan(trainer)

    trainer(Before(memory_budget=budget, device_profile=cpu_device(), verbose=False), tmp_path / "lazy", devices=1,
            max_steps=20, callbacks=[Probe()]).fit(lazy)
    out.update(seen)
    out["lazy"] = lazy.losses

    # 3. Mixed precision: FSDP2 casts parameters to bf16 for compute, reduces gradients in fp32.
    for precision in ("bf16-mixed", "bf16-true"):
        L.seed_everything(0)
        half = TinyGPT()
        s_half = ElixirStrategy(device_profile=cpu_device(), verbose=False)
        trainer(s_half, tmp_path / precision, devices=1, max_steps=12, precision=precision).fit(half)
        out[precision] = (half.losses, s_half.plan.param_dtype, s_half.plan.reduce_dtype,
                          str(half.model.blocks[0].mlp.c_fc.weight.dtype))

    # 4. Lightning's own demo Transformer (random tokens instead of its WikiText2 download).
    class DemoTransformer(LightningTransformer):
        def __init__(self) -> None:
            super().__init__(vocab_size=64)
            self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)
            self.losses: list[float] = []

        def prepare_data(self) -> None:
            pass

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, 64, (64, 16), generator=g)
            return DataLoader(TensorDataset(x, (x + 1) % 64), batch_size=8)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.losses.append(outputs["loss"].item())

    L.seed_everything(0)
    demo = DemoTransformer()
    demo_trainer = trainer("elixir", tmp_path / "demo", devices=1, max_steps=24)
    demo_trainer.fit(demo)
    out["demo"] = demo.losses
    out["demo_groups"] = len(inspect_units(demo))
    plan = demo_trainer.strategy.plan
    out["demo_plan"] = ([u.mode for u in plan.units], plan.search_method, plan.cost_model)
    return out


@RunIf(lightning=True)
def test_one_process_matches_single_device_and_trains_demo_transformer(tmp_path):
    (r,) = run_distributed(_one_process, 1, args=(str(tmp_path),), timeout=300, env=ENV)
    assert r["mixed"] and r["offloaded_groups"] > 0
    predicted, measured, steps, cost_model, error = r["prediction"]
    assert steps == 5 and measured > 0 and predicted > 0 and abs(error - (predicted / measured - 1)) < 1e-9
    assert cost_model.startswith("FLOPs / rate")  # cpu_device() has no block timings: the plan says so
    assert {"elixir/predicted_step_s", "elixir/measured_step_s", "elixir/step_time_error"} <= set(r["logged"])
    assert len(r["ref"]) == len(r["elixir"]) == 20
    assert max(abs(a - b) for a, b in zip(r["ref"], r["elixir"])) <= LOSS_ATOL, (r["ref"], r["elixir"])
    # configure_model ran on meta; the plan materialised it with GPT-2's N(0, 0.02) initialisation.
    assert r["meta_before_plan"] and not r["meta_after_setup"]
    assert 0.019 < r["init_std"] < 0.021 and r["init_bias"] == 0.0, (r["init_std"], r["init_bias"])
    assert r["lazy"][-1] < r["lazy"][0] - 1.0, r["lazy"]
    # bf16-mixed: the plan asks FSDP2 for bf16 compute and fp32 reduction, fp32 master weights stay; bf16-true
    # keeps bf16 weights. Both track the fp32 run within bf16's precision and learn.
    losses, param_dtype, reduce_dtype, weight_dtype = r["bf16-mixed"]
    assert (param_dtype, reduce_dtype, weight_dtype) == ("bfloat16", "float32", "torch.float32")
    assert max(abs(a - b) for a, b in zip(losses, r["elixir"])) < 0.05, (losses, r["elixir"][:12])
    losses, param_dtype, _, weight_dtype = r["bf16-true"]
    assert param_dtype == "bfloat16" and weight_dtype == "torch.bfloat16" and losses[-1] < losses[0] - 0.25
    # Lightning's demo Transformer with the whole device free: priced from this machine's measurements, the plan
    # keeps DDP's (one replicated unit) unless something is clearly faster; either way applied, and it learns
    # (next token = token + 1).
    modes, method, cost_model = r["demo_plan"]
    assert cost_model.startswith("measured block timings"), cost_model
    # An all-replicate plan is applied as one DDP group, whatever its number of units; otherwise one FSDP2 group each.
    assert r["demo_groups"] == (1 if set(modes) == {"replicate"} else len(modes)) and modes, (r["demo_groups"], modes)
    assert modes == ["replicate"] and "replication kept" in method or len(modes) >= 2, (modes, method)
    assert sum(r["demo"][-4:]) / 4 < sum(r["demo"][:4]) / 4 - 0.5, r["demo"]


def _errors(rank: int, world: int, tmp: str) -> dict:
    import dataclasses

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.planning import make_plan, profile_module
    from tests.lightning_elixir.common import BATCH, CONFIG, TinyGPT, cpu_device, token_data, trainer
    from tightfit.models import GPT, build_gpt
    from tightfit.planner.elixir import PlanInfeasibleError
    from tightfit.profiler.types import ClusterSpec

    out: dict = {}

    class Big(L.LightningModule):
        """GPT-2 (124 M parameters, 500 MB in fp32, eight times the budget) built in configure_model, so on meta:
        nothing allocated. Any size the budget cannot hold shows the refusal; a larger one only takes longer to
        profile and search on meta."""

        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.example_input_array = torch.zeros(2, 64, dtype=torch.long)

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build_gpt("gpt2")

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            return self.model(batch).sum()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    big = Big()
    try:
        trainer(ElixirStrategy(memory_budget="64MiB", device_profile=cpu_device(), verbose=False), Path(tmp) / "big",
                devices=1, max_steps=1).fit(big)
        out["infeasible"] = "no error"
    except PlanInfeasibleError as exc:
        out["infeasible"] = str(exc)
        out["needed"], out["budget"] = exc.needed_bytes, exc.budget_bytes
        out["all_meta"] = all(p.is_meta for p in big.parameters())

    # Plans made for another world size and for another (wider) model.
    batch = next(iter(DataLoader(token_data(8), batch_size=BATCH)))
    for which in ("world", "model"):
        other = TinyGPT()
        if which == "model":
            other.model = GPT(dataclasses.replace(CONFIG, hidden=128))
        plan = make_plan(profile_module(other, batch), ClusterSpec.uniform(cpu_device(), 2 if which == "world" else 1))
        path = Path(tmp) / f"plan-{which}.json"
        plan.to_json(path)
        try:
            trainer(ElixirStrategy(plan=str(path), verbose=False), Path(tmp) / which, devices=1,
                    max_steps=1).fit(TinyGPT())
            out[which] = "no error"
        except Exception as exc:  # the test asserts the type by name
            out[which] = f"{type(exc).__name__}: {exc}"
    return out


@RunIf(lightning=True)
def test_infeasible_budget_and_mismatched_plans_fail_clearly(tmp_path):
    (r,) = run_distributed(_errors, 1, args=(str(tmp_path),), timeout=300, env=ENV)
    # Infeasible: PlanInfeasibleError with the numbers, raised while the model is still on meta.
    assert "no Elixir plan fits 64.00 MiB per device" in r["infeasible"], r["infeasible"]
    assert "Smallest budget that fits" in r["infeasible"] and "Cheapest change" in r["infeasible"]
    assert r["needed"] > r["budget"] == 64 * 2**20
    assert r["all_meta"], "parameters were allocated before the plan was found infeasible"
    # A plan file for another world size / model.
    assert re.search(r"PlanMismatchError: plan was made for world size 2, this run has 1 ranks", r["world"]), r["world"]
    assert re.search(r"PlanMismatchError: plan was made for a model with [\d,]+ parameters .*this model has [\d,]+",
                     r["model"]), r["model"]
    assert "re-plan for this run" in r["world"] and "re-plan for this run" in r["model"]
