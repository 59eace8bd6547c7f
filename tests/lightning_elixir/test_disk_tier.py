"""Elixir with optimizer state on disk: bit-equal to the same plan all in RAM (fp32; gradient accumulation and
clipping), on 1 and 2 real gloo ranks; the bytes that went to disk and the host staging area asserted."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.multiprocess import run_distributed
from tightfit.planner.elixir import Tier

ENV = {"GROUP_RANK": "0"}
CHUNK = 8192  # elements per state tensor per staging set: TinyGPT's units then take several chunks each


def _fit(strategy, root: Path, *, devices: int, steps: int = 6, **kwargs):
    import lightning as L

    from tests.lightning_elixir.common import TinyGPT, trainer

    L.seed_everything(0)
    model = kwargs.pop("model_cls", TinyGPT)(samples=kwargs.pop("samples", 48))
    ckpt_path = kwargs.pop("ckpt_path", None)
    t = trainer(strategy, root, devices=devices, max_steps=steps, accumulate_grad_batches=2,
                gradient_clip_val=kwargs.pop("gradient_clip_val", 0.05), **kwargs)
    t.fit(model, ckpt_path=ckpt_path)
    from lightning_elixir.disk_state import local_of

    weights = {n: local_of(p).detach().clone() for n, p in model.named_parameters()}
    return model.losses, weights, t


def disk_vs_ram(rank: int, world: int, tmp: str) -> dict:
    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import ElixirConstraints

    root, disk = Path(tmp), Path(tmp) / "disk"
    disk.mkdir(exist_ok=True)
    strategy = ElixirStrategy(disk_dir=disk, device_profile=cpu_device(), verbose=False,
                              constraints=ElixirConstraints(force_disk=True))
    strategy._disk_chunk_elements = CHUNK
    losses, weights, _ = _fit(strategy, root / "a", devices=world, steps=4)
    plan, state = strategy.plan, strategy.disk_state
    assert plan is not None and state is None  # closed at teardown
    ram_plan = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0)
                                                     for u in plan.units))
    ref = ElixirStrategy(plan=ram_plan, verbose=False)
    ref_losses, ref_weights, _ = _fit(ref, root / "b", devices=world, steps=4)
    return {"losses": losses, "ref_losses": ref_losses, "equal": all(
        weights[n].equal(ref_weights[n]) for n in weights), "disk_units": plan.disk_units,
        "names": sorted(n for n in weights)}


def two_rank_runs(rank: int, world: int, tmp: str) -> dict:
    """This module's two-rank runs, :func:`disk_vs_ram` then :func:`disk_checkpoint_two_ranks`, in one spawn of the
    ranks (each rank imports torch and Lightning once); each in its own directory, with its own strategies."""
    return {"vs_ram": disk_vs_ram(rank, world, f"{tmp}/vs_ram"),
            "checkpoint": disk_checkpoint_two_ranks(rank, world, f"{tmp}/checkpoint")}


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The directory of the two-rank runs and what each rank returned."""
    tmp = tmp_path_factory.mktemp("disk_two_ranks")
    for sub in ("vs_ram", "checkpoint"):
        (tmp / sub).mkdir()
    return tmp, run_distributed(two_rank_runs, world_size=2, args=(str(tmp),), env=ENV, timeout=540)


def test_disk_tier_matches_ram_on_two_ranks(on_two_ranks):
    for out in (r["vs_ram"] for r in on_two_ranks[1]):
        assert out["disk_units"]
        assert out["losses"] == out["ref_losses"] and len(out["losses"]) == 8
        assert out["equal"]


def _disk_strategy(disk: Path, **kwargs):
    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import cpu_device
    from tightfit.planner.elixir import ElixirConstraints

    disk.mkdir(parents=True, exist_ok=True)
    s = ElixirStrategy(disk_dir=disk, device_profile=cpu_device(), verbose=False,
                       constraints=ElixirConstraints(force_disk=True), **kwargs)
    s._disk_chunk_elements = CHUNK
    return s


def _ram(plan):
    return dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0) for u in plan.units))


