"""``precision="16-mixed"`` under Elixir: fp16 FSDP2 units with dynamic loss scaling, on real gloo ranks.

* 2 processes, a mixed plan priced for fp16: the losses track fp32 DDP on the same data and seed, the
  gradients the hooks see are unscaled (their norm is DDP's), and the mean of the two ranks' losses is
  what one process training on both ranks' samples (batch 8) gets;
* overflow: a loss spike on rank 1 only (fp16 overflows in backward) and an inf planted in rank 1's
  gradient shard only: every rank skips those steps (parameters and optimizer step count unchanged) and
  halves the scale; clean steps grow it back (growth_interval=4); clipping binds on unscaled gradients;
* resume from a checkpoint saved mid-run: the scale and its growth tracker come back from the checkpoint
  and the run continues with the original's losses and scales.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

ENV = {"GROUP_RANK": "0"}
# fp16 vs fp32 losses (loss 5.5 -> ~3.5 over 20 steps). fp16's unit roundoff is 2**-11 = 4.9e-4 (bf16's is
# 8x coarser; the bf16-mixed test allows 0.05): logits carry ~1e-3 relative error and Adam compounds it.
# Measured on 2 ranks: max |fp16 - fp32| 0.0016 (default scale, one step skipped in both runs) and 0.0010
# (scale 2**10); 0.01 leaves 6x margin, while one step skipped by one run and not the other moves the
# losses by ~0.1 (measured 0.12), and a step taken with scaled gradients or in the wrong dtype by more.
FP16_LOSS_ATOL = 0.01
# Same precision, same samples, different batch split (2 x 4 vs 1 x 8): only the rounding of differently
# blocked fp16 matmuls and of the reduction differs; measured max 0.0005.
SPLIT_LOSS_ATOL = 0.005
# Gradient norm the hooks see, fp16 vs fp32 (same weights at step 0, then the trajectories above):
# measured within 0.8%; an unscaled-by-mistake gradient is 1024x.
GRAD_NORM_RTOL = 0.03
# The overflow run: rank 1 overflows at SPIKE_STEP and INF_STEP; the scale starts at INIT and doubles after
# GROWTH clean steps; the checkpoint is taken at an epoch's end (10 steps of 2 x 4 of 80 samples), where
# Lightning resumes a plain DataLoader exactly.
SPIKE_STEP, INF_STEP, CKPT_STEP, STEPS, INIT, GROWTH = 3, 6, 10, 12, 2.0**10, 4


def _global_norm(params) -> float:
    """L2 norm of the full gradients (DTensor shards gathered); what the optimizer receives."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0.0
    for p in params:
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            total += g.double().pow(2).sum().item()
    return float(torch.tensor(total).sqrt())


def _checksum(params) -> float:
    from torch.distributed.tensor import DTensor

    return sum((p.full_tensor() if isinstance(p, DTensor) else p).double().sum().item() for p in params)


