"""Elixir's set-up (measuring the device, profiling, planning) leaves the RNG streams as it found them (issue 18):
seeded ``elixir`` and ``ddp`` runs give the same losses with dropout on."""

from __future__ import annotations

import random

import torch

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

LOSS_ATOL = 1e-5  # see test_distributed.py; a different dropout mask moved step 1 by 4.6e-3


def _seeded_runs(rank: int, world: int, tmp: str) -> dict:
    import dataclasses

    import lightning as L

    import tests.lightning_elixir.common as common
    from lightning_elixir import ElixirStrategy

    common.CONFIG = dataclasses.replace(common.CONFIG, dropout=0.1)  # TinyGPT builds GPT(common.CONFIG)
    L.seed_everything(0)
    ref = common.TinyGPT()
    common.trainer("ddp", f"{tmp}/ddp", devices=world, max_steps=3).fit(ref)
    L.seed_everything(0)
    model = common.TinyGPT()
    # No device_profile: the strategy measures this device (an empty cache, so torch.randn matrices and an
    # AdamW step really run) and profiles a step before training, as on a user's first run.
    common.trainer(ElixirStrategy(verbose=False), f"{tmp}/elixir", devices=world, max_steps=3).fit(model)
    return {"ddp": ref.losses, "elixir": model.losses}


@RunIf(lightning=True)
def test_seeded_elixir_and_ddp_give_the_same_losses_with_dropout(tmp_path):
    env = {"GROUP_RANK": "0", "TIGHTFIT_CACHE_DIR": str(tmp_path / "cache")}
    (r,) = run_distributed(_seeded_runs, 1, args=(str(tmp_path),), timeout=600, env=env)
    assert len(r["ddp"]) == len(r["elixir"]) == 3
    assert max(abs(a - b) for a, b in zip(r["ddp"], r["elixir"])) <= LOSS_ATOL, r


@RunIf(lightning=True)
def test_forked_rng_restores_torch_python_and_numpy_streams():
    import numpy as np

    from lightning_elixir.planning import forked_rng

    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with forked_rng(torch.device("cpu")):
        torch.randn(100), random.random(), np.random.rand(5)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
