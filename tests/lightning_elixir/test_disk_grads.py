"""Elixir with gradients on disk between backward and the step (state tier 4, ``Tier.DISK_GRADS``): bit-equal
to the same plan all in RAM (fp32, gradient accumulation, norm and value clipping) on 1 and 2 real gloo ranks,
with the sums of micro-batches kept in RAM or read-added-written on disk; the bytes that went to disk, the
gradients dropped from RAM, checkpoint/resume, and the planner choosing tier 4 only where the host needs it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.lightning_elixir.test_disk_params import _plan_with_disk_world, _strategy, fit_beside_ram
from tests.lightning_elixir.test_disk_tier import CHUNK, ENV, _fit, _plan_with_disk
from tightfit.planner.elixir import Tier

STEPS = 3
MICRO = 2  # accumulate_grad_batches in _fit


def _tier4(plan, *, on_host: bool, every: int = 1):
    """``plan`` with every ``every``-th disk unit in tier 4 (the others in tier 3: both in one run)."""
    units = [dataclasses.replace(u, tier=(Tier.DISK_GRADS if i % every == 0 else Tier.DISK_PARAMS)
                                 if u.tier >= Tier.DISK else u.tier) for i, u in enumerate(plan.units)]
    return dataclasses.replace(plan, units=tuple(units), grads_accumulate_on_host=on_host)


def _ram(plan):
    return dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0)
                                                 for u in plan.units))


class _Watch:
    """Before each optimizer step: which tier-4 parameters still hold a gradient in RAM, and which have one on disk."""

    def __init__(self) -> None:
        self.in_ram: list[int] = []
        self.on_disk: list[int] = []
        self.grads = None

    def callback(self):
        import lightning as L

        watch = self

        class Cb(L.Callback):
            def on_before_optimizer_step(self, trainer, module, optimizer):
                grads = trainer.strategy.disk_state.grads
                watch.grads = grads
                params = [p for u in grads.units for p, _, _ in u.pieces]
                watch.in_ram.append(sum(p.grad is not None for p in params))
                watch.on_disk.append(sum(grads.holds(p) for p in params))

        return Cb()


@pytest.mark.parametrize("on_host", [True, False], ids=["sums-in-ram", "read-add-write"])
def test_one_rank_grads_on_disk_bit_equal_to_ram_with_the_bytes_asserted(tmp_path, on_host):
    from tightfit.storage import TensorStore

    plan = _tier4(_plan_with_disk(tmp_path), on_host=on_host, every=2)
    assert plan.grad_disk_units and len(plan.grad_disk_units) < len(plan.param_disk_units)  # tiers 3 and 4 mixed
    watch = _Watch()
    state = fit_beside_ram(plan, _ram(plan), tmp_path, watch.callback(), steps=STEPS, micro=MICRO)
    grads = watch.grads
    assert state is not None and grads is not None and state.steps == STEPS
    # Before every step (after backward and clipping) no tier-4 gradient is in RAM: all of them wait on disk.
    numel = {u.index: sum(n for _, _, n in u.pieces) for u in grads.units}
    tensors = sum(len(u.pieces) for u in grads.units)
    assert watch.in_ram == [0] * STEPS and watch.on_disk == [tensors] * STEPS
    # Bytes: each step writes every tier-4 gradient once per flush (the last micro-batch; every micro-batch when
    # the sums are not kept in RAM) and reads the earlier sums back (read-add-write); the step reads each once.
    g = sum(numel.values()) * 4
    assert grads.bytes_written == STEPS * g * (1 if on_host else MICRO)
    assert grads.bytes_read == (0 if on_host else STEPS * (MICRO - 1) * g)
    assert state.bytes_read >= STEPS * g  # the streamed step read them with the state
    assert not grads.terms and not grads.on_disk  # consumed by the last step
    # Staging: the chunk's master weights and gradient beside AdamW's two moments, in two sets.
    assert state.staging_bytes == 2 * 4 * CHUNK * 4
    with TensorStore(tmp_path / "disk" / "rank0") as store:
        assert {grads.name(u) for u in numel} <= set(store.names())


def test_value_clipping_of_gradients_on_disk_is_bit_equal(tmp_path):
    from lightning_elixir import ElixirStrategy

    plan = _tier4(_plan_with_disk(tmp_path), on_host=False)
    losses, weights, _ = _fit(_strategy(plan, tmp_path / "disk"), tmp_path / "a", devices=1, steps=STEPS,
                              gradient_clip_algorithm="value")
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "b", devices=1,
                                      steps=STEPS, gradient_clip_algorithm="value")
    unclipped, _, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "c", devices=1, steps=STEPS,
                           gradient_clip_val=None)
    assert losses == ram_losses != unclipped  # the clip bites, and equally on disk
    for n in weights:
        assert weights[n].equal(ram_weights[n]), n


def _clips_twice(first: str):
    """TinyGPT whose ``configure_gradient_clipping`` clips twice per step: by ``first`` at 0.05, then by norm at
    0.02 (a user's own second clip, or a callback's, after Lightning's)."""
    from tests.lightning_elixir.common import TinyGPT

    class ClipsTwice(TinyGPT):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm=first)
            self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="norm")

    return ClipsTwice


