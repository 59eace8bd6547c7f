"""Elixir with master weights and parameters on disk (state tier 3, ``Tier.DISK_PARAMS``): bit-equal to the same
plan all in RAM (fp32; gradient accumulation and clipping) on 1 and 2 real gloo ranks; the bytes that went to
disk, the units held between uses, and checkpoint/resume asserted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.lightning_elixir.test_disk_tier import CHUNK, ENV, _fit, _plan_with_disk
from tightfit.planner.elixir import Tier

STEPS = 4
MICRO = 2  # accumulate_grad_batches in _fit


def _tier3(plan, every: int = 1):
    """``plan`` with every ``every``-th disk unit in tier 3 (the others keep tier 2: both in one run)."""
    units = [dataclasses.replace(u, tier=Tier.DISK_PARAMS if u.tier >= Tier.DISK and i % every == 0 else u.tier)
             for i, u in enumerate(plan.units)]
    return dataclasses.replace(plan, units=tuple(units))


def _ram(plan):
    return dataclasses.replace(plan, units=tuple(dataclasses.replace(u, tier=min(u.tier, Tier.HOST), disk_bytes=0)
                                                 for u in plan.units))


class _Watch:
    """Records, at each batch start and before each optimizer step, which tier-3 units hold their shards."""

    def __init__(self) -> None:
        self.held: list[tuple[int, ...]] = []
        self.master = None

    def callback(self):
        import lightning as L

        watch = self

        class Cb(L.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                state = trainer.strategy.disk_state
                watch.master = state.master
                watch.held.append(state.master.resident_units if trainer.global_step else ())

            def on_before_optimizer_step(self, trainer, module, optimizer):
                watch.held.append(trainer.strategy.disk_state.master.resident_units)

        return Cb()


def _strategy(plan, disk: Path):
    from lightning_elixir import ElixirStrategy

    disk.mkdir(parents=True, exist_ok=True)
    s = ElixirStrategy(plan=plan, disk_dir=disk, verbose=False)
    s._disk_chunk_elements = CHUNK
    return s


def fit_beside_ram(plan, ram_plan, tmp_path: Path, callback, *, steps: int, micro: int):
    """Fit ``plan`` (state on disk) and ``ram_plan`` (all in RAM) on one rank; assert their losses and final weights
    bit-equal; the disk run's state as it was at teardown."""
    from lightning_elixir import ElixirStrategy

    seen = []
    strategy = _strategy(plan, tmp_path / "disk")
    original_teardown = strategy.teardown
    strategy.teardown = lambda: (seen.append(strategy.disk_state), original_teardown())  # type: ignore[method-assign]
    losses, weights, _ = _fit(strategy, tmp_path / "a", devices=1, steps=steps, callbacks=[callback])
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=ram_plan, verbose=False), tmp_path / "b", devices=1,
                                      steps=steps)
    assert losses == ram_losses and len(losses) == steps * micro
    for n in weights:
        assert weights[n].equal(ram_weights[n]), n
    return seen[0]


def test_one_rank_params_on_disk_bit_equal_to_ram_with_the_bytes_asserted(tmp_path):
    from tightfit.storage import TensorStore

    plan = _tier3(_plan_with_disk(tmp_path), every=2)
    assert plan.param_disk_units and len(plan.param_disk_units) < len(plan.disk_units)  # tiers 2 and 3 mixed
    watch = _Watch()
    state = fit_beside_ram(plan, _ram(plan), tmp_path, watch.callback(), steps=STEPS, micro=MICRO)
    master = watch.master
    assert state is not None and master is not None and state.steps == STEPS
    # Between uses no tier-3 unit holds its shards: not before an optimizer step, not at a batch start.
    assert watch.held and all(h == () for h in watch.held), watch.held
    assert master.peak_resident <= 2  # the unit in use and the one read ahead
    # Bytes: the master weights (4 B per element) were written once by the first drop, then read ahead of every
    # forward of every micro-batch but the first (the initial weights were in RAM; not ahead of the backward:
    # this is the root unit, which FSDP2 keeps unsharded from forward to backward), once more at teardown, and
    # streamed through every step with the moments (read and
    # written each step but the first, which read them and wrote them back).
    tier3 = sorted(master.order)
    assert len(tier3) == 1
    numel = {u: n for u, n in state.lengths.items()}
    params = sum(n for _, _, n in master.by_index[tier3[0]].pieces)
    assert master.fetches == STEPS * MICRO - 1 + 1
    assert master.bytes_read == master.fetches * params * 4
    assert master.bytes_written == params * 4
    moments = sum(numel.values()) * 4 * 2
    masters = sum(numel[u] for u in tier3) * 4
    assert state.disk_bytes() == moments + masters
    assert state.bytes_written == STEPS * (moments + masters)
    assert state.bytes_read == STEPS * masters + (STEPS - 1) * moments
    # Staging: two sets of one chunk per key, the master weights beside the moments (no whole-model buffer).
    assert state.staging_bytes == 2 * 3 * CHUNK * 4
    with TensorStore(tmp_path / "disk" / "rank0") as store:
        assert {master.name(u) for u in tier3} <= set(store.names())