def _recorder():
    import lightning as L

    class Recorder(L.Callback):
        """Per step: the gradient norm the hooks see (before clipping) and after the step (after clipping),
        the loss scale and its growth tracker, a parameter checksum and the optimizer's step count."""

        def __init__(self) -> None:
            self.pre, self.post, self.scale, self.tracker, self.checksum, self.opt_steps = [], [], [], [], [], []
            self.start_scale: tuple | None = None

        def on_train_start(self, trainer, pl_module) -> None:  # after a resume restored the scaler
            s = getattr(trainer.precision_plugin, "scaler", None)
            self.start_scale = (s.get_scale(), s._get_growth_tracker()) if s is not None else None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.pre.append(_global_norm(pl_module.parameters()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.post.append(_global_norm(pl_module.parameters()))
            s = getattr(trainer.precision_plugin, "scaler", None)
            self.scale.append(s.get_scale() if s is not None else None)
            self.tracker.append(s._get_growth_tracker() if s is not None else None)
            self.checksum.append(_checksum(pl_module.parameters()))
            opt = trainer.optimizers[0]
            self.opt_steps.append(max((int(st["step"]) for st in opt.state.values() if "step" in st), default=0))

    return Recorder()


def _skipped(opt_steps: list[int]) -> list[int]:
    """Steps after which the optimizer's step count did not move: the scaler skipped them."""
    return [i for i, n in enumerate(opt_steps) if n == (opt_steps[i - 1] if i else 0)]


def _models():
    import torch.distributed as dist

    from tests.lightning_elixir.common import TinyGPT

    class SkippingGPT(TinyGPT):
        """fp32 reference that leaves the parameters and the optimizer alone at the given steps, as a
        skipped fp16 step does (forward and backward still run, so the data order is unchanged)."""

        def __init__(self, skip: list[int]) -> None:
            super().__init__()
            self.skip = set(skip)

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
            if self.global_step in self.skip:
                optimizer_closure()
                return
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    class SpikyGPT(TinyGPT):
        """TinyGPT whose rank 1 alone overflows twice: its loss x1e6 at SPIKE_STEP (fp16 backward overflows
        to inf naturally) and an inf written into one element of its local gradient shard at INF_STEP."""

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e6 if dist.get_rank() == 1 and self.global_step == SPIKE_STEP else loss

        def on_after_backward(self) -> None:
            if dist.get_rank() == 1 and self.global_step == INF_STEP:
                self.model.blocks[-1].mlp.c_fc.weight.grad.to_local().view(-1)[0] = float("inf")

    return SkippingGPT, SpikyGPT


def _two_processes(rank: int, world: int, tmp: str) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.apply import inspect_units
    from lightning_elixir.precision import ElixirPrecision
    from tests.lightning_elixir.common import TinyGPT, cpu_device, mixed_budget_for, trainer

    tmp_path = Path(tmp)
    budget = mixed_budget_for(world, precision="16-mixed")
    SkippingGPT, SpikyGPT = _models()
    out: dict = {}

    def elixir(name: str, model, steps: int = 20, ckpt_path: str | None = None, **kwargs) -> L.Trainer:
        fit = trainer(ElixirStrategy(memory_budget=budget, device_profile=cpu_device(), verbose=False),
                      tmp_path / name, devices=world, max_steps=steps, **kwargs)
        fit.fit(model, ckpt_path=ckpt_path)
        return fit

    def ddp(model, rec=None) -> list[float]:
        trainer("ddp", tmp_path / "ddp", devices=world, max_steps=20, callbacks=[rec] if rec else []).fit(model)
        return model.losses

    # 1. The Trainer flag with the default scaler (2**16): the first steps may overflow (the scale is
    #    searched); fp32 DDP skipping the same steps is the reference.
    L.seed_everything(0)
    model, rec = TinyGPT(), _recorder()
    fit = elixir("flag", model, precision="16-mixed", callbacks=[rec])
    skipped = _skipped(rec.opt_steps)
    L.seed_everything(0)
    out["flag"] = {"losses": model.losses, "scale": rec.scale, "skipped": skipped,
                   "ddp": ddp(SkippingGPT(skipped)), "plugin": type(fit.precision_plugin).__name__}
    s = fit.strategy
    out["plan"] = (s.plan.precision, s.plan.param_dtype, s.plan.reduce_dtype, s.plan.is_mixed)
    units = inspect_units(model)
    out["offloaded"], out["resident"] = sum(u.offload for u in units), sum(not u.offload for u in units)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None]
    out["mp"] = sorted({(str(g.mp_policy.param_dtype), str(g.mp_policy.reduce_dtype)) for g in groups})
    out["master"] = sorted({str(p.dtype) for p in model.parameters()})

    # 2. A scale that never overflows here (2**10): every step taken, compared step by step with fp32 DDP.
    L.seed_everything(0)
    model, rec = TinyGPT(), _recorder()
    elixir("fp16", model, plugins=[ElixirPrecision(init_scale=2.0**10)], callbacks=[rec])
    L.seed_everything(0)
    ref_rec = _recorder()
    out["fp16"] = {"losses": model.losses, "pre": rec.pre, "scale": rec.scale, "skipped": _skipped(rec.opt_steps),
                   "ddp": ddp(TinyGPT(), ref_rec), "ddp_pre": ref_rec.pre}

    # 3. Overflows on rank 1 only, clipping, growth (every GROWTH clean steps), a checkpoint mid-run.
    L.seed_everything(0)
    spiky, rec = SpikyGPT(), _recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=CKPT_STEP, save_top_k=-1,
                           filename="step{step}", auto_insert_metric_name=False)
    elixir("spiky", spiky, STEPS, plugins=[ElixirPrecision(init_scale=INIT, growth_interval=GROWTH)],
           gradient_clip_val=0.05, callbacks=[rec, ckpt], enable_checkpointing=True)
    out["spiky"] = {"losses": spiky.losses, **{k: getattr(rec, k) for k in
                                                ("pre", "post", "scale", "tracker", "checksum", "opt_steps")}}
    path = tmp_path / "ckpt" / f"step{CKPT_STEP}.ckpt"
    out["saved_scaler"] = torch.load(path / "meta.pt", weights_only=True).get("ElixirPrecision")

    # 4. Resume: a new Trainer and a fresh plugin (scale INIT, tracker 0) continue the run.
    L.seed_everything(0)  # as the original script: the DistributedSampler shuffles with this seed
    resumed, rec = SpikyGPT(), _recorder()
    elixir("resume", resumed, STEPS, ckpt_path=str(path), plugins=[ElixirPrecision(init_scale=INIT, growth_interval=GROWTH)],
           gradient_clip_val=0.05, callbacks=[rec])
    out["resumed"] = {"losses": resumed.losses, "scale": rec.scale, "tracker": rec.tracker, "start": rec.start_scale}
    return out