def test_a_second_norm_clip_in_one_step_sees_the_clipped_gradients_on_disk(tmp_path):
    import torch

    from lightning_elixir import ElixirStrategy

    plan = _tier4(_plan_with_disk(tmp_path), on_host=True)
    twice = _clips_twice("norm")
    losses, weights, _ = _fit(_strategy(plan, tmp_path / "disk"), tmp_path / "a", devices=1, steps=STEPS,
                              model_cls=twice, gradient_clip_val=None)
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "b", devices=1,
                                      steps=STEPS, model_cls=twice, gradient_clip_val=None)
    once, _, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "c", devices=1, steps=STEPS)
    assert ram_losses[-1] != once[-1]  # the second clip bites
    # Equal to float64 rounding of the norm: the second norm is derived from the kept terms (RAM sums the
    # fp32-rounded scaled gradients), so the coefficient can differ in its last fp32 bit at most.
    assert losses == pytest.approx(ram_losses, rel=1e-6, abs=0)
    for n in weights:
        torch.testing.assert_close(weights[n], ram_weights[n], rtol=1e-6, atol=1e-9, msg=n)


def test_a_norm_clip_after_a_value_clip_with_gradients_on_disk_is_refused(tmp_path):
    plan = _tier4(_plan_with_disk(tmp_path), on_host=True)
    with pytest.raises(ValueError, match="after clipping by value in the same step"):
        _fit(_strategy(plan, tmp_path / "disk"), tmp_path / "a", devices=1, steps=STEPS, model_cls=_clips_twice("value"),
             gradient_clip_val=None)


def grads_disk_vs_ram(rank: int, world: int, tmp: str, on_host: bool) -> dict:
    from lightning_elixir import ElixirStrategy

    root = Path(tmp)
    plan = _tier4(_plan_with_disk_world(root / f"profile{rank}", world), on_host=on_host)
    strategy = _strategy(plan, root / "disk")
    written: list[int] = []
    original_teardown = strategy.teardown
    strategy.teardown = lambda: (written.append(strategy.disk_state.grads.bytes_written),  # type: ignore
                                 original_teardown())
    losses, weights, _ = _fit(strategy, root / "a", devices=world, steps=STEPS)
    ref_losses, ref_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), root / "b", devices=world,
                                      steps=STEPS)
    return {"losses": losses, "ref_losses": ref_losses, "tier4": plan.grad_disk_units, "written": written[0],
            "equal": all(weights[n].equal(ref_weights[n]) for n in weights)}


def both_sums_disk_vs_ram(rank: int, world: int, tmp: str) -> dict:
    """:func:`grads_disk_vs_ram` with the micro-batches' sums in RAM, then on disk, in one spawn of the ranks (each
    rank imports torch and Lightning once); each run has its own directory, plan and strategy."""
    return {on_host: grads_disk_vs_ram(rank, world, f"{tmp}/{'ram' if on_host else 'disk'}", on_host)
            for on_host in (True, False)}


