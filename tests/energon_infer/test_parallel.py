"""Tensor and pipeline parallel on real gloo ranks against transformers (the single-process reference).

World 2 runs tp=2 and then pp=2 (3 layers: stages of 2 and 1); world 4 runs tp=2 x pp=2. Each rank
loads all three families, so one spawn covers them; the reference tensors come from the parent.
"""

from __future__ import annotations

import pytest
import torch

from tests.energon_infer.conftest import GREEDY_TOKENS
from tests.energon_infer.tiny import PROMPTS
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

TOL = 1e-4


def _check_layouts(rank: int, world: int, dirs: dict, refs: dict, layouts: list) -> dict:
    from energon_infer import ModelRunner, SamplingParams

    report = {}
    for tp, pp, micro in layouts:
        for family, path in dirs.items():
            runner = ModelRunner.from_pretrained(path, tp=tp, pp=pp, microbatches=micro, block_size=4, progress=False)
            assert runner.grid.world == world and runner.grid.rank == rank
            # The vocabulary (101) is split 51 + 51 (one zero row) at tp=2.
            if tp == 2 and runner.grid.first:
                assert runner.stage.embed.weight.shape[0] == 51
            logits = runner.forward(list(enumerate(PROMPTS)), all_logits=True, broadcast=True)
            err = (logits - torch.cat(refs[family]["logits"])).abs().max().item()
            assert err <= TOL, f"{family} tp={tp} pp={pp}: logits differ by {err}"
            gens = runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
            assert [g.token_ids for g in gens] == refs[family]["greedy"], f"{family} tp={tp} pp={pp}"
            # Sampling is decided on one rank and broadcast: every rank sees the same tokens.
            sampled = runner.generate(PROMPTS[:2], SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=4))
            report[(tp, pp, family)] = (err, [g.token_ids for g in sampled])
    return report


@RunIf(min_world=2)
def test_tp2_and_pp2_equal_transformers(tiny_dirs, hf_refs):
    # pp=2 with 3 micro-batches: the 4 prompts flow through the 2 stages in 3 groups.
    out = run_distributed(_check_layouts, 2, args=(tiny_dirs, hf_refs, [(2, 1, 0), (1, 2, 3)]), timeout=600)
    assert out[0] == out[1]  # identical logits error and identical sampled tokens on both ranks
    assert len(out[0]) == 6


@RunIf(min_world=4)
def test_tp2_x_pp2_on_four_ranks_equals_transformers(tiny_dirs, hf_refs):
    out = run_distributed(_check_layouts, 4, args=(tiny_dirs, hf_refs, [(2, 2, 0)]), timeout=900)
    assert all(o == out[0] for o in out)
    assert len(out[0]) == 3


def _grid_errors(rank: int, world: int, path: str) -> str:
    from energon_infer import ModelRunner

    with pytest.raises(ValueError, match=r"tp=1 x pp=1 = 1 ranks, but the process group has 2|tp=2 x pp=2 = 4 ranks"):
        ModelRunner.from_pretrained(path, tp=2, pp=2, progress=False)
    return "ok"


@RunIf(min_world=2)
def test_grid_must_match_the_process_group(tiny_dirs):
    assert run_distributed(_grid_errors, 2, args=(tiny_dirs["llama"],), timeout=300) == ["ok", "ok"]