def _one_process(rank: int, world: int, tmp: str) -> dict:
    import lightning as L

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.precision import ElixirPrecision
    from tests.lightning_elixir.common import BATCH, TinyGPT, cpu_device, mixed_budget_for, trainer

    # Both ranks' samples in one batch: DistributedSampler gives rank r the permutation's r-th of every
    # 2, so one process at batch 8 sees exactly the union of the 2 ranks' batches of 4, step by step.
    budget = mixed_budget_for(1, precision="16-mixed", batch_size=2 * BATCH)
    L.seed_everything(0)
    model = TinyGPT(batch_size=2 * BATCH)
    strategy = ElixirStrategy(memory_budget=budget, device_profile=cpu_device(), verbose=False)
    trainer(strategy, Path(tmp) / "one", devices=1, max_steps=20,
            plugins=[ElixirPrecision(init_scale=2.0**10)]).fit(model)
    return {"losses": model.losses, "mixed": strategy.plan.is_mixed}


@RunIf(lightning=True, min_world=2)
def test_fp16_mixed_tracks_fp32_skips_overflow_on_every_rank_and_resumes(tmp_path):
    results = run_distributed(_two_processes, 2, args=(str(tmp_path),), timeout=420, env=ENV)
    (one,) = run_distributed(_one_process, 1, args=(str(tmp_path),), timeout=300, env=ENV)
    r0, r1 = results
    for rank, r in enumerate(results):
        # The Trainer flag selected Elixir's plugin; the plan was priced for fp16 and FSDP2 runs it so.
        flag, fp16 = r["flag"], r["fp16"]
        assert flag["plugin"] == "ElixirPrecision"
        assert r["plan"] == ("16-mixed", "float16", "float32", True), r["plan"]
        assert r["offloaded"] and r["resident"], r
        assert r["mp"] == [("torch.float16", "torch.float32")] and r["master"] == ["torch.float32"], r
        # Default scale: each skipped step halved it; the rest follow fp32 DDP that skips the same steps.
        assert flag["skipped"] == r0["flag"]["skipped"] and len(flag["skipped"]) <= 3, flag
        assert all(flag["scale"][i] == (flag["scale"][i - 1] if i else 2.0**16) / 2 for i in flag["skipped"])
        diff = max(abs(a - b) for a, b in zip(flag["ddp"], flag["losses"]))
        assert len(flag["losses"]) == 20 and diff <= FP16_LOSS_ATOL, f"rank {rank}: flag run vs DDP: {diff}"
        # No overflow at 2**10: all 20 steps taken, the losses are fp32 DDP's within fp16's error, and the
        # gradients the hooks saw were unscaled (a scaled one is 1024x DDP's norm).
        assert fp16["skipped"] == [] and set(fp16["scale"]) == {2.0**10}, fp16
        diff = max(abs(a - b) for a, b in zip(fp16["ddp"], fp16["losses"]))
        assert len(fp16["losses"]) == 20 and diff <= FP16_LOSS_ATOL, f"rank {rank}: fp16 vs fp32 DDP: {diff}"
        assert fp16["losses"][-1] < fp16["losses"][0] - 1.0, fp16["losses"]
        assert fp16["pre"] == pytest.approx(fp16["ddp_pre"], rel=GRAD_NORM_RTOL), (fp16["pre"], fp16["ddp_pre"])
    # The two ranks' mean loss is the one-process loss on the same 8 samples per step.
    assert one["mixed"]
    mean = [(a + b) / 2 for a, b in zip(r0["fp16"]["losses"], r1["fp16"]["losses"])]
    diff = max(abs(a - b) for a, b in zip(mean, one["losses"]))
    assert len(one["losses"]) == 20 and diff <= SPLIT_LOSS_ATOL, f"2 ranks vs 1 process differ by {diff}"

    s0, s1 = r0["spiky"], r1["spiky"]
    # Every rank took the same decisions: same scales, same parameters, same optimizer step count.
    assert s0["scale"] == s1["scale"] and s0["tracker"] == s1["tracker"] and s0["opt_steps"] == s1["opt_steps"]
    assert s0["checksum"] == s1["checksum"]
    assert _skipped(s0["opt_steps"]) == [SPIKE_STEP, INF_STEP], s0["opt_steps"]
    for i in range(STEPS):
        before = (s0["scale"][i - 1], s0["tracker"][i - 1]) if i else (INIT, 0)
        if i in (SPIKE_STEP, INF_STEP):  # skipped: parameters as they were, scale halved
            assert s0["checksum"][i] == s0["checksum"][i - 1]
            assert (s0["scale"][i], s0["tracker"][i]) == (before[0] / 2, 0)
            continue
        grown = before[1] + 1 == GROWTH  # a clean step; GROWTH in a row double the scale
        assert (s0["scale"][i], s0["tracker"][i]) == ((before[0] * 2, 0) if grown else (before[0], before[1] + 1))
        assert i == 0 or s0["checksum"][i] != s0["checksum"][i - 1]
        # Clipping ran on unscaled gradients: it binds at 0.05, from DDP-sized norms (not 1000x).
        assert 0.05 < s0["pre"][i] < 100 and s0["post"][i] == pytest.approx(0.05, rel=1e-3), (s0["pre"], s0["post"])
    assert r0["spiky"]["losses"][SPIKE_STEP] < 10 < r1["spiky"]["losses"][SPIKE_STEP]  # rank 1's loss x 1e6

    # The checkpoint carries the scaler; the resumed run starts from it and continues identically.
    for r, s in zip(results, (s0, s1)):
        saved = r["saved_scaler"]
        assert (saved["scale"], saved["_growth_tracker"]) == (s["scale"][CKPT_STEP - 1], s["tracker"][CKPT_STEP - 1])
        assert r["resumed"]["start"] == (saved["scale"], saved["_growth_tracker"]) != (INIT, 0)
        assert r["resumed"]["scale"] == s["scale"][CKPT_STEP:] and r["resumed"]["tracker"] == s["tracker"][CKPT_STEP:]
        assert r["resumed"]["losses"] == pytest.approx(s["losses"][CKPT_STEP:], abs=1e-5)