@pytest.fixture(scope="module")
def grads_on_two_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("grads_two_ranks")
    for sub in ("ram", "disk"):
        (tmp / sub).mkdir()
    return run_distributed(both_sums_disk_vs_ram, world_size=2, args=(str(tmp),), env=ENV, timeout=600)


@pytest.mark.parametrize("on_host", [True, False], ids=["sums-in-ram", "read-add-write"])
def test_grads_on_disk_bit_equal_to_ram_on_two_ranks(grads_on_two_ranks, on_host):
    for out in (by_sums[on_host] for by_sums in grads_on_two_ranks):
        assert out["tier4"] and out["written"] > 0
        assert out["losses"] == out["ref_losses"] and len(out["losses"]) == STEPS * MICRO
        assert out["equal"]


def test_grads_on_disk_checkpoint_resumes_equal_to_uninterrupted(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.checkpoint import verify_checkpoint

    plan = _tier4(_plan_with_disk(tmp_path), on_host=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="s{step}",
                           auto_insert_metric_name=False)
    losses, weights, _ = _fit(_strategy(plan, tmp_path / "disk"), tmp_path / "a", devices=1, steps=4,
                              samples=16, callbacks=[ckpt], enable_checkpointing=True)
    step2 = tmp_path / "ckpt" / "s2.ckpt"
    assert verify_checkpoint(step2)
    losses_b, weights_b, _ = _fit(_strategy(plan, tmp_path / "disk_b"), tmp_path / "b", devices=1, steps=4,
                                  samples=16, ckpt_path=step2)
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "c", devices=1,
                                      steps=4, samples=16, ckpt_path=step2)
    assert losses_b == ram_losses == losses[2 * MICRO:]
    for n in weights:
        assert weights_b[n].equal(weights[n]) and ram_weights[n].equal(weights[n]), n


def test_sixteen_bit_mixed_precision_is_refused_with_grads_on_disk(tmp_path):
    from lightning_elixir.disk_attach import attach_disk_state

    plan = _tier4(_plan_with_disk(tmp_path), on_host=True)
    with pytest.raises(ValueError, match=r"precision='16-mixed' cannot run.*allow_disk_grads=False"):
        attach_disk_state(None, plan, [], [object()], tmp_path, rank=0, precision="16-mixed")  # type: ignore[arg-type]


def _frozen_tail_gpt(**kwargs):
    """TinyGPT with each block's last parameter (the MLP's output bias) frozen: it gets no gradient, so a tier-4
    unit's gradient buffer on disk ends before the unit's last element."""
    from tests.lightning_elixir.common import TinyGPT

    model = TinyGPT(**kwargs)
    for block in model.model.blocks:
        block.mlp.c_proj.bias.requires_grad_(False)
    return model


@pytest.mark.parametrize(("tier", "chunk"), [("2", CHUNK), ("4-sums-in-ram", CHUNK), ("4-sums-in-ram", 2**20),
                                             ("4-read-add-write", 2**20)])