def params_disk_vs_ram(rank: int, world: int, tmp: str) -> dict:
    from lightning_elixir import ElixirStrategy

    root = Path(tmp)
    plan = _tier3(_plan_with_disk_world(root / f"profile{rank}", world))
    losses, weights, _ = _fit(_strategy(plan, root / "disk"), root / "a", devices=world, steps=STEPS)
    ref_losses, ref_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), root / "b", devices=world,
                                      steps=STEPS)
    return {"losses": losses, "ref_losses": ref_losses, "tier3": plan.param_disk_units,
            "equal": all(weights[n].equal(ref_weights[n]) for n in weights)}


def _plan_with_disk_world(tmp_path: Path, world: int):
    import torch
    from torch.utils.data import DataLoader

    from lightning_elixir.options import ElixirOptions
    from lightning_elixir.planning import decide_plan
    from tests.lightning_elixir.common import TinyGPT, cpu_device, token_data
    from tightfit.planner.elixir import ElixirConstraints
    from tightfit.profiler.types import DiskProfile

    tmp_path.mkdir(parents=True, exist_ok=True)
    disk = DiskProfile(path=str(tmp_path), free_bytes=2**30, read_fit=(1e-4, 1e9), write_fit=(1e-4, 1e9))
    options = ElixirOptions(device_profile=dataclasses.replace(cpu_device(), disk=disk), disk_dir=tmp_path,
                            constraints=ElixirConstraints(force_disk=True), verbose=False)
    batch = next(iter(DataLoader(token_data(8), batch_size=4)))
    return decide_plan(options, TinyGPT(), first_batch=lambda: batch, precision="32-true",
                       device=torch.device("cpu"), world_size=world).plan


def test_params_on_disk_bit_equal_to_ram_on_two_ranks(tmp_path):
    outs = run_distributed(params_disk_vs_ram, world_size=2, args=(str(tmp_path),), env=ENV, timeout=300)
    for out in outs:
        assert out["tier3"]
        assert out["losses"] == out["ref_losses"] and len(out["losses"]) == STEPS * MICRO
        assert out["equal"]


def test_params_on_disk_checkpoint_resumes_equal_to_uninterrupted(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elixir import ElixirStrategy
    from lightning_elixir.checkpoint import verify_checkpoint

    plan = _tier3(_plan_with_disk(tmp_path))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="s{step}",
                           auto_insert_metric_name=False)
    losses, weights, _ = _fit(_strategy(plan, tmp_path / "disk"), tmp_path / "a", devices=1, steps=STEPS,
                              samples=16, callbacks=[ckpt], enable_checkpointing=True)
    step2 = tmp_path / "ckpt" / "s2.ckpt"
    assert verify_checkpoint(step2)
    # Resumed with master weights on disk, and all in RAM: both end where the uninterrupted run did.
    losses_b, weights_b, _ = _fit(_strategy(plan, tmp_path / "disk_b"), tmp_path / "b", devices=1, steps=STEPS,
                                  samples=16, ckpt_path=step2)
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "c", devices=1,
                                      steps=STEPS, samples=16, ckpt_path=step2)
    assert losses_b == ram_losses == losses[2 * MICRO:]
    for n in weights:
        assert weights_b[n].equal(weights[n]) and ram_weights[n].equal(weights[n]), n


def test_tied_weights_cannot_wait_on_disk():
    import torch

    from lightning_elixir.disk_params import DiskParameters

    w = torch.nn.Parameter(torch.zeros(8))
    tied = torch.nn.Parameter(w.data)  # shares w's storage
    with pytest.raises(ValueError, match="share one storage"):
        DiskParameters([(0, None, [(w, 0, 8), (tied, 4096, 8)])], store=None)  # type: ignore[arg-type]