@RunIf(lightning=True)
def test_fp16_plan_is_priced_like_bf16_and_applied_as_fp16_with_fp32_reduce():
    import dataclasses

    import torch

    from lightning_elixir.apply import mixed_precision_policy
    from lightning_elixir.planning import make_plan, profile_module
    from tests.lightning_elixir.common import BATCH, TinyGPT, cpu_device, token_data
    from tightfit.planner.elixir import estimate, mixed_budget
    from tightfit.profiler.types import ClusterSpec

    batch = next(iter(torch.utils.data.DataLoader(token_data(8), batch_size=BATCH)))
    profile = profile_module(TinyGPT(), batch)
    # Equal fp16 and bf16 matmul rates (as on A100/H100 tensor cores): the two must be the same plan.
    device = dataclasses.replace(cpu_device(), matmul_flops={"float32": 5e10, "bfloat16": 1e11, "float16": 1e11})
    cluster = ClusterSpec.uniform(device, 2)
    budget = mixed_budget(profile, cluster, precision="bf16-mixed")
    fp16, bf16 = (make_plan(profile, cluster, precision=p, memory_budget=budget) for p in ("16-mixed", "bf16-mixed"))
    assert fp16.is_mixed and fp16.units == bf16.units
    assert (fp16.peak_bytes, fp16.step_time_s, fp16.memory) == (bf16.peak_bytes, bf16.step_time_s, bf16.memory)
    assert (fp16.precision, fp16.param_dtype, fp16.reduce_dtype) == ("16-mixed", "float16", "float32")
    # ... and not like fp32: the same units need more memory there (4-byte gathered parameters and gradients).
    fp32 = estimate(profile, cluster, list(fp16.units), precision="32-true", memory_budget=budget)
    assert fp32.peak_bytes > fp16.peak_bytes
    mp = mixed_precision_policy(fp16)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.float16, torch.float32)