def test_a_unit_whose_last_parameter_has_no_gradient_trains_bit_equal_to_ram(tmp_path, tier, chunk):
    """Optimizer state on disk (tier 2) and gradients too (tier 4): a frozen last parameter has neither, so the
    files end before the unit does; the step reads what is there and trains like RAM. Small chunks leave the
    frozen bias a chunk of its own (no state written in the first step); one chunk per unit reads gradients that
    end before the chunk."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.disk_state import local_of
    from lightning_elixir.options import ElixirOptions
    from lightning_elixir.planning import decide_plan
    from tests.lightning_elixir.common import cpu_device, token_data, trainer
    from tightfit.planner.elixir import ElixirConstraints
    from tightfit.profiler.types import DiskProfile

    disk = DiskProfile(path=str(tmp_path), free_bytes=2**30, read_fit=(1e-4, 1e9), write_fit=(1e-4, 1e9))
    options = ElixirOptions(device_profile=dataclasses.replace(cpu_device(), disk=disk), disk_dir=tmp_path,
                            constraints=ElixirConstraints(force_disk=True), verbose=False)
    batch = next(iter(DataLoader(token_data(8), batch_size=4)))
    plan = decide_plan(options, _frozen_tail_gpt(), first_batch=lambda: batch, precision="32-true",
                       device=torch.device("cpu"), world_size=1).plan
    if tier == "2":
        assert plan.disk_units and not plan.grad_disk_units and not plan.param_disk_units
    else:
        plan = _tier4(plan, on_host=tier.endswith("ram"))
        assert plan.grad_disk_units

    def fit(strategy, root):
        L.seed_everything(0)
        model = _frozen_tail_gpt(samples=48)
        t = trainer(strategy, root, devices=1, max_steps=STEPS, accumulate_grad_batches=MICRO,
                    gradient_clip_val=0.05)
        t.fit(model)
        return model.losses, {n: local_of(p).detach().clone() for n, p in model.named_parameters()}

    (tmp_path / "disk").mkdir()
    strategy = ElixirStrategy(plan=plan, disk_dir=tmp_path / "disk", verbose=False)
    strategy._disk_chunk_elements = chunk
    losses, weights = fit(strategy, tmp_path / "a")
    ram_losses, ram_weights = fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "b")
    assert losses == ram_losses and len(losses) == STEPS * MICRO
    for n in weights:
        assert weights[n].equal(ram_weights[n]), n


def test_a_failed_write_is_raised_after_every_other_write_is_done():
    """The disk tier's waits (gradient drain, tier-3 writes, the step's chunks) raise the first failure only once
    the rest are done: the buffers they write from are freed or reused next."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from lightning_elixir.disk_layout import wait_all
    from tightfit.storage import DiskFullError

    done = threading.Event()

    def fail():
        raise DiskFullError("disk full: 0 bytes free")

    def slow():
        time.sleep(0.3)
        done.set()

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(fail), pool.submit(slow)]
        with pytest.raises(DiskFullError, match="free"):
            wait_all(futures)
        assert done.is_set() and futures[1].done()


# Where a disk of this size fills with TinyGPT's tiers 3 and 4: the first forward's weight write, a backward's
# gradient write, the first optimizer step.
@pytest.mark.parametrize("size", ["8m", "12m", "16m"], ids=["forward", "backward", "step"])
def test_disk_full_with_weights_and_gradients_on_disk_leaves_the_model_whole(tmp_path, mount_tmpfs, size):
    """A disk that fills up with tiers 3 and 4 (in a forward, a backward's gradient writes or the step): one clear
    DiskFullError, and at teardown every unit holds its weights again, unhooked, the model usable in RAM."""
    import lightning as L
    import torch

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.disk_grads import _ATTR
    from lightning_elixir.disk_state import local_of
    from tests.lightning_elixir.common import TinyGPT, trainer
    from tightfit.storage import DiskFullError

    plan = _tier4(_plan_with_disk(tmp_path), on_host=False)
    assert plan.grad_disk_units and plan.param_disk_units
    strategy = ElixirStrategy(plan=plan, disk_dir=mount_tmpfs(size), verbose=False)
    strategy._disk_chunk_elements = CHUNK
    L.seed_everything(0)
    model = TinyGPT(samples=48)
    t = trainer(strategy, tmp_path / "a", devices=1, max_steps=STEPS, accumulate_grad_batches=MICRO)
    with pytest.raises(DiskFullError, match="free"):
        t.fit(model)
    assert strategy.disk_state is None  # closed, its store too
    for n, p in model.named_parameters():
        local = local_of(p)
        assert local.untyped_storage().nbytes() >= local.numel() * local.element_size(), n  # held again
        assert torch.isfinite(local).all(), n
        assert not hasattr(p, _ATTR), n  # the gradient hooks' mark is gone
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.isfinite(model.model(x)).all()
