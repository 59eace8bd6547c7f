"""A head tied to the token embedding (GPT-2's ``lm_head`` / ``wte``): the planner finds the tie from the profile, and
the runtime gathers the embedding's group in backward only for the head's (``lightning_elixir.tied``), training as
DDP does. Issue 53's case under a hard limit is in ``tests/test_memory_limits.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

ENV = {"GROUP_RANK": "0"}


@pytest.mark.parametrize("tied", [True, False])
def test_the_planner_finds_the_block_a_tied_parameter_is_used_again_in(tied):
    import torch

    from tightfit.models import GPTConfig, build_gpt
    from tightfit.planner.elixir.tied import lookup_blocks, tied_blocks, tied_units
    from tightfit.profiler import profile_model

    cfg = GPTConfig(vocab_size=512, n_positions=16, hidden=32, layers=2, heads=2, tie_embeddings=tied)
    model = build_gpt(cfg, device="meta")
    prof = profile_model(model, torch.zeros(2, 8, dtype=torch.long))
    names = [b.name for b in prof.blocks]
    # The reference: the model's own modules. wte's weight is lm_head's when tied (the same Parameter object).
    assert (model.lm_head.weight is model.wte.weight) == tied
    expect = list(range(len(names)))
    if tied:
        expect[names.index("wte")] = names.index("lm_head")
    assert list(tied_blocks(prof)) == expect
    lookups = [i for i, flag in enumerate(lookup_blocks(prof)) if flag]
    assert lookups == sorted(names.index(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding))
    units = [(i, i + 1) for i in range(len(names))]
    found = tied_units(tied_blocks(prof), lookup_blocks(prof), [b.param_numel for b in prof.blocks], units)
    assert [(t.unit, t.until, t.lookup) for t in found] == ([(names.index("wte"), names.index("lm_head"), True)]
                                                            if tied else [])


def _tied_rank(rank: int, world: int, tmp: str) -> dict:
    import lightning as L

    from lightning_elixir import ElixirStrategy
    from tests.lightning_elixir.common import TinyGPT, cpu_device, trainer
    from tightfit.planner.elixir import ElixirConstraints

    tmp_path = Path(tmp)

    class Watched(TinyGPT):
        """Records, as each step's backward reaches the first layer, whether the embedding's group is gathered."""

        def on_train_start(self) -> None:
            group = self.model.wte._get_fsdp_state()._fsdp_param_group
            self.gathered: list[bool] = []

            def hook(module, args, out):
                if out.requires_grad:
                    out.register_hook(lambda grad: self.gathered.append(group.is_unsharded))

            self.model.blocks[0].register_forward_hook(hook)

    L.seed_everything(0)
    ref = TinyGPT()
    trainer("ddp", tmp_path / "ref", devices=1, max_steps=8).fit(ref)
    L.seed_everything(0)
    model = Watched()
    # Every unit its own FSDP2 group, resharded after forward, all in RAM: the tie is the only thing that differs.
    cons = ElixirConstraints(modes=("reshard",), allow_offload=False, allow_checkpointing=False, unit_blocks=(1,))
    strategy = ElixirStrategy(device_profile=cpu_device(), constraints=cons, verbose=False)
    trainer(strategy, tmp_path / "elixir", devices=1, max_steps=8).fit(model)
    wte = next(u for u in strategy.plan.units if "model.wte" in u.blocks)
    return {"ref": ref.losses, "elixir": model.losses, "gathered": model.gathered, "wte_unit": wte.blocks,
            "tied": model.model.lm_head.weight is model.model.wte.weight}


@RunIf(lightning=True)
def test_a_tied_embedding_is_not_gathered_through_the_layers_backward_and_trains_as_ddp(tmp_path):
    (r,) = run_distributed(_tied_rank, 1, args=(str(tmp_path),), timeout=300, env=ENV)
    # The embeddings (and the dropout between them) form one unit of lookups, the head joins it at run time.
    assert r["tied"] and "model.lm_head" not in r["wte_unit"] and "model.blocks.0" not in r["wte_unit"]
    # FSDP2 alone keeps the group gathered from the head's backward to the end of backward; here it is resharded.
    assert len(r["gathered"]) == 8 and not any(r["gathered"])
    assert r["elixir"] == pytest.approx(r["ref"], abs=1e-5) and len(r["ref"]) == 8