@RunIf(lightning=True)
def test_trainer_flag_selects_elixir_precision_and_bad_arguments_are_named():
    import lightning as L

    import lightning_elixir  # noqa: F401  installs the precision hook
    from lightning_elixir import ElixirStrategy
    from lightning_elixir.precision import ElixirGradScaler, ElixirPrecision

    for strategy in ("elixir", ElixirStrategy(verbose=False)):
        t = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision="16-mixed", logger=False)
        plugin = t.precision_plugin
        assert isinstance(plugin, ElixirPrecision) and plugin.precision == "16-mixed" and plugin.device == "cpu"
        assert isinstance(plugin.scaler, ElixirGradScaler) and plugin.scaler.get_scale() == 2.0**16
    # Other strategies and precisions keep Lightning's own plugins.
    assert type(L.Trainer(strategy="elixir", accelerator="cpu", devices=1, precision="bf16-mixed",
                          logger=False).precision_plugin).__name__ == "MixedPrecision"
    assert type(L.Trainer(strategy="ddp", accelerator="cpu", devices=1, precision="16-true",
                          logger=False).precision_plugin).__name__ == "HalfPrecision"
    with pytest.raises(ValueError, match=r"ElixirPrecision\(precision='bf16-mixed'\): it implements '16-mixed' only"):
        ElixirPrecision("bf16-mixed")
    import torch

    with pytest.raises(TypeError, match=r"scaler=GradScaler.*use an ElixirGradScaler"):
        ElixirPrecision(scaler=torch.amp.GradScaler("cpu"))