def test_one_rank_disk_bytes_checkpoint_and_resume_equal_uninterrupted(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.checkpoint import verify_checkpoint
    from lightning_elixir.disk_state import DiskOptimizerState
    from tightfit.storage import TensorStore

    seen: list[DiskOptimizerState] = []
    strategy = _disk_strategy(tmp_path / "disk")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="s{step}",
                           auto_insert_metric_name=False)
    original_teardown = strategy.teardown
    strategy.teardown = lambda: (seen.append(strategy.disk_state), original_teardown())  # type: ignore[method-assign]
    losses, weights, _ = _fit(strategy, tmp_path / "a", devices=1, callbacks=[ckpt], enable_checkpointing=True,
                              samples=24)  # 3 steps per epoch: the checkpoint at step 3 ends epoch 0
    state = seen[0]
    assert state is not None and state.steps == 6 and strategy.plan is not None
    # Every disk parameter's AdamW state went to disk, each of its 2 keys at aligned offsets; the first step
    # wrote it, every later step read and wrote all of it; each checkpoint read it once more.
    assert state.keys == ("exp_avg", "exp_avg_sq")
    numel = sum(n for n in state.lengths.values())
    layout = numel * 4 * 2
    params = sum(p.numel() for p in state.params.values())
    assert state.disk_bytes() == layout >= params * 4 * 2
    assert state.bytes_written == 6 * layout  # every step wrote all of it back
    assert state.bytes_read == 5 * layout + 2 * params * 8  # 5 streamed steps + 2 checkpoints
    assert state.staging_bytes == 2 * 2 * CHUNK * 4  # two staging sets of CHUNK elements per key: no whole-model buffer
    with TensorStore(tmp_path / "disk" / "rank0") as store:
        assert sorted(store.names()) == sorted(state.name(u, k) for u in state.lengths for k in state.keys)
        assert sum(store.nbytes(n) for n in store.names()) == layout
    # A sync per step lets the store reuse the slots it replaced, so 6 steps do not leave 6 copies. (This test's
    # 32 KiB chunks are partial 4 MiB extents, each merged into a fresh slot: measured 3.05x the layout here;
    # full-size chunks are whole extents.)
    allocated = os.stat(tmp_path / "disk" / "rank0" / "data.bin").st_blocks * 512
    assert layout <= allocated <= 4 * layout, (allocated, layout)
    # The checkpoint at step 3 is a checksummed DCP directory; resumed with the disk tier, or all in RAM, it ends
    # where the uninterrupted run did, bit for bit.
    step3 = tmp_path / "ckpt" / "s3.ckpt"
    assert verify_checkpoint(step3)
    resumed = _disk_strategy(tmp_path / "disk2")
    losses_b, weights_b, _ = _fit(resumed, tmp_path / "b", devices=1, ckpt_path=step3, samples=24)
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(strategy.plan), verbose=False), tmp_path / "c",
                                      devices=1, ckpt_path=step3, samples=24)
    assert losses_b == ram_losses == losses[6:]
    for n in weights:
        assert weights_b[n].equal(weights[n]) and ram_weights[n].equal(weights[n]), n


def _plan_with_disk(tmp_path):
    """A forced-disk plan priced from a stated disk profile (a 4 MiB tmpfs cannot be profiled)."""
    import torch
    from torch.utils.data import DataLoader

    from lightning_elixir.options import ElixirOptions
    from lightning_elixir.planning import decide_plan
    from tests.lightning_elixir.common import TinyGPT, cpu_device, token_data
    from tightfit.planner.elixir import ElixirConstraints
    from tightfit.profiler.types import DiskProfile

    disk = DiskProfile(path=str(tmp_path), free_bytes=2**30, read_fit=(1e-4, 1e9), write_fit=(1e-4, 1e9))
    options = ElixirOptions(device_profile=dataclasses.replace(cpu_device(), disk=disk), disk_dir=tmp_path,
                            constraints=ElixirConstraints(force_disk=True), verbose=False)
    batch = next(iter(DataLoader(token_data(8), batch_size=4)))
    return decide_plan(options, TinyGPT(), first_batch=lambda: batch, precision="32-true",
                       device=torch.device("cpu"), world_size=1).plan