def test_a_model_built_on_meta_is_initialised_one_unit_at_a_time_equal_to_ram(tmp_path):
    """``configure_model`` on meta with tier-3 units: each unit is allocated, initialised and written in turn (paged
    in from the store as the initialisation touches it), never the whole model; the values are the in-RAM ones."""
    import lightning as L

    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import TinyGPT

    plan = _tier3(_plan_with_disk(tmp_path))
    assert len(plan.param_disk_units) >= 2
    seen: list = []

    class AtStart(L.Callback):
        def on_train_start(self, trainer, module):
            m = trainer.strategy.disk_state.master
            seen.append((m.resident_units, m.peak_resident, all(u.stored for u in m.units), m.bytes_written,
                         sum(n for u in m.units for _, _, n in u.pieces) * 4))

    losses, weights, _ = _fit(_strategy(plan, tmp_path / "disk"), tmp_path / "a", devices=1, steps=STEPS,
                              model_cls=lambda samples: TinyGPT(meta=True, samples=samples), callbacks=[AtStart()])
    # The reference is built in __init__, eagerly, all in RAM.
    ram_losses, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "b", devices=1,
                                      steps=STEPS)
    assert losses == ram_losses and len(losses) == STEPS * MICRO
    for n in weights:
        assert weights[n].equal(ram_weights[n]), n
    held, peak, stored, written, total = seen[0]
    assert held == () and stored  # initialised into the store, none held when training starts
    assert peak == 1  # one tier-3 unit in memory at a time while the model was allocated and initialised
    assert written >= 2 * total  # written after reset_parameters and again after init_weights


def test_paging_brings_back_the_unit_an_operation_touches_and_writes_what_it_changed(tmp_path):
    import torch

    from lightning_elixir.disk_params import DiskParameters
    from tightfit.storage import TensorStore

    params = [torch.nn.Parameter(torch.zeros(1024)) for _ in range(3)]
    with TensorStore(tmp_path) as store:
        disk = DiskParameters([(i, None, [(p, 0, 1024)]) for i, p in enumerate(params)], store)
        for i in range(3):
            disk.drop_blank(i)
        assert disk.resident_units == () and all(p.untyped_storage().nbytes() == 0 for p in params)
        with torch.no_grad(), disk.paging(window=1):
            for i, p in enumerate(params):
                p.fill_(i + 1.0)  # allocated without a read (blank), then filled
            params[0].mul_(10.0)  # read back from the store (unit 1..2 dropped in turn)
            assert disk.resident_units == (0,)
        assert disk.resident_units == () and disk.peak_resident == 1
        assert disk.bytes_read == 1024 * 4  # only unit 0's second touch read anything
        for i, want in enumerate((10.0, 2.0, 3.0)):
            disk.ensure(i)
            assert params[i].eq(want).all(), (i, params[i][:4])
        with pytest.raises(ValueError, match=r"paging\(window=0\)"):
            with disk.paging(window=0):
                pass


def test_weights_that_do_not_fit_the_free_host_memory_stay_in_the_store_after_fit(tmp_path, monkeypatch):
    """At teardown tier-3 weights come back into the module only if the host has room (READ_BACK_MARGIN times
    their size free); here the margin is set beyond any host: they stay on disk, equal to the RAM run's, a warning
    says where and how to keep them, and the module refuses to run or be checkpointed with what it holds."""
    import lightning as L
    import torch

    import lightning_elixir.strategy as strategy_module
    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import TinyGPT, token_data, trainer
    from tightfit.storage import TensorStore

    plan = _tier3(_plan_with_disk(tmp_path))
    monkeypatch.setattr(strategy_module, "READ_BACK_MARGIN", float(2**60))
    strategy = _strategy(plan, tmp_path / "disk")
    kept = []
    original_teardown = strategy.teardown
    strategy.teardown = lambda: (kept.append(strategy.disk_state.master), original_teardown())  # type: ignore
    L.seed_everything(0)
    model = TinyGPT(samples=48)
    t = trainer(strategy, tmp_path / "a", devices=1, max_steps=STEPS, accumulate_grad_batches=2,
                gradient_clip_val=0.05)
    with pytest.warns(UserWarning, match=r"stay in .*rank0, not read back into the module.*checkpoint during fit"):
        t.fit(model)
    master = kept[0]
    with pytest.raises(RuntimeError, match=r"stay in .*do not hold them\. Load a checkpoint"):
        model.model(token_data(2).tensors[0][:1])
    with pytest.raises(RuntimeError, match=r"cannot checkpoint: .*stay in"):
        t.save_checkpoint(tmp_path / "after.ckpt")
    _, ram_weights, _ = _fit(ElixirStrategy(plan=_ram(plan), verbose=False), tmp_path / "b", devices=1, steps=STEPS)
    names = {id(p): n for n, p in model.named_parameters()}
    with TensorStore(tmp_path / "disk" / "rank0") as store:
        checked = 0
        for u in master.units:
            for p, start, n in u.pieces:
                got = torch.empty(n)
                store.read_into(master.name(u.index), got, start * 4).result()
                assert got.equal(ram_weights[names[id(p)]].reshape(-1)), names[id(p)]
                checked += 1
    assert checked == sum(len(u.pieces) for u in master.units) > 0
