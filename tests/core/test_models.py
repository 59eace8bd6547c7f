"""tightfit.models.gpt: presets, meta builds, tying, and equality with transformers' GPT-2."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runif import RunIf
from tightfit.models import PRESETS, GPTConfig, build_gpt, convert_hf_gpt2_state_dict, gpt_config

# Published sizes of GPT-2 (tied head): 124M, 355M, 774M, 1.56B.
GPT2_PARAMS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_on_meta_with_exact_counts(name):
    model = build_gpt(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == gpt_config(name).num_params()
    assert model.lm_head.weight is model.wte.weight
    assert len(model.blocks) == gpt_config(name).layers
    if name in GPT2_PARAMS:
        assert model.num_params() == GPT2_PARAMS[name]


def test_elixir_shapes():
    sizes = {n: gpt_config(n) for n in ("gpt2-4b", "gpt2-10b", "gpt2-15b", "gpt2-20b")}
    assert [(c.hidden, c.layers) for c in sizes.values()] == [(3072, 32), (4096, 48), (8192, 18), (8192, 24)]
    billions = [round(c.num_params() / 1e9, 1) for c in sizes.values()]
    assert billions == [3.8, 9.9, 14.9, 19.8]  # the paper rounds these to 4B, 10B, 15B, 20B


def test_to_empty_then_init_weights_reties_and_trains():
    model = build_gpt("gpt2-tiny", device="meta")
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.lm_head.weight is model.wte.weight
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0  # memorises two short sequences


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"hidden=100 is not divisible by heads=3; pick heads"):
        GPTConfig(hidden=100, heads=3)
    with pytest.raises(ValueError, match=r"GPTConfig.layers=0 must be a positive integer"):
        GPTConfig(layers=0)
    with pytest.raises(KeyError, match=r"unknown GPT preset 'gpt3'; presets: gpt2-tiny, gpt2,"):
        gpt_config("gpt3")
    with pytest.raises(ValueError, match=r"sequence length 200 exceeds n_positions=128"):
        build_gpt("gpt2-tiny")(torch.zeros(1, 200, dtype=torch.long))


@RunIf(transformers=True)
def test_matches_transformers_gpt2_logits_and_config():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=3, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    cfg = GPTConfig.from_dict(hf_cfg.to_dict())
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.vocab_size, cfg.n_positions) == (48, 3, 4, 97, 32)
    ours = build_gpt(cfg).eval()
    missing, unexpected = ours.load_state_dict(convert_hf_gpt2_state_dict(hf.state_dict()), strict=True)
    assert not missing and not unexpected
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert ours.num_params() == hf.num_parameters()