def test_disk_full_in_a_step_is_a_clear_error_and_the_last_checkpoint_survives(tmp_path, mount_tmpfs):
    import pytest
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.checkpoint import verify_checkpoint
    from tightfit.storage import DiskFullError

    plan = _plan_with_disk(tmp_path)
    small = mount_tmpfs("4m")  # the state is 2.8 MB: step 1 fits, step 2 needs a second copy beside it
    strategy = ElixirStrategy(plan=plan, disk_dir=small, verbose=False)
    strategy._disk_chunk_elements = 2**20  # one write per unit and key: the footprint is exactly known
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="s{step}",
                           auto_insert_metric_name=False)
    with pytest.raises(DiskFullError, match=r"data\.bin.*free"):
        _fit(strategy, tmp_path / "a", devices=1, steps=3, callbacks=[ckpt], enable_checkpointing=True)
    step1 = tmp_path / "ckpt" / "s1.ckpt"
    assert verify_checkpoint(step1) and not (tmp_path / "ckpt" / "s2.ckpt").exists()
    # The last checkpoint resumes (here all in RAM) and trains on.
    ram = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0) for u in plan.units))
    losses, _, t = _fit(ElixirStrategy(plan=ram, verbose=False), tmp_path / "b", devices=1, steps=3, ckpt_path=step1)
    assert t.global_step == 3 and len(losses) == 4


def disk_checkpoint_two_ranks(rank: int, world: int, tmp: str) -> bool:
    from lightning.pytorch.callbacks import ModelCheckpoint

    root = Path(tmp)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="s{step}",
                           auto_insert_metric_name=False)
    _, weights, _ = _fit(_disk_strategy(root / "disk"), root / "a", devices=world, steps=4, samples=16,
                         callbacks=[ckpt], enable_checkpointing=True)
    _, resumed, _ = _fit(_disk_strategy(root / "disk_b"), root / "b", devices=world, steps=4, samples=16,
                         ckpt_path=root / "ckpt" / "s2.ckpt")
    return all(weights[n].equal(resumed[n]) for n in weights)


def test_two_rank_checkpoint_resumes_on_two_ranks_and_onto_one(tmp_path, on_two_ranks):
    # Two ranks: the disk state of uneven DTensor shards goes through the checkpoint and back, bit for bit.
    two_ranks_dir, outs = on_two_ranks
    assert all(r["checkpoint"] for r in outs)
    # Another world size: one rank resumes the two-rank checkpoint with its state on disk, and all in RAM.
    from lightning_elixir import ElixirStrategy

    step2 = two_ranks_dir / "checkpoint" / "ckpt" / "s2.ckpt"
    disk = _disk_strategy(tmp_path / "disk1")
    _, on_disk, _ = _fit(disk, tmp_path / "c", devices=1, steps=4, samples=16, ckpt_path=step2)
    assert disk.plan is not None
    _, in_ram, _ = _fit(ElixirStrategy(plan=_ram(disk.plan), verbose=False), tmp_path / "d", devices=1, steps=4,
                        samples=16, ckpt_path=step2)
    for n in on_disk:
        assert on_disk[n].equal(in_ram[n]), n


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_disk_tier_matches_ram(tmp_path, precision):
    # bf16/fp16 compute, fp32 master weights and optimizer state: the disk tier streams the same fp32 state, so
    # the run is bit-equal to RAM here too (16-mixed: ElixirPrecision unscales, then steps without a closure).
    from lightning_elixir import ElixirStrategy

    disk = _disk_strategy(tmp_path / "disk")
    losses, weights, _ = _fit(disk, tmp_path / "a", devices=1, steps=4, precision=precision)
    assert disk.plan is not None and disk.plan.disk_units and disk.plan.precision == precision
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(disk.plan), verbose=False), tmp_path / "b",
                                      devices=1, steps=4, precision=precision)
    assert losses == ram_losses
    for n in weights:
        assert weights[n].dtype == torch.float32 and weights[n].equal(ram_weights[n]), n
